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
from typing import Any, Mapping

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


def _refuse_kubernetes_api_arguments(job_to_label_mapping: Mapping[str, Any] | None,
                                     tf_server_port: int | None,
                                     override_client: Any) -> None:
    """Refuses TensorFlow's arguments that need the Kubernetes API or TF's own servers."""
    if job_to_label_mapping is not None:
        if isinstance(job_to_label_mapping, Mapping) and any(
                isinstance(k, str) and k.isupper() for k in job_to_label_mapping):
            hint = (" It looks like environment variables: pass them as "
                    "KubernetesClusterResolver(environ=...).")
        else:
            hint = ""
        raise ValueError(
            f"KubernetesClusterResolver(job_to_label_mapping={job_to_label_mapping!r:.80}): "
            "TensorFlow lists the pods of each job by label through the Kubernetes API; "
            "torchstrategy reads the cluster from a Kubeflow PyTorchJob's variables instead "
            "(every pod is a 'worker', the Master pod is worker 0) and cannot select pods "
            "by label. Run the program as a PyTorchJob and leave job_to_label_mapping None, "
            "or describe the cluster yourself with ts.SimpleClusterResolver(cluster_spec, "
            f"task_type=..., task_id=...).{hint}")
    if tf_server_port is not None:
        raise ValueError(
            f"KubernetesClusterResolver(tf_server_port={tf_server_port!r}): the pods meet at "
            "the PyTorchJob's MASTER_PORT, not at a TensorFlow server port on every pod. "
            "Leave tf_server_port None and set MASTER_PORT (the training operator sets it).")
    if override_client is not None:
        raise ValueError(
            "KubernetesClusterResolver(override_client=...): no Kubernetes API client is "
            "used (the cluster comes from the PyTorchJob's variables). Leave it None.")


class KubernetesClusterResolver(RendezvousClusterResolver):
    """This pod's place in a Kubeflow PyTorchJob (see the module docstring).

    Args (TensorFlow's signature, then ours keyword-only):
      job_to_label_mapping: TensorFlow finds the pods by label through the Kubernetes API;
        here the pods are the PyTorchJob's, from its variables, so only None is accepted
        (anything else is refused, saying so).
      tf_server_port: TensorFlow's port for every pod's server; the pods here meet at the
        job's MASTER_PORT, so only None is accepted (set MASTER_PORT instead).
      rpc_layer: prefix of `master()` addresses, e.g. "grpc" (default none).
      override_client: a Kubernetes API client in TensorFlow; none is used here, so only
        None is accepted.
      environ: the variables to read (default os.environ), e.g. for tests.

    Every pod is one task of job "worker", its index the pod's rank (PET_NODE_RANK, else
    RANK); worker 0 (the Master pod) is at MASTER_ADDR:MASTER_PORT. Other pods' addresses
    are not in the environment, so `cluster_spec()` is sparse: worker 0 and this pod.

    Attributes: num_workers (pods), worker_index (this pod), nproc_per_node (an int, or
    None for nprocPerNode "auto"/"cpu"/"gpu"), master_addr, master_port.

    Raises:
      ValueError: a missing or malformed variable, named; WORLD_SIZE disagreeing with
        PET_NNODES x PET_NPROC_PER_NODE; an elastic PET_NNODES range (``1:4``), which needs
        torchrun in the container; a TensorFlow argument that cannot be honoured here
        (`job_to_label_mapping`, `tf_server_port`, `override_client` other than None).
    """

    def __init__(self, job_to_label_mapping: Mapping[str, Any] | None = None,
                 tf_server_port: int | None = None, rpc_layer: str | None = None,
                 override_client: Any = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        _refuse_kubernetes_api_arguments(job_to_label_mapping, tf_server_port,
                                         override_client)
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
        self.rpc_layer = rpc_layer
        self.environment = "kubernetes"
