"""Issue 19, item 11: Ctrl-C (SIGINT) to the parent of a re-executed job is the user's
interruption, not a replica's failure (before: "replica 1 was killed by signal 15" and exit
status 143, the SIGTERM the parent itself had sent)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import SCRIPTS
from tests.helpers.processes import alive, plain_environment, take_sigint_by_default

SCRIPT = os.path.join(SCRIPTS, "reexec_train.py")


@pytest.mark.timeout(180)
def test_ctrl_c_to_the_parent_of_a_reexecuted_job_is_reported_as_an_interruption(tmp_path):
    process = subprocess.Popen([sys.executable, SCRIPT, "hang_until_signal", str(tmp_path)],
                               env=plain_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=take_sigint_by_default)
    try:
        ready = [tmp_path / f"ready{r}" for r in range(2)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(p.exists() for p in ready):
            time.sleep(0.1)
        assert all(p.exists() for p in ready), process.communicate(timeout=5)[1][-3000:]
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        os.kill(process.pid, signal.SIGINT)  # the parent (replica 0) only
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    assert process.returncode == -signal.SIGINT, stderr[-3000:]  # 130 in a shell
    assert "KeyboardInterrupt" in stderr
    assert "torchstrategy: interrupted (Ctrl-C); every replica was stopped." in stderr
    assert "killed by signal" not in stderr, stderr[-3000:]
    assert not any(alive(pid) for pid in pids)


FAILING = os.path.join(SCRIPTS, "failing_replica.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["launch_blocked", "reexec_blocked"])
def test_sigint_to_replica_zero_blocked_in_a_collective_ends_every_replica_at_once(
        tmp_path, mode):
    # Issue 36, item 5: replica 0 waits in a collective for replica 1 (asleep); `kill -INT`
    # to replica 0 alone. Before, the KeyboardInterrupt came at the collective's timeout.
    timeout = 200
    process = subprocess.Popen([sys.executable, FAILING, mode, str(tmp_path)],
                               env=plain_environment(timeout_seconds=timeout),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=take_sigint_by_default)
    try:
        pid_files = [tmp_path / f"pid{r}" for r in range(2)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(p.exists() for p in pid_files):
            time.sleep(0.1)
        assert all(p.exists() for p in pid_files), process.communicate(timeout=5)[1][-3000:]
        pids = [int(p.read_text()) for p in pid_files]
        time.sleep(2)  # replica 0 is in the collective by now
        start = time.monotonic()
        os.kill(pids[0], signal.SIGINT)
        _, stderr = process.communicate(timeout=timeout - 20)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    assert elapsed < 60, (elapsed, stderr[-3000:])   # seconds, not the 200 s timeout
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert "did not complete within the strategy's timeout" not in stderr
    assert "interrupted" in stderr and "blocked in a collective" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.timeout(240)
def test_ctrl_c_to_a_torchrun_job_blocked_in_a_collective_ends_it_at_once(tmp_path):
    # Issue 36, item 5, under torchrun: both workers wait in gloo for each other and the
    # whole job gets SIGINT (Ctrl-C in its terminal). Before, torchrun forwarded it to
    # workers that could not take it until the collective's timeout.
    timeout = 200
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    process = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node=2", FAILING, "torchrun_blocked",
         str(tmp_path)],
        env=plain_environment(timeout_seconds=timeout), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=take_sigint_by_default)
    try:
        pid_files = [tmp_path / f"pid{r}" for r in range(2)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(p.exists() for p in pid_files):
            time.sleep(0.1)
        assert all(p.exists() for p in pid_files), process.communicate(timeout=5)[1][-3000:]
        pids = [int(p.read_text()) for p in pid_files]
        time.sleep(2)  # both are in gloo's recv by now
        start = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)   # the agent and its workers, as a terminal
        _, stderr = process.communicate(timeout=timeout - 20)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    assert elapsed < 60, (elapsed, stderr[-3000:])   # seconds, not the 200 s timeout
    assert "was interrupted (SIGINT) while blocked in a collective" in stderr, stderr[-3000:]
    assert "did not complete within the strategy's timeout" not in stderr
    assert process.returncode != 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
