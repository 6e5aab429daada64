"""Starting a program as a user would, and telling whether its processes still run."""
import os

# Variables a launcher sets; a test that starts a program "from a plain shell" removes them
# so the program does not think it was launched (the suite itself may run under one).
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER",
                       "TORCHSTRATEGY_PARENT_PID", "GROUP_RANK", "GROUP_WORLD_SIZE")


def plain_environment(timeout_seconds=60):
    """This environment without any launcher's variables, collectives bounded by
    `timeout_seconds`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = str(timeout_seconds)
    return env


def alive(pid):
    """True while process `pid` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which may itself hold spaces or ")".
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
