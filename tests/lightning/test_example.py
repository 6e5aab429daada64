"""examples/lightning_fit.py and scripts/bench_lightning.py run end to end as a user starts
them (`python <script>`: Trainer(strategy="mirrored") re-executes it for replica 1)."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.lightning_runs import ROOT, clean_env

pytestmark = pytest.mark.lightning
TIMEOUT_SECONDS = 300


def _run(*argv):
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=clean_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert result.returncode == 0, (
        f"{' '.join(argv)} exited with {result.returncode}\n--- stdout ---\n"
        f"{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}")
    return result.stdout


@pytest.mark.timeout(TIMEOUT_SECONDS + 30)
def test_lightning_fit_example_learns_both_tasks():
    stdout = _run(os.path.join("examples", "lightning_fit.py"))
    # Replica 0 alone prints the results.
    (line,) = re.findall(r"^regression: y = ([-0-9.]+) x \+ ([-0-9.]+) \(2 replicas\)$",
                         stdout, flags=re.MULTILINE)
    assert float(line[0]) == pytest.approx(2.0, abs=0.05), stdout
    assert float(line[1]) == pytest.approx(3.0, abs=0.05), stdout
    (accuracy,) = re.findall(r"^test accuracy: ([0-9.]+)$", stdout, flags=re.MULTILINE)
    assert float(accuracy) > 0.9, stdout


@pytest.mark.timeout(TIMEOUT_SECONDS + 30)
def test_bench_lightning_quick_runs():
    # One replica per configuration: the benchmark's driver, both workers and its table are
    # what this checks; two replicas re-executed under Trainer(strategy="mirrored") are the
    # example's test above (and test_lightning's comparisons with ddp), at half the start-ups.
    stdout = _run(os.path.join("scripts", "bench_lightning.py"), "--quick", "--devices", "1")
    assert re.search(r"^ours \(strategy='mirrored'\)\s+[0-9.]+\s+[0-9.]+$", stdout,
                     flags=re.MULTILINE), stdout
    assert re.search(r"^ddp  \(strategy='ddp'\)\s+[0-9.]+\s+[0-9.]+$", stdout,
                     flags=re.MULTILINE), stdout
    assert re.search(r"^ours / ddp\s+[0-9.]+\s+[0-9.]+$", stdout, flags=re.MULTILINE), stdout
