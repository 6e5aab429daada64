import importlib.util
import os

import pytest
import torch.distributed as dist

from torchstrategy import runtime

# tests/xla/ needs torch_xla and runs in its own environment (.venv-xla, see scripts/test.sh).
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]


# Every Python process the suite starts (and its own workers) skips the garbage collector's
# walk over the whole heap at exit: 1.2-1.5 s of CPU per process that imported torch
# (tests/helpers/fast_exit/sitecustomize.py says what else it changes). The files that test
# how processes exit use the `real_exit` fixture; TORCHSTRATEGY_TESTS_REAL_EXIT=1 turns it
# off everywhere.
FAST_EXIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "fast_exit")
if os.environ.get("TORCHSTRATEGY_TESTS_REAL_EXIT") != "1" and \
        FAST_EXIT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [FAST_EXIT,
                                                             os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def real_exit():
    """The processes this module's tests start exit as users' do, collector included (for
    the tests of exit paths: clean shutdown, exit codes, nothing left behind). Module-wide
    (``pytestmark = pytest.mark.usefixtures("real_exit")``), so that it also covers the
    processes of module fixtures."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != FAST_EXIT]
    with pytest.MonkeyPatch.context() as patch:
        if path:
            patch.setenv("PYTHONPATH", os.pathsep.join(path))
        else:
            patch.delenv("PYTHONPATH", raising=False)
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_outlives_its_file():
    """A process group that a file's tests left in this pytest process (a strategy of one
    replica made in-process keeps its group until the process exits) is released when the
    file ends. pytest-xdist hands whole files to a few long-lived worker processes, in an
    order that follows the recorded durations, so without this the next file on the worker
    would inherit the group, and a replica it forks (``ts.launch(start_method="fork")``)
    would find torch.distributed already initialised as a world of one."""
    yield
    if dist.is_available() and dist.is_initialized():
        runtime.current().release_process_group()


# The longest test files start first, and every whole-suite run records how long each file
# took for the next one (tests/file_order.py; scripts/test.sh keeps the order with
# --no-loadscope-reorder).
from tests import file_order  # noqa: E402

_durations = file_order.DurationRecorder()


def pytest_collection_modifyitems(session, config, items):
    items[:] = file_order.longest_files_first(items, file_order.known_durations())


def pytest_runtest_logreport(report):
    _durations.add(report.nodeid, report.duration)


def pytest_sessionfinish(session, exitstatus):
    options = session.config.option
    is_worker = hasattr(session.config, "workerinput")
    whole_suite = not (options.file_or_dir or options.keyword or options.markexpr
                       or getattr(options, "lf", False) or getattr(options, "deselect", None))
    if not is_worker and whole_suite and exitstatus in (0, 1) and _durations.seconds:
        _durations.write()
