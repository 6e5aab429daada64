"""Replica 0's state dict on every replica: its tensors sent as tensors, the rest pickled.

An admission (`LiveRecovery`'s ``join``) gives the joiner replica 0's optimizer state, which
is as large as the parameters or twice as large (SGD's momentum, Adam's two moments).
Pickled whole through ``broadcast_object`` it took 2.5x as long as the same bytes sent by
``broadcast_`` (measured with scripts/bench_recovery.py, 1 GB of training state: 1.7-2.7 s
against 0.7-1.1 s): pickling copies every tensor into a byte string and back. Here only
the structure and the small values are pickled; the tensors travel by
``Communicator.broadcast_``: each of at least ``DIRECT_BROADCAST_BYTES`` (1 MiB) alone,
from the sender's tensor straight into the receiver's new one, the smaller ones packed in
one flat buffer per dtype. SGD's momentum of the 1 GB bench (341 MiB, four tensors) from
one gloo process to another over loopback into new tensors: 0.24 s (1.4 GiB/s; of it
~0.08 s the receiver's first touch of the new tensors' pages), against 0.68-0.88 s when
every tensor went through a flat buffer (a new buffer on each side, a pack and an unpack
copy); measured side by side in 2 runs of 4 each, load 1.7-2.2, 2 cores. In the 1 GB
bench's admission the optimizer state took 0.24-0.27 s (0.56-0.62 s before; 3 runs each,
load 1.3-2.1).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torchstrategy import nest
from torchstrategy.collectives.communicator import Communicator


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor was in the state, and what the receivers allocate for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_accelerator: bool


def broadcast_state(comm: Communicator, state: Any, src: int = 0) -> Any:
    """Returns replica `src`'s `state` on every replica of `comm` (a collective; `state` is
    only read on replica `src`, pass None elsewhere).

    `state` is a nested structure (`torchstrategy.nest`: dicts, lists, tuples; an
    optimizer's or a module's ``state_dict()``) whose leaves are tensors or picklable
    values. The receivers get new tensors of the sender's shapes, dtypes and values: on the
    CPU where the sender's were, else on `comm.device`; replica `src` gets its own `state`
    back.
    """
    # The tensors in the order of traversal, the same on the sender and the receivers.
    tensors: list[torch.Tensor] = []

    def strip(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf.detach())
        return _TensorSlot(tuple(leaf.shape), leaf.dtype, leaf.device.type != "cpu")

    def allocate(leaf: Any) -> Any:
        if not isinstance(leaf, _TensorSlot):
            return leaf
        # Contiguous and, for the sender's accelerator tensors, on the communicator's
        # device: broadcast_ receives each large one straight into it, with no copy.
        tensor = torch.empty(leaf.shape, dtype=leaf.dtype,
                             device=comm.device if leaf.on_accelerator else "cpu")
        tensors.append(tensor)
        return tensor

    skeleton = comm.broadcast_object(nest.map_structure(strip, state)
                                     if comm.rank == src else None, src=src)
    if comm.rank != src:
        state = nest.map_structure(allocate, skeleton)
    comm.broadcast_(tensors, src=src)
    return state
