"""A dead or stuck replica gives a prompt, clear error: never a hang."""
import os
import sys
import time

import pytest
import torch

import torchstrategy as ts
from torchstrategy.launch.spawn import ReplicaFailed
from tests.helpers.processes import assert_ended_not_awaited, sleep_then_mark

# Far longer than the collective timeout the stuck replica's peer is given (4 s): if the
# launch waited for the stuck replica instead of ending it, the replica would wake first.
STUCK_SECONDS = 120


def _stuck_replica_in_reduce(outdir):
    strategy = ts.MirroredStrategy()
    if strategy.extended.replica_id == 1:
        sleep_then_mark(outdir, STUCK_SECONDS)   # stuck: never joins the collective
    return strategy.reduce("SUM", torch.ones(2))


def _stuck_replica_in_backward(outdir):
    strategy = ts.MirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
    if strategy.extended.replica_id == 1:
        sleep_then_mark(outdir, STUCK_SECONDS)
    strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())


@pytest.mark.parametrize("replica_fn", [_stuck_replica_in_reduce, _stuck_replica_in_backward])
def test_a_stuck_replica_times_out_with_a_clear_error(replica_fn, tmp_path):
    with pytest.raises(ts.CollectiveError, match="did not complete within the strategy's timeout"):
        ts.launch(replica_fn, str(tmp_path), num_replicas=2, timeout_seconds=4)
    assert_ended_not_awaited(tmp_path)   # the stuck replica was ended, not waited for


def _dead_replica():
    strategy = ts.MirroredStrategy()
    if strategy.extended.replica_id == 1:
        os._exit(7)
    return strategy.reduce("SUM", torch.ones(2))


def test_a_dead_replica_ends_the_launch_at_once():
    with pytest.raises((ReplicaFailed, ts.CollectiveError), match="Replica 1|died") as caught:
        ts.launch(_dead_replica, num_replicas=2, timeout_seconds=60)
    # Its death was noticed: replica 0 was not left to wait out the collective timeout.
    assert "did not complete within the strategy's timeout" not in str(caught.value)


def _replica_one_raises_while_zero_waits():
    strategy = ts.MirroredStrategy()
    if strategy.extended.replica_id == 1:
        time.sleep(0.3)
        raise ValueError("bad input on replica 1")
    return strategy.reduce("SUM", torch.ones(2))   # fails once replica 1 is gone


def test_the_root_cause_is_reported_not_the_follow_on_collective_failure():
    for _ in range(3):  # whichever report arrives first
        with pytest.raises(ValueError, match="bad input on replica 1"):
            ts.launch(_replica_one_raises_while_zero_waits, num_replicas=2, timeout_seconds=60)


def _replica_one_calls_sys_exit(code):
    strategy = ts.MirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
    for step in range(4):
        if step == 2 and strategy.extended.replica_id == 1:
            sys.exit(code)
        strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
    return "finished"


@pytest.mark.parametrize("code", [0, 3])
def test_a_replica_calling_sys_exit_mid_training_fails_the_launch_naming_it(code):
    # Issue 36, item 3: before, sys.exit(0) on one replica made ts.launch raise
    # SystemExit(0): the launching script exited 0, silently, on a job that did not finish.
    with pytest.raises(ReplicaFailed, match=rf"replica 1 ended early: it called "
                                            rf"sys.exit\({code}\) inside "
                                            r"_replica_one_calls_sys_exit\(\)"):
        ts.launch(_replica_one_calls_sys_exit, code, num_replicas=2, timeout_seconds=60)
