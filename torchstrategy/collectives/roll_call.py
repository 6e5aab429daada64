"""Naming the replicas missing from a failed collective.

When a collective fails (a peer's connection closed, or the timeout passed) the backend
says what happened to *this* replica, not which replica is to blame. After such a failure
every surviving replica signs in at the rendezvous store; the replicas that have not
signed in within a few seconds are the ones that died or are stuck, and the error names
them. This needs nothing while training goes well: the store is touched only after a
failure.
"""
import itertools
import time

from torchstrategy import _compat

DEFAULT_WAIT_SECONDS = 3.0


class RollCall:
    """The roll calls of one process group: `token` is the same on every replica of the
    group and new for each group (a store can outlive a group: torchrun restarts reuse
    it); each call gets its own keys, numbered in the same order on every replica."""

    def __init__(self, token, world_size, name_of_rank=str, wait_seconds=DEFAULT_WAIT_SECONDS):
        self.token = token
        self.world_size = world_size
        self.name_of_rank = name_of_rank
        self.wait_seconds = wait_seconds
        self._calls = itertools.count()

    def missing_replicas(self, rank):
        """Signs this replica in and returns the ranks that did not sign in within
        `wait_seconds` (sorted; [] when everyone answered), or None when the rendezvous
        store itself cannot be reached (the process hosting it is gone)."""
        store = _compat.default_store()
        if store is None:
            return None
        prefix = f"torchstrategy/roll-call/{self.token}/{next(self._calls)}"
        try:
            store.set(f"{prefix}/{rank}", "here")
            deadline = time.monotonic() + self.wait_seconds
            while True:
                missing = [r for r in range(self.world_size)
                           if r != rank and not store.check([f"{prefix}/{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.1)
        except (RuntimeError, OSError):  # the store's host died: refused / reset / timed out
            return None

    def describe_missing(self, rank):
        """One sentence for an error message naming the missing replicas (see
        `missing_replicas`), e.g. "Missing: replica 3 (on worker:1) is not responding"."""
        missing = self.missing_replicas(rank)
        if missing is None:
            return (f"The rendezvous store is unreachable: {self.name_of_rank(0)}, whose "
                    "machine hosts it, is gone.")
        if not missing:
            return ("Every replica is still running (one of them issued a different "
                    "collective).")
        names = ", ".join(self.name_of_rank(r) for r in missing)
        verb = "is" if len(missing) == 1 else "are"
        return f"Missing: {names} {verb} not responding (died or stuck)."
