"""Naming the replicas missing from a failed collective.

When a collective fails (a peer's connection closed, or the timeout passed) the backend
says what happened to *this* replica, not which replica is to blame. After such a failure
every surviving replica signs in at the rendezvous store; the replicas that have not
signed in within a few seconds are the ones that died or are stuck, and the error names
them. A replica whose program ended without an error has said so in the store (see
`Runtime.announce_finished`): it is named as such, the usual sign of replicas that ran
different numbers of steps. A replica whose failure was written in the store (its uncaught
exception, by itself; its exit code, by the launcher that saw it: `world_lib.ENDED_KEY`)
is named with it: "replica 1 failed first: it raised KeyError: 'x'", "it called
sys.exit(3)". This needs nothing while training goes well: the store is
touched only after a failure (and once at a replica's exit).
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.launch import world as world_lib

DEFAULT_WAIT_SECONDS = 3.0
# How long past `wait_seconds` a roll call waits for the store to answer at all.
_STORE_GRACE_SECONDS = 5.0


class RollCall:
    """The roll calls of one process group: `token` is the same on every replica of the
    group and new for each group (a store can outlive a group: torchrun restarts reuse
    it); each call gets its own keys, numbered in the same order on every replica."""

    def __init__(self, token: str, world_size: int, name_of_rank: Callable[[int], str] = str,
                 wait_seconds: float = DEFAULT_WAIT_SECONDS) -> None:
        self.token = token
        self.world_size = world_size
        self.name_of_rank = name_of_rank
        self.wait_seconds = wait_seconds
        self._calls = itertools.count()

    def missing_replicas(self, rank: int, store: dist.Store | None = None
                         ) -> list[int] | None:
        """Signs this replica in and returns the ranks that did not sign in within
        `wait_seconds` (sorted; [] when everyone answered), or None when the rendezvous
        store itself cannot be reached (the process hosting it is gone). A replica that
        announced the end of its program (`Runtime.announce_finished`) is not waited
        for."""
        store = store if store is not None else runtime.current().rendezvous_store()
        if store is None:
            return None
        prefix = f"torchstrategy/roll-call/{self.token}/{next(self._calls)}"
        try:
            store.set(f"{prefix}/{rank}", "here")
            deadline = time.monotonic() + self.wait_seconds
            while True:
                missing = [r for r in range(self.world_size)
                           if r != rank and not store.check([f"{prefix}/{r}"])]
                waiting_for = [r for r in missing if not _finished(store, r)
                               and not store.check([world_lib.ENDED_KEY.format(r)])]
                if not waiting_for or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.1)
        except (RuntimeError, OSError):  # the store's host died: refused / reset / timed out
            return None

    def describe_missing(self, rank: int) -> str:
        """`_describe_missing`, bounded: the store's host may be unreachable (its machine's
        link down), where each store operation would wait for TCP to give up (many
        minutes). After `wait_seconds` plus a few seconds without an answer, it says the
        machine of replica 0, which hosts the store, is unreachable from this one."""
        answer: list[str] = []

        def ask() -> None:
            try:
                answer.append(self._describe_missing(rank))
            except (RuntimeError, OSError):  # the store failed: said below
                pass

        # A daemon thread, so the caller's error is raised on time; one left blocked on the
        # unreachable store's socket ends with the process, which is failing anyway.
        thread = threading.Thread(target=ask, name="torchstrategy-roll-call", daemon=True)
        thread.start()
        thread.join(self.wait_seconds + _STORE_GRACE_SECONDS)
        if answer:
            return answer[0]
        return (f"The rendezvous store did not answer within "
                f"{self.wait_seconds + _STORE_GRACE_SECONDS:g} s: {self.name_of_rank(0)}, "
                "whose machine hosts it, is unreachable from this one (its machine or the "
                "network link between the machines is down) or gone.")

    def _describe_missing(self, rank: int) -> str:
        """One or two sentences for an error message naming the missing replicas (see
        `missing_replicas`): those that ended their program (usually: the replicas ran
        different numbers of steps) and those that died or are stuck, e.g. "Missing:
        replica 3 (on worker:1) is not responding". Empty when this process has no
        rendezvous store to ask."""
        store = runtime.current().rendezvous_store()
        if store is None:
            return ""
        start = time.monotonic()
        missing = self.missing_replicas(rank, store)
        if missing is None:
            return (f"The rendezvous store is unreachable: {self.name_of_rank(0)}, whose "
                    "machine hosts it, is gone.")
        if not missing:
            return ("Every replica is still running (one of them issued a different "
                    "collective).")
        try:
            # What is left of `describe_missing`'s bound, less a second, for exit codes.
            notes = _end_notes(store, missing, self.wait_seconds + _STORE_GRACE_SECONDS - 1.0
                               - (time.monotonic() - start))
            finished = [r for r in missing if not notes.get(r) and _finished(store, r)]
        except (RuntimeError, OSError):
            notes, finished = {}, []
        failed = [r for r in missing if notes.get(r)]
        stuck = [r for r in missing if r not in finished and r not in failed]
        sentences = [f"{self.name_of_rank(r)[:1].upper()}{self.name_of_rank(r)[1:]} failed "
                     f"first: it {notes[r]} (the error to fix is that one; this replica's "
                     "follows from it)." for r in failed]
        if finished:
            names = ", ".join(self.name_of_rank(r) for r in finished)
            sentences.append(
                f"{names[:1].upper()}{names[1:]} ended "
                f"{'its program' if len(finished) == 1 else 'their programs'} (no uncaught "
                f"exception) while replica {rank} still waited in a collective: usually the "
                "replicas ran different numbers of steps or collectives (uneven input). Give "
                "every replica the same number of batches (the same dataset length, or "
                "drop_remainder=True) and call reduce / gather the same number of times on "
                "each.")
        if stuck:
            names = ", ".join(self.name_of_rank(r) for r in stuck)
            verb = "is" if len(stuck) == 1 else "are"
            sentences.append(f"Missing: {names} {verb} not responding (died or stuck).")
        return " ".join(sentences)


def _end_notes(store: dist.Store, ranks: list[int], wait_seconds: float
               ) -> dict[int, str]:
    """How each of `ranks` ended, where that was written (`world_lib.ENDED_KEY`: "raised
    KeyError: 'x'", "exited with code 3"; empty: exit code 0). Where a launcher records
    exit codes (`world_lib.ENDS_RECORDED_KEY`), a replica that announced its end is given
    `wait_seconds` for its launcher to write its exit code."""
    keys = {r: world_lib.ENDED_KEY.format(r) for r in ranks}
    if store.check([world_lib.ENDS_RECORDED_KEY]):
        deadline = time.monotonic() + wait_seconds
        while time.monotonic() < deadline and any(
                _finished(store, r) and not store.check([keys[r]]) for r in ranks):
            time.sleep(0.1)
    return {r: store.get(key).decode(errors="replace") for r, key in keys.items()
            if store.check([key])}


def _finished(store: dist.Store, rank: int) -> bool:
    """Whether replica `rank` announced the end of its program in `store`."""
    return store.check([world_lib.FINISHED_KEY.format(rank)])
