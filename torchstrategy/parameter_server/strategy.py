"""`ParameterServerStrategy`: parameters on parameter servers, training steps on workers.

The program runs on the chief (the coordinator). Parameters of modules created in
``strategy.scope()``, and ``ts.Variable``s created there, are placed on the parameter servers,
round-robin, each large one split along dimension 0 into a `ShardedVariable` when a
`variable_partitioner` says so. The chief's module keeps its own tensors as a local copy,
refreshed from the parameter servers whenever the module runs (forward) and by
``model.state_dict()``; ``model.load_state_dict(...)`` sends the loaded values to the
parameter servers. An optimizer over those parameters keeps its state on the parameter
servers too (`optimizers.RemoteOptimizer`): ``optimizer.state_dict()`` gathers it, shards
joined, and ``optimizer.load_state_dict(...)`` sends it back, re-split; changes to its
``param_groups`` settings (lr schedulers) apply to the steps scheduled after them.
Checkpoints are therefore plain ``{"model": ..., "optimizer": ...}`` state dicts that load
into any number of shards or into a model and optimizer without a strategy.

Training runs on workers through a `ClusterCoordinator`: see `coordinator` and
docs/parameter_server.md.
"""
import atexit
import itertools
import threading
import time

import torch
from torch.nn.modules import module as nn_module

from torchstrategy import context
from torchstrategy.parameter_server import (optimizers, partitioners, ps_store, remote,
                                            rpc_world, server)
from torchstrategy.parameter_server.variables import PSVariable, ShardedVariable
from torchstrategy.strategies.base import Strategy
from torchstrategy.variables import VariableAggregation, VariableSynchronization, _as_enum

_strategy_ids = itertools.count()


class _NoMirroring:
    """The base scope's mirroring hooks record nothing under this strategy (placement on
    parameter servers is done by this module's own registration hook)."""

    _param_ids = ()

    def add_parameter(self, param):
        pass

    def add_buffer(self, module, name):
        pass

    def add_tensor(self, tensor, trainable):
        pass

    def take_pending(self):
        return []


class _NoBarrier:
    def barrier(self):
        pass


class ParameterServerStrategyExtended:
    """The parts of `ParameterServerStrategy` most programs do not need."""

    def __init__(self, strategy, membership, variable_partitioner):
        self._container = strategy
        self._membership = membership
        self._partitioner = variable_partitioner
        self._scope_depth = threading.local()
        self._mirrored = _NoMirroring()
        self.torch_device = None
        self.replica_id = 0
        self.num_replicas_in_sync = 1
        self.communicator = _NoBarrier()
        self._prefix = f"s{next(_strategy_ids)}"
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._captured = []       # (module, name, param) registered in scope, not placed yet
        self._layouts = {}        # id(param tensor) -> Layout
        self._kept = []           # placed tensors, kept alive so their ids stay theirs
        self._hooked_modules = set()
        self._optimizers = {}     # id(optimizer) -> optimizers.RemoteOptimizer
        spec = membership.spec
        self.parameter_devices = tuple(rpc_world.task_name("ps", i)
                                       for i in spec.task_indices("ps"))
        self.worker_devices = tuple(rpc_world.task_name("worker", i)
                                    for i in spec.task_indices("worker"))
        self._next_ps = 0

    # -- what the base Strategy needs --------------------------------------------------------
    def _placement(self):
        import contextlib

        return contextlib.nullcontext()

    def _device_guard(self):
        import contextlib

        return contextlib.nullcontext()

    def _default_replica_context(self):
        from torchstrategy.replica_context import ReplicaContext

        return ReplicaContext(self._container, 0, torch.device("cpu"))

    def _after_step(self):
        pass

    def _wrap(self, structure, kind=None):
        return structure

    @property
    def should_checkpoint(self):
        return True

    should_save_summary = should_checkpoint

    # -- placement ---------------------------------------------------------------------------
    def _capture(self, module, name, param):
        with self._lock:
            self._captured.append((module, name, param))

    def _sync_mirrored_state(self):
        """At scope exit: places the parameters registered in the scope on the servers."""
        with self._lock:
            captured, self._captured = self._captured, []
        creations = []
        for module, name, param in captured:
            if id(param) in self._layouts:
                continue
            embedding = isinstance(module, torch.nn.Embedding) and name == "weight"
            layout, calls = self._place(param.detach().cpu(), f"{type(module).__name__}.{name}",
                                        param.requires_grad, embedding)
            creations += calls
            self._layouts[id(param)] = layout
            self._kept.append(param)
            self._hook(module)
        remote.wait(creations)

    def _place(self, value, name, trainable, embedding=False):
        shape, dtype = tuple(value.shape), value.dtype
        shards = partitioners.num_shards_for(self._partitioner, shape, dtype)
        key = f"{self._prefix}/{next(self._counter)}/{name}"
        servers = self.parameter_devices
        with self._lock:
            first = self._next_ps
            self._next_ps = (self._next_ps + shards) % len(servers)
        if shards == 1:
            layout = remote.Layout(key, shape, dtype,
                                   (remote.Shard(servers[first], key, 0, shape[0] if shape
                                                 else 0),),
                                   trainable, embedding)
        else:
            rows, start, parts = partitioners.shard_rows(shape[0], shards), 0, []
            for i, count in enumerate(rows):
                parts.append(remote.Shard(servers[(first + i) % len(servers)],
                                          f"{key}/part_{i}", start, count))
                start += count
            layout = remote.Layout(key, shape, dtype, tuple(parts), trainable, embedding)
        calls = [remote.call_async(s.ps, ps_store.create, (s.key, part.contiguous(), trainable))
                 for s, part in zip(layout.shards, remote.split_rows(layout, value))]
        return layout, calls

    def _hook(self, module):
        if id(module) in self._hooked_modules:
            return
        self._hooked_modules.add(id(module))
        module.register_forward_pre_hook(_ChiefHook(self._pull_before_forward))
        module.register_state_dict_pre_hook(_ChiefHook(self._pull_module))
        module.register_load_state_dict_post_hook(_ChiefHook(self._push_module))

    def _own_placed(self, module):
        return [(p, self._layouts[id(p)]) for p in module._parameters.values()
                if p is not None and id(p) in self._layouts]

    def _pull_module(self, module, prefix, keep_vars):
        placed = self._own_placed(module)
        if placed:
            values = remote.read_full([layout for _, layout in placed])
            with torch.no_grad():
                for (param, _), value in zip(placed, values):
                    param.copy_(value)

    def _pull_before_forward(self, module, args):
        self._pull_module(module, "", False)

    def _push_module(self, module, incompatible_keys):
        for param, layout in self._own_placed(module):
            remote.write_full(layout, param.detach().cpu())

    def layout_of(self, tensor):
        """Where a parameter created in the scope lives (a `remote.Layout`), or None."""
        return self._layouts.get(id(tensor))

    def read_parameters(self, module):
        """Copies the current parameter-server values into `module`'s local parameters."""
        for sub in module.modules():
            self._pull_module(sub, "", False)

    # -- variables ---------------------------------------------------------------------------
    def _create_variable(self, initial_value, trainable=None, name=None, dtype=None,
                         aggregation=VariableAggregation.NONE,
                         synchronization=VariableSynchronization.AUTO):
        aggregation = _as_enum(VariableAggregation, aggregation, "aggregation")
        synchronization = _as_enum(VariableSynchronization, synchronization, "synchronization")
        if synchronization is VariableSynchronization.ON_READ:
            raise ValueError("ParameterServerStrategy holds one copy of each variable on a "
                             "parameter server; synchronization=ON_READ is not supported.")
        if callable(initial_value):
            initial_value = initial_value()
        value = torch.as_tensor(initial_value, dtype=dtype).detach().clone().cpu()
        trainable = True if trainable is None else bool(trainable)
        trainable = trainable and (value.is_floating_point() or value.is_complex())
        name = name or "Variable"
        layout, calls = self._place(value, name, trainable)
        remote.wait(calls)
        cls = ShardedVariable if layout.sharded else PSVariable
        return cls._from_layout(layout, name, aggregation, synchronization)

    # -- pickling closures ---------------------------------------------------------------------
    def _reference(self, obj):
        if isinstance(obj, torch.Tensor):
            layout = self._layouts.get(id(obj))
            return None if layout is None else ("param", layout)
        if isinstance(obj, torch.optim.Optimizer):
            return self._optimizer_reference(obj)
        from torchstrategy.parameter_server.coordinator import PerWorkerValues

        if isinstance(obj, PerWorkerValues):
            return ("per_worker", obj._key)
        return None

    def _optimizer_reference(self, optimizer):
        with self._lock:
            known = self._optimizers.get(id(optimizer))
        if known is None:
            known = self._register_optimizer(optimizer)
        return known.reference()

    def _register_optimizer(self, optimizer):
        """On an optimizer's first schedule: builds its copies on the parameter servers
        (see `optimizers.RemoteOptimizer`)."""
        groups = []
        for group in optimizer.param_groups:
            layouts = []
            for param in group["params"]:
                layout = self._layouts.get(id(param))
                if layout is None:
                    raise ValueError(
                        f"The optimizer {type(optimizer).__name__} given to a scheduled "
                        f"function updates a parameter of shape {list(param.shape)} that was "
                        f"not created in strategy.scope(); create the model (and so its "
                        f"parameters) inside the scope.")
                layouts.append(layout)
            groups.append(layouts)
        key = f"{self._prefix}/optimizer/{next(self._counter)}"
        remote_optimizer = optimizers.RemoteOptimizer(optimizer, key, groups)
        remote_optimizer.create()
        with self._lock:
            # Keep the optimizer itself alive so that its id stays its own.
            self._optimizers[id(optimizer)] = remote_optimizer
        return remote_optimizer


class _ChiefHook:
    """A module hook that syncs with the parameter servers on the chief. Sent to a worker
    inside a module, it becomes a no-op (the worker's copy is refreshed per closure)."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args):
        return self._fn(*args)

    def __reduce__(self):
        return (_worker_side_hook, ())


def _noop_hook(*args):
    return None


def _worker_side_hook():
    return _noop_hook


class ParameterServerStrategy(Strategy):
    """Asynchronous training with parameter servers (tf.distribute's ParameterServerStrategy).

    The program runs on the chief. Modules and ``ts.Variable``s created in ``scope()`` live
    on the parameter servers; a `ClusterCoordinator` schedules training steps onto the
    workers, each of which pulls the parameters, computes gradients and pushes them; the
    servers apply the optimizer as the gradients arrive, with the optimizer's settings as
    they were on the chief when the step was scheduled (so ``torch.optim.lr_scheduler``
    works). ``model.state_dict()`` and ``optimizer.state_dict()`` on the chief return the
    servers' current values and optimizer state in the format of one process (sharded
    tensors joined along dimension 0); their ``load_state_dict`` sends values and state to
    the servers, split into the current shards.

    Args:
      cluster_resolver: a `ClusterResolver` for a cluster with a "chief", "worker"s and
        "ps"s (``ts.TFConfigClusterResolver()``, ``ts.SimpleClusterResolver(...)``, or the
        one `local_cluster` returns). This process is the chief.
      variable_partitioner: None (no sharding) or a partitioner
        (`FixedShardsPartitioner`, `MinSizePartitioner`, `MaxSizePartitioner`) splitting
        large variables along dimension 0.
      rpc_timeout: seconds before any rpc fails (scheduled functions get `closure_timeout`
        in the coordinator instead).
      startup_timeout: seconds to wait for every worker and parameter server to join.

    Raises:
      ValueError: the cluster has no chief, worker or ps, or this task is not the chief.
      TimeoutError: naming the tasks that did not start in time.
    """

    def __init__(self, cluster_resolver, variable_partitioner=None,
                 rpc_timeout=rpc_world.DEFAULT_RPC_TIMEOUT_SECONDS,
                 startup_timeout=rpc_world.DEFAULT_STARTUP_TIMEOUT_SECONDS):
        spec = cluster_resolver.cluster_spec()
        rpc_world.check_cluster(spec)
        if "chief" not in spec.jobs:
            raise ValueError(f"ParameterServerStrategy runs on the cluster's chief, but the "
                             f"cluster spec has no 'chief' job: {spec.as_dict()!r}.")
        task_type = cluster_resolver.task_type
        if task_type not in (None, "chief"):
            raise ValueError(f"ParameterServerStrategy is created by the chief; this task is "
                             f"{task_type}:{cluster_resolver.task_id}. Run worker and ps tasks "
                             f"with `python -m torchstrategy.server` (or "
                             f"ts.Server(resolver).join()).")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(f"variable_partitioner must be a partitioner (e.g. "
                            f"ts.parameter_server.FixedShardsPartitioner(2)) or None, got "
                            f"{variable_partitioner!r}.")
        self._cluster_resolver = cluster_resolver
        membership = rpc_world.join(spec, "chief", cluster_resolver.task_id or 0,
                                    rpc_timeout, startup_timeout)
        _wait_for_cluster(membership, startup_timeout)
        _register_exit(membership)
        _install_capture()
        super().__init__(ParameterServerStrategyExtended(self, membership,
                                                         variable_partitioner))
        self._coordinator = None

    @property
    def cluster_resolver(self):
        return self._cluster_resolver

    @property
    def variable_partitioner(self):
        return self._extended._partitioner

    def run(self, fn, args=(), kwargs=None, options=None):
        """Calls ``fn(*args, **kwargs)`` (inside a scheduled function, this is the
        worker's one replica); schedule functions onto workers with
        `ClusterCoordinator.schedule`."""
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value, axis=None):
        """With one replica per worker step, reducing across replicas returns `value`
        (reduced along `axis` when given)."""
        from torchstrategy.reduce_op import ReduceOp, as_reduce_op

        if axis is None:
            return value
        op = as_reduce_op(reduce_op)
        return value.sum(axis) if op is ReduceOp.SUM else value.mean(axis)

    def __repr__(self):
        ext = self._extended
        return (f"ParameterServerStrategy(workers={len(ext.worker_devices)}, "
                f"ps={len(ext.parameter_devices)})")


def _wait_for_cluster(membership, timeout):
    spec = membership.spec
    expected = {rpc_world.task_name(job, i) for job in ("worker", "ps")
                for i in spec.task_indices(job)}
    deadline = time.monotonic() + timeout
    while True:
        missing = expected - set(membership.live_members())
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"These tasks did not join the cluster within {timeout:.0f} s: "
                               f"{sorted(missing)}. Start each with `python -m "
                               f"torchstrategy.server` (TF_CONFIG set for its task).")
        time.sleep(0.05)


_exit_registered = set()


def _register_exit(membership):
    if id(membership) in _exit_registered:
        return
    _exit_registered.add(id(membership))
    atexit.register(shutdown_cluster, membership)


def shutdown_cluster(membership=None, stop_servers=True):
    """Ends this chief's part in the cluster: asks every server to stop (when
    `stop_servers`), then leaves the rpc world. Bounded: dead servers cannot hang it."""
    membership = membership or rpc_world.current()
    if membership is None or rpc_world.current() is not membership:
        return
    if stop_servers:
        futures = []
        for name in membership.live_members():
            if name != membership.name:
                try:
                    futures.append(torch.distributed.rpc.rpc_async(
                        name, server._request_stop, timeout=5))
                except Exception:
                    pass
        for future in futures:
            try:
                future.wait()
            except Exception:
                pass
    rpc_world.leave()


_capture_installed = False


def _on_parameter(module, name, param):
    strategy = context.active_non_default_strategy()
    if isinstance(strategy, ParameterServerStrategy) and context.get_strategy() is strategy \
            and param is not None:
        strategy.extended._capture(module, name, param)
    return None


def _install_capture():
    global _capture_installed
    if not _capture_installed:
        nn_module.register_module_parameter_registration_hook(_on_parameter)
        _capture_installed = True
