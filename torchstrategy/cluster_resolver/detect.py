"""Which cluster this process is in, when the program names no resolver.

Environments are looked for in this order; the first one present is used:

1. torchrun (TORCHELASTIC_RUN_ID, or RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR), which
   includes Ray Train and Accelerate, which set torchrun's variables, and ``srun torchrun``;
2. a SLURM step of several tasks started by ``srun`` (SLURM_STEP_ID, SLURM_PROCID and
   SLURM_NTASKS > 1); a batch script, ``salloc``'s shell or a one-task step counts as a
   plain process;
3. a Kubeflow PyTorchJob pod (PET_NNODES / PET_NODE_RANK, or KUBERNETES_SERVICE_HOST with
   WORLD_SIZE and RANK);
4. TF_CONFIG;
5. none: one machine.

A process started by torchstrategy's own launchers (re-execution, ``ts.launch``) skips
step 1 and 2: their variables describe this machine's replicas, and the cluster is the one
its first process found (Kubernetes or TF_CONFIG).

Two environments that are both present must describe the same number of machines (e.g.
TF_CONFIG's chief and workers, and torchrun's GROUP_WORLD_SIZE); otherwise the strategy
refuses to guess and the error names both variables.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.cluster_resolver.kubernetes import KubernetesClusterResolver, kubeflow_job
from torchstrategy.cluster_resolver.slurm import SlurmClusterResolver, srun_step
from torchstrategy.cluster_resolver.tf_config import (TF_CONFIG_ENV, TFConfigClusterResolver,
                                                      read_tf_config)
from torchstrategy.cluster_resolver.torch_elastic import TorchElasticClusterResolver
from torchstrategy.launch import world as world_lib

logger = logging.getLogger(__name__)

ORDER = ("torchrun", "slurm", "kubernetes", "tf_config")


class ConflictingEnvironmentError(ValueError):
    """Two cluster environments are set and describe different clusters."""


def _present(environ: Mapping[str, str]) -> list[str]:
    """The environments of `ORDER` present in `environ`."""
    ours = world_lib.LAUNCHER_ENV in environ
    found = []
    if not ours and ("TORCHELASTIC_RUN_ID" in environ or all(
            k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))):
        found.append("torchrun")
    if not ours and srun_step(environ):
        found.append("slurm")
    if kubeflow_job(environ):
        found.append("kubernetes")
    if environ.get(TF_CONFIG_ENV, "").strip():
        found.append("tf_config")
    return found


def _machines(name: str, environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(number of machines, the variable saying so) as environment `name` describes it, or
    None where it does not say."""
    if name == "torchrun":
        if environ.get("GROUP_WORLD_SIZE", "").isdigit():
            return int(environ["GROUP_WORLD_SIZE"]), "GROUP_WORLD_SIZE"
        return None
    if name == "slurm":
        return len(SlurmClusterResolver(environ=environ).hosts), "SLURM_JOB_NODELIST"
    if name == "kubernetes":
        raw = environ.get("PET_NNODES", "")
        if raw.isdigit():
            return int(raw), "PET_NNODES"
        if raw:
            return None  # an elastic range (torchrun's to resolve)
        return KubernetesClusterResolver(environ=environ).num_workers, "WORLD_SIZE"
    config = read_tf_config(environ)
    tasks = [j for j in ("chief", "worker") for _ in config.get("cluster", {}).get(j, [])]
    return len(tasks), "TF_CONFIG (chief and worker tasks)"


def detect(environ: Mapping[str, str] | None = None) -> str | None:
    """The name of the cluster environment this process is in (one of `ORDER`), or None.

    Raises:
      ConflictingEnvironmentError: two environments describing different numbers of
        machines, naming the variables of both.
      ValueError: a malformed variable of the environment found (named by its resolver).
    """
    # Variables torchstrategy published for its own world describe no cluster manager.
    env = world_lib.without_published(os.environ if environ is None else environ)
    found = _present(env)
    if not found:
        return None
    chosen = found[0]
    if len(found) == 1:
        return chosen  # its resolver checks its variables
    chosen_count = _machines(chosen, env)
    for other in found[1:]:
        other_count = _machines(other, env)
        if chosen_count is None or other_count is None:
            continue
        if chosen_count[0] != other_count[0] and not (
                {chosen, other} == {"slurm", "tf_config"}
                and other_count[0] == SlurmClusterResolver(environ=env).world_size):
            raise ConflictingEnvironmentError(
                f"Conflicting cluster environments: {chosen_count[1]} describes "
                f"{chosen_count[0]} machine(s) but {other_count[1]} describes "
                f"{other_count[0]}. Unset the one that does not describe this job (e.g. a "
                f"TF_CONFIG left in the environment), or pass cluster_resolver= explicitly.")
    return chosen


def resolver_for(name: str | None, environ: Mapping[str, str] | None = None
                 ) -> ClusterResolver:
    """A resolver for environment `name` (one of `ORDER`, or None: TF_CONFIG's, which
    describes one machine when TF_CONFIG is unset)."""
    if name == "torchrun":
        return TorchElasticClusterResolver(environ)
    if name == "slurm":
        return SlurmClusterResolver(environ=environ)
    if name == "kubernetes":
        return KubernetesClusterResolver(environ=environ)
    return TFConfigClusterResolver()


def default_resolver(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver of the environment `detect` finds (see the module docstring), logged.

    Raises: as `detect`.
    """
    name = detect(environ)
    resolver = resolver_for(name, environ)
    if name is not None:
        logger.info(f"torchstrategy: cluster from the {name} environment "
                    f"({type(resolver).__name__})")
    return resolver


def launched_world(resolver: ClusterResolver | None = None,
                   environ: Mapping[str, str] | None = None) -> world_lib.World | None:
    """The `World` of processes that a cluster manager started one per replica without
    torchrun (an ``srun`` step), from `resolver` or the detected environment; None when
    there is none (the strategy then launches or finds its replicas itself)."""
    if resolver is None and detect(environ) == "slurm":
        resolver = SlurmClusterResolver(environ=environ)
    if not isinstance(resolver, SlurmClusterResolver):
        return None
    world = resolver.world()
    logger.info(f"torchstrategy: replicas of the srun step of job {resolver.job_id}: rank "
                f"{world.rank} of {world.world_size} on {world.num_nodes} node(s), "
                f"rendezvous {world.master_addr}:{world.master_port}")
    return world

# Launchers whose replicas were all started by a cluster manager: rank 0 serves the store.
STORE_ON_RANK_0 = ("slurm",)
