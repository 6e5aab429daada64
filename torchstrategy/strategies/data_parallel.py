"""The data-parallel family: one replica per process, its parameters kept by a component.

- `DataParallelExtended` (final): `ProcessReplicaExtended` plus a `ParameterHandling`
  (`torchstrategy.strategies.parameters`) that decides what becomes of the parameters:
  `MirroredParameters` (the default strategy, OneDeviceStrategy, MirroredStrategy,
  MultiWorkerMirroredStrategy) or ``ShardedParameters`` (ShardedStrategy). Everything the
  scope records goes to the handling; ``settle_recorded_state`` is its `settle`, the one
  moment what was recorded becomes consistent across the replicas (for ShardedStrategy: the
  moment a model is sharded). No subclass switches any of it off: a strategy that keeps
  its parameters another way is another handling.
- `DataParallelStrategy`: the builder the mirrored and sharded strategies are thin
  constructors over: the checks their options share (`check_communication_options`,
  `resolve_cluster`, `check_bucket_cap_mb`), the start-up of this process's replica
  (`torchstrategy.strategies.startup`), the worker properties and the Trainer's build.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Sequence, final

import torch

from torchstrategy.cluster_resolver import ClusterResolver, detect
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import CrossDeviceOps
from torchstrategy.collectives.reducer import GradientReducer
from torchstrategy.collectives.stats import ReductionStats
from torchstrategy.communication_options import (CommunicationImplementation,
                                                 CommunicationOptions)
from torchstrategy.launch import world as world_lib
from torchstrategy.strategies.base import (Strategy, check_trainer_replicas,
                                          trainer_device_names)
from torchstrategy.strategies.parameters import ParameterHandling
from torchstrategy.strategies.process_replica import ProcessReplicaExtended
from torchstrategy.strategies.startup import ReplicaProcess, start_replica_process
from torchstrategy.variables import Variable


@final
class DataParallelExtended(ProcessReplicaExtended):
    """One replica in this process; its parameters kept by `parameters` (a
    `ParameterHandling`). `ProcessReplicaExtended` plus:

    - the scope's recording (``record_*``) handed to the handling, settled by
      `settle_recorded_state` (the handling's `settle`: scope exit, the start of ``run``);
    - floating buffers averaged over the replicas after each step (`synchronize_buffers`);
    - ``adopt``, the first run's check, ``no_sync``, the gradient reducer, ``stats``, the
      checkpoint conversion and the Trainer hooks: the handling's.

    Members a handling lists in its ``EXTENDED_MEMBERS`` are answered here too
    (ShardedStrategy's ``extended.mesh``, ``extended.export_state_dict``...).

    Args:
      container / communicator / torch_device / place_in_scope: as for
        `ProcessReplicaExtended`.
      parameters: the handling (serving this strategy only).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # `typing.final` is for type checkers; a program subclassing it learns it here.
        raise TypeError(f"{cls.__name__}: DataParallelExtended is final. A strategy that "
                        "keeps its parameters another way gives it another "
                        "ParameterHandling (torchstrategy.strategies.parameters).")

    def __init__(self, container: Strategy, communicator: Communicator,
                 torch_device: torch.device | None, parameters: ParameterHandling,
                 place_in_scope: bool = True) -> None:
        if not isinstance(parameters, ParameterHandling):
            raise TypeError(f"DataParallelExtended needs a ParameterHandling, got "
                            f"{parameters!r}.")
        super().__init__(container, communicator, torch_device, place_in_scope)
        self._parameters = parameters
        # Whether the handling's first-run check has passed (it wraps every run until one
        # succeeds).
        self._first_run_checked = False
        parameters.attach(container, self)

    @property
    def parameters(self) -> ParameterHandling:
        """The component that keeps this strategy's parameters."""
        return self._parameters

    def __getattr__(self, name: str) -> Any:
        # Only for names not found the usual way: the handling's own members it lists.
        parameters = self.__dict__.get("_parameters")
        if parameters is not None and name in type(parameters).EXTENDED_MEMBERS:
            return getattr(parameters, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}"
                             + (f" ({type(parameters).__name__} adds "
                                f"{sorted(type(parameters).EXTENDED_MEMBERS)})"
                                if parameters is not None and
                                type(parameters).EXTENDED_MEMBERS else ""))

    # -- running ---------------------------------------------------------------------------
    def _run_guard(self) -> ContextManager[Any]:
        if self._first_run_checked:
            return contextlib.nullcontext()
        return self._checking_first_run()

    @contextlib.contextmanager
    def _checking_first_run(self) -> Iterator[None]:
        with self._parameters.first_run_check():
            yield
        self._first_run_checked = True

    # -- the scope -----------------------------------------------------------------------
    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        self._parameters.record_parameter(module, name, param)

    def record_buffer(self, module: torch.nn.Module, name: str) -> None:
        self._parameters.record_buffer(module, name)

    def record_variable(self, variable: Variable) -> None:
        self._parameters.record_variable(variable)

    def record_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        self._parameters.record_submodule(parent, child)

    def check_variable(self, variable: Variable) -> None:
        self._parameters.check_variable(variable)

    def recorded_in_scope(self, tensor: torch.Tensor) -> bool:
        return self._parameters.created_in_scope(tensor)

    def settle_recorded_state(self) -> None:
        """The handling's `ParameterHandling.settle`."""
        self._parameters.settle()

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> torch.nn.Module:
        return self._parameters.adopt(module, optimizer)

    def continue_on_regrouped_world(self, world: world_lib.World,
                                    parameters: list[torch.Tensor] | None = None) -> None:
        """Live recovery's hook (`torchstrategy.fault_tolerance.live_recovery`): the
        runtime has replaced the default process group by one over `world` (the
        survivors); this replica becomes replica ``world.rank`` of ``world.world_size``
        (``num_replicas_in_sync`` follows), and the handling rebuilds what it built for
        the old group (the gradient reducer; for `parameters` in this order where given,
        the same on every replica). The strategy's ``num_workers`` /
        ``worker_index`` / ``is_chief`` describe `world` from then on.

        Raises:
          NotImplementedError: a handling that cannot continue on another group
            (ShardedStrategy's), or cross-device ops holding sub-groups of the old one.
        """
        if getattr(self._comm.cross_device_ops, "create_groups", None) is not None:
            raise NotImplementedError(
                f"{type(self._comm.cross_device_ops).__name__} keeps per-machine groups of "
                "the original replicas; live recovery needs the default NcclAllReduce.")
        self._comm.rank = world.rank
        self._comm.world_size = world.world_size
        # The roll call counted the old group's replicas; failures of the new group are
        # named by live recovery itself.
        self._comm.diagnose = None
        self._parameters.rebuild_after_regroup(parameters)
        if isinstance(self._container, DataParallelStrategy):
            self._container._world = world

    # -- training --------------------------------------------------------------------------
    def synchronize_buffers(self) -> None:
        """Buffers (BatchNorm statistics) become the mean over replicas after each step."""
        self._parameters.synchronize_buffers()

    def broadcast_buffers(self) -> None:
        self._parameters.broadcast_buffers()

    @property
    def backward_replicas_outside_run(self) -> int:
        """Every replica: gradients are reduced in any ``backward()``, inside ``run`` or
        not (the reducer's hooks, FSDP2's)."""
        return self._comm.world_size

    @property
    def gradient_reducer(self) -> GradientReducer | None:
        return self._parameters.gradient_reducer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._parameters.no_sync():
            yield

    def stats(self) -> ReductionStats:
        return self._parameters.stats()

    # -- checkpoints and a loop the strategy does not run -----------------------------------
    def state_dict_for_checkpoint(self, obj: Any, model: torch.nn.Module | None = None) -> Any:
        return self._parameters.state_dict_for_checkpoint(obj, model)

    def load_state_dict_from_checkpoint(self, obj: Any, state_dict: Any,
                                        model: torch.nn.Module | None = None) -> None:
        self._parameters.load_state_dict_from_checkpoint(obj, state_dict, model)

    def prepare_trainer_module(self, module: torch.nn.Module) -> None:
        self._parameters.prepare_trainer_module(module)

    def prepare_trainer_optimizer(self, optimizer: torch.optim.Optimizer,
                                  module: torch.nn.Module) -> None:
        self._parameters.prepare_trainer_optimizer(optimizer, module)


# -- the builder ---------------------------------------------------------------------------
def check_communication_options(options: CommunicationOptions | None
                                ) -> CommunicationOptions:
    """`options`, or the defaults for None.

    Raises:
      TypeError: not a `ts.CommunicationOptions`.
    """
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError(f"communication_options must be a ts.CommunicationOptions, got "
                        f"{options!r}.")
    return options


def resolve_cluster(resolver: ClusterResolver | None) -> ClusterResolver:
    """`resolver`, or the one the environment describes for None
    (`torchstrategy.cluster_resolver.detect`).

    Raises:
      TypeError: not a `ClusterResolver`.
    """
    if resolver is None:
        resolver = detect.default_resolver()
    if not isinstance(resolver, ClusterResolver):
        raise TypeError(f"cluster_resolver must be a ts.cluster_resolver.ClusterResolver, "
                        f"got {resolver!r}.")
    return resolver


def check_bucket_cap_mb(bucket_cap_mb: Any) -> float:
    """`bucket_cap_mb` in bytes.

    Raises:
      ValueError: not a positive finite number of MiB (checked before any replica is
        launched, whatever their number).
    """
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not 0 < bucket_cap_mb < float("inf"):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got "
                         f"bucket_cap_mb={bucket_cap_mb!r} (the default is 25).")
    return float(bucket_cap_mb) * 1024 * 1024


class DataParallelStrategy(Strategy):
    """What the strategies of one replica per process share: their start-up and their
    extended (a `DataParallelExtended` holding the handling `make_parameters` returns),
    the worker properties and the Trainer's build. A subclass's constructor checks its own
    arguments (before anything is launched) and calls this one.

    Args:
      make_parameters: builds the `ParameterHandling` from this process's
        `ReplicaProcess` (its world and device are known then).
      devices / cross_device_ops / timeout_seconds / cluster_resolver / implementation /
      group_for_one_replica / check_world: `startup.start_replica_process`'s.
    """

    def __init__(self, make_parameters: Callable[[ReplicaProcess], ParameterHandling], *,
                 devices: Sequence[str | torch.device] | None,
                 cross_device_ops: CrossDeviceOps, timeout_seconds: float | None,
                 cluster_resolver: ClusterResolver | None = None,
                 implementation: CommunicationImplementation =
                 CommunicationImplementation.AUTO,
                 group_for_one_replica: bool = True,
                 check_world: Callable[[world_lib.World], object] | None = None) -> None:
        process = start_replica_process(
            devices=devices, cross_device_ops=cross_device_ops,
            timeout_seconds=world_lib.timeout_seconds(timeout_seconds),
            cluster_resolver=cluster_resolver, implementation=implementation,
            group_for_one_replica=group_for_one_replica, check_world=check_world)
        super().__init__(DataParallelExtended(self, process.communicator,
                                              process.torch_device,
                                              make_parameters(process)))
        self._process = process
        self._world = process.world
        self._resolver = cluster_resolver
        self._devices = process.device_names

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The `ClusterResolver` this strategy was built from (None on one machine without
        one)."""
        return self._resolver

    @property
    def num_workers(self) -> int:
        """The number of machines taking part."""
        return self._world.num_nodes

    @property
    def worker_index(self) -> int:
        """This machine's rank among the machines (0 is the chief's machine)."""
        return self._world.node_rank

    @classmethod
    def _build_on_machines(cls, devices: Sequence[torch.device], num_nodes: int, name: str,
                           advice: str = "") -> Any:
        """One replica per Trainer device on each machine (the machines come from the
        launcher's environment), checked against ``num_nodes * len(devices)``."""
        strategy = cls(devices=trainer_device_names(devices, name))  # type: ignore[call-arg]
        check_trainer_replicas(strategy, devices, num_nodes, advice)
        return strategy
