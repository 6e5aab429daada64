"""Replica 0's state dict on every replica: its tensors sent as tensors, the rest pickled.

An admission (`LiveRecovery`'s ``join``) gives the joiner replica 0's optimizer state, which
is as large as the parameters or twice as large (SGD's momentum, Adam's two moments).
Pickled whole through ``broadcast_object`` it took 2.5x as long as the same bytes sent by
``broadcast_`` (measured with scripts/bench_recovery.py, 1 GB of training state: 1.7-2.7 s
against 0.7-1.1 s): pickling copies every tensor into a byte string and back. Here only
the structure and the small values are pickled; the tensors travel in one flat buffer per
dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torchstrategy.collectives.communicator import Communicator


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor was in the state, and what the receivers allocate for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_accelerator: bool


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by its `_TensorSlot` (appended to `tensors` in the
    order of traversal)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _TensorSlot(tuple(value.shape), value.dtype, value.device.type != "cpu")
    if isinstance(value, dict):
        return type(value)((key, _strip(item, tensors)) for key, item in value.items())
    if isinstance(value, list):
        return [_strip(item, tensors) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_strip(item, tensors) for item in value)
    return value


def _allocate(value: Any, tensors: list[torch.Tensor], device: torch.device | None) -> Any:
    """The inverse of `_strip` on a receiver: a new tensor for each slot (appended to
    `tensors` in the same order), on `device` where the sender's was on an accelerator."""
    if isinstance(value, _TensorSlot):
        tensor = torch.empty(value.shape, dtype=value.dtype,
                             device=device if value.on_accelerator else "cpu")
        tensors.append(tensor)
        return tensor
    if isinstance(value, dict):
        return type(value)((key, _allocate(item, tensors, device))
                           for key, item in value.items())
    if isinstance(value, list):
        return [_allocate(item, tensors, device) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_allocate(item, tensors, device) for item in value)
    return value


def broadcast_state(comm: Communicator, state: Any) -> Any:
    """Returns replica 0's `state` on every replica of `comm` (a collective; `state` is only
    read on replica 0, pass None elsewhere).

    `state` is a nest of dicts, lists and tuples (an optimizer's or a module's
    ``state_dict()``) whose leaves are tensors or picklable values. The receivers get new
    tensors of the sender's shapes, dtypes and values: on the CPU where the sender's were,
    else on `comm.device`; replica 0 gets its own `state` back.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _strip(state, tensors) if comm.rank == 0 else None
    skeleton = comm.broadcast_object(skeleton)
    if comm.rank != 0:
        state = _allocate(skeleton, tensors, comm.device)
    comm.broadcast_(tensors, src=0)
    return state
