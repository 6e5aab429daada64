"""`Strategy` and `StrategyExtended`: the API every strategy shares (tf.distribute's
``distribute_lib``), implemented once for the SPMD model.

A concrete strategy decides *where* replicas run (its devices, its process group) and hands
the base a `Communicator`; everything else here (scope, run, reduce, gather, input, the
gradient reducer) is the same for every one-replica-per-process strategy.
"""
import contextlib
import logging
import threading

import torch

from torchstrategy import context, mirroring, nest, values
from torchstrategy.collectives.reducer import GradientReducer
from torchstrategy.collectives.stats import ReductionStats
from torchstrategy.reduce_op import ReduceOp, as_reduce_op
from torchstrategy.replica_context import ReplicaContext

logger = logging.getLogger("torchstrategy")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("torchstrategy: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class StrategyExtended:
    """The parts of a strategy most programs do not need (tf.distribute's ``extended``).

    Attributes set by the concrete strategy:
      replica_id: this process's replica id (0 is the chief).
      num_replicas_in_sync: the number of replicas.
      torch_device: the `torch.device` this replica computes on (None for the default
        strategy, which places nothing).
    """

    def __init__(self, container, communicator, torch_device, place_in_scope=True,
                 bucket_cap_bytes=None):
        self._container = container
        self._comm = communicator
        self.torch_device = torch_device
        self._place_in_scope = place_in_scope and torch_device is not None \
            and torch_device.type != "cpu"
        self._mirrored = mirroring.MirroredState()
        self._reducer = None
        if communicator.world_size > 1:
            kwargs = {} if bucket_cap_bytes is None else {"bucket_cap_bytes": bucket_cap_bytes}
            self._reducer = GradientReducer(communicator, **kwargs)
        self._scope_depth = threading.local()

    # -- facts ---------------------------------------------------------------------------
    @property
    def replica_id(self):
        return self._comm.rank

    @property
    def num_replicas_in_sync(self):
        return self._comm.world_size

    @property
    def is_chief(self):
        """True on replica 0: the one that writes checkpoints, logs and progress bars."""
        return self._comm.rank == 0

    should_checkpoint = is_chief
    should_save_summary = is_chief

    @property
    def worker_devices(self):
        """The devices of the replicas this process runs."""
        return (self.torch_device or torch.device("cpu"),)

    @property
    def parameter_devices(self):
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self):
        return False

    @property
    def communicator(self):
        return self._comm

    @property
    def cross_device_ops(self):
        return self._comm.cross_device_ops

    # -- contexts ------------------------------------------------------------------------
    def _default_replica_context(self):
        return ReplicaContext(self._container, 0, self.torch_device or torch.device("cpu"))

    def _placement(self):
        if self._place_in_scope:
            return self.torch_device
        return contextlib.nullcontext()

    def _device_guard(self):
        if self.torch_device is not None and self.torch_device.type == "cuda":
            return torch.cuda.device(self.torch_device)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, with no communication; the
        next backward outside sums everything accumulated since across replicas (DDP's
        ``no_sync``, for gradient accumulation)."""
        if self._reducer is None:
            yield
        else:
            with self._reducer.no_sync():
                yield

    def stats(self):
        """What the gradient reducer did in the last synchronised ``backward()``: a
        `ReductionStats` (bytes reduced, buckets, exposed communication time, ...).
        All zeros with one replica, where nothing is communicated."""
        if self._reducer is None:
            return ReductionStats(num_parameters=0)
        return self._reducer.stats()

    # -- variables -----------------------------------------------------------------------
    def _check_variable(self, variable):
        """Raises if this strategy cannot hold `variable` (called when it is created)."""

    def _write_variable(self, variable, new_value):
        """Writes a variable's (already aggregated) new value into its tensor. Strategies
        running several replicas in one process override this to write it once."""
        tensor = variable.tensor
        with torch.no_grad():
            tensor.copy_(torch.as_tensor(new_value, dtype=tensor.dtype, device=tensor.device))

    # -- mirrored state ------------------------------------------------------------------
    def _sync_mirrored_state(self):
        """Broadcasts tensors mirrored since the last call from replica 0 and gives new
        parameters to the gradient reducer. Every replica calls this at the same points
        (scope exit, the start of ``run``), so it is a collective only when needed."""
        pending = self._mirrored.take_pending()
        if not pending:
            return
        if self._comm.world_size > 1:
            with torch.no_grad():
                self._comm.broadcast_(pending, src=0)
        if self._reducer is not None:
            self._reducer.add_parameters([t for t in pending
                                          if isinstance(t, torch.nn.Parameter)
                                          or id(t) in self._mirrored._param_ids])

    def _after_step(self):
        """Buffers (BatchNorm statistics) become the mean over replicas after each step,
        as TensorFlow's MEAN-aggregated moving averages do, so every replica holds the same
        values."""
        if self._comm.world_size > 1:
            buffers = self._mirrored.floating_buffers()
            if buffers:
                with torch.no_grad():
                    self._comm.all_reduce(buffers, ReduceOp.MEAN, inplace=True)

    # -- values --------------------------------------------------------------------------
    def _wrap(self, structure, kind=values.PerReplica):
        if self._comm.world_size == 1:
            return structure
        return values.wrap(structure, (self._comm.rank,), kind)

    def _local_tensors(self, value, what):
        local = values.local_component(value)
        return nest.tensor_leaves(local, what)

    def _all_reduce_local(self, reduce_op, value):
        op = as_reduce_op(reduce_op)
        tensors, spec = self._local_tensors(value, "all_reduce")
        return nest.pack(spec, self._comm.all_reduce(tensors, op))

    def _all_gather_local(self, value, axis):
        tensors, spec = self._local_tensors(value, "all_gather")
        return nest.pack(spec, self._comm.all_gather(tensors, axis))

    def _reduce(self, reduce_op, value, axis):
        op = as_reduce_op(reduce_op)
        tensors, spec = self._local_tensors(value, "reduce")
        if axis is None:
            return nest.pack(spec, self._comm.all_reduce(tensors, op))
        for index, t in enumerate(tensors):
            if not -max(t.dim(), 1) <= axis < max(t.dim(), 1) or t.dim() == 0:
                raise ValueError(f"axis {axis} is out of range for leaf {index} of shape "
                                 f"{tuple(t.shape)}.")
        sums = [t.sum(dim=axis) for t in tensors]
        if op is ReduceOp.SUM:
            return nest.pack(spec, self._comm.all_reduce(sums, op))
        # MEAN over the global batch: sum of local sums over the sum of local counts, so
        # replicas holding different numbers of rows (the uneven last batch) weigh right.
        counts = [torch.tensor(float(t.shape[axis]), dtype=s.dtype, device=s.device)
                  for t, s in zip(tensors, sums)]
        for s in sums:
            if not s.is_floating_point():
                raise ValueError("ReduceOp.MEAN of integer tensors is ambiguous; cast to a "
                                 "floating dtype first, or use SUM.")
        reduced = self._comm.all_reduce(sums + counts, ReduceOp.SUM)
        n = len(sums)
        return nest.pack(spec, [s / c for s, c in zip(reduced[:n], reduced[n:])])

    # -- tf.distribute's extended API ----------------------------------------------------
    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduces `value` across replicas and places the result on `destinations` (a
        device, a tensor whose device to use, or None for this replica's device).

        Returns a `Mirrored` (the plain value with one replica)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """`reduce_to` for many values at once, in one fused collective per dtype."""
        op = as_reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        all_tensors, layout = [], []
        for value, destinations in pairs:
            tensors, spec = self._local_tensors(value, "batch_reduce_to")
            layout.append((len(tensors), spec, destinations))
            all_tensors += tensors
        reduced = self._comm.all_reduce(all_tensors, op)
        results, start = [], 0
        for count, spec, destinations in layout:
            device = _destination_device(destinations)
            part = [t if device is None else t.to(device) for t in reduced[start:start + count]]
            start += count
            results.append(self._wrap(nest.pack(spec, part), values.Mirrored))
        return results


def _destination_device(destinations):
    if destinations is None:
        return None
    if isinstance(destinations, values.DistributedValues):
        destinations = destinations.values[0]
    if isinstance(destinations, torch.Tensor):
        return destinations.device
    if hasattr(destinations, "device") and isinstance(destinations.device, torch.device):
        return destinations.device
    from torchstrategy.devices import parse_device

    return parse_device(destinations).torch_device


class Strategy:
    """A way to distribute computation over replicas (tf.distribute.Strategy).

    Write the step once; pick the hardware by picking the strategy::

        strategy = ts.MirroredStrategy()
        with strategy.scope():
            model = Net()                       # parameters mirrored on every replica
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in strategy.experimental_distribute_dataset(loader):
            loss = strategy.run(train_step, args=(batch,))
            total = strategy.reduce("SUM", loss, axis=None)
    """

    def __init__(self, extended):
        self._extended = extended

    @property
    def extended(self):
        return self._extended

    @property
    def num_replicas_in_sync(self):
        """The number of replicas that take part in each step (across all machines)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self):
        return None

    # -- scope ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Context in which parameters, buffers and ``ts.Variable``s become mirrored.

        Inside, modules are created on the replica's device; every parameter and buffer
        registered is recorded (nothing is wrapped). When the outermost scope exits, the
        new tensors are broadcast from replica 0 so every replica starts identical.

        Raises:
          RuntimeError: when a different strategy's scope is already active.
        """
        _check_not_mixing(self)
        mirroring.install_capture()
        depth = getattr(self._extended._scope_depth, "value", 0)
        self._extended._scope_depth.value = depth + 1
        try:
            with context.enter(self, None), self._extended._placement():
                yield self
        finally:
            self._extended._scope_depth.value = depth
        if depth == 0 and not context.in_run():
            self._extended._sync_mirrored_state()

    # -- run -----------------------------------------------------------------------------
    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs ``fn(*args, **kwargs)`` on this process's replica, in replica context.

        Distributed values among the arguments are replaced by this replica's component.
        Inside `fn`, ``loss.backward()`` leaves in every mirrored parameter's ``.grad`` the
        sum of the gradients of all replicas, and ``ts.get_replica_context()`` gives the
        replica's id and its collectives.

        Returns:
          `fn`'s result with every leaf wrapped in a `PerReplica` (plain values with one
          replica, as TensorFlow's single-device strategies return them).

        Raises:
          RuntimeError: when called inside ``run`` or while another strategy is active.
        """
        if context.in_run():
            raise RuntimeError("strategy.run was called inside strategy.run (or merge_call). "
                               "Nested run is not supported: call the function directly.")
        _check_not_mixing(self)
        kwargs = kwargs or {}
        ext = self._extended
        ext._sync_mirrored_state()
        args = values.local_component(args)
        kwargs = values.local_component(kwargs)
        replica = ReplicaContext(self, ext.replica_id, ext.torch_device or torch.device("cpu"))
        with context.enter(self, replica), ext._device_guard():
            result = fn(*args, **kwargs)
        ext._after_step()
        return ext._wrap(result)

    # -- cross-replica operations ---------------------------------------------------------
    def reduce(self, reduce_op, value, axis=None):
        """Reduces a per-replica value (or nested structure) across replicas.

        Args:
          reduce_op: ``ts.ReduceOp.SUM`` / ``MEAN`` or the strings "SUM" / "MEAN".
          value: a `PerReplica` (e.g. the result of `run`), a `Mirrored`, or a tensor (in the
            SPMD model a tensor in cross-replica code is this replica's own value), or a
            nested structure of them.
          axis: None to reduce across replicas only; an int to also reduce along that
            dimension of each replica's value (MEAN then averages over all elements along
            `axis` on all replicas, so uneven slices weigh right).

        Returns:
          The reduced tensor (structure), identical on every replica.
        """
        _require_cross_replica("reduce")
        return self._extended._reduce(reduce_op, value, axis)

    def gather(self, value, axis):
        """Concatenates a per-replica value from every replica along `axis`, in replica
        order; sizes along `axis` may differ between replicas."""
        _require_cross_replica("gather")
        return self._extended._all_gather_local(value, axis)

    def experimental_local_results(self, value):
        """The components of `value` held by this process, as a tuple (one per local
        replica); a nested structure gives a tuple of structures."""
        if isinstance(value, values.DistributedValues):
            return value.values
        return (values.local_component(value),)

    # -- input ---------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes an iterable of *global* batches: replica r gets slice r of each.

        See `torchstrategy.input.distributed_dataset.DistributedDataset`.
        """
        from torchstrategy.input.distributed_dataset import DistributedDataset

        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Calls ``dataset_fn(ts.InputContext)`` to build this replica's input pipeline."""
        from torchstrategy.input.distributed_dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn):
        """Calls ``value_fn(ts.ValueContext)`` for this replica; returns a `PerReplica`."""
        from torchstrategy.input.contexts import ValueContext

        ext = self._extended
        value = value_fn(ValueContext(ext.replica_id, ext.num_replicas_in_sync))
        return ext._wrap(value)

    def __repr__(self):
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


def _check_not_mixing(strategy):
    active = context.active_non_default_strategy()
    if active is not None and active is not strategy:
        raise RuntimeError(f"Mixing different strategies is not allowed: {active!r} is "
                           f"already active here, so {strategy!r} cannot be entered. Exit "
                           "the first strategy's scope before using another.")


def _require_cross_replica(name):
    # Replica context of a run (merge_call's merge_fn runs in cross-replica context, where
    # strategy.reduce / gather are allowed, as in TensorFlow).
    if context.get_replica_context() is not None and context.in_run():
        raise RuntimeError(f"strategy.{name} must be called in cross-replica context "
                           "(outside strategy.run). Inside run, use "
                           f"ts.get_replica_context().all_{'reduce' if name == 'reduce' else 'gather'}(...).")
