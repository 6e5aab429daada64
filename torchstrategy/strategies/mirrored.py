"""`MirroredStrategy`: synchronous data parallelism, one process per local device."""
import torch

from torchstrategy import runtime
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import as_cross_device_ops
from torchstrategy.devices import ReplicaDevice, default_local_devices, parse_devices
from torchstrategy.launch import world as world_lib
from torchstrategy.strategies.base import Strategy, logger
from torchstrategy.strategies.spmd import SPMDExtended


def _launched_devices(world):
    """One device per local process when a launcher (torchrun, ts.launch) started us."""
    if torch.cuda.is_available():
        if torch.cuda.device_count() < world.local_world_size:
            raise RuntimeError(
                f"{world.local_world_size} processes on this machine but only "
                f"{torch.cuda.device_count()} GPU(s): start one process per GPU.")
        return [ReplicaDevice("cuda", i) for i in range(world.local_world_size)]
    return [ReplicaDevice("cpu", i) for i in range(world.local_world_size)]


def establish_world(devices, timeout_seconds):
    """Returns (world, local devices) for a strategy asking for `devices` (None: default).

    - Under torchrun or ts.launch: the launched world; `devices`, if given, must name one
      device per local process.
    - In a plain process: one replica per device; with several, this process becomes
      replica 0 and re-executes the program for the others.

    Raises:
      ValueError: `devices` disagreeing with the launched world.
    """
    process = runtime.current()
    parsed = parse_devices(devices) if devices is not None else None
    world = runtime.world_from_environment()
    if world is None:
        local = parsed or default_local_devices()
        if len(local) > 1:
            return process.start_local_replicas(len(local), timeout_seconds), local
        world = world_lib.World()
    else:
        if parsed is not None and len(parsed) != world.local_world_size and \
                world.launcher == "single":
            raise ValueError(
                f"devices={[d.name for d in parsed]} asks for {len(parsed)} replicas, but this "
                "program already created a one-replica strategy. A program has one replica "
                "layout: create the multi-replica strategy first (or only).")
        if parsed is not None and len(parsed) != world.local_world_size:
            raise ValueError(
                f"devices={[d.name for d in parsed]} names {len(parsed)} device(s), but "
                f"{world.launcher} started {world.local_world_size} process(es) on this "
                f"machine (LOCAL_WORLD_SIZE={world.local_world_size}). Pass "
                f"{world.local_world_size} devices, or none to take one per process.")
        local = parsed or _launched_devices(world)
    return process.adopt_world(world), local


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine, one process per device.

    Args:
      devices: the replicas' devices, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu:0",
        "cpu:1"]`` (several CPU replicas on gloo). None: every local GPU, or one CPU
        replica without GPUs; under torchrun or ``ts.launch``, one replica per process.
      cross_device_ops: how gradients and values are all-reduced: ``ts.NcclAllReduce()``
        (default; NCCL on GPU, gloo on CPU) or ``ts.ReductionToOneDevice()``.
      timeout_seconds: bound on every collective (default $TORCHSTRATEGY_TIMEOUT_SECONDS or
        30 minutes): a dead or stuck replica gives an error instead of a hang.
      bucket_cap_mb: the gradient reducer's largest bucket (25 MiB).

    Launching: under ``torchrun --nproc-per-node=N`` the strategy takes torchrun's world.
    In a plain ``python train.py`` with several devices, this process becomes replica 0 and
    runs the same command again for each other replica, supervising them (one failure ends
    all, with its exit code). ``ts.launch(fn, num_replicas=N)`` runs a function as N
    replicas (notebooks, tests).

    Raises:
      ValueError: malformed or duplicate devices, devices disagreeing with torchrun's world.
      RuntimeError: CUDA devices without CUDA; re-execution where it is impossible.
    """

    def __init__(self, devices=None, cross_device_ops=None, *, timeout_seconds=None,
                 bucket_cap_mb=25):
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not 0 < bucket_cap_mb < float("inf"):
            # Checked before any replica is launched, whatever their number.
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got "
                             f"bucket_cap_mb={bucket_cap_mb!r} (the default is 25).")
        cross_device_ops = as_cross_device_ops(cross_device_ops)
        timeout = world_lib.timeout_seconds(timeout_seconds)
        world, local = establish_world(devices, timeout)
        device = local[world.local_rank]
        torch_device = device.torch_device
        group = None
        if world.world_size > 1:
            if torch_device.type == "cuda":
                torch.cuda.set_device(torch_device)
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
            group = runtime.current().init_process_group(world, backend, timeout)
        communicator = Communicator(group, world.rank, world.world_size, torch_device,
                                    cross_device_ops)
        super().__init__(SPMDExtended(self, communicator, torch_device,
                                      bucket_cap_bytes=bucket_cap_mb * 1024 * 1024))
        self._world = world
        self._devices = tuple(d.name for d in local)
        if world.rank == 0:
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
            where = f"devices {self._devices}" if world.world_size == len(local) else \
                f"{world.world_size} replicas ({len(local)} on this machine: {self._devices})"
            logger.info(f"MirroredStrategy with {world.world_size} replica(s) on {where}"
                        + (f", {backend}" if world.world_size > 1 else ""))

    def __repr__(self):
        return f"MirroredStrategy(devices={list(self._devices)})"
