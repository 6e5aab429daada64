"""On-the-wire compression of gradient buckets: all-reduce in bf16 or fp16.

A bucket of fp32 (or fp64) gradients is packed into a buffer of half the bytes (a fused
cast-and-scale kernel), all-reduced, and unpacked back into the gradients. Each replica's
values are scaled by 1/N before the cast and the sum by N after it, so a sum over N
replicas stays in fp16's range whenever each replica's gradient does.

Errors are those of rounding to the wire dtype: every element of the summed gradient is
within about ``N * 2**-8`` (bf16) or ``N * 2**-11`` (fp16) of the largest magnitude among
the replicas' contributions to it, relative.
"""
from __future__ import annotations

from typing import TypeVar

import torch

_Ops = TypeVar("_Ops")

_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_compression(compression: str | None) -> str | None:
    """Returns `compression` ("bf16", "fp16" or None) after checking it.

    Raises:
      ValueError: any other value, naming the accepted ones.
    """
    if compression is None or compression in _WIRE_DTYPES:
        return compression
    raise ValueError(f"compression must be None, 'bf16' or 'fp16', got {compression!r}.")


def wire_dtype(compression: str | None, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a bucket of `dtype` travels in under `compression`, or None when it travels
    as it is (no compression, a non-floating bucket, or one already as small as the wire)."""
    if compression is None or not dtype.is_floating_point:
        return None
    wire = _WIRE_DTYPES[compression]
    if torch.finfo(dtype).bits <= torch.finfo(wire).bits:
        return None
    return wire


def with_compression(cross_device_ops: _Ops, compression: str | None) -> _Ops:
    """Returns `cross_device_ops` set to carry `compression` (how a strategy applies
    ``CommunicationOptions.compression`` to its cross-device ops).

    Raises:
      ValueError: a bad value, or cross-device ops already set to another compression.
    """
    compression = check_compression(compression)
    if compression is None:
        return cross_device_ops
    current = getattr(cross_device_ops, "compression", None)
    if current not in (None, compression):
        raise ValueError(f"CommunicationOptions(compression={compression!r}) disagrees with "
                         f"{cross_device_ops!r}; set compression in one place only.")
    # Any cross-device ops object: those that do not declare `compression` gain it here.
    setattr(cross_device_ops, "compression", compression)
    return cross_device_ops
