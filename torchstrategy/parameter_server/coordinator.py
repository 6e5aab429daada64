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
import collections
import inspect
import itertools
import threading
import time
import weakref

import torch.distributed.rpc as rpc

from torchstrategy import nest
from torchstrategy.parameter_server import pickling, remote, rpc_world, server, worker_runtime

DEFAULT_CLOSURE_TIMEOUT_SECONDS = 600.0
_REJOIN_POLL_SECONDS = 0.2


class ClosureCancelledError(RuntimeError):
    """A scheduled function was not run because an earlier one failed."""


class RemoteValue:
    """The result of a scheduled function, available once it has run.

    ``fetch()`` (and its alias ``get()``) blocks until then and returns the function's
    return value (tensors on the CPU), or raises the function's error.
    """

    def __init__(self):
        self._done = threading.Event()
        self._value = None
        self._error = None

    def _set(self, value):
        self._value = value
        self._done.set()

    def _set_error(self, error):
        self._error = error
        self._done.set()

    def fetch(self, timeout=None):
        """The function's return value; raises its error (TimeoutError after `timeout`)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"The scheduled function has not finished within {timeout} s.")
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch

    def done(self):
        return self._done.is_set()

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"RemoteValue({state})"


class PerWorkerValues:
    """One value per worker (e.g. each worker's dataset iterator). Passed to a scheduled
    function, it becomes the value of the worker that runs the function."""

    def __init__(self, key, workers):
        self._key = key
        self._workers = tuple(workers)

    @property
    def workers(self):
        return self._workers

    def __repr__(self):
        return f"PerWorkerValues({self._key!r}, workers={list(self._workers)})"


class PerWorkerIterator(PerWorkerValues):
    """The iterators of a `PerWorkerDataset`, one per worker (``iter(per_worker_dataset)``).
    Call ``next()`` on it inside a scheduled function, where it is the running worker's
    iterator."""

    def __iter__(self):
        return self

    def __next__(self):
        raise TypeError("A per-worker iterator is advanced on the workers: pass it to "
                        "coordinator.schedule(fn, args=(iterator,)) and call next(iterator) "
                        "inside fn.")


class PerWorkerDataset:
    """A dataset built on every worker by ``dataset_fn``; ``iter()`` of it gives a
    `PerWorkerValues` of iterators (each worker iterates over its own dataset)."""

    def __init__(self, coordinator, key):
        self._coordinator = coordinator
        self._key = key

    def __iter__(self):
        return self._coordinator._make_per_worker_iterator(self._key)


class _Closure:
    __slots__ = ("payload", "remote_value")

    def __init__(self, payload, remote_value):
        self.payload = payload
        self.remote_value = remote_value


class _Worker:
    def __init__(self, name):
        self.name = name
        self.alive = True
        self.thread = None


class ClusterCoordinator:
    """Schedules functions onto the workers of a `ParameterServerStrategy`'s cluster.

    There is one coordinator per strategy: ``ClusterCoordinator(strategy)`` returns the
    existing one when called again.

    Args:
      strategy: the `ParameterServerStrategy`.
      closure_timeout: seconds a scheduled function may run on a worker before the worker is
        considered lost and the function re-queued.
    """

    def __new__(cls, strategy, closure_timeout=DEFAULT_CLOSURE_TIMEOUT_SECONDS):
        from torchstrategy.parameter_server.strategy import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"ClusterCoordinator needs a ParameterServerStrategy, got "
                            f"{type(strategy).__name__}.")
        existing = strategy._coordinator
        if existing is not None:
            return existing
        self = super().__new__(cls)
        strategy._coordinator = self
        self._init(strategy, closure_timeout)
        return self

    def _init(self, strategy, closure_timeout):
        self._strategy = strategy
        ext = strategy.extended
        self._membership = ext._membership
        self._closure_timeout = closure_timeout
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._inflight = 0
        self._error = None          # first user error, raised once
        self._ps_error = None       # fatal
        self._keys = itertools.count()
        self._per_worker_specs = []  # ("dataset", key, payload, wants_context) | ("iter", key, src)
        self._spec_lock = threading.Lock()
        self._workers = {name: _Worker(name) for name in ext.worker_devices}
        for worker in self._workers.values():
            worker.thread = threading.Thread(target=_worker_loop,
                                             args=(weakref.ref(self), worker),
                                             name=f"torchstrategy-{worker.name}", daemon=True)
            worker.thread.start()

    def __init__(self, strategy, closure_timeout=DEFAULT_CLOSURE_TIMEOUT_SECONDS):
        pass  # set up once in __new__

    @property
    def strategy(self):
        return self._strategy

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self, fn, args=None, kwargs=None):
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
        self._raise_pending()
        if not callable(fn):
            raise TypeError(f"schedule needs a function, got {type(fn).__name__}.")
        payload, _ = pickling.dumps((fn, tuple(args or ()), dict(kwargs or {})),
                                    self._strategy.extended._reference)
        remote_value = RemoteValue()
        with self._cv:
            self._queue.append(_Closure(payload, remote_value))
            self._cv.notify_all()
        return remote_value

    def join(self):
        """Waits until every scheduled function has run.

        Raises:
          The first error of a scheduled function since the last raise (the functions
          still queued are cancelled), or ParameterServerUnavailableError.
        """
        with self._cv:
            while (self._queue or self._inflight) and self._error is None \
                    and self._ps_error is None:
                self._cv.wait(1.0)
        self._raise_pending()

    def done(self):
        """True when every scheduled function has run; raises as `join` does."""
        self._raise_pending()
        with self._cv:
            return not self._queue and not self._inflight

    def fetch(self, val):
        """The values of the `RemoteValue`s in `val` (a `RemoteValue` or a nested structure
        of them); waits for each."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        return nest.map_structure(
            lambda leaf: leaf.fetch() if isinstance(leaf, RemoteValue) else leaf, val)

    def _raise_pending(self):
        with self._cv:
            if self._ps_error is not None:
                raise self._ps_error
            error, self._error = self._error, None
        if error is not None:
            raise error

    # -- per-worker values -------------------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn):
        """Builds ``dataset_fn()`` on every worker (``dataset_fn(input_context)`` when it
        takes an argument: a ``ts.InputContext`` with the worker's index among
        ``num_input_pipelines`` workers). Returns a `PerWorkerDataset`; iterate it with
        ``iter(per_worker_dataset)`` to get a `PerWorkerValues` of iterators.

        Raises:
          TypeError: when `dataset_fn` cannot be pickled.
        """
        self._raise_pending()
        wants_context = _takes_an_argument(dataset_fn)
        payload, _ = pickling.dumps((dataset_fn, (), False), self._strategy.extended._reference)
        key = f"{self._strategy.extended._prefix}/per_worker/{next(self._keys)}"
        self._add_per_worker(("dataset", key, payload, wants_context))
        return PerWorkerDataset(self, key)

    def _make_per_worker_iterator(self, source_key):
        key = f"{self._strategy.extended._prefix}/per_worker/{next(self._keys)}"
        self._add_per_worker(("iter", key, source_key))
        return PerWorkerIterator(key, self._workers)

    def _add_per_worker(self, spec):
        with self._spec_lock:
            self._per_worker_specs.append(spec)
            calls = []
            for worker in self._workers.values():
                if worker.alive:
                    try:
                        calls.append((worker, _apply_spec_async(self, worker.name, spec)))
                    except Exception:
                        pass  # the worker thread notices the death; rejoin replays specs
            for worker, future in calls:
                try:
                    future.wait()
                except Exception as error:
                    if not remote.is_transport_error(error):
                        raise
        return spec

    def _replay_per_worker(self, name):
        with self._spec_lock:
            for spec in self._per_worker_specs:
                _apply_spec_async(self, name, spec).wait()

    # -- failures ------------------------------------------------------------------------------
    def _forget_worker(self, worker):
        """Drops a dead worker from the rpc group everywhere, so a restarted process with the
        same name can join."""
        members = self._membership.live_members()
        rank = members.get(worker.name)
        if rank is None:
            return
        try:
            self._membership.drop(worker.name, rank)
        except Exception:
            pass
        futures = []
        for name in members:
            if name not in (worker.name, self._membership.name):
                try:
                    futures.append(rpc.rpc_async(name, server._forget_member,
                                                 args=(worker.name, rank), timeout=5))
                except Exception:
                    pass
        for future in futures:
            try:
                future.wait()
            except Exception:
                pass

    def _fail_all_queued(self, error):
        with self._cv:
            queued, self._queue = list(self._queue), collections.deque()
            self._cv.notify_all()
        for closure in queued:
            closure.remote_value._set_error(error)

    def __repr__(self):
        with self._cv:
            return (f"ClusterCoordinator(workers={list(self._workers)}, queued="
                    f"{len(self._queue)}, running={self._inflight})")


def _takes_an_argument(fn):
    try:
        parameters = [p for p in inspect.signature(fn).parameters.values()
                      if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                             p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(parameters) >= 1


def _apply_spec_async(coordinator, worker_name, spec):
    timeout = coordinator._closure_timeout
    if spec[0] == "dataset":
        _, key, payload, wants_context = spec
        context = None
        if wants_context:
            names = list(coordinator._workers)
            context = (len(names), names.index(worker_name))
        return rpc.rpc_async(worker_name, worker_runtime.create_per_worker_value,
                             args=(key, payload, context), timeout=timeout)
    _, key, source = spec
    return rpc.rpc_async(worker_name, worker_runtime.make_iterator, args=(key, source),
                         timeout=timeout)


def _worker_loop(coordinator_ref, worker):
    """One thread per worker: runs queued closures there one at a time."""
    while True:
        coordinator = coordinator_ref()
        if coordinator is None or rpc_world.current() is not coordinator._membership:
            return  # the coordinator or the cluster is gone
        if not worker.alive:
            if not _wait_for_rejoin(coordinator, worker):
                del coordinator
                continue
        with coordinator._cv:
            if not coordinator._queue or coordinator._ps_error is not None:
                coordinator._cv.wait(0.5)
                del coordinator
                continue
            closure = coordinator._queue.popleft()
            coordinator._inflight += 1
        _run_on(coordinator, worker, closure)
        del coordinator


def _run_on(coordinator, worker, closure):
    try:
        future = rpc.rpc_async(worker.name, worker_runtime.run_closure,
                               args=(closure.payload,), timeout=coordinator._closure_timeout)
        result = future.wait()
    except Exception as error:
        if not remote.is_transport_error(error):
            # The call itself failed on the worker (e.g. the result could not be pickled):
            # the function's failure, not the worker's.
            _fail_closure(coordinator, worker, closure, error)
            return
        # The worker is gone: give the closure back (at the front) and drop the worker.
        worker.alive = False
        with coordinator._cv:
            coordinator._queue.appendleft(closure)
            coordinator._inflight -= 1
            coordinator._cv.notify_all()
        coordinator._forget_worker(worker)
        return
    if result[0] == "ok":
        _finish(coordinator, closure, value=result[1])
        return
    _, kind, error, trace = result
    if kind == "ps":
        with coordinator._cv:
            if coordinator._ps_error is None:
                coordinator._ps_error = error
        _finish(coordinator, closure, error=error)
        coordinator._fail_all_queued(error)
        return
    _fail_closure(coordinator, worker, closure, _with_remote_trace(error, worker.name, trace))


def _fail_closure(coordinator, worker, closure, error):
    with coordinator._cv:
        if coordinator._error is None:
            coordinator._error = error
    _finish(coordinator, closure, error=error)
    coordinator._fail_all_queued(ClosureCancelledError(
        f"Not run: an earlier scheduled function failed on {worker.name} with "
        f"{type(error).__name__}: {error}"))


def _finish(coordinator, closure, value=None, error=None):
    if error is not None:
        closure.remote_value._set_error(error)
    else:
        closure.remote_value._set(value)
    with coordinator._cv:
        coordinator._inflight -= 1
        coordinator._cv.notify_all()


def _with_remote_trace(error, worker_name, trace):
    try:
        error.add_note(f"Raised by the scheduled function on {worker_name}:\n{trace}")
    except AttributeError:
        pass
    return error


def _wait_for_rejoin(coordinator, worker):
    """Returns True once a process named like `worker` is back in the group and its
    per-worker values are rebuilt; False after a short wait (the caller loops)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if rpc_world.current() is not coordinator._membership:
            return False
        if worker.name in coordinator._membership.live_members():
            try:
                rpc.rpc_sync(worker.name, server.ping, timeout=10)
                coordinator._replay_per_worker(worker.name)
            except Exception:
                coordinator._forget_worker(worker)
                return False
            worker.alive = True
            return True
        time.sleep(_REJOIN_POLL_SECONDS)
    return False
