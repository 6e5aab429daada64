"""The Lightning adapter's behaviour, shared by the adapter classes of both Lightning
packages (``lightning.pytorch`` and ``pytorch_lightning`` have separate class trees):
`LightningStrategy` holds everything; `strategy_class` combines it with each package's
``ParallelStrategy`` (once per process; published in `torchstrategy.lightning.
lightning_pytorch` and `.pytorch_lightning`). This module imports no Lightning until an
adapter is made, and nothing of `torchstrategy.lightning`.

What the adapter does at each point of Lightning's life cycle:

- construction: every argument is checked (a bad ``kind`` or ``start_method`` is refused
  here, naming the accepted values, not at ``fit``).
- Trainer construction (``set_world_ranks``): checks the accelerator and ``num_nodes``
  Lightning resolved against the wrapped strategy (whose ``parallel_devices`` made
  Lightning take its device type: see that property), or builds the strategy from the
  Trainer's devices (registered names); building it launches the replicas (re-execution
  or torchrun).
- start of ``fit``/``validate``/... (``setup_environment``): checks the Trainer's
  ``devices`` against the wrapped strategy (Lightning keeps that argument from a
  strategy until then), before any collective.
- ``setup``: moves the model to the replica's device and hands it to the strategy
  (``extended.prepare_trainer_module``: by default its parameters and buffers are recorded
  as creating them in ``strategy.scope()`` would, broadcast from replica 0 and given to
  the gradient reducer; ShardedStrategy shards its children), then each optimizer
  (``extended.prepare_trainer_optimizer``). Nothing is wrapped.
- steps: ``training_step`` and the other steps run in the strategy's replica context
  (``ts.get_replica_context()`` works inside them).
- buffers (``buffers="broadcast"``, the default): replica 0's floating buffers are
  broadcast (``extended.broadcast_buffers()``) where Lightning's ``"ddp"`` broadcasts
  them: at ``setup``, and while fitting before a step whose previous step ran with
  gradients enabled, gradients synchronised and automatic optimisation (the rule of
  DistributedDataParallel's ``require_forward_param_sync``, as Lightning's
  ``_DDPForwardRedirection`` drives it). With ``buffers="mean"``
  ``synchronize_buffers()`` makes them the replica mean after each training step, as
  ``strategy.run`` does.
- ``backward``: the loss goes through ``ts.scale_mean_loss`` in the strategy's replica
  context, so the gradient reducer averages the gradients over the replicas as
  DistributedDataParallel's reducer does (each gradient divided by N as it enters its
  bucket, then summed): the weights equal Lightning's ``"ddp"`` bit for bit, in fp32 and
  in bf16-mixed. A strategy without such a reducer (ShardedStrategy) divides the loss's
  gradient by N as it enters the backward.
- collectives (``self.log(sync_dist=True)``, ``barrier``, ``broadcast``, ``all_gather``)
  go through the strategy's communicator and process group, under its timeout.

Only documented methods of the strategy are used (``extended.communicator``,
``torch_device``, ``replica_id``, ``one_replica_per_process``, ``prepare_trainer_module``,
``prepare_trainer_optimizer``, ``broadcast_buffers``, ``synchronize_buffers``, ``no_sync``,
``converts_checkpoint_state`` and the checkpoint methods; ``Strategy.build_for_trainer``
for a kind, found in `torchstrategy.strategies.registry`), ``ts.scale_mean_loss`` and
``runtime.current().world``. Private Lightning APIs (the parsed ``devices``, the launcher
attribute, the spawn launcher, optimizer moves), Lightning's process-wide
``rank_zero_only.rank`` and the process's environment are reached only through
`torchstrategy._compat`, which says why for each; nothing reads another function's frame.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist

from torchstrategy import _compat, context, losses, runtime
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.launch import world as world_lib
from torchstrategy.lightning_base import registration
from torchstrategy.reduce_op import ReduceOp
from torchstrategy.replica_context import ReplicaContext
from torchstrategy.strategies import registry as strategy_registry
from torchstrategy.strategies.base import Strategy

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_T = TypeVar("_T")
START_METHODS = ("popen", "fork")
# How buffers (BatchNorm statistics) follow the replicas: "broadcast" replica 0's, as
# Lightning's "ddp" (DistributedDataParallel's broadcast_buffers), or "mean" over replicas
# after each training step, as torchstrategy's own `strategy.run`.
BUFFER_MODES = ("broadcast", "mean")

_LIGHTNING_REDUCE_OPS = {"mean": ReduceOp.MEAN, "avg": ReduceOp.MEAN, "sum": ReduceOp.SUM}
_TORCH_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "product": dist.ReduceOp.PRODUCT}


@dataclasses.dataclass(frozen=True)
class LightningPackage:
    """What the adapter needs from one Lightning package, given by its module."""

    name: str                  # "lightning.pytorch" or "pytorch_lightning"
    trainer: type              # its Trainer
    fitting: Any               # TrainerFn.FITTING
    rank_zero_only: tuple      # the rank_zero_only functions whose .rank we set
    accelerators: tuple        # ((Accelerator class, device type), ...)
    reset_seed: Callable[[], None]   # re-seeds from PL_GLOBAL_SEED (seed_everything's)


# Lightning package -> the module of `torchstrategy.lightning` that publishes its classes
# (their ``__module__``: pickle and the documentation find them there).
PUBLISHED_IN = {"lightning.pytorch": "torchstrategy.lightning.lightning_pytorch",
                "pytorch_lightning": "torchstrategy.lightning.pytorch_lightning"}


def lightning_package(name: str) -> "LightningPackage":
    """The `LightningPackage` of `name` ("lightning.pytorch" or "pytorch_lightning"),
    importing that package."""
    # Lightning is an optional dependency, imported only here, on use.
    pl = importlib.import_module(name)
    accelerators = importlib.import_module(f"{name}.accelerators")
    states = importlib.import_module(f"{name}.trainer.states")
    rank_zero = importlib.import_module(f"{name}.utilities.rank_zero")
    utilities_rank_zero = importlib.import_module("lightning_utilities.core.rank_zero")
    fabric = "lightning.fabric" if name == "lightning.pytorch" else "lightning_fabric"
    seed = importlib.import_module(f"{fabric}.utilities.seed")
    return LightningPackage(
        name=name, trainer=pl.Trainer, fitting=states.TrainerFn.FITTING,
        rank_zero_only=(rank_zero.rank_zero_only, utilities_rank_zero.rank_zero_only),
        accelerators=((accelerators.CPUAccelerator, "cpu"),
                      (accelerators.CUDAAccelerator, "cuda"),
                      (accelerators.MPSAccelerator, "mps"),
                      (accelerators.XLAAccelerator, "xla")),
        reset_seed=seed.reset_seed)


def defined_once(base: type[_T], package: str, define: Callable[[], type[_T]]) -> type[_T]:
    """The subclass of `base` for Lightning `package`: the one defined earlier in this
    process (found among ``base.__subclasses__()``, which a forked child keeps), else
    ``define()``'s, made once even when several threads ask at the same time."""
    with runtime.current().state("lightning adapter classes", threading.Lock):
        for cls in base.__subclasses__():
            if cls.__module__ == PUBLISHED_IN[package]:
                return cls
        return define()


def new_package_class(name: str, bases: tuple[type, ...], package: str,
                      attributes: dict[str, Any]) -> Any:
    """A class `name` of Lightning `package`, published in ``PUBLISHED_IN[package]`` (that
    module re-exports it), with `attributes`."""
    def body(namespace: dict[str, Any]) -> None:
        namespace.update(attributes, __module__=PUBLISHED_IN[package])
    return types.new_class(name, bases, exec_body=body)


def strategy_class(package: str | None = None) -> type[LightningStrategy]:
    """The adapter class of `package` ("lightning.pytorch" or "pytorch_lightning"; None:
    the one in use), a subclass of that package's ``ParallelStrategy`` and of
    `LightningStrategy`. Defining it (once per process) registers our names in that
    package's ``StrategyRegistry``."""
    package = package or packages_in_use()[0]
    check_package(package)

    def define() -> type[LightningStrategy]:
        # Lightning is an optional dependency, imported only here, on use.
        strategies = importlib.import_module(f"{package}.strategies")
        cls = new_package_class("LightningStrategy",
                                (LightningStrategy, strategies.ParallelStrategy), package,
                                {"__doc__": CLASS_DOC, "lightning": lightning_package(package)})
        registration.register_into(strategies.StrategyRegistry, cls)
        return cls
    return defined_once(LightningStrategy, package, define)


def packages_in_use() -> list[str]:
    """The Lightning packages already imported (``lightning.pytorch`` first), else the
    first one installed, which this imports."""
    imported = [package for package in PACKAGES if package in sys.modules]
    if imported:
        return imported
    for package in PACKAGES:
        try:
            # Lightning is an optional dependency, imported only here, on use.
            importlib.import_module(package)
        except ImportError:
            continue
        return [package]
    raise ImportError("torchstrategy.lightning needs Lightning: pip install lightning "
                      "(or pytorch-lightning).")


def check_package(package: str | None) -> None:
    """Refuses a `package` other than None or one of `PACKAGES`, naming them."""
    if package is not None and package not in PACKAGES:
        raise ValueError(f"package must be one of {PACKAGES} (or None: the one in use), "
                         f"got {package!r}.")


def _device_type(accelerator: Any, known: tuple[tuple[type, str], ...]) -> str | None:
    """"cpu", "cuda", another device type, or None for an accelerator object of a class we
    do not know. `known`: ((Accelerator class, device type), ...)."""
    for cls, device_type in known:
        if isinstance(accelerator, cls):
            return device_type
    return None


def check_arguments(strategy: Strategy | None, kind: str | None, start_method: str) -> None:
    """Refuses a bad combination of the adapter's own arguments, naming what is accepted."""
    if (strategy is None) == (kind is None):
        raise ValueError("LightningStrategy needs a torchstrategy strategy "
                         "(LightningStrategy(ts.MirroredStrategy(...))) or a kind "
                         "(LightningStrategy(kind='mirrored')), not both.")
    if start_method not in START_METHODS:
        # spawn/forkserver would pickle the Trainer, the module and this strategy;
        # classes defined in a notebook cannot be unpickled elsewhere.
        raise ValueError(f"start_method must be 'popen' or 'fork' (notebooks), got "
                         f"{start_method!r}.")
    if strategy is not None:
        if start_method != "popen":
            raise ValueError(
                "A strategy that already exists has launched its replicas; "
                f"start_method={start_method!r} needs the strategy built in each process: "
                "pass kind='mirrored' (Trainer(strategy='mirrored_notebook')) instead of a "
                "strategy object.")
        _check_supported(strategy)
        return
    assert kind is not None  # exactly one of strategy and kind, checked above
    entry = strategy_registry.find_kind(kind)
    if entry is not None and not entry.runs_under_a_trainer:
        raise ValueError(_unsupported_message(entry.class_name))
    if entry is None:
        raise ValueError(f"kind must be one of {strategy_registry.kinds_under_a_trainer()}, "
                         f"got {kind!r}.")
    if start_method not in entry.start_methods:
        raise ValueError(f"kind={kind!r} is built with start_method "
                         f"{' or '.join(repr(m) for m in entry.start_methods)}, not "
                         f"{start_method!r} (start_method='fork' is for kind='mirrored').")


def check_buffers(buffers: str) -> None:
    """Refuses a `buffers` mode other than those of `BUFFER_MODES`, naming them."""
    if buffers not in BUFFER_MODES:
        raise ValueError(f"buffers must be 'broadcast' (replica 0's, as Lightning's 'ddp') "
                         f"or 'mean' (the replica mean after each training step), got "
                         f"{buffers!r}.")


def _unsupported_message(name: str) -> str:
    return (f"{name} runs all its replicas inside one process (threads, or one XLA program), "
            "but Lightning runs its training loop once per process, so the Lightning adapter "
            "cannot drive it. Use Trainer(strategy='mirrored') (one process per device), or "
            f"{name} with a custom training loop (strategy.run).")


def _check_supported(strategy: Strategy) -> None:
    """The adapter runs Lightning's loop once per process, so every process must host
    exactly one replica, communicating over torch.distributed."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"LightningStrategy wraps a torchstrategy strategy, got "
                        f"{type(strategy).__name__}.")
    ext = strategy.extended
    comm = ext.communicator
    if not ext.one_replica_per_process or not isinstance(comm, Communicator) or \
            comm.world_size != strategy.num_replicas_in_sync:
        raise ValueError(_unsupported_message(type(strategy).__name__))


def _reduce_op(reduce_op: Any) -> Any:
    if reduce_op is None:
        return ReduceOp.MEAN
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    if isinstance(reduce_op, str):
        key = reduce_op.lower()
        if key in _LIGHTNING_REDUCE_OPS:
            return _LIGHTNING_REDUCE_OPS[key]
        if key in _TORCH_REDUCE_OPS:
            return _TORCH_REDUCE_OPS[key]
        raise ValueError(f"Unsupported reduce_op {reduce_op!r}: use 'mean', 'sum', 'max' "
                         "or 'min'.")
    if reduce_op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if reduce_op == dist.ReduceOp.AVG:
        return ReduceOp.MEAN
    return reduce_op  # MAX, MIN, PRODUCT: torch.distributed's own op


# What `LightningStrategy` is combined with at run time: a Lightning package's
# ``ParallelStrategy`` (`strategy_class`), unknown here, as Lightning is optional and comes
# in two packages. For the type checker it is Any, so the methods and attributes this
# class takes from Lightning (``super().setup_environment()``, ``self.lightning_module``)
# are not reported as missing.
_LightningParallelStrategy: Any = object


class LightningStrategy(_LightningParallelStrategy):
    # The docstring is CLASS_DOC, at the end of this module.
    # This class holds the adapter's behaviour and is what isinstance checks against;
    # `strategy_class` combines it with each package's ``ParallelStrategy`` and sets
    # `lightning` (a `LightningPackage`).

    # Set on each package's subclass (`strategy_class`); None only here, on this base,
    # which `__new__` never instantiates.
    lightning: LightningPackage = None  # type: ignore[assignment]
    # Lightning's property (an annotation only: no class attribute shadows it).
    model: Any
    strategy_name = "torchstrategy"

    def __new__(cls, *args: Any, package: str | None = None, **kwargs: Any) -> Any:
        # LightningStrategy(...) makes an instance of the adapter class of the Lightning
        # package in use (or of `package`).
        check_package(package)
        if cls.lightning is not None and package in (None, cls.lightning.name):
            return super().__new__(cls)
        target = strategy_class(package)
        if issubclass(target, cls):
            return super().__new__(target)   # type() then calls target's __init__
        # The other package's class was called with package=: type() would not call the
        # __init__ of an object that is not an instance of `cls`, so build it whole.
        return target(*args, package=package, **kwargs)

    def __init__(self, strategy: Strategy | None = None, *, kind: str | None = None,
                 start_method: str = "popen", package: str | None = None,
                 buffers: str = "broadcast", accelerator: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None) -> None:
        check_package(package)
        check_buffers(buffers)
        check_arguments(strategy, kind, start_method)
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._ts = strategy
        # A strategy object decides the devices (the Trainer's must agree with it); a kind
        # is built from the Trainer's (``build_for_trainer`` checks them).
        self._wrapped = strategy is not None
        self._kind = kind
        self._start_method = start_method
        # What Lightning's connector assigns through the public ``num_nodes`` and
        # ``parallel_devices`` (the Trainer's num_nodes; its devices, for a kind only).
        self._trainer_num_nodes = 1
        self._trainer_devices: list[torch.device] | None = None
        self._buffer_mode = buffers
        # DistributedDataParallel's state, as Lightning's "ddp" drives it (see
        # `_after_step`): Lightning wraps the module only to fit, and the wrapper
        # broadcasts buffers before a forward while `_broadcast_before_next_step`
        # (its ``require_forward_param_sync``) holds; `_gradients_synchronised` is False
        # inside `block_backward_sync` (its ``require_backward_grad_sync``).
        self._fitting = False
        self._broadcast_before_next_step = False
        self._gradients_synchronised = True

    # -- the wrapped strategy ------------------------------------------------------------
    @property
    def torchstrategy(self) -> Strategy | None:
        """The wrapped torchstrategy strategy (None until built, for a kind)."""
        return self._ts

    @property
    def buffers(self) -> str:
        """How buffers follow the replicas: "broadcast" (replica 0's, as Lightning's
        "ddp") or "mean" (the replica mean after each training step)."""
        return self._buffer_mode

    def _communicator(self) -> Communicator | None:
        return None if self._ts is None else self._ts.extended.communicator

    @property
    def _built(self) -> Strategy:
        """The wrapped strategy, for the hooks that run once it exists (from the
        Trainer's construction on)."""
        if self._ts is None:
            raise RuntimeError("LightningStrategy: the torchstrategy strategy is not built "
                               "yet (the Trainer has not set up its world).")
        return self._ts

    def _set_rank_zero(self) -> None:
        _compat.set_lightning_rank_zero(self.lightning.rank_zero_only, self.global_rank)

    # -- devices and ranks ---------------------------------------------------------
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices of this machine's replicas: the strategy's, once it exists.

        Lightning's accelerator connector reads this before it resolves the Trainer's
        ``accelerator`` (``_check_config_and_set_final_flags``; checked: lightning
        2.5-2.6): a list of CPU devices makes it take the CPU accelerator, a CUDA list the
        CUDA one, and an ``accelerator`` argument of another type is refused there by
        Lightning itself (MisconfigurationException, while the Trainer is built). So
        ``accelerator="auto"`` on a machine with GPUs keeps a CPU strategy on the CPU
        accelerator (and its mixed precision on CPU autocast): were this empty, the
        connector would pick CUDA and hand it to us."""
        if self._ts is not None and self._kind is None:
            return self._local_devices()
        return self._trainer_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._trainer_devices = devices

    def _local_devices(self) -> list[torch.device]:
        """The devices of the replicas on this machine, one per process, as Lightning
        indexes them by local rank. A strategy tells only its own replica's device
        (``extended.torch_device``): on CUDA the other processes' entries are the device
        numbered by their local rank (the usual one-GPU-per-process layout); this
        process's own entry is exact."""
        own = self._built.extended.torch_device or torch.device("cpu")
        count = self._local_replicas()
        if own.type == "cpu" or count == 1:
            return [own] * count
        devices = [torch.device(own.type, i) for i in range(count)]
        devices[min(self.local_rank, count - 1)] = own
        return devices

    @staticmethod
    def _world() -> Any:
        """The world this process belongs to (rank, local world size), or None."""
        return runtime.current().world

    def _local_replicas(self) -> int:
        if self._ts is None or self._ts.num_replicas_in_sync == 1:
            return 1
        world = self._world()
        if world is not None:
            return world.local_world_size
        return int(_compat.launcher_variable("LOCAL_WORLD_SIZE")
                   or self._ts.num_replicas_in_sync)

    def _machines(self) -> int:
        if self._ts is None:
            return 1
        return max(1, self._ts.num_replicas_in_sync // self._local_replicas())

    @property
    def num_nodes(self) -> int:
        return self._trainer_num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._trainer_num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        devices = self.parallel_devices
        return len(devices) if devices else 1

    @property
    def root_device(self) -> torch.device:
        if self._ts is not None:
            return self._ts.extended.torch_device or torch.device("cpu")
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[min(self.local_rank, len(devices) - 1)]

    @property
    def global_rank(self) -> int:
        if self._ts is not None:
            return self._ts.extended.replica_id
        return self._local_rank_variable() if self._launched_here() else 0

    @property
    def local_rank(self) -> int:
        if self._ts is not None and self._ts.num_replicas_in_sync > 1:
            world = self._world()
            if world is not None:
                return world.local_rank
            return self._local_rank_variable()
        return self.global_rank

    @property
    def node_rank(self) -> int:
        if self._ts is None:
            return 0
        return self.global_rank // max(1, self._local_replicas())

    @property
    def world_size(self) -> int:
        if self._ts is not None:
            return self._ts.num_replicas_in_sync
        return self.num_nodes * self.num_processes

    @property
    def is_distributed(self) -> bool:
        """True, as for Lightning's DDPStrategy whatever its world size: Lightning then
        gives the loaders a DistributedSampler at one replica too, so the adapter shuffles
        as ``"ddp"`` does at every size."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @staticmethod
    def _local_rank_variable() -> int:
        return int(_compat.launcher_variable("LOCAL_RANK") or 0)

    def _launched_here(self) -> bool:
        return self._start_method != "popen" and \
            _compat.launcher_variable("LOCAL_RANK") is not None

    # -- Trainer construction ------------------------------------------------------
    def _check_trainer_arguments(self) -> None:
        """Raises if the Trainer being built runs another accelerator or another number of
        machines than the wrapped strategy. Lightning's connector calls `set_world_ranks`
        (hence this) after assigning what it resolved through the public attributes
        ``accelerator`` and ``num_nodes``, before any collective. The ``devices`` argument
        reaches no strategy: see `_check_trainer_devices`."""
        name = repr(self._ts)
        wanted_type = self._device().type
        if self.accelerator is not None:
            # For CPU and CUDA strategies Lightning refused a contradicting accelerator
            # already (`parallel_devices`); this catches the other device types.
            asked_type = _device_type(self.accelerator, self.lightning.accelerators)
            if asked_type is not None and asked_type != wanted_type:
                raise ValueError(
                    f"The Trainer's accelerator ({type(self.accelerator).__name__}) "
                    f"disagrees with {name}, whose replicas run on {wanted_type}. Leave "
                    f"accelerator at 'auto' (or pass accelerator={wanted_type!r}), or "
                    "create the strategy on the devices you want.")
        machines = self._machines()
        if self._trainer_num_nodes != machines:
            raise ValueError(
                f"Trainer(num_nodes={self._trainer_num_nodes}) disagrees with {name}, which "
                f"spans {machines} machine(s). Pass num_nodes={machines}.")

    def _check_trainer_devices(self, trainer: Any) -> None:
        """Raises if `trainer`'s ``devices`` disagrees with the wrapped strategy's replicas
        on this machine. Lightning keeps the argument only in its connector, parsed, and
        after the Trainer is built (`_compat.lightning_parsed_devices`), so this runs at
        the start of ``fit``/``validate``/``test``/``predict``, on every replica, before
        any collective. Parsing replaced ``"auto"`` by the accelerator's device count (1
        on CPU, every visible GPU on CUDA), so that count is taken for "auto": an explicit
        ``devices`` equal to it cannot be told apart and is accepted."""
        parsed = _compat.lightning_parsed_devices(trainer)
        asked = len(parsed) if isinstance(parsed, (list, tuple)) else int(parsed)
        local = self._local_replicas()
        auto = type(self.accelerator).auto_device_count()
        if asked not in (local, auto):
            raise ValueError(
                f"Trainer(devices={parsed!r}) disagrees with {self._ts!r}, which runs "
                f"{local} replica(s) on this machine. Leave devices at 'auto' (or pass "
                f"devices={local}): the strategy decides the devices.")

    def _device(self) -> torch.device:
        """The wrapped strategy's device for this replica."""
        return self._built.extended.torch_device or torch.device("cpu")

    def set_world_ranks(self) -> None:
        """Lightning's hook while the Trainer is built: builds the strategy of a kind
        (launching or joining its replicas), then sets Lightning's rank-zero rank."""
        if self._ts is None and self._start_method == "popen":
            self._ts = self._build_strategy()
            self._kind = None
        elif self._wrapped:
            self._check_trainer_arguments()
        self._set_rank_zero()

    def _build_strategy(self) -> Strategy:
        """Builds the strategy named by the kind from the Trainer's devices
        (``Strategy.build_for_trainer``); building it launches or joins the replicas."""
        kind = self._kind
        if kind is None:
            raise RuntimeError("LightningStrategy: no kind to build a strategy from.")
        devices = list(self._trainer_devices or [torch.device("cpu")])
        strategy_class = strategy_registry.trainer_kind(kind).strategy_class()
        return strategy_class.build_for_trainer(devices, self.num_nodes, name=kind)

    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            # Building the strategy launched the replicas.
            _compat.set_lightning_launcher(self, None)
        else:
            launcher = _compat.lightning_multiprocessing_launcher(self.lightning.name)
            _compat.set_lightning_launcher(self, launcher(self, start_method=self._start_method))

    # -- set-up --------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Lightning's hook in each replica before set-up: a replica started by
        Lightning's launcher (notebooks) builds its strategy here; a strategy object
        is checked against the Trainer's ``devices``."""
        if self._wrapped:
            self._check_trainer_devices(self.lightning_module.trainer)
        # Lightning's "ddp" re-seeds every replica from seed_everything's seed here (its
        # setup_distributed): without it, a script that calls seed_everything draws other
        # dropout masks than under "ddp" (tests/porting: the Lightning port's losses).
        self.lightning.reset_seed()
        if self._ts is None:
            # A replica started by the multiprocessing launcher (notebooks): join the
            # world the launcher set up, as under torchrun.
            local_rank = self._local_rank_variable()
            count = self.num_processes
            _compat.publish_launcher_variables({
                "RANK": str(local_rank), "WORLD_SIZE": str(count),
                "LOCAL_WORLD_SIZE": str(count),
                "MASTER_ADDR": _compat.launcher_variable("MASTER_ADDR") or "127.0.0.1"})
            self._ts = self._build_strategy()
            self._set_rank_zero()
        # Lightning's "ddp" divides the machine's cores between its replicas when
        # OMP_NUM_THREADS is unset (its launcher does, in every replica, whoever started
        # the processes), and records the choice there for the processes they start. Doing
        # the same gives the same speed and the same numbers: a matrix product split over
        # another number of threads can round differently, which AdamW makes visible. A
        # lone replica keeps torch's default (every core) and the environment untouched:
        # nothing is divided, and a process that trains in a notebook or a test runner
        # then hands no thread count to the replicas it starts later.
        local_replicas = self._local_replicas()
        if local_replicas > 1 and "OMP_NUM_THREADS" not in os.environ:
            threads = world_lib.threads_per_replica(local_replicas)
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """Moves the model to the replica's device and hands it, then each optimizer, to
        the strategy (see the module docstring)."""
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        ext = self._built.extended
        ext.prepare_trainer_module(self.model)
        fitting = trainer.state.fn == self.lightning.fitting
        if self._buffer_mode == "broadcast":
            # Lightning's "ddp" broadcasts replica 0's module state here: wrapping the
            # module to fit, or by hand to validate, test or predict.
            ext.broadcast_buffers()
        self._fitting = fitting
        # A fresh DistributedDataParallel broadcasts again before its first forward.
        self._broadcast_before_next_step = fitting
        self._gradients_synchronised = True
        if fitting:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                ext.prepare_trainer_optimizer(optimizer, self.model)
        self.setup_precision_plugin()
        if fitting:
            _compat.lightning_optimizers_to_device(self.lightning.name, self.optimizers,
                                                   self.root_device)

    def model_to_device(self) -> None:
        """Moves the LightningModule to this replica's device."""
        self.model.to(self.root_device)

    # -- steps ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _replica_context(self) -> Iterator[None]:
        ext = self._built.extended
        replica = ReplicaContext(self._ts, ext.replica_id,
                                 ext.torch_device or torch.device("cpu"))
        with context.enter(self._ts, replica):
            yield

    def _before_step(self) -> None:
        """Broadcasts replica 0's buffers where DistributedDataParallel would, before
        this step's forward (``buffers="broadcast"``)."""
        if self._buffer_mode == "broadcast" and self._broadcast_before_next_step:
            self._built.extended.broadcast_buffers()

    def _after_step(self) -> None:
        """DistributedDataParallel's rule at the end of a forward: the next forward
        broadcasts buffers only after one that ran with gradients enabled and gradients
        synchronised. Lightning's ``"ddp"`` turns gradient synchronisation off inside the
        forward in manual optimisation, so there only the first step of a fit
        broadcasts; evaluation (no gradients) and accumulating steps never arm it."""
        self._broadcast_before_next_step = (
            self._fitting and torch.is_grad_enabled() and self._gradients_synchronised
            and bool(self.lightning_module.automatic_optimization))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step in the strategy's replica context; buffers follow
        the replicas as `buffers` says (the module docstring)."""
        self._before_step()
        with self._replica_context():
            output = super().training_step(*args, **kwargs)
            self._after_step()
        if self._buffer_mode == "mean":
            self._built.extended.synchronize_buffers()
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's validation step in the strategy's replica context."""
        self._before_step()
        with self._replica_context():
            output = super().validation_step(*args, **kwargs)
            self._after_step()
        return output

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's test step in the strategy's replica context."""
        self._before_step()
        with self._replica_context():
            output = super().test_step(*args, **kwargs)
            self._after_step()
        return output

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's predict step in the strategy's replica context."""
        self._before_step()
        with self._replica_context():
            output = super().predict_step(*args, **kwargs)
            self._after_step()
        return output

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Backward of the loss, whose gradients are averaged over the replicas as
        DistributedDataParallel averages them (``ts.scale_mean_loss``: the strategy's
        gradient reducer divides each gradient by N as it enters its bucket, then sums);
        the loss itself is unchanged."""
        if self.world_size > 1:
            # In the replica context, so that scale_mean_loss asks this strategy (its
            # replicas and its reducer), whichever scope the program entered last.
            with self._replica_context():
                closure_loss = losses.scale_mean_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside stay local."""
        if self._ts is None:
            yield
            return
        self._gradients_synchronised = False
        try:
            with self._ts.extended.no_sync():
                yield
        finally:
            self._gradients_synchronised = True

    # -- checkpoints through the strategy where it converts state (a sharded model: full
    # tensors, gathered on every replica); Lightning's own path otherwise ---------------
    def _sharded(self) -> bool:
        return self._built.extended.converts_checkpoint_state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict; full tensors where the strategy converts state."""
        if not self._sharded():
            return super().lightning_module_state_dict()
        return self._built.extended.state_dict_for_checkpoint(self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """`optimizer`'s state dict; full tensors where the strategy converts state."""
        if not (self._sharded() and isinstance(optimizer, torch.optim.Optimizer)):
            return super().optimizer_state(optimizer)
        return self._built.extended.state_dict_for_checkpoint(optimizer,
                                                           model=self.lightning_module)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True
                              ) -> None:
        """Loads the module's state from a Lightning checkpoint (through the strategy
        where it converts state)."""
        if not self._sharded():
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._built.extended.load_state_dict_from_checkpoint(self.lightning_module,
                                                          checkpoint["state_dict"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads the optimizers' states from a Lightning checkpoint (through the strategy
        where it converts state)."""
        if not self._sharded():
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._built.extended.load_state_dict_from_checkpoint(
                optimizer, state, model=self.lightning_module)

    # -- collectives ---------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduces `tensor` over replicas ("mean"/"sum", torch's ReduceOp, or "max" /
        "min"); a non-tensor is returned unchanged."""
        comm = self._communicator()
        if not isinstance(tensor, torch.Tensor) or comm is None or comm.world_size == 1:
            return tensor
        if group is not None and group is not dist.group.WORLD:
            raise ValueError("LightningStrategy reduces over all replicas; a process "
                             "subgroup is not supported.")
        op = _reduce_op(reduce_op)
        if isinstance(op, ReduceOp):
            if op is ReduceOp.MEAN and not tensor.is_floating_point():
                tensor = tensor.float()
            return comm.all_reduce([tensor], op)[0]
        result = tensor.clone()
        dist.all_reduce(result, op=op)
        return result

    def barrier(self, name: str | None = None) -> None:
        """Waits for every replica (through the strategy's communicator)."""
        comm = self._communicator()
        if comm is not None:
            comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Replica `src`'s `obj` on every replica."""
        comm = self._communicator()
        if comm is None:
            return obj
        return comm.broadcast_object(obj, src=src)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers our names ("mirrored", "mirrored_notebook", ...) in
        `strategy_registry`, Lightning's ``StrategyRegistry`` (Lightning's own hook for
        a strategy class; `torchstrategy.lightning` calls it when it is imported)."""
        registration.register_into(strategy_registry, cls)

    def __repr__(self) -> str:
        inner = repr(self._ts) if self._ts is not None else \
            f"kind={self._kind!r}, start_method={self._start_method!r}"
        if self._buffer_mode != BUFFER_MODES[0]:
            inner += f", buffers={self._buffer_mode!r}"
        return f"LightningStrategy({inner})"


LightningStrategy.__doc__ = CLASS_DOC = """A Lightning strategy that runs the Trainer on a torchstrategy strategy.

    ``Trainer(strategy=LightningStrategy(ts.MirroredStrategy(...)))``; the registered
    names (``Trainer(strategy="mirrored")``, ...) build one from the Trainer's arguments.
    ``LightningStrategy(...)`` returns an instance of the adapter class of the Lightning
    package in use (``lightning.pytorch`` or ``pytorch_lightning``: the one imported,
    ``lightning.pytorch`` if both are; pass ``package=`` to choose), a subclass of that
    package's ``ParallelStrategy`` and of this class, so ``isinstance(s,
    LightningStrategy)`` holds for either package.

    Args:
      strategy: a torchstrategy strategy that runs one replica per process: the default
        strategy, ``OneDeviceStrategy``, ``MirroredStrategy`` (and the multi-worker one).
        Creating it is what launches the replicas (re-execution of ``python train.py``,
        or joining torchrun's world), so the Trainer's ``devices``, ``num_nodes`` and
        ``accelerator`` must agree with it or be left at "auto" (a clear error otherwise:
        Lightning's MisconfigurationException for the accelerator and a ValueError for
        ``num_nodes`` while the Trainer is built, a ValueError for ``devices`` at the
        start of ``fit``/``validate``/...; see docs/lightning.md).
      kind: instead of `strategy`, the name of a strategy to build from the Trainer's
        ``accelerator``/``devices``/``num_nodes`` ("mirrored", "one_device",
        "multi_worker_mirrored"): what the registered names ``Trainer(strategy="mirrored")``
        do.
      start_method: with `kind`: "popen" (default) builds the strategy when the Trainer is
        built (re-executing ``python train.py`` for the other replicas, or joining
        torchrun); "fork" (kind "mirrored" only; notebooks: ``Trainer(strategy=
        "mirrored_notebook")``) forks the replicas at ``fit``/``validate``/... and brings
        the trained weights back into the calling process, as Lightning's ``ddp_notebook``
        does.
      package: "lightning.pytorch" or "pytorch_lightning" (default: the one in use).
      buffers: how buffers (BatchNorm statistics) follow the replicas. "broadcast"
        (default): replica 0's are broadcast where Lightning's ``"ddp"`` broadcasts them
        (DistributedDataParallel's ``broadcast_buffers``: at set-up, and before each
        forward that follows a synchronised training step), so validation sees the
        values it sees under ``"ddp"``. "mean": the mean over replicas after each
        training step, as in torchstrategy's own ``strategy.run``.
      accelerator / checkpoint_io / precision_plugin: as for any Lightning strategy.

    Raises:
      ValueError: at construction, for anything but exactly one of `strategy` and `kind`,
        an unknown `kind`, `start_method`, `package` or `buffers` (the message names the
        accepted values), or a strategy that runs several replicas in one process.
      TypeError: a `strategy` that is not a torchstrategy strategy.
    """
