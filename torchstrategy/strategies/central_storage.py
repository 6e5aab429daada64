"""`CentralStorageStrategy`: parameters on one device, the step replicated in threads
(tf.distribute.experimental.CentralStorageStrategy).

One process. Parameters, buffers and optimizer state live once, on the *parameter device*;
``strategy.run(fn)`` runs `fn` once per *compute device*, each replica in its own thread,
reading the central parameters (see `replica_copies`). Gradients are summed over replicas
onto the parameter device when ``backward()`` ends, and ``optimizer.step()`` updates the
central parameters once.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence

import torch

from torchstrategy import context, mirroring, nest, values
from torchstrategy.aggregation import VariableAggregation
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import NcclAllReduce
from torchstrategy.communication_options import CommunicationOptions
from torchstrategy.devices import default_local_devices, parse_device, parse_devices
from torchstrategy.input.contexts import InputContext, InputOptions, ValueContext
from torchstrategy.input.per_host import PerHostDataset, PerHostDatasetsFromFunction
from torchstrategy.launch import world as world_lib
from torchstrategy.reduce_op import ReduceOp, as_reduce_op, check_mean_dtype
from torchstrategy.replica_context import ReplicaContext, merge_arguments
from torchstrategy.strategies import replica_copies
from torchstrategy.strategies.base import MetricSync, Strategy, StrategyExtended, logger
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy.strategies.replica_threads import ReplicaGroup, run_replicas
from torchstrategy.strategies.process_replica import (destination_device, device_guard,
                                                      placement_scope)
from torchstrategy.variables import SyncOnReadVariable, Variable


def _sum_in_order(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total: torch.Tensor | None = None
    for t in tensors:
        t = t.to(device)
        total = t.clone() if total is None else total.add_(t)
    if total is None:
        raise ValueError("no replica gave a value to reduce")
    return total


def _reduce_components(op: ReduceOp, components: Sequence[torch.Tensor],
                       device: torch.device) -> torch.Tensor:
    """SUM or MEAN of per-replica tensors, added in replica order on `device`."""
    total = _sum_in_order(components, device)
    if op is ReduceOp.MEAN:
        check_mean_dtype(op, total)
        total = total / len(components)
    return total


class _ThreadCommunicator:
    """The `Communicator` interface among the replica threads of one run.

    Inside a replica thread every operation meets the other replicas (a rendezvous of the
    run's `ReplicaGroup`); in cross-replica code the process holds one value and every
    operation is local.
    """

    def __init__(self, parameter_device: torch.device) -> None:
        self.device = parameter_device
        self.cross_device_ops = NcclAllReduce()
        # Cross-replica code: the process holds one value, a world of one.
        self._alone = Communicator(None, 0, 1, parameter_device, self.cross_device_ops)
        # Communicator's ``diagnose`` (who is to blame for a failed collective): the replicas
        # are threads of this process, and a rendezvous that times out names them itself.
        self.diagnose: Callable[[int], str] | None = None

    @staticmethod
    def _replica() -> replica_copies.ReplicaCopies | None:
        return replica_copies.current_replica()

    @property
    def rank(self) -> int:
        """This thread's replica id (0 in cross-replica code)."""
        replica = self._replica()
        return 0 if replica is None else replica.replica_id

    @property
    def world_size(self) -> int:
        """The replicas of the run (1 in cross-replica code)."""
        replica = self._replica()
        return 1 if replica is None else len(replica.session.replicas)

    @staticmethod
    def _meet(replica: replica_copies.ReplicaCopies, what: str, value: Any,
              action: Callable[[list[Any]], Any] | None,
              timeout_seconds: float | None = None) -> Any:
        """A rendezvous of `replica` (this thread's `ReplicaCopies`) with the others, waiting
        at most `timeout_seconds` (None: the strategy's); the action sees the central
        tensors."""
        if action is None:
            return replica.session.group.rendezvous(replica.replica_id, what, value,
                                                    timeout_seconds=timeout_seconds)
        act = action

        def in_central_view(contributions: list[Any]) -> Any:
            with replica.suspended():
                return act(contributions)
        return replica.session.group.rendezvous(replica.replica_id, what, value,
                                                in_central_view, timeout_seconds)

    def all_reduce(self, tensors: Iterable[torch.Tensor], op: ReduceOp | str,
                   inplace: bool = False, options: CommunicationOptions | None = None
                   ) -> list[torch.Tensor]:
        """`Communicator.all_reduce` among the replica threads (local outside a run);
        `options` as `_thread_timeout` takes them."""
        timeout = _thread_timeout(options, "all_reduce")
        op = as_reduce_op(op)
        tensors = list(tensors)
        replica = self._replica()
        if replica is None:
            return self._alone.all_reduce(tensors, op, inplace)
        reduced = self._meet(replica, "all_reduce", tensors, lambda parts: [
            _reduce_components(op, [p[i] for p in parts], self.device)
            for i in range(len(tensors))], timeout)
        results = [r.to(t.device, copy=True).to(t.dtype) for r, t in zip(reduced, tensors)]
        if inplace:
            with torch.no_grad():
                for t, r in zip(tensors, results):
                    t.copy_(r)
            return tensors
        return results

    def all_gather(self, tensors: Iterable[torch.Tensor], axis: int,
                   options: CommunicationOptions | None = None) -> list[torch.Tensor]:
        """`Communicator.all_gather` among the replica threads (local outside a run);
        `options` as `_thread_timeout` takes them."""
        timeout = _thread_timeout(options, "all_gather")
        tensors = list(tensors)
        replica = self._replica()
        if replica is None:
            return [t.clone() for t in tensors]
        for index, t in enumerate(tensors):
            nest.check_gatherable(t, axis, index)
        gathered = self._meet(replica, "all_gather", tensors, lambda parts: [
            torch.cat([p[i].to(self.device) for p in parts], dim=axis)
            for i in range(len(tensors))], timeout)
        return [g.to(t.device, copy=True) for g, t in zip(gathered, tensors)]

    def broadcast_(self, tensors: Iterable[torch.Tensor], src: int = 0) -> list[torch.Tensor]:
        """`Communicator.broadcast_` among the replica threads (nothing outside a run)."""
        tensors = list(tensors)
        replica = self._replica()
        if replica is None:
            return tensors
        source = self._meet(replica, "broadcast", tensors, lambda parts: parts[src])
        with torch.no_grad():
            for t, s in zip(tensors, source):
                if t is not s:
                    t.copy_(s.to(t.device))
        return tensors

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Replica `src`'s `obj` on every replica thread (`obj` itself outside a run)."""
        replica = self._replica()
        if replica is None:
            return obj
        return self._meet(replica, "broadcast", obj, lambda parts: parts[src])

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every replica thread's `obj`, in replica order (`[obj]` outside a run: one
        process is the whole world, which is what a checkpoint's peers see)."""
        replica = self._replica()
        if replica is None:
            return [obj]
        return self._meet(replica, "gather_objects", obj, lambda parts: list(parts))

    def barrier(self) -> None:
        """Waits for every replica thread (nothing outside a run)."""
        replica = self._replica()
        if replica is not None:
            self._meet(replica, "barrier", None, None)


class _CentralReplicaContext(ReplicaContext):
    """A replica's context: `all_reduce` / `all_gather` meet the other replica threads;
    `merge_call` runs `merge_fn` once for all replicas, as in TensorFlow.

    Attributes:
      copies: the replica's `replica_copies.ReplicaCopies` (what
        `replica_copies.current_replica` returns while this context is the current one).
    """

    def __init__(self, strategy: Strategy, replica_id: int, device: torch.device,
                 copies: replica_copies.ReplicaCopies) -> None:
        super().__init__(strategy, replica_id, device)
        self.copies = copies

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (),
                   kwargs: Mapping[str, Any] | None = None) -> Any:
        """Calls ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context,
        with every replica's arguments as `PerReplica` values (a variable they all share as
        itself); each replica gets the result (its own component of distributed values in
        it)."""
        kwargs = kwargs or {}
        replica = self.copies
        ids = tuple(range(self.num_replicas_in_sync))

        def merge(contributions: list[Any]) -> Any:
            # Variables shared by every replica arrive as themselves (as in TensorFlow).
            per_replica_args, per_replica_kwargs = merge_arguments(contributions, ids,
                                                                   len(ids))
            with replica.suspended(), context.enter(self._strategy, None):
                return merge_fn(self._strategy, *per_replica_args, **per_replica_kwargs)

        result = replica.session.group.rendezvous(self._replica_id, "merge_call",
                                                  (tuple(args), kwargs), merge)
        return values.local_component(result, self._replica_id)


class CentralStorageExtended(StrategyExtended):
    """`StrategyExtended` of a `CentralStorageStrategy`: one process, one copy of every
    parameter on the parameter device, N replicas running in threads (see the module
    docstring).

    Facts: `replica_id` is 0 (the process is the chief), `torch_device` and
    `parameter_devices` are the parameter device, `worker_devices` the compute devices,
    `communicator` meets the replica threads of a ``run`` (and is local outside one).
    """

    def __init__(self, container: Strategy, compute_devices: Sequence[torch.device],
                 parameter_device: torch.device, timeout_seconds: float) -> None:
        super().__init__(container)
        self._compute_devices = tuple(compute_devices)
        self._parameter_device = parameter_device
        self._timeout = timeout_seconds
        self._threads = _ThreadCommunicator(parameter_device)
        # What the scope recorded: the central parameters and buffers (one copy each).
        self._recorded = mirroring.MirroredState()
        # One replica computing where the parameters are needs no thread and no copies.
        self._threaded = len(compute_devices) > 1 or compute_devices[0] != parameter_device

    # -- facts ---------------------------------------------------------------------------
    @property
    def replica_id(self) -> int:
        return 0

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._compute_devices)

    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        return self._compute_devices

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        return (self._parameter_device,)

    @property
    def torch_device(self) -> torch.device:
        """The parameter device: where modules and variables created in the scope live."""
        return self._parameter_device

    @property
    def communicator(self) -> _ThreadCommunicator:  # type: ignore[override]
        # Duck-types the Communicator collectives a run's replica threads need.
        return self._threads

    def metric_sync(self) -> MetricSync:
        """Updates serialised (the replica threads share the metric); nothing to gather:
        this process holds every replica's updates."""
        return MetricSync(gather_over=None, serialize_updates=True)

    # -- running ---------------------------------------------------------------------------
    def default_replica_context(self) -> ReplicaContext:
        return ReplicaContext(self._container, 0, self._parameter_device)

    def call_for_each_replica(self, fn: Callable[..., Any], args: Sequence[Any],
                              kwargs: Mapping[str, Any]) -> Any:
        """Runs `fn` once per compute device, each in its own thread and replica context,
        and waits for all of them (in this thread, without copies, when the only replica
        computes on the parameter device).

        Inside `fn`, the central parameters read as the replica's copies;
        ``loss.backward()`` ends with the SUM of all replicas' gradients in ``param.grad``;
        ``optimizer.step()`` updates the central parameters once. Every replica must reach
        the same synchronisation points (backward, optimizer.step, all_reduce, merge_call)
        in the same order.

        Raises:
          The first failing replica's exception; the other replicas are released from any
          synchronisation point and stop. `CollectiveError` when a replica does not reach a
          synchronisation point within the timeout.
        """
        self.settle_recorded_state()
        if not self._threaded:
            device = self._parameter_device
            replica = ReplicaContext(self._container, 0, device)
            with context.enter(self._container, replica), device_guard(device):
                return fn(*values.local_component(args), **values.local_component(kwargs))
        devices = self._compute_devices
        n = len(devices)
        group = ReplicaGroup(n, self._timeout)
        session = replica_copies.RunSession(group, self._recorded.parameters,
                                            self._recorded.buffers(), devices,
                                           self._parameter_device)
        session.strategy = self._container

        def replica_fn(r: int) -> Any:
            replica = _CentralReplicaContext(self._container, r, devices[r],
                                             session.replicas[r])
            with context.enter(self._container, replica), device_guard(devices[r]), \
                    session.replicas[r]:
                return fn(*values.local_component(args, r),
                          **values.local_component(kwargs, r))

        try:
            results = run_replicas(group, replica_fn)
        finally:
            session.close()
        session.write_back()
        return values.per_replica(results)

    # -- cross-replica reductions (one process holds every replica's value) ---------------
    def _components(self, value: Any) -> tuple[list[torch.Tensor], bool]:
        """(components, distributed?) of one leaf, on the parameter device."""
        if isinstance(value, values.DistributedValues):
            return [v.to(self._parameter_device) for v in value.values], True
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        return [value.to(self._parameter_device)], False

    def reduce_across_replicas(self, reduce_op: ReduceOp | str, value: Any,
                               axis: int | None) -> Any:
        """The reduction of the replicas' components, added in replica order on the
        parameter device."""
        op = as_reduce_op(reduce_op)
        leaves, spec = nest.flatten(value)
        out = []
        for index, leaf in enumerate(leaves):
            parts, distributed = self._components(leaf)
            if not distributed and op is ReduceOp.SUM and self.num_replicas_in_sync > 1:
                raise ValueError(
                    f"Leaf {index} is a plain tensor, not a per-replica value: under "
                    "CentralStorageStrategy a tensor outside run is one value for all "
                    "replicas, so it cannot be SUM-reduced across them (TensorFlow raises "
                    "too). Reduce the PerReplica returned by strategy.run.")
            if axis is None:
                out.append(_reduce_components(op, parts, self._parameter_device)
                           if distributed else parts[0])
                continue
            for t in parts:
                nest.check_axis(t, axis, index)
            total = _sum_in_order([t.sum(dim=axis) for t in parts], self._parameter_device)
            if op is ReduceOp.MEAN:
                check_mean_dtype(op, total)
                total = total / sum(t.shape[axis] for t in parts)
            out.append(total)
        return nest.pack(spec, out)

    def gather_across_replicas(self, value: Any, axis: int) -> Any:
        """The replicas' components concatenated along `axis`, in replica order, on the
        parameter device (sizes along `axis` may differ)."""
        leaves, spec = nest.flatten(value)
        out = []
        for index, leaf in enumerate(leaves):
            parts, _ = self._components(leaf)
            nest.check_gatherable(parts[0], axis, index)
            out.append(torch.cat(parts, dim=axis))
        return nest.pack(spec, out)

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """Every replica's component (this process runs them all); a structure gives one
        structure per replica."""
        return values.local_results(value, self.num_replicas_in_sync)

    def batch_reduce_to(self, reduce_op: ReduceOp | str,
                        value_destination_pairs: Iterable[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list[Any]:
        """Reduces each value across replicas onto its destination (default: the
        parameter device); returns plain tensors (the process holds one copy)."""
        _thread_timeout(options, "batch_reduce_to / reduce_to")  # no wait: nothing to bound
        results = []
        for value, destinations in value_destination_pairs:
            device = destination_device(destinations) or self._parameter_device
            reduced = self.reduce_across_replicas(reduce_op, value, None)
            results.append(nest.map_structure(lambda t: t.to(device), reduced))
        return results

    # -- collectives in replica context (a rendezvous of the replica threads) -------------
    def _local_tensors(self, value: Any, what: str) -> tuple[list[torch.Tensor], Any]:
        replica = replica_copies.current_replica()
        index = 0 if replica is None else replica.replica_id
        return nest.tensor_leaves(values.local_component(value, index), what)

    def replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                           options: CommunicationOptions | None = None) -> Any:
        tensors, spec = self._local_tensors(value, "all_reduce")
        return nest.pack(spec, self._threads.all_reduce(tensors, as_reduce_op(reduce_op),
                                                        options=options))

    def replica_all_gather(self, value: Any, axis: int,
                           options: CommunicationOptions | None = None) -> Any:
        tensors, spec = self._local_tensors(value, "all_gather")
        return nest.pack(spec, self._threads.all_gather(tensors, axis, options=options))

    # -- the scope: one copy, on the parameter device ---------------------------------------
    def scope_placement(self) -> ContextManager[Any]:
        return placement_scope(self._parameter_device)

    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        self._recorded.add_parameter(param, f"{type(module).__name__}.{name}")

    def record_buffer(self, module: torch.nn.Module, name: str) -> None:
        self._recorded.add_buffer(module, name)

    def record_variable(self, variable: Variable) -> None:
        self._recorded.add_tensor(variable.tensor, variable.trainable,
                                  f"Variable {variable.name!r}")

    def recorded_in_scope(self, tensor: torch.Tensor) -> bool:
        return self._recorded.is_parameter(tensor) or any(
            b is tensor for b in self._recorded.buffers())

    def settle_recorded_state(self) -> None:
        """Takes what the scope recorded into the replicas' copies: there is one copy of
        each tensor, so nothing is sent anywhere (``run`` copies the parameters and buffers
        it finds recorded to each compute device)."""
        self._recorded.take_pending()

    # -- variables ---------------------------------------------------------------------
    def check_variable(self, variable: Variable) -> None:
        if self._threaded and isinstance(variable, SyncOnReadVariable):
            raise ValueError("CentralStorageStrategy does not support SyncOnReadVariable "
                             "(synchronization=ON_READ) yet: return the per-replica values "
                             "from strategy.run and combine them with strategy.reduce.")

    def write_variable(self, variable: Variable, new_value: torch.Tensor) -> None:
        """Writes the central tensor; inside ``run`` the replicas' (aggregated, hence equal)
        values are written once, when every replica has arrived."""
        replica = replica_copies.current_replica()
        if replica is None or replica.session.strategy is not self._container:
            return super().write_variable(variable, new_value)
        if variable.aggregation is VariableAggregation.NONE and self.num_replicas_in_sync > 1:
            raise ValueError(
                f"Variable {variable.name!r} is updated inside strategy.run, but its "
                "aggregation is NONE: under CentralStorageStrategy the variable exists once, "
                "so the replicas' updates must be combined. Create it with aggregation="
                "ts.VariableAggregation.SUM, MEAN or ONLY_FIRST_REPLICA.")

        tensor = variable.tensor

        def write_once(new_values: list[Any]) -> None:     # aggregated: every replica holds the same value
            with replica.suspended(), torch.no_grad():
                tensor.copy_(torch.as_tensor(new_values[0], dtype=tensor.dtype)
                             .to(tensor.device))
        replica.session.group.rendezvous(replica.replica_id, "a variable update",
                                         new_value, write_once)

    # -- input -------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Iterable[Any], options: InputOptions | None
                           ) -> PerHostDataset:
        """Splits each *global* batch along dim 0 over the replicas (see
        `torchstrategy.input.per_host.PerHostDataset`)."""
        return PerHostDataset(dataset, self._compute_devices, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any],
                                          options: InputOptions | None
                                          ) -> PerHostDatasetsFromFunction:
        """Calls ``dataset_fn(ts.InputContext)`` once; its per-replica batches go to
        replicas 0, 1, ... in turn (see `torchstrategy.input.per_host`)."""
        return PerHostDatasetsFromFunction(dataset_fn, self._compute_devices, options)

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        n = self.num_replicas_in_sync
        return values.per_replica(value_fn(ValueContext(r, n)) for r in range(n))



def _thread_timeout(options: CommunicationOptions | None, what: str) -> float | None:
    """How long a collective among the replica threads may wait, from its `options`
    (TensorFlow calls them hints): `timeout_seconds` is honoured (None: the strategy's);
    `bytes_per_pack` and `implementation` are accepted and have nothing to act on (the
    threads combine their values in memory: no transfer to pack, no library to choose);
    `compression`, which would round the values, is refused.

    Raises:
      TypeError: `options` is not a `CommunicationOptions`.
      ValueError: a `compression`.
    """
    if options is None:
        return None
    if not isinstance(options, CommunicationOptions):
        raise TypeError(f"options must be a ts.CommunicationOptions (or None), got "
                        f"{options!r}.")
    if options.compression is not None:
        raise ValueError(
            f"CentralStorageStrategy cannot honour compression={options.compression!r} in "
            f"{what}: its replicas are threads of one process that combine their values in "
            "memory, exactly; nothing is sent to compress. Leave compression=None.")
    return options.timeout_seconds

def _choose_devices(compute_devices: Any, parameter_device: Any) -> tuple[Any, Any]:
    compute = parse_devices(compute_devices) if compute_devices is not None \
        else default_local_devices()
    if parameter_device is not None:
        parameter = parse_device(parameter_device).torch_device
    elif len(compute) == 1 and compute[0].kind == "cuda":
        parameter = compute[0].torch_device        # one GPU: everything on it
    else:
        parameter = torch.device("cpu")            # several devices: the CPU holds them
    return compute, parameter


class CentralStorageStrategy(Strategy):
    """Synchronous training on the devices of one machine, parameters stored once.

    Parameters, buffers and optimizer state live on one *parameter device*; the step runs
    once per *compute device*, each replica in a thread of this process reading the central
    parameters. Inside ``run``, ``loss.backward()`` leaves in ``param.grad`` the SUM of
    every replica's gradients (scale the loss with ``ts.compute_average_loss``), and
    ``optimizer.step()`` updates the central parameters once; N replicas then train exactly
    like one device on the global batch.

    Args:
      compute_devices: the replicas' devices, e.g. ``["cuda:0", "cuda:1"]`` or
        ``["cpu:0", "cpu:1"]`` (two replicas on the CPU). None: every local GPU, or one CPU
        replica when there is none.
      parameter_device: where the parameters live. None: the GPU when there is exactly one
        compute GPU, else the CPU.
      timeout_seconds: bound on every rendezvous of the replica threads (default
        $TORCHSTRATEGY_TIMEOUT_SECONDS or 30 minutes).

    Raises:
      ValueError: malformed, duplicate or mixed CPU/CUDA compute devices.
      RuntimeError: CUDA devices without CUDA.
    """

    #: Its replicas are threads of one process sharing the user's objects.
    CAPABILITIES = Capabilities(one_replica_per_process=False, replicas_are_threads=True)

    def __init__(self, compute_devices: Sequence[str | torch.device] | None = None,
                 parameter_device: str | torch.device | None = None, *,
                 timeout_seconds: float | None = None) -> None:
        compute, parameter = _choose_devices(compute_devices, parameter_device)
        timeout = world_lib.timeout_seconds(timeout_seconds)
        super().__init__(CentralStorageExtended(self, [d.torch_device for d in compute],
                                                parameter, timeout))
        self._device_names = tuple(d.name for d in compute)
        replica_copies.install_optimizer_hooks()
        logger.info(f"CentralStorageStrategy with {len(compute)} replica(s) on "
                    f"{self._device_names}, parameters on {parameter}")

    def __repr__(self) -> str:
        return (f"CentralStorageStrategy(compute_devices={list(self._device_names)}, "
                f"parameter_device={str(self._extended.torch_device)!r})")
