"""What a parameter server holds and does: variables by key, and optimizers applying pushed
gradients to them.

Every function here is an rpc target run in the parameter-server process. Updates are
applied one at a time under a lock, as they arrive (asynchronous training: no waiting for
the other workers); reads return a consistent copy.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from torchstrategy import runtime


class _Store:
    """What this parameter-server process holds (``runtime.current().state``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # key -> tensor (an nn.Parameter when trainable)
        self.variables: dict[str, torch.Tensor] = {}
        # optimizer key -> torch optimizer over this server's variables
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        # key -> number of rows sent by read_rows (checking lookups)
        self.rows_served: dict[str, int] = {}
        # optimizer key -> index in the user's optimizer of each group
        self.group_indices: dict[str, list[int]] = {}
        # optimizer key -> version of the group settings in use
        self.hyper_versions: dict[str, int] = {}


def _store() -> _Store:
    return runtime.current().state("parameter_server.ps_store", _Store)


def create(key: str, value: torch.Tensor, trainable: bool) -> bool:
    """Stores `value` under `key` (replacing any previous value)."""
    st = _store()
    value = value.detach().clone()
    with st.lock:
        st.variables[key] = torch.nn.Parameter(value) if trainable else value
    return True


def read(keys: Iterable[str]) -> list[torch.Tensor]:
    """The current values of `keys`, copied."""
    st = _store()
    with st.lock:
        return [_get(st, key).detach().clone() for key in keys]


def read_rows(key: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (a LongTensor of local row indices) of variable `key`: only those rows
    are copied and sent."""
    st = _store()
    with st.lock:
        value = _get(st, key).detach()
        st.rows_served[key] = st.rows_served.get(key, 0) + int(rows.numel())
        return value.index_select(0, rows)


def rows_served(key: str) -> int:
    """How many rows `read_rows` has sent for `key` so far."""
    st = _store()
    with st.lock:
        return st.rows_served.get(key, 0)


def assign(key: str, value: torch.Tensor) -> bool:
    """Sets variable `key` to `value` (copied in place)."""
    st = _store()
    with st.lock:
        target = _get(st, key)
        with torch.no_grad():
            target.copy_(value)
        return True


def assign_add(key: str, delta: torch.Tensor) -> torch.Tensor:
    """Adds `delta` atomically and returns the new value."""
    st = _store()
    with st.lock:
        target = _get(st, key)
        with torch.no_grad():
            target.add_(delta)
        return target.detach().clone()


def create_optimizer(optimizer_key: str,
                     optimizer_class: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                     groups: Sequence[tuple[int, Sequence[str], Mapping[str, Any]]]) -> bool:
    """Builds ``optimizer_class`` over this server's variables.

    Args:
      groups: a list of ``(group_index, keys, hyperparameters)``, one per parameter group
        of the user's optimizer that has variables here: the group's index in the user's
        optimizer, the keys of its variables held here, and its settings (lr, momentum,
        ...) without "params".
    """
    st = _store()
    with st.lock:
        if optimizer_key in st.optimizers:
            return True
        param_groups = [dict(hyper, params=[_get(st, k) for k in keys])
                        for _, keys, hyper in groups]
        st.optimizers[optimizer_key] = optimizer_class(param_groups)
        st.group_indices[optimizer_key] = [index for index, _, _ in groups]
        st.hyper_versions[optimizer_key] = 0
        return True


def _use_hyperparameters(st: _Store, optimizer_key: str, optimizer: torch.optim.Optimizer,
                         version: int, hyperparameters: Sequence[Mapping[str, Any]]) -> None:
    # Each push carries the settings in effect when its closure was scheduled (the chief
    # bumps `version` when they change); comparing one int keeps the usual push cheap.
    if version == st.hyper_versions[optimizer_key]:
        return
    for group, index in zip(optimizer.param_groups, st.group_indices[optimizer_key]):
        group.update(hyperparameters[index])
    st.hyper_versions[optimizer_key] = version


def apply_gradients(optimizer_key: str, dense: Mapping[str, torch.Tensor],
                    sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    version: int = 0,
                    hyperparameters: Sequence[Mapping[str, Any]] | None = None) -> bool:
    """Applies one worker's gradients with the optimizer's ``step()``.

    Args:
      dense: ``{key: gradient}`` of whole variables.
      sparse: ``{key: (rows, gradient_rows)}``: gradients of some rows only (embedding
        lookups); they are added into a zero gradient of the variable's shape, so the update
        is what the same optimizer does with a dense embedding gradient.
      version, hyperparameters: the version of the user's param_group settings when the
        closure was scheduled, and those settings (one dict per group of the user's
        optimizer). The step uses them: a push from a closure scheduled after an
        ``lr_scheduler.step()`` on the chief applies the new learning rate.
    """
    st = _store()
    with st.lock:
        optimizer = st.optimizers[optimizer_key]
        if hyperparameters is not None:
            _use_hyperparameters(st, optimizer_key, optimizer, version, hyperparameters)
        touched: list[torch.Tensor] = []
        for key, grad in dense.items():
            param = _get(st, key)
            param.grad = grad.to(param.dtype).view_as(param)
            touched.append(param)
        for key, (rows, grad_rows) in sparse.items():
            param = _get(st, key)
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            grad.index_add_(0, rows, grad_rows.to(param.dtype))
            param.grad = grad
            touched.append(param)
        optimizer.step()
        for param in touched:
            param.grad = None
    return True


def optimizer_state(optimizer_key: str, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The optimizer's per-variable state (exp_avg, momentum_buffer, step, ...) of `keys`,
    copied: ``{key: {name: value}}``, leaving out variables with no state yet."""
    st = _store()
    with st.lock:
        state = st.optimizers[optimizer_key].state
        out: dict[str, dict[str, Any]] = {}
        for key in keys:
            entry = state.get(_get(st, key))
            if entry:
                out[key] = {name: value.detach().clone() if isinstance(value, torch.Tensor)
                            else value for name, value in entry.items()}
        return out


def load_optimizer_state(optimizer_key: str, states: Mapping[str, Mapping[str, Any]]) -> bool:
    """Replaces the optimizer's whole state on this server by `states` (``{key: {name:
    value}}``); variables not in `states` start with no state, as after
    ``Optimizer.load_state_dict``."""
    st = _store()
    with st.lock:
        optimizer = st.optimizers[optimizer_key]
        optimizer.state.clear()
        for key, entry in states.items():
            optimizer.state[_get(st, key)] = {
                name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                for name, value in entry.items()}
    return True


def keys() -> list[str]:
    """The keys of the variables this server holds, sorted."""
    st = _store()
    with st.lock:
        return sorted(st.variables)


def _get(st: _Store, key: str) -> torch.Tensor:
    """Variable `key` of the store `st` (the caller looked `st` up once per rpc)."""
    try:
        return st.variables[key]
    except KeyError:
        raise KeyError(f"This parameter server holds no variable {key!r}; was the cluster "
                       f"restarted? Restore the variables from a checkpoint.") from None
