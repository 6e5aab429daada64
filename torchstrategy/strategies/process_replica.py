"""`ProcessReplicaExtended`: the `StrategyExtended` of a process that is exactly one replica
and reaches the others through a `Communicator`: its facts, ``run`` (the function called
once, here), ``reduce`` / ``gather`` and the replica context's collectives as collectives of
the communicator, and the input functions.

Two kinds of strategy build on it: the data-parallel family
(`torchstrategy.strategies.data_parallel.DataParallelExtended`, whose parameters are kept
by a `ParameterHandling` component) and the parameter-server chief (a world of one replica
whose parameters live elsewhere). What the scope records, and how it settles, is theirs.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from torchstrategy import context, nest, values
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.devices import parse_device
from torchstrategy.input.contexts import ValueContext
from torchstrategy.input.distributed_dataset import (DistributedDataset,
                                                     DistributedDatasetsFromFunction)
from torchstrategy.reduce_op import ReduceOp, as_reduce_op, check_mean_dtype
from torchstrategy.replica_context import ReplicaContext
from torchstrategy.strategies.base import Strategy, StrategyExtended


class ProcessReplicaExtended(StrategyExtended):
    """This process runs exactly one replica (replica `communicator.rank` of
    `communicator.world_size`); cross-replica operations are collectives of `communicator`.

    Guarantees: ``run`` calls the function once, on this replica, inside its replica
    context and device, then calls `synchronize_buffers`; ``reduce``, ``gather``,
    ``batch_reduce_to`` and the replica context's ``all_reduce`` / ``all_gather`` are
    collectives of the communicator (local, with no communication, in a world of one); the
    input functions give this replica its slice. What the scope records and how it settles
    is the subclass's (`settle_recorded_state`).

    Args:
      container: the `Strategy` this belongs to.
      communicator: the replicas' `Communicator` (world size 1: nothing is communicated).
      torch_device: this replica's device; None places nothing (the default strategy).
      place_in_scope: whether ``scope()`` makes `torch_device` the default device (only
        for non-CPU devices: CPU is torch's default anyway).
    """

    def __init__(self, container: Strategy, communicator: Communicator,
                 torch_device: torch.device | None, place_in_scope: bool = True) -> None:
        super().__init__(container)
        self._comm = communicator
        self._torch_device = torch_device
        self._place_in_scope = place_in_scope and torch_device is not None \
            and torch_device.type != "cpu"

    # -- facts ---------------------------------------------------------------------------
    @property
    def replica_id(self) -> int:
        return self._comm.rank

    @property
    def num_replicas_in_sync(self) -> int:
        return self._comm.world_size

    @property
    def torch_device(self) -> torch.device | None:
        return self._torch_device

    @property
    def worker_devices(self) -> tuple[Any, ...]:
        return (self._torch_device or torch.device("cpu"),)

    @property
    def parameter_devices(self) -> tuple[Any, ...]:
        return self.worker_devices

    @property
    def communicator(self) -> Communicator:
        return self._comm

    # -- running ---------------------------------------------------------------------------
    def default_replica_context(self) -> ReplicaContext:
        return ReplicaContext(self._container, 0, self._torch_device or torch.device("cpu"))

    def _device_guard(self) -> ContextManager[Any]:
        return device_guard(self._torch_device)

    def _run_guard(self) -> ContextManager[Any]:
        """What the user's function runs inside, within its replica context (nothing here;
        `DataParallelExtended` checks its first run)."""
        return contextlib.nullcontext()

    def call_for_each_replica(self, fn: Any, args: Any, kwargs: Any) -> Any:
        self.settle_recorded_state()
        args = values.local_component(args)
        kwargs = values.local_component(kwargs)
        replica = ReplicaContext(self._container, self.replica_id,
                                 self._torch_device or torch.device("cpu"))
        with context.enter(self._container, replica), self._device_guard(), \
                self._run_guard():
            result = fn(*args, **kwargs)
        self.synchronize_buffers()
        return self.wrap(result)

    def wrap(self, structure: Any, kind: type = values.PerReplica) -> Any:
        """This replica's `structure` as ``run`` returns it: plain with one replica, else
        every leaf a distributed value (`kind`) holding this replica's component."""
        if self._comm.world_size == 1:
            return structure
        return values.wrap(structure, (self._comm.rank,), kind, self._comm.world_size)

    # -- cross-replica reductions ------------------------------------------------------
    def _local_tensors(self, value: Any, what: str) -> tuple[list[torch.Tensor], Any]:
        return nest.tensor_leaves(values.local_component(value), what)

    def reduce_across_replicas(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        op = as_reduce_op(reduce_op)
        tensors, spec = self._local_tensors(value, "reduce")
        if axis is None:
            return nest.pack(spec, self._comm.all_reduce(tensors, op))
        for index, t in enumerate(tensors):
            nest.check_axis(t, axis, index)
        sums = [t.sum(dim=axis) for t in tensors]
        if op is ReduceOp.SUM:
            return nest.pack(spec, self._comm.all_reduce(sums, op))
        # MEAN over the global batch: sum of local sums over the sum of local counts, so
        # replicas holding different numbers of rows (the uneven last batch) weigh right.
        counts = [torch.tensor(float(t.shape[axis]), dtype=s.dtype, device=s.device)
                  for t, s in zip(tensors, sums)]
        for s in sums:
            check_mean_dtype(op, s)
        reduced = self._comm.all_reduce(sums + counts, ReduceOp.SUM)
        n = len(sums)
        return nest.pack(spec, [s / c for s, c in zip(reduced[:n], reduced[n:])])

    def gather_across_replicas(self, value: Any, axis: int) -> Any:
        return self.replica_all_gather(value, axis)

    def local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, values.DistributedValues):
            return value.values
        return (values.local_component(value),)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any,
                        options: Any = None) -> list[Any]:
        op = as_reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        all_tensors, layout = [], []
        for value, destinations in pairs:
            tensors, spec = self._local_tensors(value, "batch_reduce_to")
            layout.append((len(tensors), spec, destinations))
            all_tensors += tensors
        reduced = self._comm.all_reduce(all_tensors, op, options=options)
        results, start = [], 0
        for count, spec, destinations in layout:
            device = destination_device(destinations)
            part = [t if device is None else t.to(device) for t in reduced[start:start + count]]
            start += count
            results.append(self.wrap(nest.pack(spec, part), values.Mirrored))
        return results

    # -- collectives in replica context -------------------------------------------------
    def replica_all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        op = as_reduce_op(reduce_op)
        tensors, spec = self._local_tensors(value, "all_reduce")
        return nest.pack(spec, self._comm.all_reduce(tensors, op, options=options))

    def replica_all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        tensors, spec = self._local_tensors(value, "all_gather")
        return nest.pack(spec, self._comm.all_gather(tensors, axis, options=options))

    # -- the scope -----------------------------------------------------------------------
    def scope_placement(self) -> Any:
        return placement_scope(self._torch_device if self._place_in_scope else None)

    # -- input -------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Any, options: Any) -> DistributedDataset:
        return DistributedDataset(self._container, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Any, options: Any
                                          ) -> DistributedDatasetsFromFunction:
        return DistributedDatasetsFromFunction(self._container, dataset_fn, options)

    def distribute_values_from_function(self, value_fn: Any) -> Any:
        value = value_fn(ValueContext(self.replica_id, self.num_replicas_in_sync))
        return self.wrap(value)


def device_guard(device: torch.device | None) -> ContextManager[Any]:
    """Inside, CUDA kernels launched without a device go to `device` when it is a CUDA
    device; nothing otherwise (None, the CPU)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def placement_scope(device: torch.device | None) -> Any:
    """What ``scope()`` makes the default device: `device`, unless it is None or the CPU
    (torch's default anyway)."""
    if device is not None and device.type != "cpu":
        return device
    return contextlib.nullcontext()


def destination_device(destinations: Any) -> torch.device | None:
    """The `torch.device` named by a ``reduce_to`` destination (None: stay where it is)."""
    if destinations is None:
        return None
    if isinstance(destinations, values.DistributedValues):
        destinations = destinations.values[0]
    if isinstance(destinations, torch.Tensor):
        return destinations.device
    if hasattr(destinations, "device") and isinstance(destinations.device, torch.device):
        return destinations.device
    return parse_device(destinations).torch_device
