"""A step commits on every replica or on none: one vote per replica in the rendezvous store.

Each replica votes once per step (with ``commit_every=k``, once per k steps). By default
the vote is cast from the optimizers' step pre-hook, when the step's first optimizer step
is about to run: the gradients are summed (a replica that gets there completed its
gradient all-reduce) and nothing expensive has changed yet. The replica adds its vote to
the step's counter; the replica whose vote completes the count writes "commit" as the
step's decision. A replica whose step failed (a collective broke because a replica died),
or that finds a replica's heartbeat stopped while it waits, writes "abort". The decision
is written with ``compare_set``, so the first one written is the only one: "commit" is
only ever written once every replica reached its vote, and every replica obeys the
decision it reads. On "commit" the optimizers step; on "abort" the step stops before them,
the replicas put back the little the step changed before the vote (buffers, gradients,
random state: `step_snapshot.StepStart`), and the survivors redo the step together. A
replica lost after the decision "commit" cannot make the others undo anything: they
apply the step, and the loss surfaces in the next collective.

A step that cannot vote before its optimizers step (``commit_every=k``, or a step
function that changes parameters by other means) votes after it, against a full copy of
the state (`step_snapshot.StepSnapshot`); the protocol here is the same.

This is torchft's ``should_commit`` made exact: torchft drops a failed group's
contribution from the step; here the step is redone on its whole global batch.

Cost when nothing fails: per replica per step, one ``add`` (its vote) and one blocking
``get`` of the decision (the store answers it when the decision is written), or, on the
replica whose vote completes the count, one ``compare_set`` instead of the ``get`` (plus
one ``add`` while joiners may be admitted); about 0.1 ms on loopback, measured with the
rest of the step in scripts/bench_recovery.py.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from torchstrategy.fault_tolerance.membership import LivenessWatch, StoreLost, wait_for_key

COMMIT = "commit"
# Committed, and one replica or more leave the job after it (a planned departure).
COMMIT_AND_LEAVE = "commit-leave"
# Committed, and the joiners up to the number after this prefix are admitted.
COMMIT_AND_ADMIT = "commit-admit:"
ABORT = "abort"
# A leaving replica's vote adds this too, so that the vote completing the count knows
# whether anyone leaves (no request more per step).
_LEAVING = 1 << 32


def joiners_key(prefix: str) -> str:
    """The store counter of the processes that asked to join the job whose live-recovery
    keys start with `prefix` (each request adds 1: its ticket)."""
    return f"{prefix}joiners"


class StepCommit:
    """The votes of one generation's members (`uids`, this replica being `uid`), under
    `prefix` in `store`. ``decide(step, ran)`` is called by every member once per
    attempt of each step."""

    def __init__(self, store: dist.Store, prefix: str, uids: Sequence[int],
                 heartbeat_prefix: str, dead_after: float) -> None:
        self._store = store
        # The count of joiners that asked to be admitted (`LiveRecovery`'s join).
        self._joiners = joiners_key(heartbeat_prefix)
        self._prefix = prefix
        self._size = len(uids)
        self._watch = LivenessWatch(store, heartbeat_prefix, uids, dead_after)

    def decide(self, step: int, ran: bool, leaving: bool = False,
               admitted: int | None = None, admissible: int = 0) -> str:
        """Votes for `step` (`ran`: whether this replica's step ran to its end; `leaving`:
        whether it leaves the job once the step committed) and returns the decision, the
        same on every replica: `COMMIT`, `COMMIT_AND_LEAVE` (committed, and some replica
        leaves), `COMMIT_AND_ADMIT` followed by the number of joiners to admit (committed;
        with `admitted`, the joiners admitted so far, the vote completing the count asks the
        store whether more are waiting, and admits at most `admissible` more of them, the
        first in their order) or `ABORT`.

        Raises:
          StoreLost: the store stopped answering (its host, the chief's machine, is gone).
        """
        decision = f"{self._prefix}step{step}/decision"
        try:
            if not ran:
                return self._store.compare_set(decision, "", ABORT).decode()
            votes = int(self._store.add(f"{self._prefix}step{step}/votes",
                                        1 + (_LEAVING if leaving else 0)))
            if votes % _LEAVING == self._size:
                outcome = COMMIT if votes < _LEAVING else COMMIT_AND_LEAVE
                if outcome == COMMIT and admitted is not None:
                    waiting = int(self._store.add(self._joiners, 0))
                    if waiting > admitted and admissible > 0:
                        outcome = f"{COMMIT_AND_ADMIT}{min(waiting, admitted + admissible)}"
                return self._store.compare_set(decision, "", outcome).decode()
        except Exception as error:  # TCPStore's errors: its host is gone
            raise StoreLost(str(error).splitlines()[0][:200]) from error

        def abort(dead: list[int]) -> None:
            self._store.compare_set(decision, "", ABORT)

        return wait_for_key(self._store, decision, self._watch, abort).decode()
