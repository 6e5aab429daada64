"""A job ends clean: the runtime's shutdown frees the process group (gloo's threads joined)
before the interpreter's teardown, and short jobs of every launch kind exit 0 with nothing
left behind (scripts/stress_exit.py runs hundreds of them; here a few)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.processes import plain_environment

# Tests of how processes exit: they exit as users' do (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_exit")

STRESS_SCRIPT = os.path.join(ROOT, "scripts", "stress_exit.py")

# How the programs below count gloo's threads (pasted into each: they run as scripts).
GLOO_THREAD_COUNTING = """
def gloo_threads():
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):
            pass   # the thread ended between the listing and the read: not running
    return sum(name in ("gloo_tcp_loop", "pt_gloo_runloop") for name in names)


def gloo_threads_started():
    # gloo's threads name themselves once scheduled: on a loaded machine the name can
    # come a moment after the group exists, so wait for it (bounded) before counting
    deadline = time.monotonic() + 20
    while gloo_threads() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return gloo_threads()
"""

# One process, a world of one (MultiWorkerMirroredStrategy without a launcher: a gloo group
# of size 1). torch.distributed.nn.functional is imported only after the group exists, as
# torch._dynamo's lazy import does at the first optimizer: its default arguments then hold
# the group object.
PROGRAM = """
import glob
import sys
import time

import torch.distributed as dist
import torchstrategy as ts
from torchstrategy import _compat, runtime
""" + GLOO_THREAD_COUNTING + """

assert "torch.distributed.nn.functional" not in sys.modules, "imported too early"
strategy = ts.MultiWorkerMirroredStrategy()
assert dist.is_initialized() and dist.get_backend() == "gloo"
import torch.distributed.nn.functional as functional  # after the group: binds it

group = _compat.default_process_group()
held = sum(value is group for value in functional.all_reduce.__defaults__)
del group
print("held", held)
print("threads before", gloo_threads_started())
runtime.current().shutdown()
print("threads after", gloo_threads())
print("default is None", functional.all_reduce.__defaults__[-1] is None)
"""


def test_shutdown_frees_the_group_that_torch_functional_defaults_held(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                            text=True, timeout=240, env=plain_environment(timeout_seconds=60))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    # the trap is set: the module's defaults hold the live group, whose threads run
    assert lines["held"] == "1", result.stdout
    assert int(lines["threads before"]) > 0, result.stdout
    # ... and the shutdown freed it: no gloo thread is left for the interpreter's teardown
    assert lines["threads after"] == "0", result.stdout
    assert lines["default is None"] == "True", result.stdout


# What else kept a group alive past the runtime's shutdown: the reducer's re-bucketing
# factory (a closure over the group, added with the bucket autotuner), an object the program
# dropped in a reference cycle (freed only by the cycle collector, possibly in teardown), and
# the traceback of the exception that ended the program (its frames' locals). One process,
# a world of one; gloo's threads are counted by an exit handler registered before the
# runtime's, so it runs after the runtime's shutdown, as the interpreter's teardown would.
HOLDERS_PROGRAM = """
import atexit
import glob
import sys
import time
""" + GLOO_THREAD_COUNTING + """

atexit.register(lambda: print("threads at exit", gloo_threads(), flush=True))

from torch import nn
import torchstrategy as ts
from torchstrategy import _compat
from torchstrategy.collectives.reducer import GradientReducer

mode = sys.argv[1]
strategy = ts.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = nn.Linear(4, 1)
print("threads before", gloo_threads_started(), flush=True)


class Holder:
    pass


if mode == "ours":
    # a reducer the autotuner re-bucketed, kept to the end as a strategy keeps its own
    reducer = GradientReducer(strategy.extended.communicator)
    reducer.add_parameters(model.parameters())
    assert reducer.launches_on_process_group()   # its C++ core holds the group
    reducer.rebucket(1024, 512)
    cycle = Holder()
    cycle.group, cycle.me = _compat.default_process_group(), cycle
    del cycle
elif mode == "exception":
    def fail(group):
        raise RuntimeError("the program failed")
    fail(_compat.default_process_group())
elif mode == "kept":
    keeper = Holder()
    keeper.group = _compat.default_process_group()
"""


def _run_holders_program(tmp_path, mode):
    script = tmp_path / "holders.py"
    script.write_text(HOLDERS_PROGRAM)
    result = subprocess.run([sys.executable, str(script), mode], cwd=ROOT,
                            capture_output=True, text=True, timeout=240,
                            env=plain_environment(timeout_seconds=60))
    lines = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines()
                 if line.startswith("threads "))
    assert int(lines["threads before"]) > 0, result.stdout + result.stderr
    return result, int(lines["threads at exit"])


@pytest.mark.parametrize("mode", ["ours", "exception"])
def test_shutdown_frees_the_group_whatever_held_it(tmp_path, mode):
    result, threads_at_exit = _run_holders_program(tmp_path, mode)
    assert result.returncode == (1 if mode == "exception" else 0), result.stderr
    if mode == "exception":
        assert "RuntimeError: the program failed" in result.stderr   # still reported
    assert threads_at_exit == 0, result.stdout + result.stderr
    assert "still referenced after it was destroyed" not in result.stderr, result.stderr


def test_a_group_the_program_keeps_is_named_at_exit(tmp_path):
    # The program's own reference cannot be dropped for it: the warning says where it is.
    result, threads_at_exit = _run_holders_program(tmp_path, "kept")
    assert result.returncode == 0, result.stderr
    assert threads_at_exit > 0, result.stdout
    assert ("torchstrategy: a process group is still referenced after it was destroyed at "
            "exit (by an attribute of a Holder)") in result.stderr, result.stderr
    assert "Drop that reference before the program ends." in result.stderr


def _stress_module():
    spec = importlib.util.spec_from_file_location("stress_exit", STRESS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("launch, strategy, handler", [
    ("torchrun", "multi_worker", True),     # the kind the abort was reported with
    ("reexec", "sharded", False),           # FSDP2
    ("ts.launch", "mirrored", True),
])
def test_short_jobs_exit_zero_with_nothing_left(tmp_path, launch, strategy, handler):
    stress = _stress_module()
    # ts.launch's replicas end with os._exit (no teardown to meet): only the launching
    # process, which joins no group, reports
    reports = 1 if launch == "ts.launch" else 2
    result = stress.launch_job(launch, strategy, handler, str(tmp_path), timeout=240)
    output = result["output"][-4000:]
    assert result["code"] == 0, output
    assert not result["terminate"], output
    assert result["reports"] == reports, output   # every replica reported at exit ...
    assert result["group_alive"] == 0, output     # ... and had freed their group
    assert result["processes"] == [], output
    assert not [f for f in result["files"] if f.startswith(str(tmp_path))], output
