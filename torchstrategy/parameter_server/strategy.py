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
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from torchstrategy import module_state, nest, runtime
from torchstrategy.aggregation import VariableAggregation, VariableSynchronization, as_enum
from torchstrategy.cluster_resolver import ClusterResolver
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import NcclAllReduce
from torchstrategy.parameter_server import (optimizers, partitioners, ps_store, remote,
                                            rpc_world, server)
from torchstrategy.parameter_server.variables import PSVariable, ShardedVariable
from torchstrategy.reduce_op import ReduceOp, as_reduce_op
from torchstrategy.strategies.base import MetricSync, Strategy
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy.strategies.process_replica import ProcessReplicaExtended
from torchstrategy.variables import Variable


def _next_strategy_id() -> int:
    """A number unique among this process's strategies (keys on the servers start with it)."""
    return next(runtime.current().state("parameter_server.strategy_ids", itertools.count))


class ParameterServerStrategyExtended(ProcessReplicaExtended):
    """The parts of `ParameterServerStrategy` most programs do not need.

    The user's program runs on the chief, a world of one replica (inside a scheduled
    function: the worker's one replica), so running, collectives (``gather``,
    ``ReplicaContext.all_reduce`` through a `Communicator` of one process) and input are
    `ProcessReplicaExtended`'s; to feed the workers use
    `ClusterCoordinator.create_per_worker_dataset`. Nothing is mirrored: there is no
    gradient reducer, buffers are not synchronised (StrategyExtended's defaults), and
    ``adopt`` is refused. What differs is where parameters live:
    parameters registered on modules inside the scope (`record_parameter`) are placed on
    the parameter servers when the scope exits and before each ``run``
    (`settle_recorded_state`); ``ts.Variable`` made in the scope is placed at once
    (`create_variable`). Buffers stay on the chief's modules and travel with them.

    Args:
      container: the `ParameterServerStrategy`.
      membership: the chief's `rpc_world.Membership`.
      variable_partitioner: None or a partitioner (see `partitioners`).
    """

    def __init__(self, container: Strategy, membership: rpc_world.Membership,
                 variable_partitioner: Callable[..., Any] | None) -> None:
        super().__init__(container,
                         Communicator(None, 0, 1, torch.device("cpu"), NcclAllReduce()), None)
        self._membership = membership
        self._partitioner = variable_partitioner
        self._prefix = f"s{_next_strategy_id()}"
        self._counter = itertools.count()
        self._lock = threading.Lock()
        # (module, name, param) registered in scope, not placed yet
        self._recorded: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        # placed parameter -> its Layout, by identity; the parameters are kept alive (their
        # values live on the servers), so none is ever taken for another.
        self._layouts: module_state.IdentityMap[torch.Tensor, remote.Layout] = \
            module_state.IdentityMap()
        # optimizer -> its optimizers.RemoteOptimizer, by identity; an entry goes with its
        # optimizer.
        self._optimizers = WeakIdKeyDictionary()
        self._coordinator: Any = None   # the ClusterCoordinator (a module above this one)
        spec = membership.spec
        self._parameter_devices = tuple(rpc_world.task_name("ps", i)
                                        for i in spec.task_indices("ps"))
        self._worker_devices = tuple(rpc_world.task_name("worker", i)
                                     for i in spec.task_indices("worker"))
        self._next_ps = 0

    # -- facts ---------------------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The rpc names of the workers ("worker:0", ...)."""
        return self._worker_devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The rpc names of the parameter servers ("ps:0", ...)."""
        return self._parameter_devices

    @property
    def membership(self) -> rpc_world.Membership:
        """The chief's `rpc_world.Membership` (the cluster it joined)."""
        return self._membership

    @property
    def variable_partitioner(self) -> Callable[..., Any] | None:
        return self._partitioner

    @property
    def key_prefix(self) -> str:
        """The prefix of every key this strategy uses on the servers and workers."""
        return self._prefix

    @property
    def coordinator(self) -> Any:
        """The strategy's `ClusterCoordinator`, or None before one was made."""
        return self._coordinator

    def metric_sync(self) -> MetricSync:
        """Refused: a metric cannot follow the replicas of a parameter-server cluster."""
        raise NotImplementedError(
            "ts.metrics.sync does not support ParameterServerStrategy: a scheduled function "
            "runs on a worker with its own copy of the metric. Return the values the metric "
            "needs from the scheduled function and update the metric on the coordinator "
            "with the fetched results.")

    def attach_coordinator(self, coordinator: Any) -> Any:
        """Records the strategy's one `ClusterCoordinator`; returns the one recorded first."""
        with self._lock:
            if self._coordinator is None:
                self._coordinator = coordinator
            return self._coordinator

    # -- cross-replica reductions ------------------------------------------------------
    def reduce_across_replicas(self, reduce_op: ReduceOp | str, value: Any,
                               axis: int | None) -> Any:
        """With one replica per step, reducing across replicas returns `value` itself (any
        structure, tensors or not: results of scheduled functions need not be tensors, so
        unlike `ProcessReplicaExtended` nothing is converted, copied or refused); with
        `axis`, each tensor is reduced along it."""
        op = as_reduce_op(reduce_op)
        if axis is None:
            return value

        def along_axis(leaf: Any) -> torch.Tensor:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"strategy.reduce(..., axis={axis}) needs tensors, got a "
                                f"{type(leaf).__name__}.")
            return leaf.sum(axis) if op is ReduceOp.SUM else leaf.mean(axis)

        return nest.map_structure(along_axis, value)

    # -- the scope: placement on the parameter servers ----------------------------------
    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        """Remembers a parameter registered in the scope; it is placed on a parameter server
        when the scope exits."""
        with self._lock:
            self._recorded.append((module, name, param))

    def record_buffer(self, module: torch.nn.Module, name: str) -> None:
        """Buffers are not placed: they stay in the chief's module, and a scheduled function
        gets them with the module (each worker updates its own copy, as in TensorFlow, where
        non-variable state is per worker)."""

    def record_variable(self, variable: Variable) -> None:
        """Nothing to record: ``ts.Variable`` in this scope is made by `create_variable`
        (placed at once), and `check_variable`, which ``ts.Variable`` calls before this,
        refuses every other kind."""

    def recorded_in_scope(self, tensor: torch.Tensor) -> bool:
        """True for a parameter registered in the scope and placed on the servers."""
        return tensor in self._layouts

    def settle_recorded_state(self) -> None:
        """Places the parameters registered in the scope on the parameter servers (at scope
        exit, and before ``run``)."""
        with self._lock:
            recorded, self._recorded = self._recorded, []
        creations: list[tuple[str, Any]] = []
        for module, name, param in recorded:
            if param in self._layouts:
                continue
            embedding = isinstance(module, torch.nn.Embedding) and name == "weight"
            layout, calls = self._place(param.detach().cpu(), f"{type(module).__name__}.{name}",
                                        param.requires_grad, embedding)
            creations += calls
            self._layouts[param] = layout
            self._hook(module)
        remote.wait(creations)

    def _place(self, value: torch.Tensor, name: str, trainable: bool, embedding: bool = False
               ) -> tuple[remote.Layout, list[tuple[str, Any]]]:
        shape, dtype = tuple(value.shape), value.dtype
        shards = partitioners.num_shards_for(self._partitioner, shape, dtype)
        key = f"{self._prefix}/{next(self._counter)}/{name}"
        servers = self._parameter_devices
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

    def _hook(self, module: torch.nn.Module) -> None:
        """Registers, once, the hooks that keep `module`'s placed parameters in step with
        the servers; their handles live in the module's `module_state`."""
        hooked = module_state.attach(module, self)
        if hooked.hooks:
            return
        hooked.hooks = [
            module.register_forward_pre_hook(_ChiefHook(self._pull_before_forward)),
            module.register_state_dict_pre_hook(_ChiefHook(self._pull_module)),
            module.register_load_state_dict_post_hook(_ChiefHook(self._push_module))]

    def _own_placed(self, module: torch.nn.Module
                    ) -> list[tuple[torch.nn.Parameter, remote.Layout]]:
        return [(p, self._layouts[p]) for _, p in module.named_parameters(recurse=False)
                if p in self._layouts]

    def _pull_module(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        placed = self._own_placed(module)
        if placed:
            values_ = remote.read_full([layout for _, layout in placed])
            with torch.no_grad():
                for (param, _), value in zip(placed, values_):
                    param.copy_(value)

    def _pull_before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._pull_module(module, "", False)

    def _push_module(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        for param, layout in self._own_placed(module):
            remote.write_full(layout, param.detach().cpu())

    def layout_of(self, tensor: torch.Tensor) -> remote.Layout | None:
        """Where a parameter created in the scope lives (a `remote.Layout`), or None."""
        return self._layouts.get(tensor)

    # -- variables ---------------------------------------------------------------------------
    def create_variable(self, initial_value: Any, trainable: bool | None = None,
                        name: str | None = None, dtype: torch.dtype | None = None,
                        aggregation: VariableAggregation | str = VariableAggregation.NONE,
                        synchronization: VariableSynchronization | str =
                        VariableSynchronization.AUTO) -> PSVariable:
        """``ts.Variable(...)`` in this strategy: a `PSVariable` (or `ShardedVariable`, as the
        partitioner says) held by the parameter servers.

        Raises:
          ValueError: ``synchronization=ON_READ`` (one copy per variable, on a server).
        """
        aggregation = as_enum(VariableAggregation, aggregation, "aggregation")
        synchronization = as_enum(VariableSynchronization, synchronization, "synchronization")
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

    def check_variable(self, variable: Variable) -> None:
        if not isinstance(variable, PSVariable):
            raise TypeError(f"ParameterServerStrategy holds variables on parameter servers; "
                            f"a {type(variable).__name__} cannot be made in its scope. Use "
                            f"ts.Variable(...), which makes a PSVariable.")

    def write_variable(self, variable: Variable, new_value: torch.Tensor) -> None:
        self.check_variable(variable)
        remote.write_full(cast(PSVariable, variable).layout, new_value)  # checked: a PSVariable

    # -- references for scheduled functions ---------------------------------------------
    def reference(self, obj: object) -> tuple[Any, ...] | None:
        """What a scheduled function carries instead of `obj` when `obj` lives on the
        parameter servers: ``("param", layout)`` for a parameter made in the scope, the
        optimizer reference for an optimizer over such parameters (its copies on the
        servers are built on first use); None for anything else (pickled as it is).

        Raises:
          ValueError: an optimizer over a parameter that was not made in the scope.
        """
        if isinstance(obj, torch.Tensor):
            layout = self._layouts.get(obj)
            return None if layout is None else ("param", layout)
        if isinstance(obj, torch.optim.Optimizer):
            with self._lock:
                known = self._optimizers.get(obj)
            if known is None:
                known = self._register_optimizer(obj)
            return known.reference()
        return None

    def _register_optimizer(self, optimizer: torch.optim.Optimizer
                            ) -> optimizers.RemoteOptimizer:
        """On an optimizer's first schedule: builds its copies on the parameter servers
        (see `optimizers.RemoteOptimizer`)."""
        groups: list[list[remote.Layout]] = []
        for group in optimizer.param_groups:
            layouts: list[remote.Layout] = []
            for param in group["params"]:
                layout = self._layouts.get(param)
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
            self._optimizers[optimizer] = remote_optimizer
        return remote_optimizer


class _ChiefHook:
    """A module hook that syncs with the parameter servers on the chief. Sent to a worker
    inside a module, it becomes a no-op (the worker's copy is refreshed per closure)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_worker_side_hook, ())


def _noop_hook(*args: Any) -> None:
    return None


def _worker_side_hook() -> Callable[..., None]:
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
      TypeError: `cluster_resolver` is not a ClusterResolver (e.g. an address string).
      ValueError: the cluster has no chief, worker or ps, or this task is not the chief.
      TimeoutError: naming the tasks that did not start in time.
    """

    #: The workers run closures the chief schedules, not the program: a loop that runs
    #: once per process (Lightning's) cannot drive it.
    CAPABILITIES = Capabilities(one_replica_per_process=False)

    def __init__(self, cluster_resolver: ClusterResolver,
                 variable_partitioner: Callable[..., Any] | None = None,
                 rpc_timeout: float = rpc_world.DEFAULT_RPC_TIMEOUT_SECONDS,
                 startup_timeout: float = rpc_world.DEFAULT_STARTUP_TIMEOUT_SECONDS) -> None:
        if not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                f"cluster_resolver must be a ts.cluster_resolver.ClusterResolver describing "
                f"the chief, workers and parameter servers, got cluster_resolver="
                f"{cluster_resolver!r}. Pass e.g. ts.SimpleClusterResolver(ts.ClusterSpec("
                "{'chief': [...], 'worker': [...], 'ps': [...]}), task_type='chief', "
                "task_id=0), ts.TFConfigClusterResolver(), or the resolver "
                "ts.parameter_server.local_cluster() returns.")
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
        runtime.current().on_shutdown(f"parameter_server.cluster.{id(membership)}",
                                      lambda: server.shutdown_cluster(membership))
        super().__init__(ParameterServerStrategyExtended(self, membership,
                                                         variable_partitioner))

    @property
    def extended(self) -> ParameterServerStrategyExtended:
        """This strategy's `ParameterServerStrategyExtended` (what the coordinator uses)."""
        return cast(ParameterServerStrategyExtended, self._extended)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster_resolver

    @property
    def variable_partitioner(self) -> Callable[..., Any] | None:
        return self.extended.variable_partitioner

    def __repr__(self) -> str:
        ext = self.extended
        return (f"ParameterServerStrategy(workers={len(ext.worker_devices)}, "
                f"ps={len(ext.parameter_devices)})")


def _wait_for_cluster(membership: rpc_world.Membership, timeout: float) -> None:
    spec = membership.spec
    expected = {rpc_world.task_name(job, i) for job in ("worker", "ps")
                for i in spec.task_indices(job)}
    missing = membership.wait_for_members(expected, timeout)
    if missing:
        raise TimeoutError(f"These tasks did not join the cluster within {timeout:.0f} s: "
                           f"{sorted(missing)}. Start each with `python -m "
                           f"torchstrategy.server` (TF_CONFIG set for its task).")
