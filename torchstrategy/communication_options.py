"""`CommunicationOptions`: how the multi-worker strategy's collectives run (TensorFlow's names)."""
from __future__ import annotations

import enum
import numbers
import warnings
from typing import Callable

from torchstrategy.collectives.compression import Compression, check_compression


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use.

    AUTO: NCCL for CUDA tensors, gloo's ring otherwise. RING: gloo (TCP rings, any device
    whose tensors gloo accepts; CPU here). NCCL: NVIDIA's library, CUDA tensors only; asked
    for on CPU replicas it warns and uses gloo, as TensorFlow does (see `backend_for`).
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


def backend_for(implementation: CommunicationImplementation, device_type: str) -> str:
    """The torch.distributed backend that carries `implementation` between replicas on
    `device_type` devices: "nccl" or "gloo".

    NCCL asked for replicas without GPUs does what TensorFlow's
    collective_all_reduce_strategy does there: a warning ("Enabled NCCL communication but
    no GPUs"), and the collectives run on the CPU implementation (gloo) instead.
    """
    if implementation is CommunicationImplementation.NCCL and device_type != "cuda":
        warnings.warn(
            f"CommunicationImplementation.NCCL was asked for, but this worker's replicas "
            f"are on {device_type.upper()} (no GPUs detected or specified); NCCL reduces "
            "CUDA tensors only, so collectives run on gloo (RING), as TensorFlow falls back "
            "too. To silence this, use implementation=RING or AUTO here, or run on GPUs "
            "(devices=['cuda:0', ...]).", RuntimeWarning, stacklevel=3)
        return "gloo"
    if implementation is CommunicationImplementation.NCCL:
        return "nccl"
    if implementation is CommunicationImplementation.RING:
        return "gloo"
    return "nccl" if device_type == "cuda" else "gloo"


class CommunicationOptions:
    """Options for cross-replica communication.

    Args:
      bytes_per_pack: gradients are all-reduced in packs (buckets) of about this many bytes;
        0 lets the library choose (25 MiB, with a small first pack so communication starts
        early).
      timeout_seconds: every collective fails with `ts.CollectiveError` after this long
        instead of hanging; None keeps the strategy's default (TORCHSTRATEGY_TIMEOUT_SECONDS,
        else 30 minutes).
      implementation: a `CommunicationImplementation` or its name ("AUTO", "RING", "NCCL").
      compression: None, "bf16" or "fp16": gradients of wider floating dtypes are
        all-reduced in that dtype (half the bytes, rounded); or ``ts.PowerSGD(rank=4)`` /
        ``ts.Int8()``: error-feedback compression (far fewer bytes; see
        docs/gradient_reduction.md); or "auto" / ``ts.AutoCompression(...)``: the gradient
        reducer measures the first steps, the link and its core, and picks the mode
        predicted fastest (`torchstrategy.collectives.auto_compression`); the same as
        ``ts.NcclAllReduce(compression=...)``.

    Raises:
      ValueError / TypeError: naming the bad argument.
    """

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: float | None = None,
                 implementation: CommunicationImplementation | str =
                 CommunicationImplementation.AUTO, compression: Compression = None) -> None:
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) \
                or bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int (0 = automatic), "
                             f"got {bytes_per_pack!r}.")
        if timeout_seconds is not None and (isinstance(timeout_seconds, bool) or not isinstance(
                timeout_seconds, numbers.Real) or not timeout_seconds > 0):
            raise ValueError(f"timeout_seconds must be a positive number or None, got "
                             f"{timeout_seconds!r}.")
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation[implementation.upper()]
            except KeyError:
                raise ValueError(f"implementation must be one of "
                                 f"{[m.name for m in CommunicationImplementation]}, got "
                                 f"{implementation!r}.") from None
        if not isinstance(implementation, CommunicationImplementation):
            raise TypeError(f"implementation must be a ts.CommunicationImplementation, got "
                            f"{implementation!r}.")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation: CommunicationImplementation = implementation
        self.compression = check_compression(compression)

    def __repr__(self) -> str:
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, "
                f"implementation={self.implementation.name}"
                + (f", compression={self.compression!r})" if self.compression else ")"))


def require_default_options(options: CommunicationOptions | None,
                            refusal: Callable[[CommunicationOptions], str]) -> None:
    """Accepts only ``options=None`` or a `CommunicationOptions` left at its defaults (it
    asks for nothing); for anything else raises ``ValueError(refusal(options))``, where the
    strategy says why it cannot honour it and what to do instead.

    Raises:
      TypeError: `options` is neither None nor a `CommunicationOptions`.
      ValueError: a non-default value.
    """
    if options is None:
        return
    if not isinstance(options, CommunicationOptions):
        raise TypeError(f"options must be a ts.CommunicationOptions (or None), got "
                        f"{options!r}.")
    if options.bytes_per_pack or options.timeout_seconds is not None or \
            options.compression is not None or \
            options.implementation is not CommunicationImplementation.AUTO:
        raise ValueError(refusal(options))
