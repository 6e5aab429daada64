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
import contextlib
import threading
import time

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

    def __init__(self, num_replicas, timeout_seconds):
        self.num_replicas = num_replicas
        self.timeout_seconds = timeout_seconds
        self._cond = threading.Condition()
        self._generation = 0
        self._contributions = [None] * num_replicas
        self._arrived = set()
        self._last = (None, None)   # (result, error) of the round that just completed
        self._failure = None        # (replica_id, exception) of the first failure

    @property
    def failure(self):
        """(replica_id, exception) of the first replica that failed, or None."""
        return self._failure

    def abort(self, replica_id, error):
        """Records `error` as the group's failure (the first one wins) and releases every
        replica waiting at a rendezvous."""
        with self._cond:
            if self._failure is None:
                self._failure = (replica_id, error)
            self._cond.notify_all()

    def _aborted_error(self, replica_id, what):
        failed, error = self._failure
        return ReplicaAborted(f"torchstrategy: replica {replica_id} stopped at {what} because "
                              f"replica {failed} failed: {type(error).__name__}: {error}")

    def rendezvous(self, replica_id, what, value=None, action=None):
        """Waits until every replica has arrived, then returns ``action(values)`` (values in
        replica order), computed once by the last replica to arrive; None without action.

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
                deadline = time.monotonic() + self.timeout_seconds
                while self._generation == generation and self._failure is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = sorted(set(range(self.num_replicas)) - self._arrived)
                        error = CollectiveError(
                            f"torchstrategy: {what} on replica {replica_id} timed out after "
                            f"{self.timeout_seconds:g} s: replica(s) {missing} did not reach "
                            "it (every replica must run the same steps: backward, "
                            "optimizer.step, all_reduce, merge_call, in the same order).")
                        if self._failure is None:
                            self._failure = (replica_id, error)
                        self._cond.notify_all()
                        raise error
                    self._cond.wait(remaining)
                if self._generation == generation:
                    raise self._aborted_error(replica_id, what)
            result, error = self._last
        if error is not None:
            raise error
        return result


def _thread_state():
    """The calling thread's torch thread-local state, as a context manager factory."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocasts = []
    for device_type in ("cpu", "cuda"):
        if device_type == "cuda" and not torch.cuda.is_available():
            continue
        if torch.is_autocast_enabled(device_type):
            autocasts.append((device_type, torch.get_autocast_dtype(device_type)))

    @contextlib.contextmanager
    def restore():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode() if inference
                                else torch.set_grad_enabled(grad))
            for device_type, dtype in autocasts:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield
    return restore


def run_replicas(group, replica_fn):
    """Runs ``replica_fn(replica_id)`` for every replica of `group`, each in its own thread.

    Returns:
      The list of results, in replica order.

    Raises:
      The first failing replica's exception (other replicas are released from their
      rendezvous and end); `KeyboardInterrupt` aborts every replica.
    """
    n = group.num_replicas
    results = [None] * n
    restore = _thread_state()

    def body(replica_id):
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
        _, error = group.failure
        raise error
    return results
