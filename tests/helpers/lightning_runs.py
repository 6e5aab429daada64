"""Helpers for tests/test_lightning*.py: run the Lightning training script in a fresh
process (with a timeout) and read back what replica 0 saved."""
import os
import subprocess
import sys

import torch

from tests.helpers import ROOT
SCRIPT = os.path.join(ROOT, "tests", "scripts", "lightning_train.py")
SUBPROCESS_TIMEOUT_SECONDS = 180

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                       "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                       "TORCHSTRATEGY_LAUNCHER", "TORCHSTRATEGY_PARENT_PID", "PL_GLOBAL_SEED",
                       "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
                       "TORCHSTRATEGY_PUBLISHED_WORLD")


def clean_env():
    """This environment without any launcher's variables (so the OS picks every port)."""
    env = dict(os.environ)
    for name in _LAUNCHER_VARIABLES:
        env.pop(name, None)
    env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = "60"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_training(out_dir, *argv, stdin=False, torchrun=False):
    """Runs the training script with `argv` writing into `out_dir`; returns its result.

    With `stdin` the program is read from standard input (``python - ...``), where
    re-execution is impossible, as in a notebook. With `torchrun` it runs under
    ``torchrun --standalone --nproc-per-node=2`` (rendezvous on a free port)."""
    os.makedirs(out_dir, exist_ok=True)
    argv = [*argv, "--out", str(out_dir)]
    if torchrun:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", SCRIPT, *argv], cwd=ROOT,
                                env=clean_env(), capture_output=True, text=True,
                                timeout=SUBPROCESS_TIMEOUT_SECONDS)
    elif stdin:
        with open(SCRIPT) as source:
            result = subprocess.run([sys.executable, "-", *argv], stdin=source, cwd=ROOT,
                                    env=clean_env(), capture_output=True, text=True,
                                    timeout=SUBPROCESS_TIMEOUT_SECONDS)
    else:
        result = subprocess.run([sys.executable, SCRIPT, *argv], cwd=ROOT, env=clean_env(),
                                capture_output=True, text=True,
                                timeout=SUBPROCESS_TIMEOUT_SECONDS)
    assert result.returncode == 0, (
        f"{' '.join(argv)} exited with {result.returncode}\n--- stdout ---\n"
        f"{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}")
    return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)
