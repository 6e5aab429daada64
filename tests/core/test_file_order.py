"""tests/file_order.py: the suite's files start longest first, and a whole run records each
file's duration for the next one (scripts/test.sh's scheduling; no test is changed)."""
import json
from types import SimpleNamespace

from tests import file_order


def _items(*nodeids):
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_the_longest_files_come_first_each_file_whole_and_in_its_order():
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1",
                   "tests/d.py::t1", "tests/b.py::t2")
    durations = {"tests/a.py": 5.0, "tests/b.py": 300.0, "tests/c.py": 40.0}
    ordered = [item.nodeid for item in file_order.longest_files_first(items, durations)]
    # b (300 s), then c (40 s) and d (unknown: the median, 40 s, after c as collected), then a.
    assert ordered == ["tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1", "tests/d.py::t1",
                       "tests/a.py::t1", "tests/a.py::t2"]


def test_without_durations_the_files_with_most_tests_come_first_as_xdist_orders_them():
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/b.py::t2", "tests/b.py::t3",
                   "tests/c.py::t1", "tests/c.py::t2")
    ordered = [item.nodeid for item in file_order.longest_files_first(items, {})]
    assert ordered == ["tests/b.py::t1", "tests/b.py::t2", "tests/b.py::t3", "tests/c.py::t1",
                       "tests/c.py::t2", "tests/a.py::t1"]


def test_a_run_records_seconds_per_file_and_the_next_run_reads_them(tmp_path, monkeypatch):
    last_run = tmp_path / "build" / "test-file-durations.json"
    committed = tmp_path / "file_durations.json"
    monkeypatch.setattr(file_order, "LAST_RUN", last_run)
    monkeypatch.setattr(file_order, "COMMITTED", committed)
    assert file_order.known_durations() == {}
    committed.write_text(json.dumps({"tests/x.py": 12.5}))
    assert file_order.known_durations() == {"tests/x.py": 12.5}
    recorder = file_order.DurationRecorder()
    for nodeid, seconds in (("tests/x.py::a", 1.25), ("tests/x.py::a", 0.5),   # call, teardown
                            ("tests/y.py::b[1]", 30.0), ("tests/x.py::c", 2.0)):
        recorder.add(nodeid, seconds)
    recorder.write()
    assert json.loads(last_run.read_text()) == {"tests/y.py": 30.0, "tests/x.py": 3.8}
    assert file_order.known_durations() == {"tests/y.py": 30.0, "tests/x.py": 3.8}  # last run first
