"""collectives/peers.py: agreeing on an outcome and running on the chief over 3 real gloo
replicas; every replica raises the class and message the failing replica raised, and none
is left waiting."""
import pytest

import torchstrategy as ts

from tests.helpers.replicas import launch
from torchstrategy.collectives import peers as peers_lib


class ShardMissing(Exception):
    """An exception class of the program's own (rebuilt from its pickle)."""


class NeedsTwoArguments(Exception):
    """Cannot be rebuilt from its pickle (its __init__ takes two arguments)."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")


def _outcome(fn):
    try:
        return ("returned", fn())
    except Exception as error:  # every replica reports what it raised
        return ("raised", type(error).__name__, str(error))


def _replica():
    ts.MirroredStrategy()  # joins the launched world's default process group
    peers = peers_lib.process_group_peers()
    assert peers is peers_lib.process_group_peers()  # one per default group
    rank = peers.rank
    results = {"facts": (rank, peers.world_size, peers.is_chief)}
    results["broadcast"] = peers.broadcast({"from": rank})
    results["gathered"] = peers.gather_to_chief(rank * 10)
    results["agree_ok"] = _outcome(lambda: peers.agree(None))
    results["agree_fail"] = _outcome(
        lambda: peers.agree(ShardMissing(f"shard {rank} missing") if rank >= 1 else None))
    results["agree_named"] = _outcome(
        lambda: peers.agree(KeyError("no 'w'") if rank == 2 else None, name_finder=True))
    results["chief_value"] = _outcome(lambda: peers.run_on_chief(lambda: rank + 100))

    def fails():
        raise NotADirectoryError("/x is a file")
    results["chief_fails"] = _outcome(lambda: peers.run_on_chief(fails))

    def fails_oddly():
        raise NeedsTwoArguments("/x", "odd")
    results["chief_fails_oddly"] = _outcome(lambda: peers.run_on_chief(fails_oddly))
    # After all failures the replicas are still in step: one more collective works.
    results["after"] = peers.gather_to_chief("still here")
    return results


@pytest.fixture(scope="module")
def every_replica():
    return launch(_every, n=3)


def _every():
    results = _replica()
    return peers_lib.process_group_peers().communicator.gather_objects(results)


def test_rank_world_and_chief(every_replica):
    assert [r["facts"] for r in every_replica] == [(0, 3, True), (1, 3, False), (2, 3, False)]


def test_broadcast_and_gather(every_replica):
    assert all(r["broadcast"] == {"from": 0} for r in every_replica)
    assert every_replica[0]["gathered"] == [0, 10, 20]
    assert every_replica[1]["gathered"] is None and every_replica[2]["gathered"] is None
    assert every_replica[0]["after"] == ["still here"] * 3


def test_agree_is_all_or_nothing(every_replica):
    assert all(r["agree_ok"] == ("returned", None) for r in every_replica)
    # The first failing replica's (rank 1's) error, on every replica, rank 0 included.
    assert [r["agree_fail"] for r in every_replica] == \
        [("raised", "ShardMissing", "shard 1 missing")] * 3
    assert [r["agree_named"] for r in every_replica] == \
        [("raised", "KeyError", "\"no 'w' (found by replica 2)\"")] * 3


def test_run_on_chief_returns_or_raises_the_chiefs_error_everywhere(every_replica):
    assert [r["chief_value"] for r in every_replica] == [("returned", 100)] * 3
    assert [r["chief_fails"] for r in every_replica] == \
        [("raised", "NotADirectoryError", "/x is a file")] * 3
    # The chief raises its own; an exception that cannot be rebuilt travels as a
    # RuntimeError naming its class and message.
    assert every_replica[0]["chief_fails_oddly"] == ("raised", "NeedsTwoArguments", "/x: odd")
    assert every_replica[1]["chief_fails_oddly"] == \
        ("raised", "RuntimeError", "NeedsTwoArguments: /x: odd")


def test_alone_sends_nothing():
    peers = peers_lib.alone()
    assert (peers.rank, peers.world_size, peers.is_chief) == (0, 1, True)
    assert peers.broadcast(5) == 5 and peers.gather_to_chief(5) == [5]
    assert peers.run_on_chief(lambda: 7) == 7
    with pytest.raises(ShardMissing, match="mine"):
        peers.agree(ShardMissing("mine"), name_finder=True)
