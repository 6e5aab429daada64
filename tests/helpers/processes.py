"""Starting a program as a user would, and telling whether its processes still run."""
import os
import signal
import time

# Variables a launcher sets; a test that starts a program "from a plain shell" removes them
# so the program does not think it was launched (the suite itself may run under one).
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER",
                       "TORCHSTRATEGY_PARENT_PID", "GROUP_RANK", "GROUP_WORLD_SIZE",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHSTRATEGY_PUBLISHED_WORLD")


def plain_environment(timeout_seconds=60):
    """This environment without any launcher's variables, collectives bounded by
    `timeout_seconds`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = str(timeout_seconds)
    return env



def take_sigint_by_default() -> None:
    """`preexec_fn` for a job a test interrupts with SIGINT, as a terminal's Ctrl-C does.

    A job started from a shell's background (`cmd &`, `nohup`, some CI runners) inherits
    SIGINT ignored, and Python then never installs its KeyboardInterrupt handler: the job
    would ignore the test's Ctrl-C. A job in a terminal takes SIGINT; so does this one."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


def sleep_then_mark(outdir: "str | os.PathLike[str]", seconds: float) -> None:
    """In a replica that should be ended by its launcher: records this process's id in
    `outdir`/sleeper.pid, sleeps `seconds`, and writes `outdir`/woke if it ever gets there.
    `assert_ended_not_awaited` then tells "ended by the launcher" from "waited for", by the
    order of events rather than by a clock."""
    pid_file = os.path.join(outdir, "sleeper.pid")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)   # the reader never sees a half-written id
    time.sleep(seconds)
    with open(os.path.join(outdir, "woke"), "w"):
        pass


def assert_ended_not_awaited(outdir: "str | os.PathLike[str]",
                             bound_seconds: float = 60) -> None:
    """The process of `sleep_then_mark` was ended before its sleep was over: it never woke,
    and it is gone (polled up to `bound_seconds`, a hang guard: reaping is asynchronous)."""
    assert not os.path.exists(os.path.join(outdir, "woke")), \
        "the launcher waited for the sleeping replica instead of ending it"
    pid_file = os.path.join(outdir, "sleeper.pid")
    if not os.path.exists(pid_file):
        return  # ended before it began to sleep: nothing was awaited
    with open(pid_file) as f:
        pid = int(f.read())
    deadline = time.monotonic() + bound_seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"the sleeping replica (pid {pid}) outlived its launcher"
    assert not os.path.exists(os.path.join(outdir, "woke"))
