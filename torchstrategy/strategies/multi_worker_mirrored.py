"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over several machines.

Each machine (worker) runs one process per local device, exactly as `MirroredStrategy` does
on one machine, and all of them form one process group: machine m's replicas take the
global ranks ``m * L .. (m + 1) * L - 1`` (L replicas per machine), so rank 0 is the chief's
first replica. Everything else (scope, run, the gradient reducer, input) is the shared
data-parallel machinery (`torchstrategy.strategies.data_parallel`).

How the machines find each other:

- under ``torchrun --nnodes=N`` (c10d rendezvous): torchrun's environment, read by
  `TorchElasticClusterResolver`; nothing is launched;
- with ``TF_CONFIG`` set and a plain ``python train.py`` on each machine: the cluster spec
  gives every machine its index (chief first, then the workers in order); the process
  re-executes itself for its machine's other replicas and all of them meet at the first
  training task's address (the chief's, else worker 0's), where machine 0 hosts the
  rendezvous store;
- under ``srun`` (a SLURM step, one task per replica): `SlurmClusterResolver`; nothing is
  launched, rank 0's host serves the rendezvous;
- in a Kubeflow PyTorchJob pod running ``python train.py``: `KubernetesClusterResolver`,
  then as with TF_CONFIG (one machine per pod, meeting at MASTER_ADDR:MASTER_PORT);
- in a process whose default process group someone else initialised (Ray Train,
  Accelerate, the user): that group and its ranks, adopted and never destroyed here;
- with none of these: a single machine, like `MirroredStrategy`.

Without a resolver the environment is detected in that order (see
`torchstrategy.cluster_resolver.detect`), and ``strategy.cluster_resolver`` is the
resolver used.
"""
from __future__ import annotations

from typing import Sequence

import torch

from torchstrategy.cluster_resolver import ClusterResolver
from torchstrategy.collectives.compression import with_compression
from torchstrategy.collectives.cross_device_ops import CrossDeviceOps, as_cross_device_ops
from torchstrategy.collectives.reducer import DEFAULT_BUCKET_CAP_BYTES
from torchstrategy.communication_options import CommunicationOptions
from torchstrategy.strategies.base import logger
from torchstrategy.strategies.data_parallel import (DataParallelStrategy,
                                                    check_communication_options,
                                                    resolve_cluster)
from torchstrategy.strategies.parameters import MirroredParameters


class MultiWorkerMirroredStrategy(DataParallelStrategy):
    """Synchronous training on every device of several machines (tf.distribute's name).

    Args:
      cluster_resolver: where this process sits in the cluster. None: detected, in this
        order: torchrun (`ts.cluster_resolver.TorchElasticClusterResolver`), an srun step
        (`SlurmClusterResolver`), a Kubeflow PyTorchJob (`KubernetesClusterResolver`),
        ``TF_CONFIG`` (`TFConfigClusterResolver`; unset means one machine); two that
        disagree raise `ts.cluster_resolver.ConflictingEnvironmentError`.
      communication_options: a `ts.CommunicationOptions`. ``implementation``: RING (gloo),
        NCCL (GPUs; without GPUs it warns and uses gloo, as TensorFlow) or AUTO (NCCL on GPUs, gloo otherwise); ``bytes_per_pack``: the
        gradient reducer's bucket size (0: 25 MiB); ``timeout_seconds``: bound on every
        collective (default $TORCHSTRATEGY_TIMEOUT_SECONDS or 30 minutes), so a dead or
        stuck worker gives an error naming it instead of a hang.
      devices: this machine's replica devices (keyword only; default every local GPU, else
        one CPU replica), e.g. ``["cpu:0", "cpu:1"]`` for two CPU replicas per machine.
        Every machine must run the same number of replicas.
      cross_device_ops: keyword only; ``ts.HierarchicalCopyAllReduce()`` reduces inside each
        machine before crossing the network; default ``ts.NcclAllReduce()``.

    Launching: ``torchrun --nnodes=N --nproc-per-node=L --rdzv-backend=c10d
    --rdzv-endpoint=HOST:PORT train.py`` on every machine, or ``python train.py`` on every
    machine with TF_CONFIG naming the cluster and that machine's task.

    Raises:
      ValueError / TFConfigError: a malformed TF_CONFIG, a ps or evaluator task, bad
        devices or options; before any process waits on another.
      RuntimeError: a machine that does not join within the timeout (named), machines with
        different numbers of replicas.
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None, *,
                 devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None) -> None:
        options = check_communication_options(communication_options)
        resolver = resolve_cluster(cluster_resolver)
        cross_device_ops = with_compression(as_cross_device_ops(cross_device_ops),
                                            options.compression)
        bucket_bytes = options.bytes_per_pack or DEFAULT_BUCKET_CAP_BYTES
        super().__init__(lambda process: MirroredParameters(bucket_bytes),
                         devices=devices, cross_device_ops=cross_device_ops,
                         timeout_seconds=options.timeout_seconds,
                         cluster_resolver=resolver, implementation=options.implementation)
        self._cluster = resolver
        self._options = options
        world = self._world
        if world.rank == 0:
            logger.info(f"MultiWorkerMirroredStrategy with {world.world_size} replica(s) on "
                        f"{world.num_nodes} worker(s), {world.local_world_size} per worker "
                        f"(here {self._devices})"
                        + (f", {self._process.backend}" if world.world_size > 1 else ""))

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The `ClusterResolver` this strategy was built from."""
        return self._cluster

    @property
    def task_type(self) -> str | None:
        """This machine's job ("chief" or "worker"); None on a single machine without a
        cluster description, as in TensorFlow."""
        return self._cluster.task_type

    @property
    def task_id(self) -> int | None:
        """This task's index in its job, as the cluster resolver gives it: under torchrun
        and srun a task is one process (its global rank, as in TensorFlow, where a task is a
        process); under TF_CONFIG or Kubeflow a task is one machine, shared by that
        machine's replicas. None without a cluster description. For one-off work use
        `is_chief` / ``extended.should_checkpoint``, which name exactly one process."""
        return self._cluster.task_id

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    @property
    def is_chief(self) -> bool:
        """True in exactly one process of the cluster: the first replica of the chief task
        (the chief job, or worker 0 when there is no chief). Use it for one-off work:
        writing checkpoints and summaries, printing."""
        return self._world.local_rank == 0 and self._world.node_rank == 0

    @classmethod
    def build_for_trainer(cls, devices: Sequence[torch.device], num_nodes: int, *,
                          name: str) -> MultiWorkerMirroredStrategy:
        """One replica per Trainer device on each machine; the machines come from
        torchrun's environment (or TF_CONFIG) (``Trainer(strategy=
        "multi_worker_mirrored")``).

        Raises:
          ValueError: devices other than CPU or CUDA; a job whose replica count is not
            ``num_nodes * len(devices)``.
        """
        return cls._build_on_machines(devices, num_nodes, name,
                                      " Pass num_nodes= the number of machines and devices= "
                                      "the processes per machine.")

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(num_workers={self.num_workers}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
