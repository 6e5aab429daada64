"""examples/parameter_server.py runs end to end as a user starts it, and learns."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
TIMEOUT_SECONDS = 240


@pytest.mark.timeout(TIMEOUT_SECONDS + 30)
def test_parameter_server_example_trains_to_high_accuracy():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, os.path.join("examples", "parameter_server.py"), "--epochs", "3",
         "--steps-per-epoch", "40"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(re.findall(r"^Finished epoch \d", result.stdout, flags=re.MULTILINE)) == 3
    found = re.findall(r"^test accuracy: ([0-9.]+)", result.stdout, flags=re.MULTILINE)
    assert len(found) == 1 and float(found[0]) > 0.9, result.stdout
