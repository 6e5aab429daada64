"""`ParameterHandling`: how a data-parallel strategy keeps its parameters, as a component.

A strategy of the data-parallel family (the default strategy, OneDeviceStrategy, the
mirrored strategies, ShardedStrategy) is one `DataParallelExtended` holding one
`ParameterHandling`; the handling, not a subclass, decides what becomes of the parameters:

- `MirroredParameters` (here): every replica holds every parameter, replica 0's values are
  broadcast, a `GradientReducer` sums the gradients during ``backward()`` (DDP's model);
- ``ShardedParameters`` (`torchstrategy.strategies.sharding.parameters`): parameters,
  gradients and optimizer state sharded with FSDP2.

The protocol, in the order a program meets it:

1. record what is built in the scope: `record_parameter`, `record_buffer`,
   `record_variable` (`check_variable` refuses what the handling cannot hold),
   `record_submodule`;
2. settle (`settle`), the one moment at which what was recorded becomes consistent across
   the replicas (compared, broadcast from replica 0, and, for the sharded handling,
   sharded). The strategy calls it through one entry point,
   ``extended.settle_recorded_state()``: at the outermost ``scope()`` exit; where a scope
   is still open, before whatever needs the settled state (``run``, ``adopt``, a Trainer's
   set-up, a checkpoint of the handling's own);
3. `adopt` a module built outside the scope, as if recorded inside;
4. train: `first_run_check` (wraps runs until one returns), `gradient_reducer`,
   `no_sync`, `stats`, `synchronize_buffers` / `broadcast_buffers`;
5. checkpoint: `state_dict_for_checkpoint` / `load_state_dict_from_checkpoint` (whether
   they convert is the strategy's ``Capabilities.converts_checkpoint_state``);
6. a loop the strategy does not run (Lightning's Trainer): `prepare_trainer_module`,
   `prepare_trainer_optimizer`.

Buffers and non-trainable variables are mirrored by every handling (the defaults here, over
`recorded`); an implementation adds to the defaults and never switches one off.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, ClassVar, ContextManager, Iterator

import torch

from torchstrategy import _compat, mirroring, module_state, ownership
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.reducer import GradientReducer
from torchstrategy.collectives.stats import ReductionStats
from torchstrategy.reduce_op import ReduceOp
from torchstrategy.strategies.base import Strategy, StrategyExtended
from torchstrategy.variables import Variable


class ParameterHandling(abc.ABC):
    """How one data-parallel strategy's parameters are recorded, made consistent across
    the replicas, trained and checkpointed (the module docstring lists the protocol).

    A handling serves exactly one strategy: `attach` is called once, by the strategy's
    `DataParallelExtended`, before anything is recorded.

    Class attributes:
      EXTENDED_MEMBERS: names of this handling's own public members that
        ``strategy.extended`` also answers (ShardedStrategy's ``extended.mesh``,
        ``extended.save_checkpoint``...); empty by default.
    """

    EXTENDED_MEMBERS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        #: What the scope recorded: parameters (where mirrored), buffers, variable tensors.
        self.recorded = mirroring.MirroredState()
        self._strategy: Strategy | None = None
        self._extended: StrategyExtended | None = None

    def attach(self, strategy: Strategy, extended: StrategyExtended) -> None:
        """Binds this handling to `strategy`, whose extended (being built) is `extended`:
        its `communicator`, `torch_device` and replica id are read from then on.

        Raises:
          RuntimeError: the handling serves another strategy already.
        """
        if self._strategy is not None and self._strategy is not strategy:
            raise RuntimeError(f"This {type(self).__name__} already serves "
                               f"{self._strategy!r}; give each strategy its own.")
        self._strategy = strategy
        self._extended = extended

    # -- what it serves ------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a strategy yet.")
        return self._strategy

    @property
    def extended(self) -> StrategyExtended:
        if self._extended is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a strategy yet.")
        return self._extended

    @property
    def communicator(self) -> Communicator:
        return self.extended.communicator

    @property
    def world_size(self) -> int:
        return self.communicator.world_size

    # -- 1. recording --------------------------------------------------------------------
    @abc.abstractmethod
    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        """A parameter registered on `module` inside the scope (or on an adopted module)."""

    def record_buffer(self, module: torch.nn.Module, name: str) -> None:
        """A buffer registered on `module` inside the scope: mirrored (broadcast at
        `settle`, averaged by `synchronize_buffers`)."""
        self.recorded.add_buffer(module, name)

    def record_variable(self, variable: Variable) -> None:
        """A ``ts.Variable`` created inside the scope: its tensor is mirrored, as a
        parameter when trainable."""
        self.recorded.add_tensor(variable.tensor, variable.trainable,
                                 f"Variable {variable.name!r}")

    def check_variable(self, variable: Variable) -> None:
        """Raises if this handling cannot hold `variable` (when it is created)."""

    def record_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """`child` was attached to `parent` inside the scope (nothing by default)."""

    def created_in_scope(self, tensor: torch.Tensor) -> bool:
        """True for a parameter or buffer this handling recorded (or made, sharding)."""
        return self.recorded.is_parameter(tensor) or any(
            b is tensor for b in self.recorded.buffers())

    # -- 2. the one moment ---------------------------------------------------------------
    @abc.abstractmethod
    def settle(self) -> None:
        """Makes what was recorded since the last call consistent across the replicas and
        ready for training. Every replica calls it at the same point (through
        ``extended.settle_recorded_state()``); it communicates only when something was
        recorded.

        Raises:
          ValueError: replicas that recorded different tensors (the first difference and
            the replicas are named), before anything is sent onto them.
        """

    # -- 3. adopting ---------------------------------------------------------------------
    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> torch.nn.Module:
        """``strategy.adopt``: `module` built outside the scope (and its optimizer) is
        handled as if built inside; returns `module`. A collective.

        Raises:
          NotImplementedError: by default (a handling that records its own way and cannot
            replay that for a module built outside the scope), saying to build it inside.
        """
        raise NotImplementedError(
            f"{type(self.strategy).__name__} cannot adopt a module built outside its "
            "scope: create the module (and its optimizer) inside `with strategy.scope():`.")

    # -- 4. training ---------------------------------------------------------------------
    def first_run_check(self) -> ContextManager[Any]:
        """What runs of the user's function are wrapped in until one returns (nothing by
        default)."""
        return contextlib.nullcontext()

    @property
    def gradient_reducer(self) -> GradientReducer | None:
        """The `GradientReducer` summing gradients during ``backward()`` (None by
        default: gradients are reduced another way)."""
        return None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside
        communicates everything accumulated (nothing changes by default)."""
        yield

    def stats(self) -> ReductionStats:
        """What the gradient reduction did in the last synchronised ``backward()``."""
        return ReductionStats(num_parameters=0)

    def synchronize_buffers(self) -> None:
        """Floating buffers (BatchNorm statistics) become their mean over the replicas,
        as TensorFlow's MEAN-aggregated moving averages do (after each step)."""
        if self.world_size > 1:
            buffers = self.recorded.floating_buffers()
            if buffers:
                with torch.no_grad():
                    # Their layout was compared at `settle`: no check per step.
                    self.communicator.all_reduce(buffers, ReduceOp.MEAN, inplace=True,
                                                 check_layout=False)

    def broadcast_buffers(self) -> None:
        """Floating buffers become replica 0's on every replica (one fused broadcast per
        dtype), as DistributedDataParallel does before a forward."""
        if self.world_size > 1:
            buffers = self.recorded.floating_buffers()
            if buffers:
                with torch.no_grad():
                    self.communicator.broadcast_(buffers, src=0)

    # -- 5. checkpoints ------------------------------------------------------------------
    def state_dict_for_checkpoint(self, obj: Any, model: torch.nn.Module | None = None
                                  ) -> Any:
        """What a single-file checkpoint stores for `obj` (``obj.state_dict()`` by
        default). Every replica calls it; the chief's result is written."""
        return obj.state_dict()

    def load_state_dict_from_checkpoint(self, obj: Any, state_dict: Any,
                                        model: torch.nn.Module | None = None) -> None:
        """Loads what `state_dict_for_checkpoint` returned on the chief into `obj`."""
        obj.load_state_dict(state_dict)

    # -- 6. a loop the strategy does not run -----------------------------------------------
    def prepare_trainer_module(self, module: torch.nn.Module) -> None:
        """`module`, on the replica's device, is brought under the strategy for a loop the
        strategy does not run: every parameter and persistent buffer is recorded (as
        creating them inside ``scope()`` would; recorded ones are skipped), then settled."""
        for submodule in module.modules():
            for name, param in submodule.named_parameters(recurse=False):
                self.record_parameter(submodule, name, param)
            for name, _buffer in _compat.module_persistent_buffers(submodule):
                self.record_buffer(submodule, name)
        self.extended.settle_recorded_state()

    def prepare_trainer_optimizer(self, optimizer: torch.optim.Optimizer,
                                  module: torch.nn.Module) -> None:
        """Each optimizer such a loop creates for `module`, after `prepare_trainer_module`;
        it stays the same object (changed in place where needed). Nothing by default."""

    def rebuild_after_regroup(self, parameters: list[torch.Tensor] | None = None) -> None:
        """Live recovery's hook: the communicator now spans another set of replicas (a new
        process group, see `torchstrategy.fault_tolerance.live_recovery`); whatever was
        built for the old one is built again, for `parameters` (in this order, the same on
        every replica) where given. A handling that cannot refuses.

        Raises:
          NotImplementedError: this handling cannot continue on another group.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot continue on a regrouped set of replicas (live "
            "recovery): use MultiWorkerMirroredStrategy or MirroredStrategy, or "
            "BackupAndRestore to restart the job.")


class MirroredParameters(ParameterHandling):
    """Parameters mirrored as DistributedDataParallel's: every replica holds all of them,
    replicas compare their layout and take replica 0's values at `settle`, and with
    several replicas a `GradientReducer` sums the gradients during every ``backward()``
    (inside ``run`` or not).

    Args:
      bucket_cap_bytes: the gradient reducer's largest bucket (None: 25 MiB).

    Raises:
      ValueError: a bucket cap that is not positive.
    """

    def __init__(self, bucket_cap_bytes: float | None = None) -> None:
        if bucket_cap_bytes is not None and not bucket_cap_bytes > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got "
                             f"{bucket_cap_bytes / (1024 * 1024):g}.")
        super().__init__()
        self._bucket_cap_bytes = bucket_cap_bytes
        self._reducer: GradientReducer | None = None

    def attach(self, strategy: Strategy, extended: StrategyExtended) -> None:
        """As `ParameterHandling.attach`; with several replicas the gradient reducer is
        built here."""
        super().attach(strategy, extended)
        if self._reducer is None and self.world_size > 1:
            # The reducer takes the cap as given (a fraction of a MiB is a float of bytes).
            kwargs: dict[str, Any] = {} if self._bucket_cap_bytes is None else \
                {"bucket_cap_bytes": self._bucket_cap_bytes}
            self._reducer = GradientReducer(self.communicator, **kwargs)

    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        self.recorded.add_parameter(param, f"{type(module).__name__}.{name}")
        self._own(module)

    def record_buffer(self, module: torch.nn.Module, name: str) -> None:
        super().record_buffer(module, name)
        self._own(module)

    def _own(self, module: torch.nn.Module) -> None:
        """Marks `module`, which registered a tensor this strategy mirrors, as its own
        (`module_state`), so that checkpoints of it go through this strategy wherever they
        are taken (``checkpoint.owning_extended``), as for an adopted module. A module
        belongs to the strategy that recorded it last (as ``adopt`` makes it the
        adopter's): a LightningModule handed to a second Trainer is the second's."""
        module_state.attach(module, self.extended)

    def settle(self) -> None:
        """Broadcasts what was recorded since the last call from replica 0, after the
        replicas compared names, shapes and dtypes (as DDP verifies its parameters), and
        gives the new parameters to the gradient reducer."""
        labelled = self.recorded.take_pending_labelled()
        if not labelled:
            return
        pending = [tensor for _, tensor in labelled]
        comm = self.communicator
        if comm.world_size > 1:
            mirroring.check_replicas_agree(comm, labelled)
            with torch.no_grad():
                comm.broadcast_(pending, src=0)
        if self._reducer is not None:
            self._reducer.add_parameters([t for t in pending
                                          if isinstance(t, torch.nn.Parameter)
                                          or self.recorded.is_parameter(t)])

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> torch.nn.Module:
        """Replays the scope's recording for `module` (and broadcasts `optimizer`'s state):
        `ownership.replay_scope`."""
        return ownership.replay_scope(self.strategy, module, optimizer)

    def first_run_check(self) -> ContextManager[Any]:
        """With several replicas, a RuntimeWarning naming the parameters of the first module
        the run calls that are not mirrored (`ownership.warn_if_unmirrored`)."""
        if self.world_size > 1:
            return ownership.warn_if_unmirrored(self.strategy, self.recorded.is_parameter)
        return contextlib.nullcontext()

    @property
    def gradient_reducer(self) -> GradientReducer | None:
        """The reducer (None with one replica): its ``bucket_sizes``, ``bucket_layout()``,
        ``is_bucket_view(p)``."""
        return self._reducer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: the reducer's hooks only accumulate inside."""
        if self._reducer is None:
            yield
        else:
            with self._reducer.no_sync():
                yield

    def stats(self) -> ReductionStats:
        if self._reducer is None:
            return ReductionStats(num_parameters=0)
        return self._reducer.stats()

    def rebuild_after_regroup(self, parameters: list[torch.Tensor] | None = None) -> None:
        """A new gradient reducer over the regrouped communicator, for `parameters`, else
        the old reducer's in the same order (none with one replica left); the old one is
        closed (its hooks do nothing from then on)."""
        old = self._reducer
        params = list(parameters) if parameters is not None else \
            old.parameters if old is not None else []
        if old is not None:
            old.close()
        self._reducer = None
        if self.world_size > 1 and params:
            kwargs: dict[str, Any] = {} if self._bucket_cap_bytes is None else \
                {"bucket_cap_bytes": self._bucket_cap_bytes}
            self._reducer = GradientReducer(self.communicator, **kwargs)
            self._reducer.add_parameters(params)
