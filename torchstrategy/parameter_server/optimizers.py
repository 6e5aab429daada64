"""The chief's side of an optimizer whose state lives on the parameter servers.

A user's ``torch.optim`` optimizer over parameters placed on parameter servers becomes, on
its first `schedule`, one optimizer of the same class on each server holding some of its
parameters (over that server's shards). `RemoteOptimizer` keeps the user's optimizer and
those copies in step:

- Settings: every closure carries the user's ``param_groups`` settings (lr, betas, ...) as
  they are when it is scheduled, with a version number that grows when they change, so an
  ``lr_scheduler.step()`` on the chief takes effect for the closures scheduled after it. A
  server re-reads the settings only when the version differs from the one it last used.
- State: ``optimizer.state_dict()`` first fetches the servers' per-variable state
  (exp_avg, momentum_buffer, step, ...) into the user's optimizer, shards joined along
  dimension 0, so it is the state dict one process training the same model would have;
  ``optimizer.load_state_dict(...)`` sends the loaded state back, split into whatever
  shards the variables have now.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from torchstrategy import _compat
from torchstrategy.parameter_server import ps_store, remote


def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{name: value for name, value in group.items() if name != "params"}
            for group in optimizer.param_groups]


def _copy_settings(settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{name: value.detach().clone() if isinstance(value, torch.Tensor) else value
             for name, value in group.items()} for group in settings]


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # a value with no single truth value compares as changed
        return False


def _same_settings(current: list[dict[str, Any]], sent: list[dict[str, Any]]) -> bool:
    return len(current) == len(sent) and all(
        group.keys() == old.keys() and all(_same_value(group[k], old[k]) for k in group)
        for group, old in zip(current, sent))


def _row_wise(value: Any, rows: int, row_shape: tuple[int, ...]) -> bool:
    """Whether a state entry has one row per variable row (exp_avg, momentum_buffer, ...),
    as opposed to a per-variable scalar such as Adam's step."""
    return (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows
            and tuple(value.shape[1:]) == row_shape)


def join_shard_states(layout: remote.Layout, parts: Sequence[dict[str, Any] | None]
                      ) -> dict[str, Any] | None:
    """One variable's optimizer state from its shards' states (None for a shard with no
    state yet): row-wise entries are concatenated along dimension 0, others (the step
    count) are taken from the shards that have state, the largest when they differ (a
    shard of an embedding table whose rows no step looked up has not stepped)."""
    if all(part is None for part in parts):
        return None
    if not layout.sharded:
        return dict(parts[0] or {})  # one part, not None (checked above)
    row_shape = tuple(layout.shape[1:])
    present = [part for part in parts if part is not None]
    out: dict[str, Any] = {}
    for name in present[0]:
        values = [None if part is None else part.get(name) for part in parts]
        known = [v for v in values if v is not None]
        if all(_row_wise(v, s.rows, row_shape)
               for v, s in zip(values, layout.shards) if v is not None):
            like = known[0]
            out[name] = torch.cat([
                v if v is not None else torch.zeros((s.rows,) + row_shape, dtype=like.dtype)
                for v, s in zip(values, layout.shards)])
        elif all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0)
                 for v in known):
            out[name] = max(known, key=float)
        else:
            out[name] = known[0]
    return out


def split_state(layout: remote.Layout, state: dict[str, Any]) -> list[dict[str, Any]]:
    """One variable's optimizer state cut into its shards' states (row-wise entries split
    along dimension 0, others copied to every shard)."""
    if not layout.sharded:
        return [state]
    row_shape = tuple(layout.shape[1:])
    parts: list[dict[str, Any]] = [{} for _ in layout.shards]
    for name, value in state.items():
        if _row_wise(value, layout.shape[0], row_shape):
            pieces = remote.split_rows(layout, value)
        else:
            pieces = [value] * len(layout.shards)
        for part, piece in zip(parts, pieces):
            part[name] = piece.contiguous() if isinstance(piece, torch.Tensor) else piece
    return parts


class RemoteOptimizer:
    """Ties a user's optimizer to its copies on the parameter servers (module docstring).

    Args:
      optimizer: the user's ``torch.optim.Optimizer`` (its parameters are the chief's
        local copies of parameter-server parameters).
      key: the servers' name for the copies.
      layouts: per parameter group, the `remote.Layout` of each parameter, in order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, key: str,
                 layouts: Sequence[Sequence[remote.Layout]]) -> None:
        # Weak: the strategy finds this object through the optimizer (a weak-keyed table),
        # so the optimizer's life is the user's to decide.
        self._optimizer_ref = weakref.ref(optimizer)
        self._key = key
        self._layouts = tuple(tuple(group) for group in layouts)
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._flat_layouts = [l for group in self._layouts for l in group]
        self._lock = threading.Lock()
        self._version = 0
        self._sent = _copy_settings(_settings(optimizer))
        self._servers = sorted({s.ps for l in self._flat_layouts for s in l.shards})

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError("The optimizer whose state lives on the parameter servers no "
                               "longer exists.")
        return optimizer

    def create(self) -> None:
        """Builds the optimizer's copies on the servers (starting from the user's
        optimizer's state, when it has any, e.g. after ``load_state_dict``) and hooks
        ``state_dict``/``load_state_dict`` of the user's optimizer."""
        per_ps: dict[str, list[tuple[int, list[str], dict[str, Any]]]] = {}
        for index, (layouts, hyper) in enumerate(zip(self._layouts, self._sent)):
            keys_by_ps: dict[str, list[str]] = {}
            for layout in layouts:
                for shard in layout.shards:
                    keys_by_ps.setdefault(shard.ps, []).append(shard.key)
            for ps, keys in keys_by_ps.items():
                per_ps.setdefault(ps, []).append((index, keys, hyper))
        remote.wait([remote.call_async(ps, ps_store.create_optimizer,
                                       (self._key, type(self._optimizer), groups))
                     for ps, groups in per_ps.items()])
        if self._optimizer.state:
            self.push_state()
        self._optimizer.register_state_dict_pre_hook(_StateHook(self.pull_state))
        self._optimizer.register_load_state_dict_post_hook(_StateHook(self.push_state))

    def reference(self) -> tuple[Any, ...]:
        """What a scheduled closure carries for this optimizer: its layouts and the current
        settings with their version. Costs one comparison of the (small) settings."""
        # A scheduled step stands in for optimizer.step() on the chief: say so to torch's
        # lr schedulers, which warn about a scheduler stepped before its optimizer.
        _compat.mark_optimizer_stepped(self._optimizer)
        with self._lock:
            current = _settings(self._optimizer)
            if not _same_settings(current, self._sent):
                self._sent = _copy_settings(current)
                self._version += 1
            return ("optimizer", self._key, self._layouts, self._version, self._sent)

    def pull_state(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Fetches the servers' state into the user's optimizer (``optimizer.state``)."""
        keys_by_ps: dict[str, list[str]] = {}
        for layout in self._flat_layouts:
            for shard in layout.shards:
                keys_by_ps.setdefault(shard.ps, []).append(shard.key)
        shard_states: dict[str, dict[str, Any]] = {}
        for states in remote.wait([remote.call_async(ps, ps_store.optimizer_state,
                                                     (self._key, keys))
                                   for ps, keys in keys_by_ps.items()]):
            shard_states.update(states)
        for param, layout in zip(self._params, self._flat_layouts):
            state = join_shard_states(layout, [shard_states.get(s.key) for s in layout.shards])
            if state is None:
                self._optimizer.state.pop(param, None)
            else:
                self._optimizer.state[param] = state

    def push_state(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Replaces the servers' state by the user's optimizer's (``optimizer.state``)."""
        states: dict[str, dict[str, Any]] = {ps: {} for ps in self._servers}
        for param, layout in zip(self._params, self._flat_layouts):
            state = self._optimizer.state.get(param)
            if state:
                for shard, part in zip(layout.shards, split_state(layout, state)):
                    states[shard.ps][shard.key] = part
        remote.wait([remote.call_async(ps, ps_store.load_optimizer_state, (self._key, s))
                     for ps, s in states.items()])


class _StateHook:
    """An optimizer hook that is dropped when the optimizer is pickled (it talks to the
    parameter servers from the chief only)."""

    def __init__(self, fn: Callable[[torch.optim.Optimizer], None]) -> None:
        self._fn = fn

    def __call__(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        self._fn(optimizer)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_no_hook, ())


def _noop(*args: Any) -> None:
    return None


def _no_hook() -> Callable[..., None]:
    return _noop
