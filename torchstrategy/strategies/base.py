"""`Strategy` and `StrategyExtended`: the API every strategy shares (tf.distribute's
``distribute_lib``).

`Strategy` is written once, here: ``scope``, ``run``, ``reduce``, ``gather``,
``experimental_local_results`` and the input functions check their arguments and context,
then call the strategy's `StrategyExtended`. `StrategyExtended` is an abstract contract:
each strategy implements every abstract method below, in full, and nothing else in the
package reaches into a strategy's private attributes. A new strategy is a new module with
a `Strategy` subclass (its constructor and properties) and a `StrategyExtended` subclass.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import numbers
import threading
import warnings
from typing import (Any, Callable, ClassVar, ContextManager, Iterable, Iterator, Mapping,
                    Sequence)

import torch

from torchstrategy import _compat, context, mirroring, nest, values
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy import ownership
from torchstrategy.cluster_resolver import ClusterResolver
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import CrossDeviceOps
from torchstrategy.collectives.reducer import GradientReducer
from torchstrategy.collectives.stats import ReductionStats
from torchstrategy.communication_options import CommunicationOptions
from torchstrategy.input.contexts import (InputContext, InputOptions, ValueContext,
                                          explained_small_local_batches)
from torchstrategy.replica_context import ReplicaContext
from torchstrategy.run_options import RunOptions
from torchstrategy.devices import parse_device
from torchstrategy.reduce_op import ReduceOp, as_mean_input, as_reduce_op
from torchstrategy.run_options import check_run_options
from torchstrategy.variables import Variable, VariablesByTensor

# The library logs through the standard "torchstrategy" logger and configures nothing: a
# program that wants the messages configures logging (the examples call basicConfig).
logger = logging.getLogger("torchstrategy")
logger.addHandler(logging.NullHandler())


class StrategyExtended(abc.ABC):
    """The parts of a strategy most programs do not need (tf.distribute's ``extended``),
    and the contract between `Strategy` and a concrete strategy.

    Facts every strategy provides: `replica_id` (this process's first replica),
    `num_replicas_in_sync`, `worker_devices`, `parameter_devices`, `is_chief`,
    `torch_device` (None where nothing is placed), `communicator` (collectives among this
    process's peers: ``all_reduce``, ``broadcast_``, ``broadcast_object``, ``barrier``).

    The library asks a strategy questions only through the methods and properties here:
    what it is (`capabilities`, one frozen `Capabilities` record, stated by the strategy
    class), `state_dict_for_checkpoint` / `load_state_dict_from_checkpoint` (checkpoints),
    `metric_sync` (``ts.metrics.sync``), `adopt`, `backward_replicas_outside_run`,
    `prepare_trainer_module` / `prepare_trainer_optimizer` / `broadcast_buffers` (a
    training loop the strategy does not run, Lightning's), and the class method
    `Strategy.build_for_trainer`. It never tests a strategy's class.

    The members group as: facts; running; cross-replica reductions and replica-context
    collectives; the scope (recording, and `settle_recorded_state`, the one moment what
    was recorded becomes consistent across replicas); variables (TF's ``extended`` API);
    input; capabilities and the hooks of loops and checkpoints the strategy does not run.
    """

    def __init__(self, container: Strategy) -> None:
        self._container = container
        self._scope_depth = threading.local()
        # The ts.Variables made under this strategy, found by their tensor (weak: a
        # variable's entry goes when the variable does); see `created_variable`.
        self._variables = VariablesByTensor()

    # -- facts ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def replica_id(self) -> int:
        """The replica id of this process's (first) replica; 0 is the chief's."""

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """The number of replicas taking part in each step, across all machines."""

    @property
    @abc.abstractmethod
    def worker_devices(self) -> tuple[Any, ...]:
        """The `torch.device`s of the replicas this process runs."""

    @property
    @abc.abstractmethod
    def parameter_devices(self) -> tuple[Any, ...]:
        """The devices parameters live on."""

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device | None:
        """The device this process's replica computes on (None: nothing is placed)."""

    @property
    @abc.abstractmethod
    def communicator(self) -> Communicator:
        """Collectives among the processes of this strategy (a world of one process
        where the user's program runs alone, as on a parameter-server chief)."""

    @property
    def is_chief(self) -> bool:
        """True in the one process that writes checkpoints, logs and progress bars."""
        return self.replica_id == 0

    @property
    def should_checkpoint(self) -> bool:
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self.is_chief

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    @property
    def cross_device_ops(self) -> CrossDeviceOps | None:
        return getattr(self.communicator, "cross_device_ops", None)

    # -- running ---------------------------------------------------------------------------
    @abc.abstractmethod
    def default_replica_context(self) -> ReplicaContext:
        """The `ReplicaContext` code outside any ``run`` sees when this strategy is the
        default one (only the default strategy's is ever used)."""

    @abc.abstractmethod
    def call_for_each_replica(self, fn: Callable[..., Any], args: Sequence[Any],
                              kwargs: Mapping[str, Any]) -> Any:
        """Runs ``fn(*args, **kwargs)`` for every replica this process runs, in replica
        context, and returns the result(s) as ``strategy.run`` returns them. Distributed
        values among the arguments are replaced by each replica's component."""

    # -- cross-replica reductions ------------------------------------------------------
    @abc.abstractmethod
    def reduce_across_replicas(self, reduce_op: ReduceOp | str, value: Any,
                               axis: int | None) -> Any:
        """``strategy.reduce``: the reduced value, identical on every replica."""

    @abc.abstractmethod
    def gather_across_replicas(self, value: Any, axis: int) -> Any:
        """``strategy.gather``: every replica's value concatenated along `axis`."""

    @abc.abstractmethod
    def local_results(self, value: Any) -> tuple[Any, ...]:
        """``experimental_local_results``: this process's components, as a tuple."""

    @abc.abstractmethod
    def batch_reduce_to(self, reduce_op: ReduceOp | str,
                        value_destination_pairs: Iterable[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list[Any]:
        """Reduces many values at once (one fused collective per dtype); each result is
        placed on its destination (a device, a tensor whose device to use, or None)."""

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduces `value` across replicas and places it on `destinations`; returns a
        `Mirrored` (the plain value with one replica)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    # -- collectives in replica context -------------------------------------------------
    @abc.abstractmethod
    def replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                           options: CommunicationOptions | None = None) -> Any:
        """``ReplicaContext.all_reduce``: the reduced value on every replica."""

    @abc.abstractmethod
    def replica_all_gather(self, value: Any, axis: int,
                           options: CommunicationOptions | None = None) -> Any:
        """``ReplicaContext.all_gather``: the values of every replica along `axis`."""

    # -- the scope: placement, recording, and the moment it settles -----------------------
    def scope_placement(self) -> ContextManager[Any]:
        """A context manager active inside ``scope()`` (e.g. the default device)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        """Called for every parameter registered on a module inside the scope (and on a
        module adopted by ``strategy.adopt``)."""

    @abc.abstractmethod
    def record_buffer(self, module: torch.nn.Module, name: str) -> None:
        """Called for every buffer registered on a module inside the scope."""

    @abc.abstractmethod
    def record_variable(self, variable: Variable) -> None:
        """Called for every ``ts.Variable`` created inside the scope."""

    def record_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """Called for every module attached to another inside the scope (nothing by
        default; ShardedStrategy finds each model's root through it)."""

    @abc.abstractmethod
    def recorded_in_scope(self, tensor: torch.Tensor) -> bool:
        """True for a parameter or buffer this strategy recorded (or made from one)."""

    @abc.abstractmethod
    def settle_recorded_state(self) -> None:
        """The one moment what was recorded since the last call becomes consistent across
        the replicas (replica 0's values; ShardedStrategy shards its models here) and ready
        for training. ``scope()`` calls it when the outermost scope exits; ``run``,
        ``adopt``, a Trainer's set-up and a strategy's own checkpoint methods call it first
        for what a scope still open holds. Every replica calls it at the same points; it
        communicates only when something was recorded."""

    # -- variables ---------------------------------------------------------------------
    def create_variable(self, *args: Any, **kwargs: Any) -> Variable | None:
        """The variable ``ts.Variable(*args, **kwargs)`` makes in this strategy's scope,
        or None to make the usual `MirroredVariable` / `SyncOnReadVariable`."""
        return None

    def check_variable(self, variable: Variable) -> None:
        """Raises if this strategy cannot hold `variable` (called when it is created)."""

    def write_variable(self, variable: Variable, new_value: torch.Tensor) -> None:
        """Writes a variable's (already aggregated) new value into its tensor (by default
        in place, converted to the tensor's dtype and device)."""
        tensor = variable.tensor
        with torch.no_grad():
            tensor.copy_(torch.as_tensor(new_value, dtype=tensor.dtype, device=tensor.device))

    def created_variable(self, variable: Variable) -> None:
        """Called for every ``ts.Variable`` made while this strategy is the current one (in
        its scope or inside its ``run``): remembered (weakly) for `value_container` and
        `variable_created_in_scope`."""
        self._variables.add(variable)

    def variable_created_in_scope(self, v: Any) -> bool:
        """True if `v` (a ``ts.Variable``, or a parameter, buffer or tensor) was created in
        this strategy's scope: a ``ts.Variable`` made under it, a parameter or buffer of a
        module built in ``scope()``, or a variable's tensor (tf.distribute's
        ``extended.variable_created_in_scope``)."""
        tensor = v.tensor if isinstance(v, Variable) else v
        known = self._variables.get(tensor)
        if known is not None:
            return known is v or tensor is v
        if not isinstance(v, torch.Tensor):
            return False
        return self.recorded_in_scope(v)

    def value_container(self, value: Any) -> Any:
        """The container `value` belongs to: the ``ts.Variable`` whose tensor `value` is, or
        `value` itself (tf.distribute's ``extended.value_container``; nothing else is
        wrapped here, so a parameter is its own container)."""
        known = self._variables.get(value)
        if known is not None:
            return known
        return value

    def colocate_vars_with(self, colocate_with_variable: Any) -> ContextManager[Any]:
        """A context manager: variables and modules created inside go where
        `colocate_with_variable` lives (tf.distribute's ``extended.colocate_vars_with``).

        Raises:
          ValueError: `colocate_with_variable` was not created in this strategy's scope
            (as TensorFlow refuses it).
        """
        if not self.variable_created_in_scope(colocate_with_variable):
            raise ValueError(
                f"colocate_vars_with needs a variable created in this strategy's scope "
                f"({type(self._container).__name__}), got {colocate_with_variable!r:.80}. "
                "Create it inside `with strategy.scope():` first.")
        return _placed_on(colocate_with_variable.device)

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (),
               kwargs: Mapping[str, Any] | None = None, group: bool = True) -> Any:
        """Runs ``fn(var, *args, **kwargs)`` once per copy of `var` this process holds (one
        here: a variable is one tensor per process), without recording gradients, and
        returns its result (tf.distribute's ``extended.update``). Distributed values in
        `args` / `kwargs` must be `Mirrored` (reduce per-replica values first, e.g. with
        ``reduce_to``); each is replaced by this replica's copy.

        Args:
          var: a ``ts.Variable``, parameter or tensor.
          fn: the update, e.g. ``lambda v, d: v.assign_add(d)``.
          group: True returns `fn`'s result; False a tuple of the results per copy.

        Raises:
          RuntimeError: called inside ``run`` (use ``ReplicaContext.merge_call``).
          ValueError: a `PerReplica` argument with more than one replica.
        """
        _require_cross_replica("extended.update", "ts.get_replica_context().merge_call("
                               "lambda strategy: strategy.extended.update(...))")
        kwargs = kwargs or {}
        leaves, _ = nest.flatten((args, kwargs))
        if self.num_replicas_in_sync > 1 and any(
                isinstance(leaf, values.PerReplica) for leaf in leaves):
            raise ValueError("extended.update(var, fn, args) needs Mirrored arguments (the "
                             "same on every replica), got a PerReplica. Reduce it first: "
                             "strategy.extended.reduce_to('SUM', value, var).")
        args, kwargs = values.local_component(tuple(args)), values.local_component(kwargs)
        with torch.no_grad():
            result = fn(var, *args, **kwargs)
        return result if group else (result,)

    def broadcast_to(self, tensor: torch.Tensor, destinations: Any) -> Any:
        """`tensor` on `destinations`, the same on every replica: in a strategy of several
        processes replica 0's value is sent to the others (a plain tensor outside ``run``
        is each process's own); returns a `Mirrored` (the tensor with one replica).
        tf.distribute's ``extended.broadcast_to``."""
        value = torch.as_tensor(tensor).detach().clone()
        self.communicator.broadcast_([value], src=0)
        device = _destination_device(destinations)
        if device is not None:
            value = value.to(device)
        mirrored = self.distribute_values_from_function(lambda _context: value)
        if isinstance(mirrored, values.DistributedValues):
            return values.Mirrored(mirrored.values, mirrored.replica_ids,
                                   mirrored.num_replicas)
        return mirrored

    # -- input -------------------------------------------------------------------------
    @abc.abstractmethod
    def distribute_dataset(self, dataset: Iterable[Any], options: InputOptions | None) -> Any:
        """``experimental_distribute_dataset``: replica r iterates slice r of each global
        batch."""

    @abc.abstractmethod
    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any],
                                          options: InputOptions | None) -> Any:
        """``distribute_datasets_from_function``: ``dataset_fn(InputContext)`` builds each
        input pipeline."""

    @abc.abstractmethod
    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``experimental_distribute_values_from_function``: ``value_fn(ValueContext)`` per
        local replica, as a `PerReplica`."""

    # -- optional capabilities -------------------------------------------------------------
    def check_run_options(self, options: RunOptions | None) -> RunOptions:
        """Returns the `RunOptions` of a ``run`` after refusing what this strategy cannot
        honour (see `torchstrategy.run_options`)."""
        return check_run_options(options, type(self._container).__name__)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication; the
        next backward outside sums everything accumulated since across replicas (DDP's
        ``no_sync``, for gradient accumulation). Where gradients are not communicated
        during backward this changes nothing."""
        yield

    @property
    def backward_replicas_outside_run(self) -> int:
        """How many replicas a ``backward()`` outside ``run`` sums gradients over (a
        DDP-style loop): loss scaling outside ``run`` divides by it. 1 by default: gradients
        are communicated only inside ``run``."""
        return 1

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> torch.nn.Module:
        """``strategy.adopt``: brings a module built outside the scope (and its optimizer)
        under this strategy, as if created in its scope; returns `module`.

        Raises:
          NotImplementedError: by default, saying to create the module in the scope.
        """
        raise NotImplementedError(
            f"{type(self._container).__name__} cannot adopt a module built outside its "
            "scope: create the module (and its optimizer) inside `with strategy.scope():`.")

    def host_copy(self, obj: Any) -> Any:
        """`obj` as a checkpoint stores it: tensors readable without this strategy's
        devices (TPUStrategy copies XLA tensors to the host); identity by default."""
        return obj

    def state_dict_for_checkpoint(self, obj: Any, model: torch.nn.Module | None = None) -> Any:
        """What a single-file checkpoint (`BackupAndRestore`, Lightning's) stores for `obj`.

        Every replica calls it at the same point (a strategy that shards parameters gathers
        them here); the chief's result is what is written. By default ``obj.state_dict()``.
        `model`: the module whose parameters an optimizer `obj` updates, where a strategy
        needs it to name them (ShardedStrategy)."""
        return obj.state_dict()

    def load_state_dict_from_checkpoint(self, obj: Any, state_dict: Any,
                                        model: torch.nn.Module | None = None) -> None:
        """Loads into `obj` what `state_dict_for_checkpoint` returned on the chief; every
        replica calls it with that same state. By default ``obj.load_state_dict(state_dict)``.
        """
        obj.load_state_dict(state_dict)

    # -- capabilities: what the library asks of a strategy ----------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """What this strategy is (`Capabilities`), as its class states it
        (``Strategy.CAPABILITIES``): the one answer the library reads."""
        return self._container.CAPABILITIES

    # The record's fields, read where the library asks one question (loss scaling, the
    # Lightning adapter): the same answer, never a second one.
    @property
    def one_replica_per_process(self) -> bool:
        """``capabilities.one_replica_per_process``."""
        return self.capabilities.one_replica_per_process

    @property
    def replicas_are_threads(self) -> bool:
        """``capabilities.replicas_are_threads``."""
        return self.capabilities.replicas_are_threads

    @property
    def traces_global_batch(self) -> bool:
        """``capabilities.traces_global_batch``."""
        return self.capabilities.traces_global_batch

    @property
    def shards_parameters(self) -> bool:
        """``capabilities.shards_parameters``."""
        return self.capabilities.shards_parameters

    @property
    def converts_checkpoint_state(self) -> bool:
        """``capabilities.converts_checkpoint_state``."""
        return self.capabilities.converts_checkpoint_state

    def metric_sync(self) -> "MetricSync":
        """How ``ts.metrics.sync`` makes a metric updated inside ``run`` give, at
        ``compute()`` in cross-replica context, the value over every replica's rows: a
        `MetricSync`. By default the metric's states are gathered over `communicator` when
        it spans several processes, and updates are serialised when the replicas are
        threads (``capabilities.replicas_are_threads``).

        Raises:
          NotImplementedError: a strategy whose replicas cannot share a metric (saying what
            to do instead).
        """
        comm = self.communicator
        spans_processes = isinstance(comm, Communicator) and comm.world_size > 1
        return MetricSync(gather_over=comm if spans_processes else None,
                          serialize_updates=self.capabilities.replicas_are_threads)

    def prepare_trainer_module(self, module: torch.nn.Module) -> None:
        """Brings `module`, already on `torch_device`, under this strategy for a training
        loop that this strategy does not run (Lightning's Trainer): afterwards its
        parameters are identical on every replica and ``backward()`` communicates their
        gradients as inside ``run``. Every replica calls it at the same point. By default
        every parameter and persistent buffer is recorded (as creating them inside
        ``scope()`` would) and `settle_recorded_state` makes them consistent; tensors
        recorded already are skipped."""
        for submodule in module.modules():
            for name, param in submodule.named_parameters(recurse=False):
                self.record_parameter(submodule, name, param)
            for name, _buffer in _compat.module_persistent_buffers(submodule):
                self.record_buffer(submodule, name)
        self.settle_recorded_state()

    def prepare_trainer_optimizer(self, optimizer: torch.optim.Optimizer,
                                  module: torch.nn.Module) -> None:
        """Called for each optimizer such a training loop creates for `module`, after
        `prepare_trainer_module`, on every replica. The optimizer stays the same object
        (LR schedulers refer to it): a strategy that partitions optimizer state changes it
        in place. By default nothing changes."""

    def synchronize_buffers(self) -> None:
        """Makes mirrored buffers (BatchNorm statistics) identical on every replica; the
        strategy calls it after each ``run``, an adapter driving its own loop (Lightning)
        after each optimizer step."""

    def broadcast_buffers(self) -> None:
        """Overwrites the floating buffers the scope recorded (BatchNorm statistics) with
        replica 0's on every replica, in one fused broadcast per dtype, as
        DistributedDataParallel does before a forward (``broadcast_buffers=True``).
        Every replica calls it at the same point; with one replica, or no buffers, it
        communicates nothing. The Lightning adapter calls it where Lightning's ``"ddp"``
        would broadcast. Nothing by default (a strategy that mirrors buffers over processes
        implements it)."""

    def stats(self) -> ReductionStats:
        """What the gradient reduction did in the last synchronised ``backward()``, as a
        `ReductionStats`; all zeros where nothing is communicated."""
        return ReductionStats(num_parameters=0)

    @property
    def gradient_reducer(self) -> GradientReducer | None:
        """The `GradientReducer` that sums gradients over processes during ``backward()``,
        or None where gradients are reduced another way (replica threads, FSDP2) or not at
        all. ``ts.scale_mean_loss`` asks it to average a backward as DDP does."""
        return None


@dataclasses.dataclass(frozen=True)
class MetricSync:
    """How a metric follows a strategy (`StrategyExtended.metric_sync`).

    Attributes:
      gather_over: the communicator (``gather_objects``, ``all_gather``) over which a
        metric's states are gathered at ``compute()``; None when one process already holds
        every replica's updates (or the job has one process).
      serialize_updates: the replicas are threads of this process sharing the metric: each
        ``update`` / ``forward`` must hold a lock and move its tensors to the metric's
        device.
    """

    gather_over: Communicator | None = None
    serialize_updates: bool = False


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

    #: What this strategy is (`Capabilities`): stated by the class, before any instance
    #: exists, so the table of Trainer names reads the same answer as a built strategy.
    CAPABILITIES: ClassVar[Capabilities] = Capabilities()

    def __init__(self, extended: StrategyExtended) -> None:
        if not isinstance(extended, StrategyExtended):
            raise TypeError(f"a Strategy needs a StrategyExtended, got {extended!r}.")
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas that take part in each step (across all machines)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        return None

    @classmethod
    def build_for_trainer(cls, devices: Sequence[torch.device], num_nodes: int, *,
                          name: str) -> "Strategy":
        """The strategy a training loop that runs once per process (Lightning's Trainer)
        asks for by `name` (e.g. ``Trainer(strategy="mirrored")``), built from the
        Trainer's `devices` (the `torch.device`s of this machine's replicas) and
        `num_nodes`; building it launches or joins the replicas, as the constructor does.

        Raises:
          ValueError: `devices` / `num_nodes` this strategy cannot run on (the message says
            what to pass).
          NotImplementedError: by default (a strategy that is not built from a Trainer's
            arguments; pass the strategy object instead).
        """
        raise NotImplementedError(
            f"{cls.__name__} is not built from a Trainer's devices: create it yourself and "
            "pass it (LightningStrategy(strategy)).")

    # -- scope ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Context in which parameters, buffers and ``ts.Variable``s become mirrored.

        Inside, modules are created on the replica's device; every parameter and buffer
        registered is recorded (nothing is wrapped). When the outermost scope exits, the
        new tensors are made identical on every replica (replica 0's values).

        Raises:
          RuntimeError: when a different strategy's scope is already active.
        """
        _check_not_mixing(self)
        mirroring.install_capture()
        ownership.note_scope_entered(self)
        ext = self._extended
        depth = getattr(ext._scope_depth, "value", 0)
        ext._scope_depth.value = depth + 1
        try:
            with context.enter(self, None), ext.scope_placement():
                yield self
        finally:
            ext._scope_depth.value = depth
        if depth == 0 and not context.in_run():
            ext.settle_recorded_state()

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> torch.nn.Module:
        """Brings `module`, built outside ``scope()``, under this strategy with the
        guarantees of building it inside (DDP's ``DistributedDataParallel(model)``,
        without a wrapper): it is moved to the replica's device, replicas check that they
        built the same parameters and buffers, replica 0's values are broadcast, gradients
        are summed in ``backward()``, buffers are averaged after each step, and Parameters
        or submodules registered on it later are recorded too. `optimizer`'s state (from a
        checkpoint, or steps taken before) is moved along and broadcast from replica 0.

        Returns `module` itself (nothing is wrapped; ``state_dict()`` keys are unchanged),
        so ``model = strategy.adopt(model, optimizer)`` reads like DDP. Every replica calls
        it at the same point (it is a collective).

        Raises:
          NotImplementedError: a strategy that cannot adopt (create the module in scope).
          TypeError / ValueError / RuntimeError: see `torchstrategy.ownership.replay_scope`
            (the mirrored strategies; ShardedStrategy's is its handling's ``adopt``).
        """
        return self._extended.adopt(module, optimizer)

    # -- run -----------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None, options: RunOptions | None = None) -> Any:
        """Runs ``fn(*args, **kwargs)`` on this process's replica(s), in replica context.

        Distributed values among the arguments are replaced by each replica's component.
        Inside `fn`, ``loss.backward()`` leaves in every mirrored parameter's ``.grad`` the
        sum of the gradients of all replicas, and ``ts.get_replica_context()`` gives the
        replica's id and its collectives.

        Args:
          fn: the step function.
          args / kwargs: its arguments (a tuple / a dict).
          options: a `ts.RunOptions`; values this strategy cannot honour are refused.

        Returns:
          `fn`'s result with every leaf wrapped in a `PerReplica` (plain values with one
          replica, as TensorFlow's single-device strategies return them).

        Raises:
          RuntimeError: when called inside ``run`` or while another strategy is active.
          TypeError / ValueError: `args` not a tuple or list, `kwargs` not a dict, options.
        """
        if context.in_run():
            raise RuntimeError("strategy.run was called inside strategy.run (or merge_call). "
                               "Nested run is not supported: call the function directly.")
        _check_not_mixing(self)
        if not callable(fn):
            raise TypeError(f"strategy.run needs a function, got {fn!r}.")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"strategy.run(fn, args=...) takes a tuple of arguments, got a "
                            f"{type(args).__name__}; write args=(x,) for one argument.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"strategy.run(fn, kwargs=...) takes a dict, got "
                            f"{type(kwargs).__name__}.")
        self._extended.check_run_options(options)
        with explained_small_local_batches(self.num_replicas_in_sync):
            return self._extended.call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    # -- cross-replica operations ---------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces a per-replica value (or nested structure) across replicas.

        Args:
          reduce_op: ``ts.ReduceOp.SUM`` / ``MEAN`` or the strings "SUM" / "MEAN".
          value: a `PerReplica` (e.g. the result of `run`), a `Mirrored`, or a tensor (in the
            SPMD model a tensor in cross-replica code is this replica's own value), or a
            nested structure of them.
          axis: None to reduce across replicas only; an int to also reduce along that
            dimension of each replica's value (MEAN then averages over all elements along
            `axis` on all replicas, so uneven slices weigh right).

        A Python number is not a distributed value: as in TensorFlow, with ``axis=None``
        MEAN returns it as it is, SUM returns it with one replica (or when it is 0) and
        raises with more (there is one value, not one per replica); pass a tensor to sum
        each process's own number. MEAN of integer tensors gives the floating mean (true
        division, see `torchstrategy.reduce_op.mean_dtype`).

        Returns:
          The reduced tensor (structure), identical on every replica.

        Raises:
          ValueError: SUM of a Python number with more than one replica; MEAN of bools.
        """
        _require_cross_replica("reduce")
        _check_axis_argument(axis, "reduce", allow_none=True)
        op = as_reduce_op(reduce_op)
        leaves, spec = nest.flatten(value)
        numbers_at = [i for i, leaf in enumerate(leaves) if _is_number(leaf)]
        if axis is None and numbers_at:
            for i in numbers_at:
                _check_number_reducible(op, leaves[i], i, self.num_replicas_in_sync)
            if len(numbers_at) == len(leaves):
                return value
            rest = [leaf for i, leaf in enumerate(leaves) if i not in numbers_at]
            reduced = iter(self._extended.reduce_across_replicas(
                op, _mean_inputs(op, rest), None))
            return nest.pack(spec, [leaf if i in numbers_at else next(reduced)
                                    for i, leaf in enumerate(leaves)])
        return self._extended.reduce_across_replicas(op, _mean_inputs(op, value), axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates a per-replica value from every replica along `axis`, in replica
        order; sizes along `axis` may differ between replicas."""
        _require_cross_replica("gather")
        _check_axis_argument(axis, "gather", allow_none=False)
        return self._extended.gather_across_replicas(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of `value` held by this process, as a tuple (one per local
        replica); a nested structure gives a tuple of structures."""
        return self._extended.local_results(value)

    # -- input ---------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable[Any],
                                        options: InputOptions | None = None) -> Any:
        """Distributes an iterable of *global* batches: replica r gets slice r of each.

        See `torchstrategy.input.distributed_dataset.DistributedDataset`.
        """
        return self._extended.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any],
                                          options: InputOptions | None = None) -> Any:
        """Calls ``dataset_fn(ts.InputContext)`` to build each replica's input pipeline."""
        return self._extended.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_datasets_from_function(
            self, dataset_fn: Callable[[InputContext], Any],
            options: InputOptions | None = None) -> Any:
        """Deprecated alias of `distribute_datasets_from_function` (TensorFlow 2.0-2.3's
        name): warns with a DeprecationWarning, then does the same."""
        warnings.warn("strategy.experimental_distribute_datasets_from_function is "
                      "deprecated (as in TensorFlow): call "
                      "strategy.distribute_datasets_from_function instead.",
                      DeprecationWarning, stacklevel=2)
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_run_v2(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                            kwargs: Mapping[str, Any] | None = None,
                            options: RunOptions | None = None) -> Any:
        """Deprecated alias of `run` (TensorFlow 2.0-2.1's name): warns with a
        DeprecationWarning, then does the same."""
        warnings.warn("strategy.experimental_run_v2 is deprecated (as in TensorFlow): call "
                      "strategy.run instead.", DeprecationWarning, stacklevel=2)
        return self.run(fn, args, kwargs, options)

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls ``value_fn(ts.ValueContext)`` for each local replica; returns a
        `PerReplica`."""
        return self._extended.distribute_values_from_function(value_fn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


def trainer_device_names(devices: Sequence[torch.device], name: str) -> list[str]:
    """The device names (``"cpu:0"``, ``"cuda:1"``) of a Trainer's `devices` for a strategy
    with one process per CPU or CUDA device (`Strategy.build_for_trainer`); several CPU
    replicas get distinct names.

    Raises:
      ValueError: devices of another type (the message names the Trainer's `name`).
    """
    device_type = devices[0].type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"Trainer(strategy={name!r}) runs on CPU or CUDA devices, not "
            f"{device_type}. Pass accelerator='cpu' or 'cuda'.")
    if device_type == "cpu":
        return [f"cpu:{i}" for i in range(len(devices))]
    return [str(d) for d in devices]


def check_trainer_replicas(strategy: Strategy, devices: Sequence[torch.device],
                           num_nodes: int, advice: str = "") -> None:
    """Raises ValueError when `strategy`'s replica count differs from the Trainer's
    ``num_nodes * len(devices)`` (`advice` ends the message)."""
    count = len(devices)
    if strategy.num_replicas_in_sync != count * num_nodes:
        raise ValueError(
            f"Trainer(num_nodes={num_nodes}, devices={count}) asks for "
            f"{count * num_nodes} replicas, but the job has "
            f"{strategy.num_replicas_in_sync}.{advice}")


def _check_not_mixing(strategy: Strategy) -> None:
    active = context.active_non_default_strategy()
    if active is not None and active is not strategy:
        raise RuntimeError(f"Mixing different strategies is not allowed: {active!r} is "
                           f"already active here, so {strategy!r} cannot be entered. Exit "
                           "the first strategy's scope before using another.")


def _require_cross_replica(name: str, instead: str | None = None) -> None:
    # Replica context of a run (merge_call's merge_fn runs in cross-replica context, where
    # strategy.reduce / gather are allowed, as in TensorFlow).
    if context.get_replica_context() is not None and context.in_run():
        if instead is None:
            instead = f"ts.get_replica_context().all_{'reduce' if name == 'reduce' else 'gather'}(...)"
        raise RuntimeError(f"strategy.{name} must be called in cross-replica context "
                           f"(outside strategy.run). Inside run, use {instead}.")


def _is_number(leaf: Any) -> bool:
    """A Python (or numpy) number: one value for every replica, not a distributed one."""
    return isinstance(leaf, numbers.Number) and not isinstance(leaf, torch.Tensor)


def _check_number_reducible(op: ReduceOp, number: Any, index: int, num_replicas: int
                            ) -> None:
    """TensorFlow's rule for reducing a non-distributed value (``reduce_non_distributed_
    value``): 0 and MEAN give it back, SUM needs a single replica."""
    if op is ReduceOp.SUM and num_replicas > 1 and number != 0:
        raise ValueError(
            f"strategy.reduce('SUM', ...): leaf {index} is the plain number {number!r}, one "
            f"value rather than one per replica, so it cannot be summed over "
            f"{num_replicas} replicas (TensorFlow raises too). Reduce what strategy.run "
            "returned; to add up a number each replica computed itself, pass it as a "
            "tensor: strategy.reduce('SUM', torch.tensor(x)).")


def _mean_inputs(op: ReduceOp, structure: Any) -> Any:
    """For MEAN, integer tensors (and integer components of PerReplica / Mirrored values)
    converted to the floating dtype their mean has; anything else unchanged."""
    if op is not ReduceOp.MEAN:
        return structure

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return as_mean_input(op, leaf)
        if type(leaf) in (values.PerReplica, values.Mirrored) and any(
                isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())
                for v in leaf.values):
            return type(leaf)(tuple(as_mean_input(op, v) if isinstance(v, torch.Tensor)
                                    else v for v in leaf.values), leaf.replica_ids,
                              leaf.num_replicas)
        return leaf
    return nest.map_structure(convert, structure)


def _placed_on(device: Any) -> ContextManager[Any]:
    """Inside, torch creates tensors on `device` (nothing changes for the CPU, torch's
    default)."""
    device = torch.device(device)
    return contextlib.nullcontext() if device.type == "cpu" else device


def _destination_device(destinations: Any) -> torch.device | None:
    """The `torch.device` a ``broadcast_to`` destination names (None: stay where it is)."""
    if destinations is None:
        return None
    if isinstance(destinations, values.DistributedValues):
        destinations = destinations.values[0]
    device = getattr(destinations, "device", None)
    if isinstance(device, torch.device):
        return device
    return parse_device(destinations).torch_device


def _check_axis_argument(axis: Any, name: str, allow_none: bool) -> None:
    if axis is None and allow_none:
        return
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"strategy.{name}(..., axis={axis!r}): axis must be an int"
                        + (" or None" if allow_none else "") + f", got a {type(axis).__name__}.")

