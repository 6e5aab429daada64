"""Surviving failures across machines.

- A replica SIGKILLed mid-training under ``torchrun --max-restarts`` (two agents, one
  replica each): the job finishes, resumed by ts.BackupAndRestore, with exactly the final
  parameters of a run that was never interrupted (1e-6 asked; the resumed run is bitwise
  identical).
- A dead or hung peer: the survivor exits non-zero within the collective timeout, and its
  error names the missing replica and its machine's task.
"""
import os
import re

import pytest
import torch

from tests.helpers.replicas import assert_same_tensors
from tests.helpers.multi_machine import start_tf_config_machines, start_torchrun_machines, wait_all

pytestmark = pytest.mark.multi_worker


def _final(outdir, rank):
    return torch.load(os.path.join(outdir, f"backup-rank{rank}.pt"))


def test_a_killed_worker_is_restarted_and_finishes_like_an_uninterrupted_run(tmp_path):
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted.mkdir()
    killed.mkdir()
    # Both jobs at once (they share nothing but the CPU). In the second, the replica of
    # rank 1 SIGKILLs itself at global step 9 of 18 on the first attempt; the last backup
    # was written after step 8 (save_freq=4).
    reference_job = start_torchrun_machines("backup", uninterrupted, nproc=1)
    machines = start_torchrun_machines("backup", killed, nproc=1, max_restarts=2,
                                       KILL_AT_STEP=9, KILL_RANK=1)
    codes = wait_all(reference_job + machines)
    logs = "\n".join(m.log() for m in machines)
    assert codes == [0, 0, 0, 0], logs[-4000:]
    assert "exitcode: -9" in logs  # it really was killed, and torchrun restarted it
    for rank in range(2):
        reference, resumed = _final(uninterrupted, rank), _final(killed, rank)
        assert not reference["restored"]
        assert resumed["restored"]
        assert not resumed["backup_left"]  # delete_checkpoint=True once training finished
        assert_same_tensors(resumed["final"], reference["final"], atol=1e-6, rtol=0,
                            what=f"rank {rank}")


@pytest.mark.parametrize("mode,cause", [
    ("peer_death", "failed because another replica died"),
    ("peer_hang", "did not complete within the strategy's timeout"),
])
def test_a_dead_or_hung_peer_fails_the_survivor_naming_it(tmp_path, mode, cause):
    timeout = 15
    machines = start_tf_config_machines(mode, tmp_path, replicas=1,
                                        TORCHSTRATEGY_TIMEOUT_SECONDS=timeout)
    survivor, peer = machines
    try:
        code = survivor.wait(timeout=120)   # a hang guard, far above start-up + timeout
    finally:
        peer.kill()  # a hung peer is still sleeping
    log = survivor.log()
    assert code != 0, log[-3000:]
    assert "finished all steps" not in log
    assert cause in log, log[-3000:]
    assert "Missing: replica 1 (on worker:1) is not responding (died or stuck)." in log
    if mode == "peer_death":   # noticed as a death, not waited out until the timeout
        assert "did not complete within the strategy's timeout" not in log, log[-3000:]


def test_a_worker_that_never_comes_is_named_and_nobody_hangs(tmp_path):
    """Each task of a two-worker cluster started alone, with a 5 s timeout: the first task
    names the one missing; the other cannot reach the rendezvous and says where it looked."""
    (first,) = start_tf_config_machines("peer_death", tmp_path / "first", replicas=1,
                                        only=[0], TORCHSTRATEGY_TIMEOUT_SECONDS=5)
    (second,) = start_tf_config_machines("peer_death", tmp_path / "second", replicas=1,
                                         only=[1], TORCHSTRATEGY_TIMEOUT_SECONDS=5)
    assert wait_all([first, second], timeout=120) == [1, 1]
    assert ("torchstrategy: worker(s) ['worker:1'] did not join the cluster within 5 s. "
            "Start `python train.py` with the same TF_CONFIG cluster (and its own task) on "
            "every machine.") in first.log()
    assert re.search(r"torchstrategy: task worker:1 could not reach the rendezvous at "
                     r"127\.0\.0\.1:\d+ within 5 s: start the first task \(worker:0\) too",
                     second.log()), second.log()[-2000:]
