"""Agreeing on the step to checkpoint at, through the rendezvous store, never a collective.

A collective would hang if the peer that got the notice is already gone; store requests
are answered by the store's host (torchrun's agent, or replica 0) whatever the peers do.

The protocol relies on what synchronous training guarantees: every step holds a collective
of all replicas (the gradient all-reduce), so no replica can finish step ``c + 1`` before
every other replica has started it. A replica that has finished ``c`` steps and holds a
notice claims the preemption (the first claim wins) and publishes ``c + 1`` *before*
starting step ``c + 1``; every replica checks the key before each step (one ``check``
request, about 35 us on one machine). A replica finishing step ``c + 1`` has therefore
waited for the publisher to start it, and sees the key at its next check: all replicas
save after exactly ``c + 1`` steps.

Keys live under ``torchstrategy/preemption/<nonce>/``, the nonce picked by the chief when
the handler is made, so a restarted job that shares the store never reads the old keys.

The waits of a save (the chief for the replicas' random states, the replicas for the chief's
"written") poll the store every few milliseconds instead of blocking in one ``Store.wait``:
between polls Python runs signal handlers, so a replica that waits still notices a SIGTERM
(torchrun's agent stopping the group) and a save that failed on any replica (a key every
replica checks), and stops waiting at once instead of at the bound.
"""
from __future__ import annotations

import io
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

logger = logging.getLogger("torchstrategy")

# Between two store requests of a save's wait: short against a save, long against a request.
_POLL_SECONDS = 0.02


class SaveFailedError(RuntimeError):
    """A replica could not do its part of a preemption save; the message is its reason,
    recorded in the store for every replica (the first failure wins)."""


class LocalAgreement:
    """One process: nothing to agree with."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self._published: dict[int, tuple[int, bool]] = {}
        self._saved: dict[int, bool] = {}
        self._rng: Any = None

    def claim(self) -> bool:
        """Always True: the only replica leads."""
        return True

    def publish(self, round_: int, step: int, final: bool) -> None:
        """Records: save after `step` steps; `final`: exit after that save."""
        self._published[round_] = (step, final)

    def agreed(self, round_: int) -> tuple[int, bool] | None:
        """``(step, final)`` once published for `round_`, else None."""
        return self._published.get(round_)

    def offer_rng(self, round_: int, state: Any) -> None:
        """Keeps this process's random-generator state for the checkpoint."""
        self._rng = state

    def collect_rng(self, round_: int, timeout_seconds: float,
                    interrupted: Callable[[], bool] | None = None) -> dict[int, Any]:
        """This process's offered state, as rank 0's."""
        return {0: self._rng}

    def mark_saved(self, round_: int) -> None:
        """Records that the checkpoint of `round_` is written."""
        self._saved[round_] = True

    def wait_saved(self, round_: int, timeout_seconds: float,
                   interrupted: Callable[[], bool] | None = None) -> bool:
        """Always True: this process wrote it."""
        return True

    def report_save_failure(self, round_: int, message: str) -> str:
        """`message`: no other replica can have failed first."""
        return message

    def report_error(self, message: str) -> str:
        """`message`: there is no other replica whose failure came first."""
        return message


class StoreAgreement:
    """The protocol of the module docstring over `store` (a c10d Store)."""

    def __init__(self, store: dist.Store, nonce: str, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._prefix = f"torchstrategy/preemption/{nonce}/"

    def _key(self, *parts: object) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def claim(self) -> bool:
        """True for the first replica to claim the preemption (it leads the agreement)."""
        return self._store.add(self._key("claim"), 1) == 1

    def publish(self, round_: int, step: int, final: bool) -> None:
        """Announces: save after `step` steps; `final`: exit after that save."""
        self._store.set(self._key("step", round_), f"{step}:{int(final)}")

    def agreed(self, round_: int) -> tuple[int, bool] | None:
        """``(step, final)`` once published for `round_`, else None (one cheap request)."""
        key = self._key("step", round_)
        if not self._store.check([key]):
            return None
        step, final = self._store.get(key).decode().split(":")
        return int(step), bool(int(final))

    def offer_rng(self, round_: int, state: Any) -> None:
        """Hands this replica's random-generator state to the chief (which writes it)."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        # Store.set takes bytes as well as str (torch's stubs name str only).
        self._store.set(self._key("rng", round_, self.rank),
                        buffer.getvalue())  # type: ignore[arg-type]

    def _wait_for(self, key: str, round_: int, deadline: float,
                  interrupted: Callable[[], bool] | None) -> bool:
        """True once `key` is set; False at `deadline` or when `interrupted()` says so.

        Raises:
          SaveFailedError: a replica reported that its part of the save of `round_` failed.
        """
        failed = self._key("save_failed", round_)
        while True:
            if self._store.check([failed]):
                raise SaveFailedError(self._store.get(failed).decode())
            if self._store.check([key]):
                return True
            if (interrupted is not None and interrupted()) or time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)

    def collect_rng(self, round_: int, timeout_seconds: float,
                    interrupted: Callable[[], bool] | None = None) -> dict[int, Any]:
        """The chief: every replica's offered state, by rank. A replica that offered none
        within `timeout_seconds` (in all), or by the time `interrupted()` returns True, is
        left out (and said so).

        Raises:
          SaveFailedError: a replica reported that its part of the save failed.
        """
        states: dict[int, Any] = {}
        deadline = time.monotonic() + max(timeout_seconds, 0.1)
        for rank in range(self.world_size):
            key = self._key("rng", round_, rank)
            try:
                if not self._wait_for(key, round_, deadline, interrupted):
                    why = ("a signal came while waiting" if interrupted is not None
                           and interrupted() else f"not within {timeout_seconds:.0f} s")
                    logger.warning(f"torchstrategy: replica {rank} did not hand over its "
                                   f"random state for the preemption checkpoint ({why}); it is "
                                   "saved without it.")
                    continue
                raw = self._store.get(key)
            except SaveFailedError:
                raise
            except Exception as error:  # the store's host is gone: save without its state
                logger.warning(f"torchstrategy: replica {rank} did not hand over its random "
                               f"state for the preemption checkpoint ({error}); it is saved "
                               "without it.")
                continue
            states[rank] = torch.load(io.BytesIO(raw), weights_only=True)
        return states

    def mark_saved(self, round_: int) -> None:
        """Tells the replicas that the checkpoint of `round_` is written."""
        self._store.set(self._key("saved", round_), "1")

    def wait_saved(self, round_: int, timeout_seconds: float,
                   interrupted: Callable[[], bool] | None = None) -> bool:
        """True once the chief has written the checkpoint; False after `timeout_seconds`,
        when `interrupted()` returns True (checked every few milliseconds), or when the
        store is gone.

        Raises:
          SaveFailedError: a replica (the chief included) reported that its part of the
            save failed.
        """
        try:
            if self._wait_for(self._key("saved", round_), round_,
                              time.monotonic() + max(timeout_seconds, 0.1), interrupted):
                return True
            why = ("a signal came while waiting: not waiting any longer"
                   if interrupted is not None and interrupted()
                   else f"not within {timeout_seconds:.0f} s")
        except SaveFailedError:
            raise
        except Exception as error:
            why = str(error)
        logger.warning(f"torchstrategy: replica {self.rank}: the chief did not confirm the "
                       f"preemption checkpoint ({why}).")
        return False

    def report_save_failure(self, round_: int, message: str) -> str:
        """Records that this replica's part of the save of `round_` failed, for every
        replica's wait to see; returns the failure recorded first (this one or another
        replica's)."""
        try:
            return self._store.compare_set(self._key("save_failed", round_), "",
                                           message).decode()
        except Exception:  # the store's host is gone: keep our own message
            return message

    def report_error(self, message: str) -> str:
        """Records the first replica's failure; returns the one recorded first."""
        try:
            return self._store.compare_set(self._key("error"), "", message).decode()
        except Exception:  # the store's host is gone: keep our own message
            return message
