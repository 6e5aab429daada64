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

import torch.distributed as dist

_calls = itertools.count()
DEFAULT_WAIT_SECONDS = 3.0


def missing_replicas(rank, world_size, token, wait_seconds=DEFAULT_WAIT_SECONDS):
    """Signs this replica in and returns the ranks that did not sign in within
    `wait_seconds` (sorted; [] when everyone answered), or None when the rendezvous store
    itself cannot be reached (the process hosting it is gone).

    `token` is the same on every replica of this process group and new for each (a store
    can outlive a group: torchrun restarts reuse it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    prefix = f"torchstrategy/roll-call/{token}/{next(_calls)}"
    try:
        store.set(f"{prefix}/{rank}", "here")
        deadline = time.monotonic() + wait_seconds
        while True:
            missing = [r for r in range(world_size)
                       if r != rank and not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # the store's host died: connection refused / reset / timed out
        return None


def describe_missing(rank, world_size, token, name_of_rank=str,
                     wait_seconds=DEFAULT_WAIT_SECONDS):
    """One sentence for an error message naming the missing replicas (see
    `missing_replicas`); `name_of_rank` turns a rank into words, e.g. "replica 3 (worker:1)".
    """
    missing = missing_replicas(rank, world_size, token, wait_seconds)
    if missing is None:
        return (f"The rendezvous store is unreachable: {name_of_rank(0)}, whose machine "
                "hosts it, is gone.")
    if not missing:
        return "Every replica is still running (one of them issued a different collective)."
    names = ", ".join(name_of_rank(r) for r in missing)
    verb = "is" if len(missing) == 1 else "are"
    return f"Missing: {names} {verb} not responding (died or stuck)."
