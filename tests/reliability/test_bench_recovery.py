"""scripts/bench_recovery.py runs end to end on a tiny model: the per-step cost, a replica
SIGKILLed and recovered from, a joiner admitted, and the restart path loading the state
cold and warm, each printed with its figures (a full run had ended in a KeyError after the
cost figures without anyone noticing). No timing is asserted: only that every figure is
there and is a number."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMBER = r"[0-9]+\.[0-9]+"


def test_bench_recovery_prints_every_figure_of_a_tiny_run():
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHSTRATEGY_TIMEOUT_SECONDS="60")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_recovery.py"), "--replicas", "2",
         "--state-mb", "1", "--rounds", "1", "--block", "6", "--detection", "1"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-3000:]
    for pattern in (
            rf"step, strategy\.run:  median {NUMBER} ms",
            rf"CPU time per step, vote in every step: median {NUMBER} ms",
            rf"loss of replica 1 -> next completed step: {NUMBER} s",
            rf"admission: waiting for a commit -?{NUMBER} s, new group {NUMBER} s",
            rf"local load from the cold file {NUMBER} s",
            rf"the same load again from the warm file \(in the page cache\): {NUMBER} s",
            rf"admission / local load from the cold file: {NUMBER} x",
            rf"admission / local load from the warm file: {NUMBER} x"):
        assert re.search(pattern, out), (pattern, out[-3000:])
