"""A global batch split among however many replicas are alive, for live recovery.

Live recovery redoes an interrupted step on the *same* global batch, split among the
survivors, so that N replicas keep training exactly like one device through a loss. That
needs two things, both here: a global batch size that every size the job may pass through
divides (checked once, before training starts), and the slice of a global batch that
replica r of n takes (equal, contiguous slices along the first dimension, replica 0
first: the order a single device sees the samples in).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from torchstrategy import nest


def check_divisible(global_batch_size: int, sizes: Iterable[int]) -> None:
    """Raises unless `global_batch_size` is a positive int that every replica count in
    `sizes` divides.

    Raises:
      ValueError: naming the sizes that do not divide it and the smallest global batch
        that every size divides.
    """
    sizes = sorted(set(int(s) for s in sizes))
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive int, got "
                         f"{global_batch_size!r}.")
    bad = [s for s in sizes if global_batch_size % s]
    if bad:
        lcm = 1
        for s in sizes:
            lcm = lcm * s // _gcd(lcm, s)
        raise ValueError(
            f"torchstrategy: live recovery may continue on any of {sizes} replicas, but a "
            f"global batch of {global_batch_size} samples cannot be split equally among "
            f"{bad} of them. Use a global batch that every one of these sizes divides "
            f"(a multiple of {lcm}), or raise min_replicas.")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def replica_slice(global_batch: Any, rank: int, world_size: int,
                  global_batch_size: int) -> Any:
    """Replica `rank`'s share of `global_batch` (a tensor or a nest of tensors whose first
    dimension is the batch): rows ``rank * k .. (rank + 1) * k - 1`` of every leaf, with
    ``k = global_batch_size // world_size``. Leaves that are not tensors are passed as they
    are.

    Raises:
      ValueError: a tensor leaf whose first dimension is not `global_batch_size` (the last,
        smaller batch of an epoch included: give the loader ``drop_last=True``).
    """
    leaves, spec = nest.flatten(global_batch)
    per_replica = global_batch_size // world_size
    out = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] != global_batch_size:
                raise ValueError(
                    f"torchstrategy: live recovery splits every global batch of "
                    f"{global_batch_size} samples among the replicas, but leaf {index} of "
                    f"this batch has shape {tuple(leaf.shape)}. Give every step a full "
                    "global batch (a DataLoader with drop_last=True and batch_size="
                    f"{global_batch_size}).")
            leaf = leaf[rank * per_replica:(rank + 1) * per_replica]
        out.append(leaf)
    return nest.pack(spec, out)
