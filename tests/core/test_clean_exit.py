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

STRESS_SCRIPT = os.path.join(ROOT, "scripts", "stress_exit.py")

# One process, a world of one (MultiWorkerMirroredStrategy without a launcher: a gloo group
# of size 1). torch.distributed.nn.functional is imported only after the group exists, as
# torch._dynamo's lazy import does at the first optimizer: its default arguments then hold
# the group object.
PROGRAM = """
import glob
import sys

import torch.distributed as dist
import torchstrategy as ts
from torchstrategy import _compat, runtime


def gloo_threads():
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        with open(comm) as f:
            names.append(f.read().strip())
    return sum(name in ("gloo_tcp_loop", "pt_gloo_runloop") for name in names)


assert "torch.distributed.nn.functional" not in sys.modules, "imported too early"
strategy = ts.MultiWorkerMirroredStrategy()
assert dist.is_initialized() and dist.get_backend() == "gloo"
import torch.distributed.nn.functional as functional  # after the group: binds it
group = _compat.default_process_group()
held = sum(value is group for value in functional.all_reduce.__defaults__)
del group
print("held", held)
print("threads before", gloo_threads())
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
