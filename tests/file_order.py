"""The order in which the suite's test files start: the longest first.

scripts/test.sh runs the suite on 3 pytest-xdist workers with ``--dist loadfile``: each file
goes whole to one worker, handed out in collection order as the workers free up. xdist's
default order (most tests first) starts the files with one long multi-process test last, and
one of them can then run alone on one worker while the other has finished: the run is as long
as that tail. Starting the longest files first (the classic longest-processing-time rule)
keeps every worker busy until the end. test.sh passes ``--no-loadscope-reorder`` so that
xdist keeps this order.

The durations come from the last run on this machine (``build/test-file-durations.json``,
written at the end of every run of the whole suite by `record`), else from the committed
``tests/file_durations.json`` (seconds per file, copied from such a run); a file in neither
gets the median; with neither file, the files with most tests go first, as xdist orders them.
Ordering changes no test, only when each file starts.
"""
from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "tests" / "file_durations.json"
LAST_RUN = ROOT / "build" / "test-file-durations.json"


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def known_durations() -> dict[str, float]:
    """Seconds per test file (its path from the repository's root): the last run's, else the
    committed ones; {} when neither can be read."""
    for path in (LAST_RUN, COMMITTED):
        try:
            with open(path) as f:
                found = json.load(f)
            return {str(name): float(seconds) for name, seconds in found.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return {}


def longest_files_first(items: list, durations: dict[str, float]) -> list:
    """`items` regrouped by file, the files in decreasing order of their duration (unknown
    ones at the median), each file's items in their own order. Without any durations, the
    files with most tests first: xdist's own order."""
    by_file: dict[str, list] = defaultdict(list)
    for item in items:
        by_file[_file_of(item.nodeid)].append(item)
    if durations:
        default = statistics.median(durations.values())
        order = sorted(by_file, key=lambda name: -durations.get(name, default))  # stable
    else:
        order = sorted(by_file, key=lambda name: -len(by_file[name]))
    return [item for name in order for item in by_file[name]]


class DurationRecorder:
    """Adds up each file's setup, call and teardown times as their reports arrive (on the
    xdist controller, or in a run without workers), and writes them when the whole suite
    ran: a run of some files only would leave the others out."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, nodeid: str, duration: float) -> None:
        self.seconds[_file_of(nodeid)] += duration

    def write(self) -> None:
        LAST_RUN.parent.mkdir(exist_ok=True)
        temporary = LAST_RUN.with_suffix(".tmp")
        with open(temporary, "w") as f:
            json.dump({name: round(seconds, 1) for name, seconds in
                       sorted(self.seconds.items(), key=lambda kv: -kv[1])}, f, indent=1)
            f.write("\n")
        os.replace(temporary, LAST_RUN)
