"""Running one function as several replicas in threads of one process, with rendezvous.

Strategies that host several replicas in one process (CentralStorageStrategy) run the step
of each replica in its own thread. The replicas meet at *rendezvous points* (the end of
``backward()``, ``optimizer.step()``, ``ReplicaContext.all_reduce`` / ``merge_call``):
every replica contributes a value, the last one to arrive runs the point's action once on
all the contributions, and all of them continue with its result.

Guarantees:
- A replica that raises aborts the group: replicas waiting at (or later reaching) a
  rendezvous are released with `ReplicaAborted`, and `run_replicas` re-raises the first
  replica's original exception. Nothing deadlocks because one replica failed.
- A rendezvous waits at most `timeout_seconds`; past that it raises `CollectiveError`
  naming the replicas that did not arrive.
- The thread-local state torch keeps per thread (grad mode, inference mode, autocast) is
  copied from the calling thread into every replica thread.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

import torch

from torchstrategy.collectives.communicator import CollectiveError

# How long `run_replicas` waits for replicas still busy after the group was aborted (a
# replica in a long computation reaches its next rendezvous, is released and ends).
_ABORT_GRACE_SECONDS = 10.0


class ReplicaAborted(RuntimeError):
    """Raised in a replica released from a rendezvous because another replica failed."""


class ReplicaGroup:
    """A cyclic barrier for `num_replicas` threads with an action per round.

    Every replica must reach the same rendezvous points in the same order, as with any
    collective.
    """

    def __init__(self, num_replicas: int, timeout_seconds: float) -> None:
        self.num_replicas = num_replicas
        self.timeout_seconds = timeout_seconds
        self._cond = threading.Condition()
        self._generation = 0
        self._contributions: list[Any] = [None] * num_replicas
        self._arrived: set[int] = set()
        # (result, error) of the round that just completed
        self._last: tuple[Any, BaseException | None] = (None, None)
        # (replica_id, exception) of the first failure
        self._failure: tuple[int, BaseException] | None = None

    @property
    def failure(self) -> tuple[int, BaseException] | None:
        """(replica_id, exception) of the first replica that failed, or None."""
        return self._failure

    def abort(self, replica_id: int, error: BaseException) -> None:
        """Records `error` as the group's failure (the first one wins) and releases every
        replica waiting at a rendezvous."""
        with self._cond:
            if self._failure is None:
                self._failure = (replica_id, error)
            self._cond.notify_all()

    def _aborted_error(self, replica_id: int, what: str) -> ReplicaAborted:
        failed, error = self._failure or (-1, None)
        return ReplicaAborted(f"torchstrategy: replica {replica_id} stopped at {what} because "
                              f"replica {failed} failed: {type(error).__name__}: {error}")

    def rendezvous(self, replica_id: int, what: str, value: Any = None,
                   action: Callable[[list[Any]], Any] | None = None,
                   timeout_seconds: float | None = None) -> Any:
        """Waits until every replica has arrived, then returns ``action(values)`` (values in
        replica order), computed once by the last replica to arrive; None without action.
        `timeout_seconds` bounds this replica's wait (None: the group's timeout).

        Raises:
          ReplicaAborted: another replica failed.
          CollectiveError: not every replica arrived within the timeout.
          Whatever `action` raised, in every replica.
        """
        with self._cond:
            if self._failure is not None:
                raise self._aborted_error(replica_id, what)
            generation = self._generation
            self._contributions[replica_id] = value
            self._arrived.add(replica_id)
            if len(self._arrived) == self.num_replicas:
                contributions = self._contributions
                self._contributions = [None] * self.num_replicas
                self._arrived = set()
                try:
                    self._last = (None if action is None else action(contributions), None)
                except BaseException as error:  # every replica re-raises it below
                    self._last = (None, error)
                self._generation += 1
                self._cond.notify_all()
            else:
                limit = self.timeout_seconds if timeout_seconds is None else timeout_seconds
                deadline = time.monotonic() + limit
                while self._generation == generation and self._failure is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = sorted(set(range(self.num_replicas)) - self._arrived)
                        timeout = CollectiveError(
                            f"torchstrategy: {what} on replica {replica_id} timed out after "
                            f"{limit:g} s: replica(s) {missing} did not reach "
                            "it (every replica must run the same steps: backward, "
                            "optimizer.step, all_reduce, merge_call, in the same order).")
                        if self._failure is None:
                            self._failure = (replica_id, timeout)
                        self._cond.notify_all()
                        raise timeout
                    self._cond.wait(remaining)
                if self._generation == generation:
                    raise self._aborted_error(replica_id, what)
            result, raised = self._last
        if raised is not None:
            raise raised
        return result


def _thread_state() -> Callable[[], ContextManager[None]]:
    """The calling thread's torch thread-local state, as a context manager factory."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocasts: list[tuple[str, torch.dtype]] = []
    for device_type in ("cpu", "cuda"):
        if device_type == "cuda" and not torch.cuda.is_available():
            continue
        if torch.is_autocast_enabled(device_type):
            autocasts.append((device_type, torch.get_autocast_dtype(device_type)))

    @contextlib.contextmanager
    def restore() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode() if inference
                                else torch.set_grad_enabled(grad))
            for device_type, dtype in autocasts:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield
    return restore


def run_replicas(group: ReplicaGroup, replica_fn: Callable[[int], Any]) -> list[Any]:
    """Runs ``replica_fn(replica_id)`` for every replica of `group`, each in its own thread.

    Returns:
      The list of results, in replica order.

    Raises:
      The first failing replica's exception (other replicas are released from their
      rendezvous and end); `KeyboardInterrupt` aborts every replica.
    """
    n = group.num_replicas
    results: list[Any] = [None] * n
    restore = _thread_state()

    def body(replica_id: int) -> None:
        try:
            with restore():
                results[replica_id] = replica_fn(replica_id)
        except BaseException as error:
            group.abort(replica_id, error)

    threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                name=f"torchstrategy-replica-{r}") for r in range(n)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive() and group.failure is None:
                thread.join(0.05)
    except BaseException as error:   # Ctrl-C in the calling thread: release everyone
        group.abort(-1, error)
        raise
    if group.failure is not None:
        deadline = time.monotonic() + _ABORT_GRACE_SECONDS
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        _, first = group.failure
        raise first
    return results
