"""Issue 19, items 3 and 11: per-replica values that differ, uneven steps and hangs.

- values of different shapes, dtypes or structures given to `strategy.reduce`,
  `strategy.gather` and the replica context's `all_reduce` / `all_gather` are an error
  naming the difference and the replicas on every replica (before: "another replica died",
  a SIGABRT for dtypes, or a silently reinterpreted (2, 4) / (4, 2) reduction);
- a replica that takes one more step than the other is told that the other ended its
  program (uneven input), not only that it died;
- a collective timeout names the replica that did not arrive.
"""
import pytest
import torch

import torchstrategy as ts
from tests.helpers.processes import assert_ended_not_awaited, sleep_then_mark
from tests.helpers.replicas import from_every_replica
from torchstrategy.collectives.communicator import CollectiveError

pytestmark = pytest.mark.timeout(120)


def _error(fn):
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def mismatches():
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    found = {}
    # Same element count, transposed: reduced silently as reinterpreted values before.
    found["shape"] = _error(lambda: strategy.reduce(
        "SUM", torch.ones((2, 4) if rank == 0 else (4, 2)), axis=None))
    # A float64 against a float32: gloo aborted the process before.
    found["dtype"] = _error(lambda: strategy.reduce(
        "MEAN", torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64), axis=None))
    found["structure"] = _error(lambda: strategy.reduce(
        "SUM", [torch.ones(2)] * (1 + rank), axis=None))
    found["gather_dtype"] = _error(lambda: strategy.gather(
        torch.ones(2, 3, dtype=torch.float32 if rank == 0 else torch.int64), axis=0))
    found["gather_inner"] = _error(lambda: strategy.gather(torch.ones(2, 3 + rank), axis=0))

    def in_replica():
        context = ts.get_replica_context()
        return (_error(lambda: context.all_reduce("SUM", torch.ones(1 + rank))),
                _error(lambda: context.all_gather(torch.ones(2, 2 + rank), axis=0)))

    (found["replica_all_reduce"], found["replica_all_gather"]), = \
        strategy.experimental_local_results(strategy.run(in_replica))
    # The group is still usable, and sizes along the gathered axis may differ.
    found["gathered"] = strategy.gather(torch.full((1 + rank, 2), float(rank)), axis=0)
    found["sum"] = strategy.reduce("SUM", torch.tensor([1.0 + rank]), axis=None)
    return from_every_replica(found)


def test_values_that_differ_between_replicas_are_named_on_every_replica():
    reports = ts.launch(mismatches, num_replicas=2, timeout_seconds=60)
    for rank, found in enumerate(reports):
        assert "reduce / all_reduce values of different shapes: tensor 0 is float32 [2, 4] " \
               "on replica 0 but float32 [4, 2] on replica 1" in found["shape"], found
        assert "different dtypes: tensor 0 is float32 [3] on replica 0 but float64 [3] on " \
               "replica 1" in found["dtype"], found
        assert "different numbers of tensors: 1 on replica 0, 2 on replica 1" \
            in found["structure"], found
        assert "gather / all_gather values of different dtypes: tensor 0 is float32 ['*', 3] " \
               "on replica 0 but int64 ['*', 3] on replica 1" in found["gather_dtype"], found
        assert "different shapes: tensor 0 is float32 ['*', 3] on replica 0 but float32 " \
               "['*', 4] on replica 1" in found["gather_inner"], found
        assert "float32 [1] on replica 0 but float32 [2] on replica 1" \
            in found["replica_all_reduce"], found
        assert "float32 ['*', 2] on replica 0 but float32 ['*', 3] on replica 1" \
            in found["replica_all_gather"], found
        assert "Every replica must give" in found["shape"]
        torch.testing.assert_close(found["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0],
                                                                    [1.0, 1.0]]))
        torch.testing.assert_close(found["sum"], torch.tensor([3.0]))


def one_extra_step():
    strategy = ts.MirroredStrategy()
    steps = 2 + strategy.extended.replica_id  # replica 1 has one batch more
    for _ in range(steps):
        strategy.reduce("SUM", torch.ones(2), axis=None)
    return "done"


def test_a_replica_taking_one_extra_step_is_told_the_other_ended_its_program():
    with pytest.raises(CollectiveError) as caught:
        ts.launch(one_extra_step, num_replicas=2, timeout_seconds=60)
    message = str(caught.value)
    assert "reduce / all_reduce on replica 1 failed because another replica died or " \
           "ended" in message, message
    assert "Replica 0 ended its program (no uncaught exception) while replica 1 still " \
           "waited in a collective: usually the replicas ran different numbers of steps" \
        in message, message
    assert "Give every replica the same number of batches" in message
    assert "not responding" not in message


def late_replica(outdir):
    strategy = ts.MirroredStrategy()
    if strategy.extended.replica_id == 0:
        # Stuck outside any collective, far longer than the timeout.
        sleep_then_mark(outdir, 100)
    strategy.reduce("SUM", torch.ones(2), axis=None)


def test_a_timeout_names_the_replica_that_did_not_arrive(tmp_path):
    with pytest.raises(CollectiveError) as caught:
        ts.launch(late_replica, str(tmp_path), num_replicas=2, timeout_seconds=3)
    message = str(caught.value)
    assert "on replica 1 did not complete within the strategy's timeout" in message, message
    assert "Missing: replica 0 is not responding (died or stuck)." in message, message
    assert_ended_not_awaited(tmp_path)   # the late replica was ended, not waited for
