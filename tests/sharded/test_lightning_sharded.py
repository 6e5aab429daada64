"""The Lightning adapter on ShardedStrategy: ``Trainer(strategy=LightningStrategy(
ts.ShardedStrategy(...)))`` trains two CPU replicas (re-executed script) to the weights of
``Trainer(strategy="mirrored")`` (itself tested equal to Lightning's ddp), with sharded
parameters; its checkpoint holds a plain state_dict and the optimizer state keyed by
parameter name, and ``Trainer(strategy="sharded")`` resumes from it as "mirrored" resumes
from its own (4 + 2 steps)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.lightning_runs import SUBPROCESS_TIMEOUT_SECONDS, clean_env

# The script imports Lightning in its own processes; this one only reads tensors back, so it
# checks that Lightning is installed without paying for importing it.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)
pytestmark = pytest.mark.timeout(SUBPROCESS_TIMEOUT_SECONDS + 30)

SCRIPT = os.path.join(ROOT, "tests", "sharded", "lightning_script.py")


def test_lightning_trainer_on_sharded_strategy(tmp_path):
    result = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], cwd=ROOT,
                            env=clean_env(), capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_SECONDS)
    assert result.returncode == 0, result.stderr[-5000:]
    # The script freezes its objects (gc.freeze) before its end; the runtime's shutdown
    # still frees the groups (a group alive at the teardown aborted a replica now and then).
    assert "still referenced after it was destroyed" not in result.stderr, \
        result.stderr[-5000:]
    out = torch.load(tmp_path / "result.pt", weights_only=False)
    assert out["placements"] == ["DTensor"]
    sharded, mirrored = out["sharded"], out["mirrored"]
    assert list(sharded["checkpoint"]) == list(mirrored["checkpoint"])
    assert len(mirrored["checkpoint"]) == 6
    for key, value in mirrored["checkpoint"].items():
        assert type(sharded["checkpoint"][key]) is torch.Tensor
        torch.testing.assert_close(sharded["checkpoint"][key], value, atol=1e-5, rtol=0)
        torch.testing.assert_close(sharded["resumed"][key], mirrored["resumed"][key],
                                   atol=1e-5, rtol=0)
    # Optimizer state keyed by parameter name (mirrored's by index), the same values.
    assert [name for name, _ in sharded["optimizer"]] == list(mirrored["checkpoint"])
    for (_, mine), (_, theirs) in zip(sharded["optimizer"], mirrored["optimizer"]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[key], theirs[key], atol=1e-5, rtol=0)
