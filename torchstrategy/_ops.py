"""The fused kernels of ``torchstrategy._C``, as Python functions.

Importing ``torchstrategy._C`` registers ``torch.ops.torchstrategy.pack`` and ``unpack``.
A missing extension, or one built against another torch, does not make ``import
torchstrategy`` fail: the torch_xla environment (another torch, no build) imports the package
for TPUStrategy, which never packs. The first `pack` / `unpack` there raises the ImportError
below instead.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

try:
    from torchstrategy import _C  # noqa: F401  (registers the ops)
    _load_error: ImportError | None = None
except ImportError as error:
    _load_error = error


def _require_extension() -> None:
    if _load_error is not None:
        raise ImportError(
            "torchstrategy's compiled extension (torchstrategy._C) is missing or was built "
            "against another torch. Rebuild it in the environment you run in with "
            "`pip install --no-build-isolation -e .` (or `bash scripts/setup.sh`)."
        ) from _load_error


def make_reducer(cap_bytes: int, first_cap_bytes: int, world_size: int, wire_dtype: str,
                 process_group: Any, launch_bucket: Callable[[int, torch.Tensor], Any],
                 finalize_callback: Callable[[], None]) -> Any:
    """A ``torchstrategy._C.Reducer`` (the gradient reducer's hot path, csrc/reducer.cpp):
    buckets of at most `cap_bytes` (the first `first_cap_bytes`) over `world_size`
    replicas, on the wire in `wire_dtype` ("bf16", "fp16" or "" for the buckets' own),
    launched on the c10d `process_group` or, when None, through ``launch_bucket(bucket
    index, flat buffer)`` (which returns a handle with ``wait()``; index -1 carries the
    step's "contributed" flags, to be summed like a bucket); `finalize_callback` is
    queued on the autograd engine once per backward and must call ``finalize()``."""
    _require_extension()
    return _C.Reducer(cap_bytes, first_cap_bytes, world_size, wire_dtype, process_group,
                      launch_bucket, finalize_callback)


def pack(flat: torch.Tensor, tensors: Sequence[torch.Tensor | None], offsets: Sequence[int],
         numels: Sequence[int], scale: float = 1.0) -> None:
    """Writes ``scale * tensors[i]`` into ``flat[offsets[i]:offsets[i] + numels[i]]``.

    A None entry writes zeros. Sources of another dtype or layout are converted.
    """
    _require_extension()
    torch.ops.torchstrategy.pack(flat, tensors, offsets, numels, float(scale))


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
           scale: float = 1.0, accumulate: bool = False) -> None:
    """Writes ``scale * flat[offsets[i]:...]`` into each ``tensors[i]`` in place (added to
    it when `accumulate`)."""
    _require_extension()
    torch.ops.torchstrategy.unpack(flat, tensors, offsets, float(scale), bool(accumulate))


def ef_quantize_int8(grad: torch.Tensor, residual: torch.Tensor, q: torch.Tensor,
                     scales: torch.Tensor, chunk: int) -> None:
    """Int8 quantisation with error feedback, in place (csrc/ef_ops.h): ``c = grad +
    residual``; per chunk of `chunk` elements ``scales[j] = max|c| / 127``; ``q =
    round(c / scales[j])`` (int8); ``residual = c - q * scales[j]``."""
    _require_extension()
    torch.ops.torchstrategy.ef_quantize_int8(grad, residual, q, scales, int(chunk))


def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                   chunk: int) -> None:
    """``out = sum_r q[r] * scales[r]`` (per chunk), summed in float in replica order, so
    every replica computes the same bits (csrc/ef_ops.h)."""
    _require_extension()
    torch.ops.torchstrategy.dequantize_sum(q, scales, out, int(chunk))


def powersgd_finish(residual: torch.Tensor, p: torch.Tensor, q_local_t: torch.Tensor,
                    q_t: torch.Tensor, out: torch.Tensor) -> None:
    """PowerSGD's last pass, in place (csrc/powersgd_ops.h): ``residual -= p @ q_local_t``
    (what this replica's term missed), ``out = p @ q_t`` (P Q^T); one fused pass on CPU."""
    _require_extension()
    torch.ops.torchstrategy.powersgd_finish(residual, p, q_local_t, q_t, out)


def powersgd_project(residual: torch.Tensor, grad: torch.Tensor, q_t: torch.Tensor,
                     p: torch.Tensor) -> None:
    """PowerSGD's first pass for `count` matrices of one shape, in place
    (csrc/powersgd_ops.h): ``residual += grad`` (M), ``p = residual @ q_t^T`` (P = M Q);
    `residual` and `grad` are ``count x rows x cols``, `q_t` ``count x rank x cols``, `p`
    ``count x rows x rank``. One sweep over M on CPU, each matrix the same bits alone or in
    a run, whatever the thread count."""
    _require_extension()
    torch.ops.torchstrategy.powersgd_project(residual, grad, q_t, p)


def powersgd_finish_batched(residual: torch.Tensor, p: torch.Tensor, q_local_t: torch.Tensor,
                            q_t: torch.Tensor, out: torch.Tensor) -> None:
    """`powersgd_finish` for `count` matrices of one shape at once, in place: `residual` and
    `out` are ``count x rows x cols``, `p` ``count x rows x rank``, `q_local_t` and `q_t`
    ``count x rank x cols``. On CPU every matrix gets the bits `powersgd_finish` gives it
    alone (csrc/powersgd_ops.h), without a call per matrix."""
    _require_extension()
    torch.ops.torchstrategy.powersgd_finish_batched(residual, p, q_local_t, q_t, out)
