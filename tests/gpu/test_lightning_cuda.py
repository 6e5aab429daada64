"""Lightning on a GPU: ``Trainer(accelerator="gpu", devices=1, strategy="mirrored")``
trains exactly as ``strategy="ddp"`` (deterministic, 1e-6). On "cpu" the same two runs with
``accelerator="cpu"``."""
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.devices import DEVICES
from tests.gpu.test_strategies_cuda import TIMEOUT, assert_states, environment
from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "tests", "gpu", "lightning_run.py")
pytest.importorskip("lightning", reason="Lightning is not installed in this python")


def train(strategy, device, out):
    accelerator = "gpu" if device == "cuda" else "cpu"
    done = subprocess.run([sys.executable, SCRIPT, "--strategy", strategy, "--accelerator",
                           accelerator, "--out", str(out)], cwd=ROOT, env=environment(device),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_mirrored_equals_ddp(device, tmp_path):
    ours = train("mirrored", device, tmp_path / "mirrored.pt")
    ddp = train("ddp", device, tmp_path / "ddp.pt")
    assert ours["strategy"] == "LightningStrategy" and ddp["strategy"] == "DDPStrategy"
    assert ours["device"] == ddp["device"] == ("cuda:0" if device == "cuda" else "cpu")
    assert ours["global_step"] == ddp["global_step"] == 10
    assert_states(ours["state_dict"], ddp["state_dict"], atol=1e-6, what="mirrored vs ddp")
