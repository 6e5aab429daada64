"""Distributed values: `PerReplica` and `Mirrored`, as in tf.distribute.

In torchstrategy's SPMD model each process hosts one replica (per-host strategies host
several), so a distributed value holds the components of the replicas *this process* runs,
keyed by their replica ids. ``experimental_local_results`` returns them as a tuple.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from torchstrategy import nest



class DistributedValues:
    """Base class: one component per local replica.

    Args:
      values: the local replicas' components.
      replica_ids: their replica ids (default 0, 1, ...).
      num_replicas: how many replicas there are in all, when known (default: as many as
        `values` when no `replica_ids` are given, else unknown); only printing uses it.

    Attributes:
      values: tuple of the local replicas' components, in replica-id order.
      replica_ids: tuple of the replica ids those components belong to.
      num_replicas: the number of replicas in all (None: unknown).

    Printing shows what the value is and which replicas this process holds, e.g.
    ``PerReplica{replica 1 of 2 (this process): tensor(...)}``: in a strategy of several
    processes the other replicas' components live in the other processes.
    """

    _num_replicas: int | None = None   # subclasses that keep their components otherwise: unknown
    _values: tuple[Any, ...]
    _replica_ids: tuple[int, ...]

    def __init__(self, values: Iterable[Any], replica_ids: Iterable[int] | None = None,
                 num_replicas: int | None = None) -> None:
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component.")
        if replica_ids is None:
            replica_ids = tuple(range(len(values)))
            if num_replicas is None:
                num_replicas = len(values)
        replica_ids = tuple(replica_ids)
        if len(replica_ids) != len(values):
            raise ValueError(f"{len(values)} components but {len(replica_ids)} replica ids.")
        if num_replicas is not None and (isinstance(num_replicas, bool) or not isinstance(
                num_replicas, int) or num_replicas < len(values)):
            raise ValueError(f"num_replicas must be an int of at least {len(values)} (the "
                             f"components given), got {num_replicas!r}.")
        self._values = values
        self._replica_ids = replica_ids
        self._num_replicas = num_replicas

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    @property
    def replica_ids(self) -> tuple[int, ...]:
        return self._replica_ids

    @property
    def num_replicas(self) -> int | None:
        return self._num_replicas

    def __repr__(self) -> str:
        total = self._num_replicas
        of = "" if total is None else f" of {total}"
        # Components of other replicas live elsewhere (other processes) unless all are here.
        here = " (this process)" if total is None or len(self._values) < total else ""
        body = ", ".join(f"replica {r}{of}{here}: {v!r}"
                         for r, v in zip(self._replica_ids, self._values))
        return f"{type(self).__name__}{{{body}}}"

    __str__ = __repr__


class PerReplica(DistributedValues):
    """Values that may differ between replicas (losses, batches, outputs of `run`)."""


class Mirrored(DistributedValues):
    """Values that are the same on every replica (results of all-reduce, mirrored state)."""


def wrap(structure: Any, replica_ids: Sequence[int],
         kind: type[DistributedValues] = PerReplica, num_replicas: int | None = None) -> Any:
    """Wraps every non-None leaf of a structure computed by the local replica(s).

    `structure` is the result of one local replica when ``len(replica_ids) == 1``; with
    several local replicas pass a list of structures (one per replica) and they are zipped.
    `num_replicas`: the number of replicas in all, when known (for printing).
    """
    if len(replica_ids) == 1:
        return nest.map_structure(
            lambda leaf: leaf if leaf is None else kind((leaf,), replica_ids, num_replicas),
            structure)
    flattened = [nest.flatten(s) for s in structure]
    leaves_per_replica = [leaves for leaves, _ in flattened]
    spec = flattened[-1][1]
    zipped = [None if parts[0] is None else kind(parts, replica_ids, num_replicas)
              for parts in zip(*leaves_per_replica)]
    return nest.pack(spec, zipped)


def local_component(structure: Any, index: int = 0) -> Any:
    """Replaces every distributed value in `structure` by its `index`-th local component.

    Non-distributed leaves are returned unchanged: they are the same for every replica.
    """
    def pick(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            if index >= len(leaf.values):
                raise ValueError(f"{type(leaf).__name__} has {len(leaf.values)} local "
                                 f"component(s); no component {index}.")
            return leaf.values[index]
        return leaf
    return nest.map_structure(pick, structure)


def local_results(value: Any, num_local: int = 1,
                  component: Callable[[DistributedValues, int], Any] | None = None
                  ) -> tuple[Any, ...]:
    """The local components of `value`, as a tuple (``experimental_local_results``).

    A distributed value gives its components; a structure holding distributed values gives
    one structure per local replica (`num_local` of them), each distributed leaf replaced
    by ``component(leaf, index)`` (default: its `index`-th component, as `local_component`
    picks it); anything else is the same for every replica: a 1-tuple.
    """
    if isinstance(value, DistributedValues):
        return value.values
    leaves, _ = nest.flatten(value)
    if not any(isinstance(leaf, DistributedValues) for leaf in leaves):
        return (value,)
    if component is None:
        return tuple(local_component(value, index) for index in range(num_local))
    return tuple(nest.map_structure(
        lambda leaf, index=index: component(leaf, index)
        if isinstance(leaf, DistributedValues) else leaf, value)
        for index in range(num_local))


def per_replica(parts: Iterable[Any], kind: type[DistributedValues] = PerReplica) -> Any:
    """The value of per-replica `parts` (one structure per local replica, replica ids 0,
    1, ...): the part itself with one replica, else every leaf a `kind` (see `wrap`)."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    return wrap(parts, tuple(range(len(parts))), kind, len(parts))
