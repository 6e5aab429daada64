"""The `StrategyExtended` of strategies whose process runs one replica, in two layers.

- `CommunicatorReplicaExtended`: a process that runs exactly one replica and reaches the
  others through a `Communicator`: its facts, ``run`` (the function called once, here),
  ``reduce`` / ``gather`` and the replica context's collectives as collectives of the
  communicator, and the input functions. The parameter-server chief is one (a world of one
  replica whose parameters live elsewhere).
- `SPMDExtended`: that, plus mirrored state, as DistributedDataParallel does: what the
  scope records is broadcast from replica 0, buffers are averaged after each step, and a
  gradient reducer sums gradients during backward. The default strategy,
  OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy, and ShardedStrategy
  (which shards parameters with FSDP2 instead of mirroring them).

A concrete strategy decides *where* its replica runs (its device, its process group: see
`torchstrategy.strategies.startup`) and hands a `Communicator`; everything else is here,
once.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch

from torchstrategy import context, mirroring, nest, ownership, values
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.reducer import GradientReducer
from torchstrategy.collectives.stats import ReductionStats
from torchstrategy.devices import parse_device
from torchstrategy.input.contexts import ValueContext
from torchstrategy.input.distributed_dataset import (DistributedDataset,
                                                     DistributedDatasetsFromFunction)
from torchstrategy.reduce_op import ReduceOp, as_reduce_op, check_mean_dtype
from torchstrategy.replica_context import ReplicaContext
from torchstrategy.strategies.base import Strategy, StrategyExtended


class CommunicatorReplicaExtended(StrategyExtended):
    """This process runs exactly one replica (replica `communicator.rank` of
    `communicator.world_size`); cross-replica operations are collectives of `communicator`.

    Guarantees: ``run`` calls the function once, on this replica, inside its replica
    context and device, then calls `synchronize_buffers`; ``reduce``, ``gather``,
    ``batch_reduce_to`` and the replica context's ``all_reduce`` / ``all_gather`` are
    collectives of the communicator (local, with no communication, in a world of one); the
    input functions give this replica its slice. What the scope records and how it is
    synchronised is the subclass's (`synchronize_mirrored_state`).

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
        `SPMDExtended` checks its first run)."""
        return contextlib.nullcontext()

    def call_for_each_replica(self, fn: Any, args: Any, kwargs: Any) -> Any:
        self.synchronize_mirrored_state()
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


class SPMDExtended(CommunicatorReplicaExtended):
    """One replica in this process, its state mirrored across the replicas as
    DistributedDataParallel's: `CommunicatorReplicaExtended` plus

    - the scope's recording (StrategyExtended's ``record_*``, into ``self._mirrored``),
      broadcast from replica 0 by `synchronize_mirrored_state` after the replicas compared
      its layout;
    - floating buffers averaged over the replicas after each step (`synchronize_buffers`);
    - with several replicas and `reduce_gradients`, a `GradientReducer` summing the
      gradients of the mirrored parameters during every ``backward()``;
    - ``adopt`` and a check, around the first multi-replica ``run``, that the model called
      there is mirrored (both where `records_in_scope`).

    Args:
      container / communicator / torch_device / place_in_scope: as for
        `CommunicatorReplicaExtended`.
      bucket_cap_bytes: the gradient reducer's largest bucket (None: 25 MiB).
      reduce_gradients: False for a strategy whose gradients are reduced another way
        (ShardedStrategy: FSDP2): no gradient reducer is ever built.

    Raises:
      ValueError: a bucket cap that is not positive, or one given with
        ``reduce_gradients=False``.
    """

    #: True where the scope's ``record_*`` methods record into ``self._mirrored`` and
    #: `synchronize_mirrored_state` broadcasts it, as here: then ``adopt`` replays that
    #: recording for a module built outside the scope, and the first multi-replica ``run``
    #: warns about parameters that are not mirrored. A subclass that records its own way
    #: sets it to False: adoption is refused (StrategyExtended's ``adopt``) and the first
    #: run is not checked, unless it overrides ``adopt`` / `_first_run_check` itself.
    records_in_scope: bool = True

    def __init__(self, container: Strategy, communicator: Communicator,
                 torch_device: torch.device | None, place_in_scope: bool = True,
                 bucket_cap_bytes: float | None = None, reduce_gradients: bool = True
                 ) -> None:
        if bucket_cap_bytes is not None and not bucket_cap_bytes > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got "
                             f"{bucket_cap_bytes / (1024 * 1024):g}.")
        if bucket_cap_bytes is not None and not reduce_gradients:
            raise ValueError(f"bucket_cap_bytes={bucket_cap_bytes:g} sizes the gradient "
                             "reducer's buckets, but reduce_gradients=False builds no "
                             "reducer: leave it None.")
        super().__init__(container, communicator, torch_device, place_in_scope)
        self._reducer: GradientReducer | None = None
        if reduce_gradients and communicator.world_size > 1:
            # The reducer takes the cap as given (a fraction of a MiB is a float of bytes).
            kwargs: dict[str, Any] = {} if bucket_cap_bytes is None else \
                {"bucket_cap_bytes": bucket_cap_bytes}
            self._reducer = GradientReducer(communicator, **kwargs)
        # Whether `_first_run_check` has passed (it wraps every run until one succeeds).
        self._first_run_checked = False

    @property
    def gradient_reducer(self) -> GradientReducer | None:
        """The `GradientReducer` summing gradients during backward (None with one
        replica, or without `reduce_gradients`): its ``bucket_sizes``,
        ``bucket_layout()``, ``is_bucket_view(p)``."""
        return self._reducer

    # -- running ---------------------------------------------------------------------------
    def _run_guard(self) -> ContextManager[Any]:
        if self._first_run_checked:
            return contextlib.nullcontext()
        return self._checking_first_run()

    @contextlib.contextmanager
    def _checking_first_run(self) -> Iterator[None]:
        with self._first_run_check():
            yield
        self._first_run_checked = True

    def _first_run_check(self) -> ContextManager[Any]:
        """What runs of the user's function are wrapped in until one returns: with several
        replicas where `records_in_scope`, a RuntimeWarning naming the parameters of the
        first module called that are not mirrored (`ownership.warn_if_unmirrored`);
        nothing otherwise. A subclass with its own notion of what is managed overrides
        it."""
        if self._comm.world_size > 1 and self.records_in_scope:
            return ownership.warn_if_unmirrored(self._container, self._mirrored.is_parameter)
        return contextlib.nullcontext()

    # -- the scope: record_parameter / record_buffer / record_variable are
    # StrategyExtended's (into self._mirrored) ------------------------------------------
    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> torch.nn.Module:
        """Replays the scope's recording for `module` (and `optimizer`) built outside it
        (`ownership.adopt`: a collective). Where not `records_in_scope`, refuses, saying to
        build the module in the scope."""
        if not self.records_in_scope:
            return super().adopt(module, optimizer)
        return ownership.adopt(self._container, module, optimizer)

    def synchronize_mirrored_state(self) -> None:
        """Broadcasts tensors recorded since the last call from replica 0 and gives new
        parameters to the gradient reducer. Every replica calls this at the same points
        (scope exit, the start of ``run``), so it is a collective only when needed.

        Before anything is broadcast, the replicas compare names, shapes and dtypes of
        what they recorded (as DDP verifies its parameters).

        Raises:
          ValueError: replicas that recorded different tensors, naming the first
            difference and the replicas.
        """
        labelled = self._mirrored.take_pending_labelled()
        if not labelled:
            return
        pending = [tensor for _, tensor in labelled]
        if self._comm.world_size > 1:
            mirroring.check_replicas_agree(self._comm, labelled)
            with torch.no_grad():
                self._comm.broadcast_(pending, src=0)
        if self._reducer is not None:
            self._reducer.add_parameters([t for t in pending
                                          if isinstance(t, torch.nn.Parameter)
                                          or self._mirrored.is_parameter(t)])

    def synchronize_buffers(self) -> None:
        """Buffers (BatchNorm statistics) become the mean over replicas after each step,
        as TensorFlow's MEAN-aggregated moving averages do, so every replica holds the same
        values."""
        if self._comm.world_size > 1:
            buffers = self._mirrored.floating_buffers()
            if buffers:
                with torch.no_grad():
                    # Their layout was compared when the scope was left: no check per step.
                    self._comm.all_reduce(buffers, ReduceOp.MEAN, inplace=True,
                                          check_layout=False)

    # -- variables: write_variable is StrategyExtended's (in place) -----------------------

    # -- optional capabilities -------------------------------------------------------------
    @property
    def backward_replicas_outside_run(self) -> int:
        """Every replica: the reducer's hooks sum gradients in any ``backward()``, inside
        ``run`` or not."""
        return self._comm.world_size

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self._reducer is None:
            yield
        else:
            with self._reducer.no_sync():
                yield

    def stats(self) -> ReductionStats:
        if self._reducer is None:
            return ReductionStats(num_parameters=0)
        return self._reducer.stats()


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
