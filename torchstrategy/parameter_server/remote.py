"""Calling parameter servers: every call bounded by a timeout, failures named.

A call that fails because the server is gone (connection lost, or no answer within the rpc
timeout) raises `ParameterServerUnavailableError`; an error raised by the server's own code
(e.g. a missing variable) is re-raised as is.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence, Tuple

import torch
import torch.distributed.rpc as rpc

from torchstrategy.parameter_server import ps_store

# What TensorPipe's and the rpc agent's errors say when a peer is gone or silent.
_TRANSPORT_MARKERS = ("timeout", "timed out", "connection", "pipe", "eof", "closed",
                      "reset by peer", "broken", "refused", "unreachable", "shut",
                      "could not find destination", "unknown destination",
                      "no longer running")


class ParameterServerUnavailableError(RuntimeError):
    """A parameter server cannot be reached: its variables (and optimizer state) are lost
    for this run. Restart the cluster and restore the variables from the last checkpoint."""


def is_transport_error(error: BaseException) -> bool:
    """Whether `error` says the server is gone or silent (not an error of its own code)."""
    if isinstance(error, ParameterServerUnavailableError):
        return True
    if not isinstance(error, (RuntimeError, TimeoutError, ConnectionError)):
        return False
    text = str(error).lower()
    return any(marker in text for marker in _TRANSPORT_MARKERS)


def unavailable(ps_name: str, error: BaseException) -> ParameterServerUnavailableError:
    """The error to raise when `ps_name` cannot be reached (`error` says how)."""
    return ParameterServerUnavailableError(
        f"Parameter server {ps_name} is unavailable ({str(error).strip().splitlines()[0]}). "
        f"The variables it held are lost for this run: restart the cluster and restore the "
        f"variables from the last checkpoint (ts.checkpoint).")


def call_async(ps_name: str, fn: Callable[..., Any], args: Sequence[Any] = (),
               timeout: float | None = None) -> tuple[str, Any]:
    """Starts ``fn(*args)`` on `ps_name`; returns a future (wait on it with `wait`)."""
    try:
        future = rpc.rpc_async(ps_name, fn, args=args,
                               timeout=rpc.constants.UNSET_RPC_TIMEOUT if timeout is None
                               else timeout)
    except RuntimeError as error:  # the agent already knows the peer is gone
        raise unavailable(ps_name, error) from None
    return ps_name, future


def wait(calls: Iterable[tuple[str, Any]]) -> list[Any]:
    """Waits for ``(ps_name, future)`` pairs; returns their results in order."""
    results: list[Any] = []
    for ps_name, future in calls:
        try:
            results.append(future.wait())
        except Exception as error:  # the server's own error arrives as its own type
            if is_transport_error(error):
                raise unavailable(ps_name, error) from None
            raise
    return results


def call(ps_name: str, fn: Callable[..., Any], args: Sequence[Any] = (),
         timeout: float | None = None) -> Any:
    """``fn(*args)`` on `ps_name`, waited for (see `call_async` and `wait`)."""
    return wait([call_async(ps_name, fn, args, timeout)])[0]


@dataclasses.dataclass(frozen=True)
class Shard:
    ps: str        # the parameter server's rpc name
    key: str       # the variable's key there
    start: int     # first row (0 for an unsharded variable)
    rows: int      # number of rows (0 for a scalar)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a variable lives: its shards (one for an unsharded variable), in row order."""

    key: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    shards: Tuple[Shard, ...]
    trainable: bool = True
    embedding: bool = False   # an nn.Embedding table: workers read only the rows they use

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 0


def read_full(layouts: Sequence[Layout]) -> list[torch.Tensor]:
    """The current value of each layout's variable (shards concatenated along dim 0), with
    one rpc per parameter server."""
    by_ps: dict[str, list[str]] = {}
    for layout in layouts:
        for shard in layout.shards:
            by_ps.setdefault(shard.ps, []).append(shard.key)
    calls = [call_async(ps, ps_store.read, (keys,)) for ps, keys in by_ps.items()]
    values: dict[str, torch.Tensor] = {}
    for (ps, keys), result in zip(by_ps.items(), wait(calls)):
        values.update(zip(keys, result))
    out: list[torch.Tensor] = []
    for layout in layouts:
        parts = [values[s.key] for s in layout.shards]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts, 0))
    return out


def split_rows(layout: Layout, value: torch.Tensor) -> list[torch.Tensor]:
    """`value` (the whole variable) cut into the layout's shards."""
    if not layout.sharded:
        return [value]
    return [value.narrow(0, s.start, s.rows) for s in layout.shards]


def write_full(layout: Layout, value: Any) -> None:
    """Assigns the whole variable (each shard gets its rows)."""
    value = torch.as_tensor(value, dtype=layout.dtype).detach().cpu()
    if tuple(value.shape) != tuple(layout.shape):
        raise ValueError(f"Cannot assign a value of shape {list(value.shape)} to variable "
                         f"{layout.key!r} of shape {list(layout.shape)}.")
    parts = split_rows(layout, value)
    wait([call_async(s.ps, ps_store.assign, (s.key, part.contiguous()))
          for s, part in zip(layout.shards, parts)])


def read_rows(layout: Layout, ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `ids` (any shape of int64 indices) of a variable, fetching from each shard only
    the distinct rows it holds. Returns ``(unique_ids, rows, inverse)`` with
    ``rows[inverse]`` the lookup result."""
    flat = ids.reshape(-1).to(torch.int64).cpu()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= layout.num_rows):
        raise IndexError(f"Embedding lookup id out of range for variable {layout.key!r} "
                         f"with {layout.num_rows} rows: ids span [{int(flat.min())}, "
                         f"{int(flat.max())}].")
    unique, inverse = torch.unique(flat, return_inverse=True)
    pieces: list[torch.Tensor] = []
    calls: list[tuple[str, Any]] = []
    for shard in layout.shards:
        mask = (unique >= shard.start) & (unique < shard.start + shard.rows)
        if bool(mask.any()):
            pieces.append(mask)
            calls.append(call_async(shard.ps, ps_store.read_rows,
                                    (shard.key, unique[mask] - shard.start)))
    row_shape = tuple(layout.shape[1:])
    rows = torch.empty((unique.numel(),) + row_shape, dtype=layout.dtype)
    for mask, result in zip(pieces, wait(calls)):
        rows[mask] = result
    return unique, rows, inverse
