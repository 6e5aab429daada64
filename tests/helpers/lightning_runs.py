"""Helpers for the tests that run Lightning programs in fresh processes: the environment
without any launcher's variables, and the time limit of such a run."""
import os

from tests.helpers import ROOT
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
