"""`TPUStrategy`: synchronous data parallelism over every XLA device with torch_xla's SPMD.

One process per host drives all of its XLA devices. The training step is traced once, over
the whole global batch, and XLA partitions it: parameters are replicated on every device,
each batch is split along dim 0 (each device holding its rows), and XLA inserts the
cross-device sums the math needs. The step therefore computes exactly what one device would
compute on the global batch: with the loss scaled by ``ts.compute_average_loss`` (the global
batch size), each parameter's ``.grad`` is the *sum* over replicas of their gradients,
TensorFlow's semantics, and training equals single-device training on the global batch.

Semantics that follow from tracing one program for all replicas:
- Inside ``run``, tensors are global: a batch has the global batch's rows, and a loss
  computed from it already covers every replica. ``ts.get_replica_context().all_reduce`` and
  ``all_gather`` therefore return their argument unchanged.
- ``run`` returns `GlobalValue`s. ``reduce(op, value, axis=None)`` returns the global value
  (the step already combined every replica), so ``reduce(SUM, ...)`` of a loss scaled by
  ``compute_average_loss`` is the global mean loss, as under MirroredStrategy; with `axis`,
  SUM / MEAN run along that axis over the whole global batch.
- ``experimental_local_results`` gives each local device's piece (its rows, or its copy).
- BatchNorm statistics are those of the global batch (like SyncBatchNorm).

torch_xla is imported when a TPUStrategy is created, never by ``import torchstrategy``.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence
import torch

from torchstrategy import _compat, context, mirroring, nest, runtime, values
from torchstrategy.cluster_resolver.tpu import TPUClusterResolver
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import NcclAllReduce
from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.communication_options import CommunicationOptions, require_default_options
from torchstrategy.input.contexts import InputContext, InputOptions, ValueContext
from torchstrategy.launch import world as world_lib
from torchstrategy.reduce_op import ReduceOp, as_mean_input, as_reduce_op
from torchstrategy.replica_context import ReplicaContext
from torchstrategy.run_options import RunOptions, check_run_options
from torchstrategy.strategies.base import MetricSync, Strategy, StrategyExtended, logger
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy.strategies.process_replica import destination_device
from torchstrategy.variables import Variable
from torchstrategy.xla import require_torch_xla
from torchstrategy.xla.input import TPUDistributedDataset, TPUDistributedDatasetsFromFunction
from torchstrategy.xla.mesh import DataMesh, is_xla
from torchstrategy.xla.values import GlobalValue, device_ordinal


class TPUExtended(StrategyExtended):
    """TPUStrategy's extended API: the mesh, the step counter, global values.

    Attributes:
      mesh: the `torchstrategy.xla.mesh.DataMesh` (all XLA devices on the "data" axis).
      steps_per_execution: steps traced into one XLA execution.
    """

    def __init__(self, container: Strategy, mesh: DataMesh, communicator: Communicator,
                 steps_per_execution: int) -> None:
        super().__init__(container)
        # What the scope recorded: replicated over the mesh, identical on every host.
        self._recorded = mirroring.MirroredState()
        self._comm = communicator
        self.mesh = mesh
        self.steps_per_execution = steps_per_execution
        self._pending_steps = 0

    # -- facts ---------------------------------------------------------------------------
    @property
    def replica_id(self) -> int:
        """The id of the first replica (device) this process drives: 0 on host 0."""
        return self.mesh.process_index * self.mesh.num_local_devices

    @property
    def num_replicas_in_sync(self) -> int:
        return self.mesh.num_devices

    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        return (self.mesh.device,)

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        """The XLA device parameters are replicated over (every device holds a copy)."""
        return (self.mesh.device,)

    @property
    def torch_device(self) -> torch.device:
        """torch_xla's SPMD device: tensors on it are global, placed over the whole mesh."""
        return self.mesh.device

    @property
    def communicator(self) -> Communicator:
        """Host-side collectives among the hosts' processes (checkpoint barriers, seeds);
        the devices' collectives are inside the XLA program."""
        return self._comm

    @property
    def experimental_require_static_shapes(self) -> bool:
        return True  # a new batch shape is a new XLA compilation

    def metric_sync(self) -> MetricSync:
        """Nothing to gather or lock: the step is one SPMD program over the global batch,
        so a metric updated inside ``run`` already sees every replica's rows, on every host
        (a process-group gather would count each row once per host)."""
        return MetricSync()

    @property
    def pending_steps(self) -> int:
        """Steps traced since the graph was last cut (0 right after an execution
        started)."""
        return self._pending_steps

    # -- running ---------------------------------------------------------------------------
    def default_replica_context(self) -> ReplicaContext:
        return self._replica_context()

    def _replica_context(self) -> ReplicaContext:
        # One traced program stands for every replica at once, seeing global tensors (see
        # the module docstring): replica 0, whose all_reduce / all_gather return their
        # argument (`replica_all_reduce`).
        return ReplicaContext(self._container, 0, self.mesh.device)

    def check_run_options(self, options: RunOptions | None) -> RunOptions:
        """Refuses what torch_xla cannot honour. ``experimental_xla_options``: torch_xla has
        no per-execution compiler options (XLA flags are read once, from $XLA_FLAGS, when
        its runtime starts), so it is refused. ``experimental_enable_dynamic_batch_size=
        False`` is honoured: torch_xla always compiles for the static shapes it traces."""
        return check_run_options(options, "TPUStrategy", compiles_with_xla=True)

    def call_for_each_replica(self, fn: Callable[..., Any], args: Sequence[Any],
                              kwargs: Mapping[str, Any]) -> Any:
        """Traces ``fn(*args, **kwargs)`` once for all replicas, over global tensors.

        `GlobalValue` arguments (batches from the distributed dataset) are passed as their
        global tensors, host tensors are copied to every device. Inside `fn`,
        ``loss.backward()`` leaves in each parameter's ``.grad`` the sum of the replicas'
        gradients (the gradient over the global batch of a loss scaled by
        ``ts.compute_average_loss``). Every `steps_per_execution` calls the traced steps
        start executing on the devices. Returns `fn`'s result with every XLA tensor wrapped
        in a `GlobalValue`.
        """
        self.settle_recorded_state()
        args = self.to_program_input(args)
        kwargs = self.to_program_input(kwargs)
        with context.enter(self._container, self._replica_context()):
            result = fn(*args, **kwargs)
        self.synchronize_buffers()
        return self.wrap_global(result)

    def synchronize_buffers(self) -> None:
        """The end of a step. Buffers (BatchNorm statistics) are global tensors, identical
        on every device by construction (those of the global batch); what a step boundary
        does here is cut the traced graph every `steps_per_execution` steps: XLA then
        compiles (once) and runs those steps as one execution, asynchronously. ``run`` calls
        it after each step, an adapter driving its own loop after each optimizer step."""
        self._pending_steps += 1
        if self._pending_steps >= self.steps_per_execution:
            self.flush()

    def flush(self) -> None:
        """Starts the execution of every step traced so far (asynchronous)."""
        import torch_xla  # optional dependency: present whenever a TPUStrategy exists

        torch_xla.sync()
        self._pending_steps = 0

    def materialize(self) -> None:
        """Runs everything traced so far and waits for the devices."""
        import torch_xla.core.xla_model as xm  # optional dependency (see flush)

        self.flush()
        xm.wait_device_ops()

    # -- values --------------------------------------------------------------------------
    def wrap_global(self, structure: Any) -> Any:
        """Wraps every XLA tensor of `structure` in a `GlobalValue`."""
        return nest.map_structure(
            lambda leaf: GlobalValue(leaf, self) if is_xla(leaf) else leaf, structure)

    def local_pieces(self, tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``[(device ordinal, host copy of that device's piece)]`` for the local devices,
        in device order (rows of a split tensor without XLA's padding; copies of a
        replicated one)."""
        self.materialize()
        shards, places = _compat.xla_local_shards(tensor)
        pieces = []
        for (data, device), (_, indices) in zip(shards, places):
            if indices != Ellipsis:  # drop XLA's padding of an uneven split
                data = data[tuple(slice(0, s.stop - s.start) for s in indices)]
            pieces.append((device_ordinal(device), data))
        pieces.sort(key=lambda piece: piece[0])
        return pieces

    def to_program_input(self, structure: Any) -> Any:
        """What the traced step receives for each leaf of `run`'s arguments: the global tensor
        of a `GlobalValue`; the concatenation (split along dim 0) of a several-component
        `PerReplica`; host tensors copied to every device (replicated)."""
        def convert(leaf: Any) -> Any:
            if isinstance(leaf, GlobalValue):
                return leaf.tensor
            if isinstance(leaf, values.DistributedValues):
                parts = leaf.values
                if len(parts) == 1:
                    return convert(parts[0])
                if not all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts):
                    raise ValueError(
                        "TPUStrategy passes a PerReplica with several components to its one "
                        "program as their concatenation along dim 0, so each component must "
                        "be a tensor with a batch dimension (e.g. shape [rows, ...]).")
                return self.mesh.batch_to_device([torch.cat([p.cpu() for p in parts])])[0]
            if isinstance(leaf, torch.Tensor) and not is_xla(leaf):
                return self.mesh.replicate_to_device(leaf)
            return leaf
        return nest.map_structure(convert, structure)

    def _global_tensors(self, value: Any, what: str) -> tuple[list[Any], Any]:
        """Leaves of `value` as global tensors, and the PerReplica leaves as lists of
        their components (genuinely per-replica values)."""
        leaves, spec = nest.flatten(value)
        out: list[Any] = []   # a global tensor, or a PerReplica's list of components
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, GlobalValue):
                out.append(leaf.tensor)
            elif isinstance(leaf, values.DistributedValues):
                parts = [torch.as_tensor(p) for p in leaf.values]
                out.append(parts[0] if len(parts) == 1 else parts)
            elif isinstance(leaf, torch.Tensor):
                out.append(leaf)
            elif isinstance(leaf, (bool, int, float)):
                out.append(torch.as_tensor(leaf))
            else:
                raise TypeError(f"{what} needs tensors, but leaf {index} of the structure is "
                                f"a {type(leaf).__name__} ({leaf!r:.60}).")
        return out, spec

    # -- cross-replica reductions ------------------------------------------------------
    def reduce_across_replicas(self, reduce_op: ReduceOp | str, value: Any,
                               axis: int | None) -> Any:
        """A global value already covers every replica: with ``axis=None`` it is returned
        as it is; with `axis`, SUM / MEAN run along that axis of the global tensor. A
        `PerReplica` of several components is reduced over its components."""
        op = as_reduce_op(reduce_op)
        leaves, spec = self._global_tensors(value, "reduce")
        out = []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, list):  # one component per replica
                if axis is None:
                    stacked = as_mean_input(op, torch.stack(leaf))
                    out.append(stacked.sum(0) if op is ReduceOp.SUM else stacked.mean(0))
                    continue
                leaf = torch.cat(leaf, dim=axis)
            elif axis is None:
                out.append(leaf)  # a global value already covers every replica
                continue
            nest.check_axis(leaf, axis, index)
            leaf = as_mean_input(op, leaf)  # MEAN of integers: a floating mean, as TF
            out.append(leaf.sum(dim=axis) if op is ReduceOp.SUM else leaf.mean(dim=axis))
        return nest.pack(spec, out)

    def gather_across_replicas(self, value: Any, axis: int) -> Any:
        """Every replica's piece concatenated along `axis`, in replica order. For a tensor
        split along `axis` that is the global tensor itself (nothing moves); otherwise the
        pieces are concatenated (a replicated value gives one copy per replica, as
        tf.distribute's gather of identical values does)."""
        leaves, spec = nest.flatten(value)
        out = []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, GlobalValue):
                tensor = leaf.tensor
                _check_axis(tensor, axis, index)
                sharding = _compat.xla_sharding_spec(tensor)
                if sharding == "":   # not computed yet: run it, then read its sharding
                    self.materialize()
                    sharding = _compat.xla_sharding_spec(tensor)
                if _split_only_along(sharding, axis % tensor.dim()):
                    out.append(tensor)
                else:
                    out.append(torch.cat(list(leaf.values), dim=axis).to(tensor.device))
            elif isinstance(leaf, values.DistributedValues):
                parts = list(leaf.values)
                for p in parts:
                    _check_axis(p, axis, index)
                out.append(torch.cat(parts, dim=axis))
            elif isinstance(leaf, torch.Tensor):
                _check_axis(leaf, axis, index)
                out.append(leaf)
            else:
                raise TypeError(f"gather needs tensors, but leaf {index} is a "
                                f"{type(leaf).__name__}.")
        return nest.pack(spec, out)

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The pieces of `value` on this host's devices, one per device, in device order
        (host copies; reading them runs any pending steps first). A structure gives one
        structure per local device."""
        n = self.mesh.num_local_devices

        def piece(leaf: Any, index: int) -> Any:   # a leaf with another number of parts: its first
            parts = leaf.values
            return parts[index] if len(parts) == n else parts[0]
        return values.local_results(value, n, piece)

    def batch_reduce_to(self, reduce_op: ReduceOp | str,
                        value_destination_pairs: Iterable[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list[Any]:
        _refuse_options(options, "batch_reduce_to / reduce_to")
        results = []
        for value, destinations in value_destination_pairs:
            reduced = self.reduce_across_replicas(reduce_op, value, None)
            device = destination_device(destinations)
            if device is not None:
                reduced = nest.map_structure(
                    lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, reduced)
            results.append(reduced)
        return results

    # -- collectives in replica context -------------------------------------------------
    def replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                           options: CommunicationOptions | None = None) -> Any:
        """Returns `value`: inside the SPMD program a tensor is already the global one
        (computed over every replica's rows), so there is nothing left to combine."""
        as_reduce_op(reduce_op)
        _refuse_options(options, "all_reduce")
        return value

    def replica_all_gather(self, value: Any, axis: int,
                           options: CommunicationOptions | None = None) -> Any:
        """Returns `value`: a global tensor already holds every replica's rows."""
        _refuse_options(options, "all_gather")
        return value

    # -- the scope -----------------------------------------------------------------------
    def scope_placement(self) -> ContextManager[Any]:
        """Modules and variables created in the scope are placed on the XLA device."""
        return self.mesh.device

    # -- the scope -----------------------------------------------------------------------
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
        """Makes new parameters and buffers identical on every host (host 0's values; a
        no-op with one host) and computes them, so their initialisation is not traced into
        the first step.

        With several hosts, the hosts first compare names, shapes and dtypes of what they
        recorded, as the data-parallel strategies' replicas do.

        Raises:
          ValueError: hosts that recorded different tensors, naming the first difference.
        """
        labelled = self._recorded.take_pending_labelled()
        if not labelled:
            return
        if self.mesh.process_count > 1:
            mirroring.check_replicas_agree(self._comm, labelled)
            with torch.no_grad():
                hosts = [tensor.detach().cpu() for _, tensor in labelled]
                self._comm.broadcast_(hosts, src=0)
                for (_, tensor), host in zip(labelled, hosts):
                    tensor.copy_(host.to(tensor.device))
        self.flush()

    # -- variables: write_variable is StrategyExtended's (in place) -----------------------

    # -- input -------------------------------------------------------------------------
    def distribute_dataset(self, dataset: Iterable[Any], options: InputOptions | None
                           ) -> TPUDistributedDataset:
        """Global batches split along dim 0 over the devices, copied ahead of use; see
        `torchstrategy.xla.input.TPUDistributedDataset`."""
        return TPUDistributedDataset(self._container, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any],
                                          options: InputOptions | None
                                          ) -> TPUDistributedDatasetsFromFunction:
        """One pipeline per host of per-replica batches; see
        `torchstrategy.xla.input.TPUDistributedDatasetsFromFunction`."""
        return TPUDistributedDatasetsFromFunction(self._container, dataset_fn, options)

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``value_fn(ts.ValueContext)`` once per local device, as a `PerReplica` (passed to
        ``run`` as the components' concatenation along dim 0)."""
        first = self.replica_id
        ids = tuple(range(first, first + self.mesh.num_local_devices))
        parts = [value_fn(ValueContext(i, self.num_replicas_in_sync)) for i in ids]
        return values.wrap(parts, ids) if len(ids) > 1 else values.wrap(parts[0], ids)

    # -- optional capabilities -------------------------------------------------------------
    def host_copy(self, obj: Any) -> Any:
        """`obj` with every XLA tensor copied to the host (what ``ts.checkpoint.save``
        writes, so the file loads anywhere, without torch_xla)."""
        if not any(is_xla(leaf) for leaf in nest.flatten(obj)[0]):
            return obj
        self.materialize()
        return nest.map_structure(lambda t: t.cpu() if is_xla(t) else t, obj)


def _refuse_options(options: CommunicationOptions | None, what: str) -> None:
    """The devices' collectives are inside the XLA program (XLA chooses how they travel):
    only default options are accepted."""
    require_default_options(options, lambda o: (
        f"TPUStrategy cannot honour {o!r} in {what}: the cross-device sums are "
        "compiled into the XLA program, which decides how they travel, and inside run "
        "tensors are already global. Pass options=None."))

def _check_axis(tensor: torch.Tensor, axis: int, index: int) -> None:
    nest.check_gatherable(tensor, axis, index)
    nest.check_axis(tensor, axis, index)


def _split_only_along(sharding: str, axis: int) -> bool:
    """True when torch_xla's sharding text splits the tensor along `axis` and nowhere else
    (e.g. "{devices=[4,1]0,1,2,3}" for axis 0)."""
    if not sharding.startswith("{devices=["):
        return False
    tiles = [int(n) for n in sharding[len("{devices=["):sharding.index("]")].split(",")]
    if "last_tile_dim_replicate" in sharding:
        tiles = tiles[:-1]
    return axis < len(tiles) and all((n > 1) == (d == axis) for d, n in enumerate(tiles))


class TPUStrategy(Strategy):
    """Synchronous training on every XLA device (TPU cores, or XLA:CPU devices for testing)
    with torch_xla's SPMD partitioner; see the module docstring for the semantics.

    Args:
      cluster_resolver: a `ts.cluster_resolver.TPUClusterResolver` (default: one made from
        the environment). Several hosts run one process each, all with the same program,
        e.g. ``torchrun --nnodes=HOSTS --nproc-per-node=1 train.py``.
      steps_per_execution: how many calls of ``run`` are traced into one XLA execution
        before the host waits for nothing and moves on (TensorFlow's steps_per_execution).
        Values returned by ``run`` are computed when that execution runs; reading one on the
        host (``.item()``, ``experimental_local_results``) runs what is pending first.
      timeout_seconds: bound on the host-side collectives between hosts (checkpoint
        barriers, the shuffling seed), as for the other strategies.

    Create the strategy before putting any tensor on an XLA device: it switches torch_xla
    to SPMD mode. ``num_replicas_in_sync`` is the number of XLA devices of the job.

    Raises:
      ImportError: torch_xla is not installed, naming the command that installs it.
      ValueError: ``steps_per_execution`` < 1; torchrun with several processes on a host.
      RuntimeError: torch_xla's process count disagreeing with the cluster resolver's.
    """

    #: One XLA program per host runs every local replica over the global batch: a loop
    #: that runs once per process cannot drive it, and loss scaling divides by the global
    #: batch without multiplying by the replica count.
    CAPABILITIES = Capabilities(one_replica_per_process=False, traces_global_batch=True)

    def __init__(self, cluster_resolver: ClusterResolver | None = None, *,
                 steps_per_execution: int = 1, timeout_seconds: float | None = None) -> None:
        require_torch_xla()
        if int(steps_per_execution) < 1:
            raise ValueError(f"steps_per_execution must be at least 1, got "
                             f"{steps_per_execution}.")
        resolver = cluster_resolver if cluster_resolver is not None else TPUClusterResolver()
        mesh = DataMesh()
        hosts = getattr(resolver, "num_hosts", None) or resolver.num_workers
        if mesh.process_count != hosts:
            raise RuntimeError(
                f"torch_xla's runtime sees {mesh.process_count} host process(es) but the "
                f"cluster resolver describes {hosts} host(s); start one process per host on "
                "every host of the TPU job.")
        # Not `startup.start_replica_process`: that start-up gives each process one replica
        # (its world is the replicas, its device one of them, with re-execution for the
        # others), while here one process drives every XLA device of its host. Its world
        # is the hosts, found only under torchrun, and shares a gloo group for host-side
        # work; torch_xla's runtime, not a process group, connects the devices.
        if mesh.process_count > 1:
            # Host-side coordination only (checkpoint barriers, seeds): the devices'
            # collectives are inside the XLA program.
            world = runtime.world_from_environment()
            if world is None or world.world_size != mesh.process_count:
                raise RuntimeError("A multi-host TPUStrategy needs torchrun's environment "
                                   "(torchrun --nnodes=HOSTS --nproc-per-node=1 train.py).")
            process = runtime.current()
            process.enter_world(world)
            process.init_process_group(world, "gloo", world_lib.timeout_seconds(timeout_seconds))
        communicator = Communicator(None, mesh.process_index, mesh.process_count,
                                    torch.device("cpu"), NcclAllReduce())
        super().__init__(TPUExtended(self, mesh, communicator, int(steps_per_execution)))
        self._cluster_resolver = resolver
        if mesh.process_index == 0:
            logger.info(f"TPUStrategy: {mesh.num_devices} XLA device(s) on "
                        f"{mesh.process_count} host(s), SPMD data parallelism")

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster_resolver

    def __repr__(self) -> str:
        return f"TPUStrategy(num_replicas_in_sync={self.num_replicas_in_sync})"
