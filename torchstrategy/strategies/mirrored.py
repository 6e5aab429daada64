"""`MirroredStrategy`: synchronous data parallelism, one process per local device."""
from __future__ import annotations

from typing import Sequence

import torch

from torchstrategy.collectives.cross_device_ops import CrossDeviceOps, as_cross_device_ops
from torchstrategy.strategies.base import logger, trainer_device_names
from torchstrategy.strategies.data_parallel import DataParallelStrategy, check_bucket_cap_mb
from torchstrategy.strategies.parameters import MirroredParameters


class MirroredStrategy(DataParallelStrategy):
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

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 timeout_seconds: float | None = None, bucket_cap_mb: float = 25) -> None:
        bucket_cap_bytes = check_bucket_cap_mb(bucket_cap_mb)
        super().__init__(lambda process: MirroredParameters(bucket_cap_bytes),
                         devices=devices, cross_device_ops=as_cross_device_ops(cross_device_ops),
                         timeout_seconds=timeout_seconds)
        world = self._world
        if world.rank == 0:
            where = f"devices {self._devices}" if world.world_size == len(self._devices) else \
                f"{world.world_size} replicas ({len(self._devices)} on this machine: " \
                f"{self._devices})"
            logger.info(f"MirroredStrategy with {world.world_size} replica(s) on {where}"
                        + (f", {self._process.backend}" if world.world_size > 1 else ""))

    @classmethod
    def build_for_trainer(cls, devices: Sequence[torch.device], num_nodes: int, *,
                          name: str) -> MirroredStrategy:
        """One replica per Trainer device on this machine (``Trainer(strategy="mirrored")``).

        Raises:
          ValueError: devices other than CPU or CUDA, or several nodes.
          RuntimeError: re-execution where it is impossible (the message then points to
            ``Trainer(strategy='mirrored_notebook')``).
        """
        names = trainer_device_names(devices, name)
        if num_nodes != 1:
            raise ValueError(
                f"Trainer(strategy='mirrored') runs on one machine, but num_nodes="
                f"{num_nodes}. Use strategy='multi_worker_mirrored' (under "
                "torchrun) for several machines, or pass num_nodes=1.")
        try:
            return cls(devices=names)
        except RuntimeError as error:
            if "interactive" not in str(error) and "pytest" not in str(error):
                raise
            raise RuntimeError(
                f"{error} With Lightning, use Trainer(strategy='mirrored_notebook') "
                "to start the replicas at fit time instead.") from error

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(self._devices)})"
