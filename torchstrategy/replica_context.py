"""`ReplicaContext`: what code inside ``strategy.run`` can ask of its replica."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from torchstrategy import context, nest, values
from torchstrategy.communication_options import CommunicationOptions
from torchstrategy.reduce_op import ReduceOp
from torchstrategy.variables import Variable


def _is_variable(leaf: Any) -> bool:
    # A variable (a ts.Variable of any kind, or a module's parameter) is one object that
    # every replica shares, in TensorFlow's sense of a MirroredVariable: merge_fn must get
    # it to pass to extended.update / reduce_to, not a PerReplica of it.
    return isinstance(leaf, (Variable, torch.nn.Parameter))


def merge_arguments(structures: list[Any], replica_ids: tuple[int, ...],
                    num_replicas: int | None = None) -> Any:
    """The arguments `merge_fn` receives from ``merge_call``: `structures` holds one
    structure per local replica (the same layout in each), zipped leaf by leaf.

    A leaf that is a variable (``ts.Variable`` or ``torch.nn.Parameter``) and is the same
    object on every local replica is passed as that variable, as TensorFlow passes a
    MirroredVariable; every other non-None leaf becomes a `PerReplica` of the replicas'
    leaves. None leaves stay None.
    """
    flattened = [nest.flatten(s) for s in structures]
    spec = flattened[-1][1]
    merged: list[Any] = []
    for parts in zip(*(leaves for leaves, _ in flattened)):
        first = parts[0]
        if first is None:
            merged.append(None)
        elif _is_variable(first) and all(part is first for part in parts):
            merged.append(first)
        else:
            merged.append(values.PerReplica(tuple(parts), replica_ids, num_replicas))
    return nest.pack(spec, merged)


class ReplicaContext:
    """The context of one replica while ``strategy.run`` executes it.

    Obtained with ``ts.get_replica_context()``. Every collective here (`all_reduce`,
    `all_gather`, `merge_call`) must be called by every replica, in the same order, as with
    any SPMD collective; each is bounded by the strategy's timeout.
    """

    def __init__(self, strategy: context.AnyStrategy, replica_id_in_sync_group: int,
                 device: torch.device) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._device = device

    @property
    def strategy(self) -> context.AnyStrategy:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index in ``range(num_replicas_in_sync)`` (a Python int)."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def device(self) -> torch.device:
        """The `torch.device` this replica computes on."""
        return self._device

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return (self._device,)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                   options: CommunicationOptions | None = None) -> Any:
        """Reduces `value` (a tensor or nested structure of tensors) across replicas and
        returns the result, identical on every replica, on this replica's device.

        All tensors of a structure travel in one fused collective per dtype. `options`, a
        `ts.CommunicationOptions`, is honoured or refused by the strategy (see
        ``StrategyExtended.batch_reduce_to``).
        """
        return self._strategy.extended.replica_all_reduce(reduce_op, value, options)

    def all_gather(self, value: Any, axis: int,
                   options: CommunicationOptions | None = None) -> Any:
        """Concatenates `value` (tensor or structure) from every replica along `axis`, in
        replica order. Sizes along `axis` may differ between replicas. `options` as in
        `all_reduce`."""
        return self._strategy.extended.replica_all_gather(value, axis, options)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (),
                   kwargs: Mapping[str, Any] | None = None) -> Any:
        """Calls ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context.

        As in TensorFlow, the arguments reach `merge_fn` as distributed values (PerReplica)
        so that it can call ``strategy.reduce`` / ``strategy.extended.reduce_to`` on them,
        except variables (``ts.Variable``, parameters), which arrive as themselves, as a
        MirroredVariable does (TF's ``merge_fn(strategy, v, value)`` calling
        ``strategy.extended.update(v, ...)``); distributed values in its result are returned
        to the replica as local values.
        """
        ids = (self._replica_id,)
        args, kwargs = merge_arguments([(tuple(args), dict(kwargs or {}))], ids)
        with context.enter(self._strategy, None):
            result = merge_fn(self._strategy, *args, **kwargs)
        return values.local_component(result)

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
