"""`GlobalValue`: what TPUStrategy's distributed values are.

Under torch_xla SPMD the step runs once, as one program over the whole global batch, and each
tensor is one *global* tensor whose pieces live on the devices: a batch split along dim 0
(each device holding its rows) or a replicated value (each device holding a full copy).
`GlobalValue` wraps such a tensor and presents it as a tf.distribute distributed value:
``values`` are the per-device pieces (what ``experimental_local_results`` returns), while
`TPUStrategy` computes on the global tensor itself without gathering anything.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from torchstrategy.values import DistributedValues


class GlobalValue(DistributedValues):
    """One global XLA tensor of TPUStrategy, with one component per local XLA device.

    Attributes:
      tensor: the global tensor (lazy: using it in further XLA computation moves nothing).
      values: a tuple of host (CPU) copies of each local device's piece, in device order:
        its rows for a tensor split along a dimension (XLA gives each device
        ``ceil(rows / devices)`` rows, the last ones fewer or none), the whole tensor for a
        replicated one. Reading them waits for the pending computation.
      replica_ids: the global ordinals of those devices.
    """

    def __init__(self, tensor: torch.Tensor, extended: Any) -> None:  # noqa: D107
        # No components until asked: `extended` (TPUStrategy's) reads them from the devices.
        self._tensor = tensor
        self._extended = extended
        self._pieces: list[tuple[int, torch.Tensor]] | None = None

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def _read(self) -> list[tuple[int, torch.Tensor]]:
        if self._pieces is None:
            self._pieces = self._extended.local_pieces(self._tensor)
        return self._pieces

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        return tuple(data for _, data in self._read())

    @property
    def replica_ids(self) -> tuple[int, ...]:
        return tuple(ordinal for ordinal, _ in self._read())

    @property
    def shape(self) -> torch.Size:
        """The global tensor's shape."""
        return self._tensor.shape

    def __repr__(self) -> str:
        return f"GlobalValue(shape={tuple(self._tensor.shape)}, dtype={self._tensor.dtype})"

    __str__ = __repr__


def device_ordinal(name: str) -> int:
    """``"CPU:3"`` / ``"TPU:3"`` -> 3."""
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else 0
