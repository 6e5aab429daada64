"""The commit vote's admission of joiners (`LiveRecovery`'s ``join``): the vote completing
the count admits the joiners waiting, but never more than `max_replicas` leaves room for
(the decision is what every replica then regroups to). One replica's vote on a real
TCPStore: its vote completes the count, so `decide` returns without waiting."""
import datetime

import pytest
import torch.distributed as dist

from torchstrategy.fault_tolerance.step_commit import COMMIT, COMMIT_AND_ADMIT, StepCommit


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True,
                           timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    yield server


def _vote(store, joiners_waiting, admitted, admissible):
    """A commit's decision (each call a new generation: its decision is not yet written)."""
    store.set("job/joiners", str(joiners_waiting))
    generation = store.add("test/generation", 1)
    commit = StepCommit(store, f"job/gen{generation}/", [0], "job/", dead_after=2.0)
    return commit.decide(0, ran=True, admitted=admitted, admissible=admissible)


def test_waiting_joiners_are_admitted_when_there_is_room(store):
    assert _vote(store, joiners_waiting=2, admitted=0, admissible=2) == f"{COMMIT_AND_ADMIT}2"


def test_admission_stops_at_max_replicas(store):
    # 3 joiners asked; the job has room for 1 more replica: only the first is admitted,
    # the others keep waiting for a later commit with room.
    assert _vote(store, joiners_waiting=3, admitted=0, admissible=1) == f"{COMMIT_AND_ADMIT}1"
    assert _vote(store, joiners_waiting=4, admitted=1, admissible=2) == f"{COMMIT_AND_ADMIT}3"


def test_no_joiner_waiting_is_a_plain_commit(store):
    assert _vote(store, joiners_waiting=1, admitted=1, admissible=2) == COMMIT
