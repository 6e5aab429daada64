"""The fused kernels of ``torchstrategy._C``, as Python functions.

Importing ``torchstrategy._C`` registers ``torch.ops.torchstrategy.pack`` and ``unpack``.
"""
try:
    from torchstrategy import _C  # noqa: F401  (registers the ops)
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchstrategy's compiled extension (torchstrategy._C) is missing or was built "
        "against another torch. Rebuild it in the environment you run in with "
        "`pip install --no-build-isolation -e .` (or `bash scripts/setup.sh`)."
    ) from error

import torch

Reducer = _C.Reducer  # the gradient reducer's hot path (csrc/reducer.cpp)


def pack(flat, tensors, offsets, numels, scale=1.0):
    """Writes ``scale * tensors[i]`` into ``flat[offsets[i]:offsets[i] + numels[i]]``.

    A None entry writes zeros. Sources of another dtype or layout are converted.
    """
    torch.ops.torchstrategy.pack(flat, tensors, offsets, numels, float(scale))


def unpack(flat, tensors, offsets, scale=1.0, accumulate=False):
    """Writes ``scale * flat[offsets[i]:...]`` into each ``tensors[i]`` in place (added to
    it when `accumulate`)."""
    torch.ops.torchstrategy.unpack(flat, tensors, offsets, float(scale), bool(accumulate))
