"""The devices the tests of tests/gpu run on: "cpu" (the same comparisons, here and in CI)
and "cuda" (skipped without a GPU, with the reason). scripts/gpu_check.sh sets
TORCHSTRATEGY_GPU_CHECK_CUDA_ONLY=1 on a GPU machine: the CPU cases ran in CI already, and
its 8 minutes go to the CUDA ones."""
import os

import pytest
import torch

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False here)"
CUDA_ONLY = os.environ.get("TORCHSTRATEGY_GPU_CHECK_CUDA_ONLY") == "1" and \
    torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
CUDA = pytest.param("cuda", id="cuda", marks=needs_cuda)
DEVICES = ([] if CUDA_ONLY else [pytest.param("cpu", id="cpu")]) + [CUDA]
