"""The examples and the step benchmark run end to end, as a user would start them.

Each runs as `python <script>` in a subprocess: the examples' MirroredStrategy re-executes
the command for replica 1, exactly as on a user's machine.
"""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
SUBPROCESS_TIMEOUT_SECONDS = 240


def _env():
    env = dict(os.environ)
    env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = "60"
    env["PYTHONUNBUFFERED"] = "1"
    # A launcher's variables (pytest under torchrun) must not leak into the examples.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER",
                 "TORCHSTRATEGY_PARENT_PID"):
        env.pop(name, None)
    return env


def _run(*argv):
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(),
                            capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_SECONDS)
    assert result.returncode == 0, (
        f"{' '.join(argv)} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    return result.stdout


@pytest.mark.timeout(SUBPROCESS_TIMEOUT_SECONDS + 30)
@pytest.mark.parametrize("example", ["quickstart.py", "custom_training_loop.py"])
def test_example_trains_to_high_accuracy(example):
    stdout = _run(os.path.join("examples", example))
    found = re.findall(r"^test accuracy: ([0-9.]+)", stdout, flags=re.MULTILINE)
    # Replica 0 alone prints the result.
    assert len(found) == 1, f"expected one 'test accuracy' line:\n{stdout}"
    assert float(found[0]) > 0.9, stdout


@pytest.mark.timeout(SUBPROCESS_TIMEOUT_SECONDS + 30)
def test_bench_step_quick_runs():
    stdout = _run(os.path.join("scripts", "bench_step.py"), "--quick")
    for config in ("ours", "ddp", "no-sync"):
        assert re.search(rf"^{config}\s+[0-9.]+", stdout, flags=re.MULTILINE), stdout
    for pair in ("ours / ddp", "ours / no-sync", "ddp / no-sync"):
        assert re.search(rf"^{pair}\s+[0-9.]+\s+[0-9.]+", stdout, flags=re.MULTILINE), stdout
