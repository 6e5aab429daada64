"""`ClusterCoordinator`: schedules functions onto the workers of a parameter-server cluster.

As in TensorFlow (``tf.distribute.coordinator.ClusterCoordinator``):

- ``schedule(fn, args, kwargs)`` queues ``fn`` and returns a `RemoteValue` at once; each
  worker runs one scheduled function at a time, taking the next from the queue.
- ``join()`` waits for everything scheduled; ``done()`` says whether it has finished;
  ``fetch(structure)`` waits for the `RemoteValue`s in a structure and returns their values.
- An error raised by a scheduled function is re-raised by the next ``schedule``, ``join``
  or ``done`` (once); functions still queued then are cancelled.
- A worker that dies (its process ends, or it does not answer within `closure_timeout`)
  has its function put back at the front of the queue for the other workers: every
  scheduled function runs *at least once* (possibly twice when a worker dies after its
  updates reached the parameter servers). When a process with the same task name joins
  again, the coordinator rebuilds its per-worker datasets and gives it work again.
- A parameter server that dies ends training: ``schedule``, ``join`` and ``done`` raise
  `ParameterServerUnavailableError` naming it; restart the cluster and restore from the
  last checkpoint.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import logging
import math
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch.distributed.rpc as rpc

from torchstrategy import nest
from torchstrategy.parameter_server import pickling, remote, rpc_world, server, worker_runtime
from torchstrategy.parameter_server.strategy import ParameterServerStrategy

logger = logging.getLogger("torchstrategy")

DEFAULT_CLOSURE_TIMEOUT_SECONDS = 600.0
# How long a lost worker's thread waits at a time for a process with its name to join again
# (it is woken at once when a member joins; the bound lets it notice the cluster ending).
_REJOIN_WAIT_SECONDS = 5.0
_PING_TIMEOUT_SECONDS = 10
_FORGET_TIMEOUT_SECONDS = 5
# How often `join` reports that it waits while no worker is alive (seconds; the variable
# overrides it, e.g. for tests or very long restarts).
WAIT_REPORT_ENV = "TORCHSTRATEGY_COORDINATOR_WAIT_REPORT_SECONDS"
DEFAULT_WAIT_REPORT_SECONDS = 30.0


def wait_report_seconds() -> float:
    """The period of `ClusterCoordinator.join`'s report while no worker is alive:
    $TORCHSTRATEGY_COORDINATOR_WAIT_REPORT_SECONDS, else 30.

    Raises:
      ValueError: the variable is not a positive, finite number of seconds.
    """
    raw = os.environ.get(WAIT_REPORT_ENV)
    if raw is None:
        return DEFAULT_WAIT_REPORT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{WAIT_REPORT_ENV}={raw!r} must be a positive, finite number of "
                         "seconds (e.g. 30), or unset.")
    return value


class ClosureCancelledError(RuntimeError):
    """A scheduled function was not run because an earlier one failed."""


class RemoteValue:
    """The result of a scheduled function, available once it has run.

    ``fetch()`` (and its alias ``get()``) blocks until then and returns the function's
    return value (tensors on the CPU), or raises the function's error.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any) -> None:
        self._value = value
        self._done.set()

    def _set_error(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's return value; raises its error (TimeoutError after `timeout`)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"The scheduled function has not finished within {timeout} s.")
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch

    def done(self) -> bool:
        """True once the function has run (its value or error is in)."""
        return self._done.is_set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"RemoteValue({state})"


class PerWorkerValues:
    """One value per worker (e.g. each worker's dataset iterator). Passed to a scheduled
    function, it becomes the value of the worker that runs the function."""

    def __init__(self, key: str, workers: Iterable[str]) -> None:
        self._key = key
        self._workers = tuple(workers)

    @property
    def key(self) -> str:
        """The name the workers keep their values under."""
        return self._key

    @property
    def workers(self) -> tuple[str, ...]:
        return self._workers

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._key!r}, workers={list(self._workers)})"


class PerWorkerIterator(PerWorkerValues):
    """The iterators of a `PerWorkerDataset`, one per worker (``iter(per_worker_dataset)``).
    Call ``next()`` on it inside a scheduled function, where it is the running worker's
    iterator."""

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError("A per-worker iterator is advanced on the workers: pass it to "
                        "coordinator.schedule(fn, args=(iterator,)) and call next(iterator) "
                        "inside fn.")


class PerWorkerDataset:
    """A dataset built on every worker by ``dataset_fn``; ``iter()`` of it gives a
    `PerWorkerValues` of iterators (each worker iterates over its own dataset)."""

    def __init__(self, coordinator: ClusterCoordinator, key: str) -> None:
        self._coordinator = coordinator
        self._key = key

    def __iter__(self) -> PerWorkerIterator:
        return self._coordinator._make_per_worker_iterator(self._key)


# -- what the coordinator keeps ----------------------------------------------------------

@dataclasses.dataclass
class _Closure:
    """A scheduled function, pickled, and the `RemoteValue` its result goes to."""

    payload: bytes
    remote_value: RemoteValue


@dataclasses.dataclass(frozen=True)
class _PerWorkerDatasetSpec:
    """``create_per_worker_dataset``: build ``dataset_fn`` on each worker under `key`."""

    key: str
    payload: bytes
    wants_context: bool

    rpc_target = staticmethod(worker_runtime.create_per_worker_value)

    def args(self, worker_name: str, worker_names: Sequence[str]) -> tuple[Any, ...]:
        """The arguments of `rpc_target` on `worker_name` (one of `worker_names`)."""
        input_context = None
        if self.wants_context:
            input_context = (len(worker_names), list(worker_names).index(worker_name))
        return self.key, self.payload, input_context


@dataclasses.dataclass(frozen=True)
class _PerWorkerIteratorSpec:
    """``iter(per_worker_dataset)``: each worker's value `key` is ``iter(source_key)``."""

    key: str
    source_key: str

    rpc_target = staticmethod(worker_runtime.make_iterator)

    def args(self, worker_name: str, worker_names: Sequence[str]) -> tuple[Any, ...]:
        """The arguments of `rpc_target` on `worker_name` (one of `worker_names`)."""
        return self.key, self.source_key


class _ClosureQueue:
    """The scheduled functions not run yet, those running, and the errors to raise.

    Every change notifies one condition; worker threads block in `take`, ``join`` in
    `wait_idle`.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque[_Closure] = collections.deque()
        self._inflight = 0
        # first error of a scheduled function, raised once
        self._error: BaseException | None = None
        self._ps_error: BaseException | None = None     # a lost parameter server: fatal
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def put(self, closure: _Closure) -> None:
        with self._cv:
            self._queue.append(closure)
            self._cv.notify_all()

    def take(self) -> _Closure | None:
        """The next closure (counted as running), blocking until there is one; None once
        the queue is stopped."""
        with self._cv:
            while not self._stopped and (not self._queue or self._ps_error is not None):
                self._cv.wait()
            if self._stopped:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def put_back(self, closure: _Closure) -> None:
        """A running closure whose worker was lost goes back to the front of the queue."""
        with self._cv:
            self._queue.appendleft(closure)
            self._inflight -= 1
            self._cv.notify_all()

    def finish(self, closure: _Closure, value: Any = None,
               error: BaseException | None = None) -> None:
        if error is not None:
            closure.remote_value._set_error(error)
        else:
            closure.remote_value._set(value)
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def fail(self, closure: _Closure, error: BaseException, worker_name: str) -> None:
        """The closure's function failed: `error` is raised once by the coordinator, and
        the closures still queued are cancelled."""
        with self._cv:
            if self._error is None:
                self._error = error
        self.finish(closure, error=error)
        self._cancel_queued(ClosureCancelledError(
            f"Not run: an earlier scheduled function failed on {worker_name} with "
            f"{type(error).__name__}: {error}"))

    def fail_parameter_server(self, closure: _Closure, error: BaseException) -> None:
        """A parameter server is lost: every later call to the coordinator raises `error`."""
        with self._cv:
            if self._ps_error is None:
                self._ps_error = error
        self.finish(closure, error=error)
        self._cancel_queued(error)

    def _cancel_queued(self, error: BaseException) -> None:
        with self._cv:
            queued, self._queue = list(self._queue), collections.deque()
            self._cv.notify_all()
        for closure in queued:
            closure.remote_value._set_error(error)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running, or an error is pending (returns True),
        or until `timeout` seconds passed (returns False; None: no bound)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._queue or self._inflight) and self._error is None \
                    and self._ps_error is None and not self._stopped:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
            return True

    def idle(self) -> bool:
        with self._cv:
            return not self._queue and not self._inflight

    def raise_pending(self) -> None:
        with self._cv:
            if self._ps_error is not None:
                raise self._ps_error
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Wakes every waiter for good (the cluster is gone)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def counts(self) -> tuple[int, int]:
        with self._cv:
            return len(self._queue), self._inflight


class _Worker:
    """One worker of the cluster and the thread that runs closures there, one at a time.

    A worker that is lost has its closure put back in the queue; its thread then waits for
    a process with the same task name to join again, rebuilds the per-worker values there
    and takes closures again.
    """

    def __init__(self, coordinator: ClusterCoordinator, name: str, index: int) -> None:
        self.name = name
        self.index = index      # its worker index (experimental_get_current_worker_index)
        self.alive = True
        self._coordinator = coordinator
        self.thread = threading.Thread(target=self._loop, name=f"torchstrategy-{name}",
                                       daemon=True)

    def _loop(self) -> None:
        queue = self._coordinator.closure_queue
        try:
            while not queue.stopped:
                if not self.alive:
                    self._await_rejoin()
                    continue
                closure = queue.take()
                if closure is None:
                    return
                self._run(closure)
        except Exception:
            # The cluster was left while this thread was between checks (the queue stops
            # before the rpc agent shuts down): its rpc calls now fail ("Current RPC agent
            # is not set"), and there is nothing left to do or to report.
            if not queue.stopped:
                raise

    def _run(self, closure: _Closure) -> None:
        coordinator = self._coordinator
        queue = coordinator.closure_queue
        try:
            future = rpc.rpc_async(self.name, worker_runtime.run_closure,
                                   args=(closure.payload, self.index),
                                   timeout=coordinator.closure_timeout)
            result = future.wait()
        except Exception as error:  # any failure of the call itself; sorted out below
            if not remote.is_transport_error(error):
                # The call failed on the worker (e.g. the result could not be pickled): the
                # function's failure, not the worker's.
                queue.fail(closure, error, self.name)
                return
            # The worker is gone: give the closure back (at the front) and drop the worker.
            self.alive = False
            queue.put_back(closure)
            coordinator.forget_worker(self.name)
            return
        if result.ok:
            queue.finish(closure, value=result.value)
        elif result.error_kind == "ps":
            queue.fail_parameter_server(closure, result.error)
        else:
            queue.fail(closure, _with_remote_trace(result.error, self.name, result.trace),
                       self.name)

    def _await_rejoin(self) -> None:
        """Blocks until a process named like this worker is back in the group and its
        per-worker values are rebuilt (or the cluster ends, or a bounded wait passed)."""
        coordinator = self._coordinator
        if coordinator.membership.wait_for_members({self.name}, _REJOIN_WAIT_SECONDS):
            return  # not back yet: the caller loops (and stops when the cluster ends)
        try:
            rpc.rpc_sync(self.name, server.ping, timeout=_PING_TIMEOUT_SECONDS)
            coordinator.replay_per_worker(self.name)
        except Exception as error:  # whatever failed, the new process is unusable: drop it
            logger.warning(f"{self.name} rejoined but could not be set up again: {error}")
            coordinator.forget_worker(self.name)
            return
        self.alive = True


class ClusterCoordinator:
    """Schedules functions onto the workers of a `ParameterServerStrategy`'s cluster.

    There is one coordinator per strategy: ``ClusterCoordinator(strategy)`` returns the
    existing one when called again.

    Args:
      strategy: the `ParameterServerStrategy`.
      closure_timeout: seconds a scheduled function may run on a worker before the worker is
        considered lost and the function re-queued.
    """

    def __new__(cls, strategy: ParameterServerStrategy,
                closure_timeout: float = DEFAULT_CLOSURE_TIMEOUT_SECONDS) -> ClusterCoordinator:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"ClusterCoordinator needs a ParameterServerStrategy, got "
                            f"{type(strategy).__name__}.")
        existing = strategy.extended.coordinator
        if existing is not None:
            return existing
        self = super().__new__(cls)
        self._init(strategy, closure_timeout)
        winner = strategy.extended.attach_coordinator(self)
        if winner is not self:  # another thread made one meanwhile: keep that one
            self._queue.stop()
            return winner
        # The worker threads end when the chief leaves the cluster.
        self._membership.on_leave(self._queue.stop)
        for worker in self._workers.values():
            worker.thread.start()
        return self

    def _init(self, strategy: ParameterServerStrategy, closure_timeout: float) -> None:
        self._strategy = strategy
        ext = strategy.extended
        self._membership = ext.membership
        self._closure_timeout = closure_timeout
        self._queue = _ClosureQueue()
        self._keys = itertools.count()
        self._per_worker_specs: list[_PerWorkerDatasetSpec | _PerWorkerIteratorSpec] = []
        self._spec_lock = threading.Lock()
        self._workers = {name: _Worker(self, name, index)
                         for index, name in enumerate(ext.worker_devices)}

    def __init__(self, strategy: ParameterServerStrategy,
                 closure_timeout: float = DEFAULT_CLOSURE_TIMEOUT_SECONDS) -> None:
        """Everything is set up once, in ``__new__`` (which may return an existing
        coordinator, which must not be set up again)."""

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    @property
    def closure_queue(self) -> _ClosureQueue:
        """The `_ClosureQueue` the worker threads take from."""
        return self._queue

    @property
    def closure_timeout(self) -> float:
        return self._closure_timeout

    @property
    def membership(self) -> rpc_world.Membership:
        return self._membership

    @staticmethod
    def experimental_get_current_worker_index() -> int:
        """Inside a function scheduled with `schedule`: the index (0 .. workers - 1) of the
        worker running it, as ``tf.distribute.coordinator.experimental_get_current_worker_
        index()`` gives it (e.g. to pick a per-worker shard).

        Raises:
          RuntimeError: called anywhere else.
        """
        return worker_runtime.current_worker_index()

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                 kwargs: Mapping[str, Any] | None = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns its `RemoteValue`
        without waiting.

        `fn` travels by reference (define it at module level; functions of the main script
        travel by value). Modules, optimizers and variables made in the strategy's scope
        travel as references to the parameter servers; a `PerWorkerValues` becomes the
        running worker's value. An optimizer carries its ``param_groups`` settings as they
        are now: the function's ``optimizer.step()`` applies them, whatever the chief
        changes later (e.g. with an lr scheduler).

        Raises:
          TypeError: when `fn` or its arguments cannot be pickled (before anything runs).
          The error of an earlier scheduled function, if one failed since the last raise.
          ParameterServerUnavailableError: when a parameter server is lost.
        """
        self._queue.raise_pending()
        if not callable(fn):
            raise TypeError(f"schedule needs a function, got {type(fn).__name__}.")
        payload, _ = pickling.dumps((fn, tuple(args or ()), dict(kwargs or {})),
                                    self._reference)
        remote_value = RemoteValue()
        self._queue.put(_Closure(payload, remote_value))
        return remote_value

    def join(self) -> None:
        """Waits until every scheduled function has run.

        While no worker is alive (all died; their functions wait in the queue for one to
        rejoin) it says so every 30 seconds ($TORCHSTRATEGY_COORDINATOR_WAIT_REPORT_SECONDS)
        with a warning on the "torchstrategy" logger naming the workers it waits for, and
        once per call with a `RuntimeWarning`.

        Raises:
          The first error of a scheduled function since the last raise (the functions
          still queued are cancelled), or ParameterServerUnavailableError.
          ValueError: a malformed $TORCHSTRATEGY_COORDINATOR_WAIT_REPORT_SECONDS.
        """
        period = wait_report_seconds()
        started = time.monotonic()
        warned = False
        while not self._queue.wait_idle(period):
            lost = sorted(w.name for w in self._workers.values() if not w.alive)
            if len(lost) < len(self._workers):
                continue  # a worker is running the functions: progress, nothing to say
            queued, running = self._queue.counts()
            message = (
                f"ClusterCoordinator.join() has waited {time.monotonic() - started:.0f} s "
                f"with no worker alive: {', '.join(lost)} "
                f"{'is' if len(lost) == 1 else 'are'} lost, and {queued + running} scheduled "
                "function(s) wait for one of them to rejoin. Restart the worker tasks "
                "(`python -m torchstrategy.server` with their TF_CONFIG, or "
                "LocalCluster.restart), or end the program.")
            logger.warning(message)
            if not warned:
                warned = True
                # Also a warning: the library configures no logging, and without a worker
                # this call never returns.
                warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._queue.raise_pending()

    def done(self) -> bool:
        """True when every scheduled function has run; raises as `join` does."""
        self._queue.raise_pending()
        return self._queue.idle()

    def fetch(self, val: Any) -> Any:
        """The values of the `RemoteValue`s in `val` (a `RemoteValue` or a nested structure
        of them); waits for each."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        return nest.map_structure(
            lambda leaf: leaf.fetch() if isinstance(leaf, RemoteValue) else leaf, val)

    def _reference(self, obj: object) -> tuple[Any, ...] | None:
        if isinstance(obj, PerWorkerValues):
            return ("per_worker", obj.key)
        return self._strategy.extended.reference(obj)

    # -- per-worker values -------------------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """Builds ``dataset_fn()`` on every worker (``dataset_fn(input_context)`` when it
        takes an argument: a ``ts.InputContext`` with the worker's index among
        ``num_input_pipelines`` workers). Returns a `PerWorkerDataset`; iterate it with
        ``iter(per_worker_dataset)`` to get a `PerWorkerValues` of iterators.

        Raises:
          TypeError: when `dataset_fn` cannot be pickled.
        """
        self._queue.raise_pending()
        wants_context = _takes_an_argument(dataset_fn)
        payload, _ = pickling.dumps((dataset_fn, (), False), self._reference)
        key = self._new_key()
        self._add_per_worker(_PerWorkerDatasetSpec(key, payload, wants_context))
        return PerWorkerDataset(self, key)

    def _make_per_worker_iterator(self, source_key: str) -> PerWorkerIterator:
        key = self._new_key()
        self._add_per_worker(_PerWorkerIteratorSpec(key, source_key))
        return PerWorkerIterator(key, self._workers)

    def _new_key(self) -> str:
        return f"{self._strategy.extended.key_prefix}/per_worker/{next(self._keys)}"

    def _add_per_worker(self, spec: _PerWorkerDatasetSpec | _PerWorkerIteratorSpec) -> None:
        names = list(self._workers)
        with self._spec_lock:
            self._per_worker_specs.append(spec)
            alive = [worker.name for worker in self._workers.values() if worker.alive]
            errors = rpc_world.call_each(alive, spec.rpc_target,
                                         lambda name: spec.args(name, names),
                                         self._closure_timeout)
        for error in errors.values():
            # A worker lost (or known gone) meanwhile gets the specs replayed when it
            # rejoins; the worker's own error arrives as its own type and is raised.
            if not remote.is_transport_error(error):
                raise error

    def replay_per_worker(self, name: str) -> None:
        """Rebuilds every per-worker value on the worker `name` (after it rejoined)."""
        names = list(self._workers)
        with self._spec_lock:
            for spec in self._per_worker_specs:
                rpc.rpc_async(name, spec.rpc_target, args=spec.args(name, names),
                              timeout=self._closure_timeout).wait()

    # -- failures ------------------------------------------------------------------------------
    def forget_worker(self, name: str) -> None:
        """Drops a dead worker from the rpc group everywhere, so a restarted process with the
        same name can join."""
        members = self._membership.live_members()
        rank = members.get(name)
        if rank is None:
            return
        try:
            self._membership.drop(name, rank)
        except (RuntimeError, TimeoutError) as error:
            # The store or its membership token is unavailable: the members told below
            # still forget it, and a rejoining process is refused until the store recovers.
            logger.warning(f"could not drop {name} from the cluster's store: {error}")
        others = [member for member in members if member not in (name, self._membership.name)]
        errors = rpc_world.call_each(others, rpc_world.drop_local, (name, rank),
                                     _FORGET_TIMEOUT_SECONDS)
        for member, failure in errors.items():
            # That member is gone or silent too; it is dropped when its own loss is noticed.
            logger.debug(f"{member} did not hear that {name} is gone: {failure}")

    def __repr__(self) -> str:
        queued, running = self._queue.counts()
        return (f"ClusterCoordinator(workers={list(self._workers)}, queued={queued}, "
                f"running={running})")


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    try:
        parameters = [p for p in inspect.signature(fn).parameters.values()
                      if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                             p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature (a builtin): called without arguments
        return False
    return len(parameters) >= 1


def _with_remote_trace(error: BaseException, worker_name: str, trace: str) -> BaseException:
    try:
        error.add_note(f"Raised by the scheduled function on {worker_name}:\n{trace}")
    except AttributeError:  # not an exception with notes (Python < 3.11): keep it as is
        return error
    return error
