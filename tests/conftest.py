import importlib.util

# tests/xla/ needs torch_xla and runs in its own environment (.venv-xla, see scripts/test.sh).
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]


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
