"""The Lightning strategy class wrapping a torchstrategy strategy, built per Lightning
package (``lightning.pytorch`` and ``pytorch_lightning`` have separate class trees).

What the adapter does at each point of Lightning's life cycle:

- Trainer construction (``set_world_ranks``): checks the Trainer's ``accelerator``,
  ``devices`` and ``num_nodes`` against the wrapped strategy, or builds the strategy from
  them (registered names); building it launches the replicas (re-execution or torchrun).
- ``setup``: moves the model to the replica's device and records its parameters and
  buffers as mirrored, which broadcasts them from replica 0 and hands the parameters to the
  fused gradient reducer. Nothing is wrapped.
- steps: ``training_step`` and the other steps run in the strategy's replica context
  (``ts.get_replica_context()`` works inside them); after each training step floating
  buffers become the replica mean, as everywhere in torchstrategy.
- ``backward``: the loss is scaled by 1/N, so the reducer's cross-replica *sum* is the
  *mean* gradient Lightning's DDP produces.
- collectives (``self.log(sync_dist=True)``, ``barrier``, ``broadcast``, ``all_gather``)
  go through the strategy's communicator and process group, under its timeout.
"""
import contextlib
import importlib
import os
import sys

import torch
import torch.distributed as dist

from torchstrategy import context
from torchstrategy.reduce_op import ReduceOp
from torchstrategy.replica_context import ReplicaContext

_classes = {}  # package -> adapter class

_FABRIC = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}

_LIGHTNING_REDUCE_OPS = {"mean": ReduceOp.MEAN, "avg": ReduceOp.MEAN, "sum": ReduceOp.SUM}
_TORCH_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "product": dist.ReduceOp.PRODUCT}


def adapter_class(package):
    """The adapter class for `package`, built once."""
    if package not in _classes:
        _classes[package] = _build_class(package)
    return _classes[package]


def _trainer_arguments(trainer_cls):
    """The ``accelerator``, ``devices`` and ``num_nodes`` passed to the Trainer being
    constructed in this thread, or None outside a Trainer constructor.

    Lightning keeps only the parsed ``devices`` (where "auto" and 1 look alike on CPU), so
    they are read from the constructor's frame to tell "left at auto" from a real request.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and \
                isinstance(frame.f_locals.get("self"), trainer_cls):
            args = frame.f_locals
            return {"accelerator": args.get("accelerator", "auto"),
                    "devices": args.get("devices", "auto"),
                    "num_nodes": args.get("num_nodes", 1)}
        frame = frame.f_back
    return None


def _device_type(accelerator):
    """"cpu", "cuda", another device type, or None for "auto"."""
    if accelerator is None:
        return None
    if not isinstance(accelerator, str):
        name = type(accelerator).__name__.lower()
        for kind in ("cpu", "cuda", "mps", "xla"):
            if name.startswith(kind):
                return kind
        return name
    accelerator = accelerator.lower()
    if accelerator == "auto":
        return None
    return {"gpu": "cuda", "tpu": "xla"}.get(accelerator, accelerator)


def _requested_count(devices):
    """The number of devices a Trainer ``devices`` value asks for (None: "auto", or -1 /
    "-1" meaning all)."""
    if devices in ("auto", None, -1, "-1"):
        return None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        devices = devices.strip()
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        return int(devices)
    return int(devices)


def _build_class(package):
    pl = importlib.import_module(package)
    fabric = _FABRIC[package]
    ParallelStrategy = importlib.import_module(f"{package}.strategies").ParallelStrategy
    launchers = importlib.import_module(f"{package}.strategies.launchers.multiprocessing")
    rank_zero = importlib.import_module(f"{package}.utilities.rank_zero")
    trainer_fn = importlib.import_module(f"{package}.trainer.states").TrainerFn
    optimizers_to_device = importlib.import_module(
        f"{fabric}.utilities.optimizer")._optimizers_to_device
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    class LightningStrategy(ParallelStrategy):
        __doc__ = f"""Runs a {package} Trainer on a torchstrategy strategy (see
        ``torchstrategy.lightning.LightningStrategy`` for the arguments)."""

        strategy_name = "torchstrategy"

        def __init__(self, strategy=None, *, kind=None, start_method="popen",
                     accelerator=None, checkpoint_io=None, precision_plugin=None):
            if (strategy is None) == (kind is None):
                raise ValueError("LightningStrategy needs a torchstrategy strategy "
                                 "(LightningStrategy(ts.MirroredStrategy(...))) or a kind "
                                 "(LightningStrategy(kind='mirrored')), not both.")
            if start_method not in ("popen", "fork"):
                # spawn/forkserver would pickle the Trainer, the module and this
                # strategy; classes defined in a notebook cannot be unpickled elsewhere.
                raise ValueError(f"start_method must be 'popen' or 'fork' (notebooks), got "
                                 f"{start_method!r}.")
            if strategy is not None and start_method != "popen":
                raise ValueError(
                    "A strategy that already exists has launched its replicas; "
                    f"start_method={start_method!r} needs the strategy built in each "
                    "process: pass kind='mirrored' (Trainer(strategy='mirrored_notebook')) "
                    "instead of a strategy object.")
            if strategy is not None:
                _check_supported(strategy)
            super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io,
                             precision_plugin=precision_plugin)
            self._ts = strategy
            self._kind = kind
            self._start_method = start_method
            self._num_nodes = 1
            self._parallel_devices = None

        # -- the wrapped strategy ------------------------------------------------------
        @property
        def torchstrategy(self):
            """The wrapped torchstrategy strategy (None until built, for a kind)."""
            return self._ts

        def _communicator(self):
            return None if self._ts is None else self._ts.extended.communicator

        # -- devices and ranks ---------------------------------------------------------
        @property
        def parallel_devices(self):
            if self._ts is not None and self._kind is None:
                self._check_trainer_arguments()
                return self._local_devices()
            return self._parallel_devices

        @parallel_devices.setter
        def parallel_devices(self, devices):
            self._parallel_devices = devices

        def _local_devices(self):
            """The devices of the wrapped strategy's replicas on this machine."""
            from torchstrategy.devices import parse_devices

            names = getattr(self._ts, "_devices", None)
            if names and len(names) == self._local_replicas():
                return [d.torch_device for d in parse_devices(list(names))]
            return [self._ts.extended.torch_device or torch.device("cpu")] * \
                self._local_replicas()

        def _world(self):
            """The launch world of the wrapped strategy (rank, local world size)."""
            from torchstrategy.strategies import mirrored

            return getattr(self._ts, "_world", None) or mirrored._process_world

        def _local_replicas(self):
            if self._ts is None or self._ts.num_replicas_in_sync == 1:
                return 1
            world = self._world()
            if world is not None:
                return world.local_world_size
            return int(os.environ.get("LOCAL_WORLD_SIZE", self._ts.num_replicas_in_sync))

        def _machines(self):
            if self._ts is None:
                return 1
            return max(1, self._ts.num_replicas_in_sync // self._local_replicas())

        @property
        def num_nodes(self):
            return self._num_nodes

        @num_nodes.setter
        def num_nodes(self, num_nodes):
            self._num_nodes = num_nodes

        @property
        def num_processes(self):
            devices = self.parallel_devices
            return len(devices) if devices else 1

        @property
        def root_device(self):
            if self._ts is not None:
                return self._ts.extended.torch_device or torch.device("cpu")
            devices = self.parallel_devices or [torch.device("cpu")]
            return devices[min(self.local_rank, len(devices) - 1)]

        @property
        def global_rank(self):
            if self._ts is not None:
                return self._ts.extended.replica_id
            return int(os.environ.get("LOCAL_RANK", 0)) if self._launched_here() else 0

        @property
        def local_rank(self):
            if self._ts is not None and self._ts.num_replicas_in_sync > 1:
                world = self._world()
                if world is not None:
                    return world.local_rank
                return int(os.environ.get("LOCAL_RANK", 0))
            return self.global_rank

        @property
        def node_rank(self):
            if self._ts is None:
                return 0
            return self.global_rank // max(1, self._local_replicas())

        @property
        def world_size(self):
            if self._ts is not None:
                return self._ts.num_replicas_in_sync
            return self.num_nodes * self.num_processes

        @property
        def is_distributed(self):
            return self.world_size > 1

        @property
        def distributed_sampler_kwargs(self):
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def _launched_here(self):
            return self._start_method != "popen" and "LOCAL_RANK" in os.environ

        # -- Trainer construction ------------------------------------------------------
        def _check_trainer_arguments(self):
            """Raises if the Trainer being built asks for other devices than the wrapped
            strategy has (Lightning reads `parallel_devices` first while it parses its
            arguments, so this runs before any of them is acted on)."""
            given = _trainer_arguments(pl.Trainer)
            if given is None:
                return
            name = repr(self._ts)
            wanted_type = (self._ts.extended.torch_device or torch.device("cpu")).type
            asked_type = _device_type(given["accelerator"])
            if asked_type is not None and asked_type != wanted_type:
                raise ValueError(
                    f"Trainer(accelerator={given['accelerator']!r}) disagrees with {name}, "
                    f"whose replicas run on {wanted_type}. Leave accelerator at 'auto' (or "
                    f"pass accelerator={wanted_type!r}), or create the strategy on the "
                    "devices you want.")
            asked = _requested_count(given["devices"])
            local = self._local_replicas()
            if asked is not None and asked != local:
                raise ValueError(
                    f"Trainer(devices={given['devices']!r}) disagrees with {name}, which "
                    f"runs {local} replica(s) on this machine. Leave devices at 'auto' (or "
                    f"pass devices={local}): the strategy decides the devices.")
            machines = self._machines()
            if given["num_nodes"] != machines:
                raise ValueError(
                    f"Trainer(num_nodes={given['num_nodes']}) disagrees with {name}, which "
                    f"spans {machines} machine(s). Pass num_nodes={machines}.")

        def set_world_ranks(self):
            if self._ts is None and self._start_method == "popen":
                self._ts = self._build_strategy()
                self._kind = None
            rank_zero.rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

        def _build_strategy(self):
            """Builds the strategy named by the kind from the Trainer's devices; building
            it launches or joins the replicas."""
            import torchstrategy as ts

            devices = list(self._parallel_devices or [torch.device("cpu")])
            device_type = devices[0].type
            count = len(devices)
            if self._kind == "one_device":
                if count != 1 or self.num_nodes != 1:
                    raise ValueError(
                        f"Trainer(strategy='one_device') runs one replica, but the Trainer "
                        f"asks for {count} device(s) on {self.num_nodes} node(s). Pass "
                        "devices=1, or use strategy='mirrored' for several devices.")
                return ts.OneDeviceStrategy(devices[0])
            _check_kind_supported(self._kind)
            if device_type not in ("cpu", "cuda"):
                raise ValueError(
                    f"Trainer(strategy={self._kind!r}) runs on CPU or CUDA devices, not "
                    f"{device_type}. Pass accelerator='cpu' or 'cuda'.")
            names = [f"cpu:{i}" for i in range(count)] if device_type == "cpu" else \
                [str(d) for d in devices]
            if self._kind == "multi_worker_mirrored":
                if not hasattr(ts, "MultiWorkerMirroredStrategy"):
                    raise ValueError("This torchstrategy has no MultiWorkerMirroredStrategy.")
                # One replica per Trainer device on each machine; the machines come from
                # torchrun's environment (or TF_CONFIG).
                strategy = ts.MultiWorkerMirroredStrategy(devices=names)
                if strategy.num_replicas_in_sync != count * self.num_nodes:
                    raise ValueError(
                        f"Trainer(num_nodes={self.num_nodes}, devices={count}) asks for "
                        f"{count * self.num_nodes} replicas, but the job has "
                        f"{strategy.num_replicas_in_sync}. Pass num_nodes= the number of "
                        "machines and devices= the processes per machine.")
                return strategy
            if self._kind != "mirrored":
                raise ValueError(f"Unknown torchstrategy kind {self._kind!r}.")
            if self.num_nodes != 1:
                raise ValueError(
                    f"Trainer(strategy='mirrored') runs on one machine, but num_nodes="
                    f"{self.num_nodes}. Use strategy='multi_worker_mirrored' (under "
                    "torchrun) for several machines, or pass num_nodes=1.")
            try:
                return ts.MirroredStrategy(devices=names)
            except RuntimeError as error:
                if "interactive" not in str(error) and "pytest" not in str(error):
                    raise
                raise RuntimeError(
                    f"{error} With Lightning, use Trainer(strategy='mirrored_notebook') "
                    "to start the replicas at fit time instead.") from error

        def _configure_launcher(self):
            if self._start_method == "popen":
                self._launcher = None    # building the strategy launched the replicas
            else:
                self._launcher = launchers._MultiProcessingLauncher(
                    self, start_method=self._start_method)

        # -- set-up --------------------------------------------------------------------
        def setup_environment(self):
            if self._ts is None:
                # A replica started by the multiprocessing launcher (notebooks): join the
                # world the launcher set up, as under torchrun.
                local_rank = int(os.environ.get("LOCAL_RANK", 0))
                count = self.num_processes
                os.environ.update({
                    "RANK": str(local_rank), "WORLD_SIZE": str(count),
                    "LOCAL_WORLD_SIZE": str(count),
                    "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")})
                self._ts = self._build_strategy()
                rank_zero.rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
            super().setup_environment()

        def setup(self, trainer):
            self.accelerator.setup(trainer)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            _mirror_module(self._ts, self.model)
            fitting = trainer.state.fn == trainer_fn.FITTING
            if fitting:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if fitting:
                optimizers_to_device(self.optimizers, self.root_device)

        def model_to_device(self):
            self.model.to(self.root_device)

        # -- steps ---------------------------------------------------------------------
        @contextlib.contextmanager
        def _replica_context(self):
            ext = self._ts.extended
            replica = ReplicaContext(self._ts, ext.replica_id,
                                     ext.torch_device or torch.device("cpu"))
            with context.enter(self._ts, replica):
                yield

        def training_step(self, *args, **kwargs):
            with self._replica_context():
                output = super().training_step(*args, **kwargs)
            self._ts.extended._after_step()
            return output

        def validation_step(self, *args, **kwargs):
            with self._replica_context():
                return super().validation_step(*args, **kwargs)

        def test_step(self, *args, **kwargs):
            with self._replica_context():
                return super().test_step(*args, **kwargs)

        def predict_step(self, *args, **kwargs):
            with self._replica_context():
                return super().predict_step(*args, **kwargs)

        def backward(self, closure_loss, optimizer, *args, **kwargs):
            # Lightning (DDP) averages gradients over replicas; the reducer sums them.
            n = self.world_size
            scaled = closure_loss if n == 1 else closure_loss * (1.0 / n)
            super().backward(scaled, optimizer, *args, **kwargs)
            return closure_loss.detach()

        @contextlib.contextmanager
        def block_backward_sync(self):
            """Gradient accumulation: backward passes inside stay local."""
            if self._ts is None:
                yield
                return
            with self._ts.extended.no_sync():
                yield

        # -- collectives ---------------------------------------------------------------
        def reduce(self, tensor, group=None, reduce_op="mean"):
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

        def barrier(self, name=None):
            comm = self._communicator()
            if comm is not None:
                comm.barrier()

        def broadcast(self, obj, src=0):
            comm = self._communicator()
            if comm is None:
                return obj
            return comm.broadcast_object(obj, src=src)

        @classmethod
        def register_strategies(cls, strategy_registry):
            """Names are registered by torchstrategy.lightning.registration."""

        def __repr__(self):
            inner = repr(self._ts) if self._ts is not None else \
                f"kind={self._kind!r}, start_method={self._start_method!r}"
            return f"LightningStrategy({inner})"

    LightningStrategy.__module__ = __name__
    LightningStrategy.__qualname__ = "LightningStrategy"
    return LightningStrategy


def _reduce_op(reduce_op):
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


_ONE_PROCESS_STRATEGIES = ("CentralStorageStrategy", "TPUStrategy")


def _unsupported_message(name):
    return (f"{name} runs all its replicas inside one process (threads, or one XLA program), "
            "but Lightning runs its training loop once per process, so the Lightning adapter "
            "cannot drive it. Use Trainer(strategy='mirrored') (one process per device), or "
            f"{name} with a custom training loop (strategy.run).")


def _check_kind_supported(kind):
    name = {"central_storage": "CentralStorageStrategy", "tpu": "TPUStrategy"}.get(kind)
    if name is not None:
        raise ValueError(_unsupported_message(name))


def _check_supported(strategy):
    """The adapter runs Lightning's loop once per process, so every process must host
    exactly one replica, communicating over torch.distributed."""
    from torchstrategy.collectives.communicator import Communicator
    from torchstrategy.strategies.base import Strategy

    if not isinstance(strategy, Strategy):
        raise TypeError(f"LightningStrategy wraps a torchstrategy strategy, got "
                        f"{type(strategy).__name__}.")
    name = type(strategy).__name__
    comm = getattr(strategy.extended, "communicator", None)
    if name in _ONE_PROCESS_STRATEGIES or not isinstance(comm, Communicator) or \
            comm.world_size != strategy.num_replicas_in_sync:
        raise ValueError(_unsupported_message(name))


def _mirror_module(strategy, module):
    """Records `module`'s parameters and buffers as mirrored by `strategy` (what creating
    it inside ``strategy.scope()`` would have done): they are broadcast from replica 0 and
    the parameters join the gradient reducer. Already recorded tensors are skipped."""
    ext = strategy.extended
    state = ext._mirrored
    for param in module.parameters():
        state.add_parameter(param)
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                state.add_buffer(submodule, name)
    ext._sync_mirrored_state()
