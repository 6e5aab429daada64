"""Metrics in a custom loop: torchmetrics made to follow a strategy, as TensorFlow's
``train_accuracy.update_state(...)`` inside the step and ``.result()`` outside follow it.

``ts.metrics.sync(metric)`` configures a ``torchmetrics.Metric`` (or ``MetricCollection``)
once, in place, so that it is updated inside ``strategy.run`` with each replica's rows and
``compute()`` in cross-replica context gives the value over every replica's rows:

- MirroredStrategy, MultiWorkerMirroredStrategy (one replica per process): torchmetrics
  already gathers its states over the default process group at ``compute()``, which is the
  strategy's group; with `sync` the gather goes through the strategy's communicator
  instead (its timeout, its explained errors), with a single replica nothing is gathered
  even if some other process group exists, and ``update`` also takes the `PerReplica`
  results of ``run`` in cross-replica context.
- CentralStorageStrategy (the replicas are threads of one process, sharing the one metric
  object): torchmetrics would update the states from several threads at once (``forward``
  swaps the states while it computes the batch value, so concurrent calls lose updates)
  and with tensors on other devices than the states. With `sync` every ``update`` and
  ``forward`` holds a lock and moves its tensors to the metric's device; there is nothing
  to gather (one process holds every replica's updates).
- TPUStrategy: the step is one SPMD program over the global batch, so a metric updated
  inside ``run`` already sees every replica's rows, on every host; `sync` turns
  torchmetrics' process-group gather off (it would count each row once per host).
- ParameterServerStrategy: refused (a scheduled function runs on a worker, with its own
  copy of the metric); compute metrics on the coordinator from the fetched results.

The strategy says which of these applies (``strategy.extended.metric_sync()``, a
`MetricSync`: the communicator to gather over, whether updates are serialised); any other
strategy gets the first behaviour by default, or the second if its replicas are threads.

torchmetrics is an optional dependency: it is imported only when `sync` is called.
"""
from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Callable

import torch

from torchstrategy import nest, values
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.context import AnyStrategy, get_strategy


class _Shared:
    """A configuration object a metric keeps: copied metrics (``metric.clone()``) keep
    following the same strategy and lock instead of deep-copying them."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("A metric configured by ts.metrics.sync cannot be pickled (it refers "
                        "to its strategy): save metric.state_dict(), or call "
                        "ts.metrics.sync again on the metric loaded.")


class _CommunicatorGather(_Shared):
    """torchmetrics' ``dist_sync_fn`` over a strategy's communicator: every replica's
    version of one state tensor, in replica order (shapes may differ between replicas)."""

    def __init__(self, communicator: Communicator) -> None:
        self._comm = communicator

    def __call__(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        if group is not None:
            raise ValueError(f"ts.metrics.sync gathers over the strategy's replicas; a "
                             f"process_group ({group!r}) cannot be used with it. Leave "
                             "process_group unset.")
        shapes = self._comm.gather_objects(tuple(tensor.shape))
        flat = self._comm.all_gather([tensor.reshape(-1)], axis=0)[0]
        parts: list[torch.Tensor] = []
        start = 0
        for shape in shapes:
            count = 1
            for size in shape:
                count *= size
            parts.append(flat[start:start + count].reshape(shape))
            start += count
        return parts


class _Available(_Shared):
    """torchmetrics' ``distributed_available_fn``: whether `compute` gathers."""

    def __init__(self, gather: bool) -> None:
        self._gather = gather

    def __call__(self) -> bool:
        return self._gather


class _Update:
    """Wraps a metric's ``update`` / ``forward``: `PerReplica` arguments (given in
    cross-replica context) are fed one local replica at a time; with a `lock` each call
    holds it and moves tensors to the device of `owner` (replica threads sharing one
    metric). A copy of the metric (``clone()``) gets a wrapper of its own method, sharing
    the lock."""

    def __init__(self, fn: Callable[..., Any], lock: _Lock | None = None,
                 owner: Any = None) -> None:
        self._fn = fn
        self._lock = lock
        self._owner = owner

    def _move(self, structure: Any) -> Any:
        if self._owner is None:
            return structure
        device = self._owner.device  # read now: the metric may have been moved since
        return nest.map_structure(
            lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf,
            structure)

    def _call(self, args: Any, kwargs: Any) -> Any:
        if self._lock is None:
            return self._fn(*args, **kwargs)
        with self._lock:
            return self._fn(*self._move(args), **self._move(kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = nest.flatten((args, kwargs))
        distributed = [leaf for leaf in leaves if isinstance(leaf, values.DistributedValues)]
        if not distributed:
            return self._call(args, kwargs)
        result = None
        for index in range(len(distributed[0].values)):
            result = self._call(values.local_component(args, index),
                                values.local_component(kwargs, index))
        return result


def _members(metric: Any, torchmetrics: Any) -> list[Any]:
    if isinstance(metric, torchmetrics.MetricCollection):
        return list(metric.values(copy_state=False))
    if isinstance(metric, torchmetrics.Metric):
        return [metric]
    raise TypeError(f"ts.metrics.sync(metric={metric!r}): expected a torchmetrics.Metric or "
                    "MetricCollection.")


def sync(metric: Any, strategy: AnyStrategy | None = None) -> Any:
    """Makes `metric` follow `strategy` (default: the current one, ``ts.get_strategy()``):
    updated inside ``strategy.run`` with each replica's rows (or in cross-replica context
    with the `PerReplica` results of ``run``), its ``compute()`` in cross-replica context
    gives the value over every replica's rows (see the module docstring for each strategy).
    Call it once, after creating the metric; returns `metric`, configured in place. Every
    replica computes the metric at the same point (with several processes, a collective).

    Raises:
      TypeError: `metric` is not a torchmetrics Metric or MetricCollection.
      NotImplementedError: a ParameterServerStrategy.
      ImportError: torchmetrics is not installed.
    """
    # torchmetrics is optional: only users of this function need it.
    import torchmetrics
    members = _members(metric, torchmetrics)
    strategy = get_strategy() if strategy is None else strategy
    # The strategy says how (StrategyExtended.metric_sync); a parameter-server strategy
    # raises NotImplementedError there, saying what to do instead.
    how = strategy.extended.metric_sync()
    gather = None if how.gather_over is None else _CommunicatorGather(how.gather_over)
    lock = _Lock() if how.serialize_updates else None
    if isinstance(metric, torchmetrics.MetricCollection):
        # The collection's own calls are made atomic too; its members move the tensors.
        _wrap(metric, lock, None)
    for member in members:
        member.dist_sync_fn = gather
        member.process_group = None
        member.distributed_available_fn = _Available(gather is not None)
        _wrap(member, lock, member if lock is not None else None)
    return metric


def _wrap(metric: Any, lock: _Lock | None, owner: Any) -> None:
    # Idempotent: a second `sync` replaces the first one's wrappers.
    update = metric.update
    metric.update = _Update(update._fn if isinstance(update, _Update) else update, lock,
                            owner)
    forward = metric.forward
    if isinstance(forward, _Update):
        forward = forward._fn
    # forward needs the lock only: it calls update, which moves the tensors.
    metric.forward = forward if lock is None else _Update(forward, lock)


class _Lock(_Shared):
    """A re-entrant lock (``forward`` calls ``update``) shared by a metric's wrappers."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return self._lock.__exit__(kind, value, traceback)


__all__ = ["sync"]
