"""TPUStrategy on torch_xla's CUDA device (PJRT_DEVICE=CUDA) trains as a plain CPU loop.

Skipped, saying why, unless the python running the suite has both a GPU and torch_xla (the
GPU machine's python has no torch_xla; a CUDA build of torch_xla matching its torch is
needed, which pip cannot fetch there without internet)."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.gpu.devices import NO_CUDA
from tests.gpu.test_strategies_cuda import TIMEOUT, assert_states, environment
from tests.helpers import ROOT

REASON = None
if not torch.cuda.is_available():
    REASON = NO_CUDA
elif importlib.util.find_spec("torch_xla") is None:
    REASON = (f"torch_xla is not installed in {sys.executable} (torch {torch.__version__}): "
              "TPUStrategy on XLA's CUDA device needs a CUDA build of torch_xla for this torch")


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_tpu_strategy_on_xla_cuda_trains_as_a_cpu_loop(tmp_path):
    out = tmp_path / "xla.pt"
    done = subprocess.run([sys.executable, "-m", "tests.gpu.cases", "xla_on_cuda", str(out)],
                          cwd=ROOT, env=environment("cuda", PJRT_DEVICE="CUDA",
                                                    GPU_NUM_DEVICES="1"),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = torch.load(out, weights_only=False)
    assert result["replicas"] >= 1
    torch.testing.assert_close(result["losses"], result["plain_losses"], atol=1e-4, rtol=1e-4)
    assert_states(result["ours"], result["plain"], atol=1e-4, rtol=1e-4, what="xla:cuda vs cpu")
