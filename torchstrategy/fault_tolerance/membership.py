"""Who is alive: heartbeats in the rendezvous store, and the survivors' agreement.

Each replica of a job with live recovery keeps a counter in the rendezvous store, raised
every `interval` seconds by a daemon thread over a store connection of its own (a
collective cannot tell a dead replica from a slow one; a counter that stopped can). A
replica that waits for the others (the commit of a step, the roll call after a failure)
takes one whose counter has not moved for `dead_after` seconds for dead.

After a failure every survivor registers under the next generation's prefix and waits
until each member of the old group has either registered or been found dead; the first
survivor to finish writes the list of survivors with ``compare_set`` and every survivor
adopts that list, so all of them agree on the same members even if their views differed
for a moment (torchft's quorum does the same through its coordinator).
"""
from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Callable, Sequence

import torch.distributed as dist


class StoreLost(RuntimeError):
    """The rendezvous store stopped answering: the machine that hosts it (the chief's) is
    gone or unreachable."""


def _counter_key(prefix: str, uid: int) -> str:
    return f"{prefix}heartbeat/{uid}"


class Heartbeat:
    """A daemon thread raising this replica's counter every `interval` seconds over
    `store` (a connection no other thread uses). `stop()` ends it; a store that stops
    answering ends it too, and `lost` is then set.

    A store whose machine became unreachable (its link down) does not answer and does not
    fail either: torch's client waits for the reply until TCP gives up, many minutes later.
    With `unreachable_after`, a second daemon thread calls `on_unreachable(seconds)` once
    no beat has been answered for that long (and sets `lost`): the replica is cut off from
    the job, whose other replicas take it for lost at that point at the latest.

    With `on_beat`, each answered beat is followed by ``on_beat(store)`` in the heartbeat's
    thread, over its connection (for reading the others' counters: see `LivenessWatch`); a
    store error it raises ends the heartbeat as a failed beat does.
    """

    def __init__(self, store: dist.Store, prefix: str, uid: int,
                 interval: float = 0.2, unreachable_after: float | None = None,
                 on_unreachable: Callable[[float], None] | None = None,
                 on_beat: Callable[[dist.Store], None] | None = None) -> None:
        self._store = store
        self._on_beat = on_beat
        self._key = _counter_key(prefix, uid)
        self._interval = interval
        self._stopped = threading.Event()
        self.lost = threading.Event()
        store.add(self._key, 1)
        self._answered = time.monotonic()
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"torchstrategy-heartbeat-{uid}")
        self._thread.start()
        if unreachable_after is not None and on_unreachable is not None:
            threading.Thread(target=self._watch, args=(unreachable_after, on_unreachable),
                             daemon=True, name=f"torchstrategy-heartbeat-watch-{uid}").start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._store.add(self._key, 1)
                self._answered = time.monotonic()
                if self._on_beat is not None:
                    self._on_beat(self._store)
            except Exception:  # the store's host is gone: the main thread will find out
                self.lost.set()
                return

    def _watch(self, unreachable_after: float,
               on_unreachable: Callable[[float], None]) -> None:
        while not self._stopped.wait(self._interval):
            silent = time.monotonic() - self._answered
            if silent >= unreachable_after and not self._stopped.is_set():
                self.lost.set()
                on_unreachable(silent)
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(2 * self._interval + 1.0)


class LivenessWatch:
    """Tells, from the heartbeat counters of `uids`, which replicas stopped: a replica
    whose counter has not changed for `dead_after` seconds (measured here, so the
    machines' clocks need not agree)."""

    def __init__(self, store: dist.Store, prefix: str, uids: Sequence[int],
                 dead_after: float) -> None:
        self._store = store
        self._prefix = prefix
        self._dead_after = dead_after
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {uid: (-1, now) for uid in uids}

    def dead(self) -> list[int]:
        """The replicas found dead now (one store request per replica watched).

        Raises:
          StoreLost: the store did not answer.
        """
        now = time.monotonic()
        found = []
        for uid, (count, since) in self._seen.items():
            try:
                value = int(self._store.add(_counter_key(self._prefix, uid), 0))
            except Exception as error:
                raise StoreLost(str(error).splitlines()[0][:200]) from error
            if value != count:
                self._seen[uid] = (value, now)
            elif now - since >= self._dead_after:
                found.append(uid)
        return found


def _arrivals_key(prefix: str) -> str:
    return f"{prefix}arrivals"


def agreement_begun(store: dist.Store, prefix: str) -> bool:
    """Whether a replica has registered in the agreement under `prefix` (one store
    request). A replica registers only after it abandoned its process group, so once this
    is true no collective of that group can complete.

    Raises:
      StoreLost: the store did not answer.
    """
    try:
        return int(store.add(_arrivals_key(prefix), 0)) > 0
    except Exception as error:  # TCPStore's errors: the store's host is gone
        raise StoreLost(str(error).splitlines()[0][:200]) from error


def agree_on_survivors(store: dist.Store, prefix: str, heartbeat_prefix: str, uid: int,
                       members: Sequence[int], dead_after: float, deadline: float,
                       info: str = "") -> list[int]:
    """Registers `uid` as alive under `prefix` (the generation's) and returns the survivors
    of `members` (sorted uids) every survivor agrees on.

    Waits until each of `members` has registered or its heartbeat (the counter a
    `Heartbeat` raises under `heartbeat_prefix`) stopped for `dead_after` seconds, then
    proposes the registered ones; the first proposal written (``compare_set``) is the
    answer on every replica. A member whose heartbeat still moves is waited for (until
    `deadline`), never counted as lost: a survivor that is slow to notice the failure is
    not dropped. `info` is stored beside the registration (the machine's name, for
    messages).

    Raises:
      StoreLost: the store stopped answering.
      TimeoutError: the members were not all accounted for by `deadline` (a
        ``time.monotonic()`` value).
    """
    registered = f"{prefix}alive/"
    try:
        store.set(f"{registered}{uid}", info or "alive")
        store.add(_arrivals_key(prefix), 1)
        watch = LivenessWatch(store, heartbeat_prefix, members, dead_after)
        decided = f"{prefix}survivors"
        while True:
            if store.check([decided]):
                return json.loads(store.get(decided))
            alive = [m for m in members if store.check([f"{registered}{m}"])]
            dead = set(watch.dead()) - set(alive)
            if len(alive) + len(dead) == len(members):
                proposal = json.dumps(sorted(alive))
                winner = store.compare_set(decided, "", proposal)
                return json.loads(winner)
            if time.monotonic() > deadline:
                missing = [m for m in members if m not in alive and m not in dead]
                raise TimeoutError(f"replica(s) {missing} neither rejoined nor stopped "
                                   "their heartbeat in time")
            time.sleep(0.02)
    except (TimeoutError, StoreLost):
        raise
    except Exception as error:  # TCPStore's errors: the store's host is gone
        raise StoreLost(str(error).splitlines()[0][:200]) from error


def wait_for_key(store: dist.Store, key: str, watch: LivenessWatch,
                 on_dead: Callable[[list[int]], None], poll_seconds: float = 0.25) -> bytes:
    """Waits for `key` in `store` and returns its value; while waiting, every
    `poll_seconds`, asks `watch` for dead replicas and calls `on_dead(them)` once some are
    found (which is expected to set `key`).

    The wait is the store's own blocking ``get`` (the server answers when the key is
    written: no polling, no sleep to be woken from on a loaded machine; one request from
    here, where ``wait`` then ``get`` would be two), under a timeout of `poll_seconds` set
    on `store` for that call only (the connection must not be shared with another
    thread). torch logs a warning each time such a wait expires, which happens only while
    a replica is missing.

    Raises:
      StoreLost: the store stopped answering.
    """
    told = False
    previous = store.timeout  # type: ignore[attr-defined]  # a property the stubs omit
    while True:
        store.set_timeout(datetime.timedelta(seconds=poll_seconds))
        try:
            return store.get(key)
        except Exception as error:  # TCPStore's errors: an expired wait, or a lost store
            text = str(error).lower()
            if "timeout" not in text and "timed out" not in text:
                raise StoreLost(str(error).splitlines()[0][:200]) from error
        finally:
            store.set_timeout(previous)
        dead = watch.dead()
        if dead and not told:
            told = True
            on_dead(dead)
