"""`ShardedStrategy`: data parallelism with parameters, gradients and optimizer state
sharded over the replicas (ZeRO-3), on torch's own FSDP2 (``fully_shard``) and DTensor.

It is `MultiWorkerMirroredStrategy` (one replica per process; one machine or many, through
torchrun, TF_CONFIG or a cluster resolver; ``run``, ``reduce``, ``gather``, the input
functions and ``compute_average_loss`` unchanged) with another parameter handling: modules
created in ``scope()`` are recorded and, when the outermost scope exits (or at the next
``run``), each model is broadcast from replica 0 and ``fully_shard``-ed, its repeated
blocks first (each transformer layer, each Linear of an MLP; see
`sharding.plan.repeated_blocks`), then the model itself. Each replica then holds 1/N of
every parameter, gradient and optimizer state; each unit's full parameters exist only
while it runs. Gradients are *summed* over replicas, as MirroredStrategy's (FSDP2 averages
by default; the divide factor is set to 1), so a loss scaled with
``ts.compute_average_loss`` gives the gradient of the global batch's mean.

An optimizer built in the same scope, before the scope shards the model, holds the
unsharded parameters; it is switched to the sharded ones before its first step
(`sharding.stale.StaleParameters`). The parameter handling, and the one moment a model is
sharded, are `sharding.parameters.ShardedParameters`'s; this module is its constructor.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import init_device_mesh

from torchstrategy.cluster_resolver import ClusterResolver
from torchstrategy.collectives.cross_device_ops import as_cross_device_ops
from torchstrategy.communication_options import CommunicationOptions
from torchstrategy.strategies.base import logger
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy.strategies.data_parallel import (DataParallelStrategy,
                                                    check_communication_options,
                                                    resolve_cluster)
from torchstrategy.strategies.sharding import materialize, plan
from torchstrategy.strategies.sharding.parameters import ShardedParameters
from torchstrategy.strategies.startup import ReplicaProcess


def _mesh_shape(world_size: int, shard_group_size: int | None
                ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dimension names) of the device mesh.

    Raises:
      ValueError: a group size that does not divide the number of replicas.
    """
    if shard_group_size is None or shard_group_size == world_size:
        return (world_size,), ("shard",)
    if world_size % shard_group_size:
        raise ValueError(
            f"ShardedStrategy(shard_group_size={shard_group_size}) must divide the number of "
            f"replicas ({world_size}): parameters are sharded within groups of that many "
            "replicas and replicated across the groups. Usually: the replicas per machine.")
    return (world_size // shard_group_size, shard_group_size), ("replicate", "shard")


class ShardedStrategy(DataParallelStrategy):
    """Synchronous training with parameters, gradients and optimizer state sharded over
    the replicas (FSDP2, ZeRO-3): for models whose training state does not fit on one
    device. A training script written for MirroredStrategy runs unchanged.

    Args:
      devices: this machine's replica devices, as for MirroredStrategy (default: every
        local GPU, else one CPU replica; one per process under torchrun / ``ts.launch``).
      shard_modules: which modules become FSDP units (each is gathered whole while it
        runs): a list of ``nn.Module`` classes and/or names (a class name or a qualified
        name as in ``model.named_modules()``). None: each repeated block (the children of
        an ``nn.ModuleList`` / ``nn.Sequential`` whose class repeats), then every model.
      mixed_precision: None; ``torch.bfloat16`` / "bf16" (or float16): compute in that
        dtype, reduce gradients in float32, keep float32 parameters and optimizer state;
        or a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
      reshard_after_forward: None (default): True for every unit but the model itself;
        True: free each unit's gathered parameters after its forward, gather again for
        backward; False: keep them (less communication, more memory); an int: reshard to
        groups of that many replicas.
      cpu_offload: True to keep the sharded parameters, gradients and optimizer state in
        host memory (the optimizer steps on the CPU), or a ``CPUOffloadPolicy``.
      shard_group_size: None: shard over all replicas. k: hybrid sharding, shard within
        groups of k consecutive replicas (give the replicas per machine) and replicate
        across the groups (a 2-D device mesh).
      activation_checkpointing: True to keep only the inputs of each unit but the model
        itself (each repeated block by default), none of its activations: backward
        recomputes the unit's forward (``torch.utils.checkpoint``, non-reentrant;
        gradients unchanged).
      init_fn: how a model built on the meta device in the scope (``with
        torch.device("meta"):``) gets its values once sharded: ``init_fn(module)`` is
        called for every module with parameters or buffers of its own, in
        ``model.modules()`` order, and initialises those in place (it sees them as full,
        plain tensors; each replica keeps its slice). None: each such module's
        ``reset_parameters()``. The values are the same for any number of replicas
        (every replica draws from replica 0's random state). Models built with values
        keep them (broadcast from replica 0).
      same_parameters_every_step: False (default): replicas may use different parameters
        in a step (a branch chosen by each replica's own batch, a mixture of experts
        inside one unit): every unit reduce-scatters every parameter, with zeros where a
        replica used none, and a parameter no replica used keeps ``.grad`` None (one
        all-reduce of 4 bytes per parameter before each optimizer step); the gradients
        are one device's. True: your word that every replica uses the same parameters in
        every step; FSDP2's own reduction, without that all-reduce. A replica that then
        used other parameters gets wrong gradients. False needs a torch whose FSDP2 has
        ``set_reduce_scatter_unused_params`` (2.13 has it, 2.11 not); without it the
        strategy is refused, naming True as the fix. See docs/sharded.md.
      cluster_resolver / communication_options: as for MultiWorkerMirroredStrategy
        (``implementation`` and ``timeout_seconds`` are honoured; ``bytes_per_pack`` and
        ``compression`` are refused: FSDP2 communicates per unit).

    Raises:
      ValueError / TypeError: bad options, before any replica is launched.
    """

    #: Each replica holds a shard of every parameter: checkpoints convert its state.
    CAPABILITIES = Capabilities(shards_parameters=True, converts_checkpoint_state=True)

    def __init__(self, devices: Sequence[str | torch.device] | None = None, *,
                 shard_modules: Sequence[Any] | None = None, mixed_precision: Any = None,
                 reshard_after_forward: bool | int | None = None, cpu_offload: Any = False,
                 shard_group_size: int | None = None, activation_checkpointing: bool = False,
                 init_fn: materialize.InitFn | None = None,
                 same_parameters_every_step: bool = False,
                 cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None) -> None:
        shard_modules = plan.check_shard_modules(shard_modules)
        mp_policy = plan.mixed_precision_policy(mixed_precision)
        plan.check_reshard_after_forward(reshard_after_forward)
        if shard_group_size is not None and (isinstance(shard_group_size, bool) or not
                                             isinstance(shard_group_size, int)
                                             or shard_group_size < 1):
            raise ValueError(f"ShardedStrategy(shard_group_size={shard_group_size!r}): give a "
                             "positive int (the replicas per machine) or None.")
        plan.offload_policy(cpu_offload, "cpu")  # raises for what is not an option
        materialize.check_init_fn(init_fn)
        if not isinstance(same_parameters_every_step, bool):
            raise TypeError(f"ShardedStrategy(same_parameters_every_step="
                            f"{same_parameters_every_step!r}): give True or False.")
        if not same_parameters_every_step and not plan.fsdp_reduces_unused_parameters():
            # Without it two replicas that used different parameters would sum mismatched
            # slices of their gradient buffers: refused rather than silently wrong.
            raise RuntimeError(
                f"ShardedStrategy(same_parameters_every_step=False) needs FSDP2's "
                f"FSDPModule.set_reduce_scatter_unused_params, which torch {torch.__version__} "
                "lacks (torch 2.11 has none; 2.13 has it). Fix: pass "
                "same_parameters_every_step=True if every replica uses the same parameters "
                "in every step (FSDP2's own reduction), or install a torch that has it.")
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(f"ShardedStrategy(activation_checkpointing="
                            f"{activation_checkpointing!r}): give True or False.")
        options = check_communication_options(communication_options)
        if options.bytes_per_pack or options.compression is not None:
            raise ValueError(
                "ShardedStrategy: CommunicationOptions(bytes_per_pack=..., compression=...) "
                "are MirroredStrategy's gradient reducer options; FSDP2 reduce-scatters each "
                "unit's gradients at once. Choose the units with shard_modules instead.")
        resolver = resolve_cluster(cluster_resolver)
        shape: tuple[int, ...] = ()
        names: tuple[str, ...] = ()

        def sharded_parameters(process: ReplicaProcess) -> ShardedParameters:
            nonlocal shape, names
            shape, names = _mesh_shape(process.world.world_size, shard_group_size)
            device_type = process.torch_device.type
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            fsdp_kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                           "mp_policy": mp_policy,
                           "offload_policy": plan.offload_policy(cpu_offload, device_type)}
            return ShardedParameters(mesh, shard_modules, fsdp_kwargs,
                                     activation_checkpointing=activation_checkpointing,
                                     init_fn=init_fn,
                                     same_parameters_every_step=same_parameters_every_step)

        super().__init__(
            sharded_parameters, devices=devices, cross_device_ops=as_cross_device_ops(None),
            timeout_seconds=options.timeout_seconds, cluster_resolver=resolver,
            implementation=options.implementation,
            # FSDP2 needs a process group even for one replica.
            group_for_one_replica=True,
            # A group size that does not divide the replicas is refused before any group.
            check_world=lambda world: _mesh_shape(world.world_size, shard_group_size))
        self._cluster = resolver
        self._shape = shape
        if self._world.rank == 0:
            logger.info(f"ShardedStrategy with {self._world.world_size} replica(s), mesh "
                        f"{dict(zip(names, shape))}, on {self._process.backend}")

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._cluster

    @classmethod
    def build_for_trainer(cls, devices: Sequence[torch.device], num_nodes: int, *,
                          name: str) -> ShardedStrategy:
        """One replica per Trainer device; several machines under torchrun
        (``Trainer(strategy="sharded")``).

        Raises:
          ValueError: devices other than CPU or CUDA; a job whose replica count is not
            ``num_nodes * len(devices)``.
        """
        return cls._build_on_machines(devices, num_nodes, name)

    def __repr__(self) -> str:
        return (f"ShardedStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"mesh={list(self._shape)})")
