"""`KubernetesClusterResolver`: the cluster of a Kubeflow PyTorchJob, from its pod variables.

Kubeflow's training operator gives every pod of a PyTorchJob (the Master, then the Workers)
MASTER_ADDR and MASTER_PORT (the master pod's service), WORLD_SIZE (pods x
nprocPerNode), RANK (the pod's index: the master is 0, worker i is i + 1), and torchrun's
arguments as PET_* variables: PET_NNODES (the number of pods, or ``min:max`` for an
elastic job), PET_NPROC_PER_NODE, PET_NODE_RANK. No kubernetes client is needed.

When the container runs ``torchrun``, torchrun reads the PET_* variables and its processes
are recognised as torchrun's (torchrun comes first in detection). When it runs ``python
train.py``, every pod is one machine of the cluster: the strategy takes the pod's devices
(one replica each, re-executing the program for the pod's other devices) and the pods meet
at MASTER_ADDR:MASTER_PORT, where the master pod serves the rendezvous.
"""
from __future__ import annotations

import os
from typing import Mapping

from torchstrategy.cluster_resolver.base import RendezvousClusterResolver
from torchstrategy.launch import world as world_lib

_FIX = ("Run it as a PyTorchJob of Kubeflow's training operator (which sets MASTER_ADDR, "
        "MASTER_PORT, WORLD_SIZE, RANK and PET_NNODES), or set these variables yourself.")


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env.get(name)
    try:
        value = int(raw or "")  # missing: a ValueError, as for any non-integer
    except (TypeError, ValueError):
        raise ValueError(f"The PyTorchJob variable {name}={raw!r} is not an integer. "
                         f"{_FIX}") from None
    if value < minimum:
        raise ValueError(f"The PyTorchJob variable {name}={value} must be at least {minimum}.")
    return value


def kubeflow_job(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment looks like a PyTorchJob pod's: PET_NNODES or PET_NODE_RANK
    set, or a Kubernetes pod (KUBERNETES_SERVICE_HOST) with WORLD_SIZE and RANK but without
    torchrun's LOCAL_RANK."""
    env = os.environ if environ is None else environ
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        return True
    return ("KUBERNETES_SERVICE_HOST" in env and "WORLD_SIZE" in env and "RANK" in env
            and "LOCAL_RANK" not in env)


class KubernetesClusterResolver(RendezvousClusterResolver):
    """This pod's place in a Kubeflow PyTorchJob (see the module docstring).

    Args:
      environ: the variables to read (default os.environ), e.g. for tests.

    Every pod is one task of job "worker", its index the pod's rank (PET_NODE_RANK, else
    RANK); worker 0 (the Master pod) is at MASTER_ADDR:MASTER_PORT. Other pods' addresses
    are not in the environment, so `cluster_spec()` is sparse: worker 0 and this pod.

    Attributes: num_workers (pods), worker_index (this pod), nproc_per_node (an int, or
    None for nprocPerNode "auto"/"cpu"/"gpu"), master_addr, master_port.

    Raises:
      ValueError: a missing or malformed variable, named; WORLD_SIZE disagreeing with
        PET_NNODES x PET_NPROC_PER_NODE; an elastic PET_NNODES range (``1:4``), which needs
        torchrun in the container.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if env.get(n, "") == ""]
        if env.get("PET_NODE_RANK", "") == "" and env.get("RANK", "") == "":
            missing.append("RANK")
        if env.get("PET_NNODES", "") == "" and env.get("WORLD_SIZE", "") == "":
            missing.append("PET_NNODES")
        if missing:
            raise ValueError(f"KubernetesClusterResolver: {missing} "
                             f"{'is' if len(missing) == 1 else 'are'} not set. {_FIX}")
        self.master_addr = env["MASTER_ADDR"]
        self.master_port = _int(env, "MASTER_PORT", 1)
        raw_nproc = env.get("PET_NPROC_PER_NODE", "1") or "1"
        self.nproc_per_node: int | None = _int(
            {"PET_NPROC_PER_NODE": raw_nproc}, "PET_NPROC_PER_NODE",
            1) if raw_nproc.lstrip("-").isdigit() else None
        if self.nproc_per_node is None and raw_nproc not in ("auto", "cpu", "gpu"):
            raise ValueError(f"PET_NPROC_PER_NODE={raw_nproc!r} is neither a number nor "
                             "auto/cpu/gpu (the values of the PyTorchJob's nprocPerNode).")
        raw_nodes = env.get("PET_NNODES", "")
        if ":" in raw_nodes:
            raise ValueError(f"PET_NNODES={raw_nodes!r} is an elastic range: only torchrun can "
                             "run an elastic PyTorchJob. Make the container's command "
                             "`torchrun train.py` (torchrun reads the PET_* variables).")
        if world_lib.LAUNCHER_ENV in env:
            # A replica re-executed on a pod: RANK and WORLD_SIZE are now the replica's;
            # its launcher kept the pod's place in GROUP_RANK and GROUP_WORLD_SIZE.
            env = dict(env, PET_NNODES=env.get("GROUP_WORLD_SIZE", raw_nodes),
                       PET_NODE_RANK=env.get("GROUP_RANK", env.get("PET_NODE_RANK", "")))
            env.pop("WORLD_SIZE", None)
            raw_nodes = env["PET_NNODES"]
        if raw_nodes:
            pods = _int(env, "PET_NNODES", 1)
        else:  # an older operator: WORLD_SIZE counts the pods
            pods = _int(env, "WORLD_SIZE", 1) // (self.nproc_per_node or 1)
        if env.get("WORLD_SIZE", "") != "" and self.nproc_per_node is not None:
            world_size = _int(env, "WORLD_SIZE", 1)
            if world_size != pods * self.nproc_per_node:
                raise ValueError(
                    f"WORLD_SIZE={world_size} disagrees with PET_NNODES={pods} x "
                    f"PET_NPROC_PER_NODE={self.nproc_per_node}: these variables describe "
                    "different jobs. Unset the one you set by hand.")
        rank_name = "PET_NODE_RANK" if env.get("PET_NODE_RANK", "") != "" else "RANK"
        pod = _int(env, rank_name)
        if pod >= pods:
            raise ValueError(f"{rank_name}={pod} is outside the job's {pods} pod(s) "
                             f"(0..{pods - 1}).")
        self._num_workers = pods
        self.task_id = pod
        self.rpc_layer = None
        self.environment = "kubernetes"
