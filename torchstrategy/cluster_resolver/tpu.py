"""`TPUClusterResolver`: the hosts of a TPU job, for `TPUStrategy`.

A TPU job runs one process per host, each driving all of its host's XLA devices (torch_xla's
SPMD mode); every host is one task of job "worker". The hosts are found, in this order:

1. torchrun's variables, when the job was started with ``torchrun --nnodes=H
   --nproc-per-node=1``: host index = node rank, H hosts, rendezvous at MASTER_ADDR:PORT;
2. the TPU VM's variables ``TPU_WORKER_HOSTNAMES`` (comma-separated) and ``TPU_WORKER_ID``;
3. otherwise this machine alone (a single TPU host, or XLA:CPU devices for testing).

Nothing here imports torch_xla except `num_accelerators`, which asks its runtime.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.cluster_resolver.cluster_spec import ClusterSpec, JobTasks

# The port tf.distribute's TPU resolver names hosts with; only used when nothing else does.
DEFAULT_PORT = 8470


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    try:
        return int(value or "")  # missing: a ValueError, as for any non-integer
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer.") from None


class TPUClusterResolver(ClusterResolver):
    """This host's place in a TPU job (see the module docstring for where it looks).

    Args:
      tpu: None, "" or "local" to discover the job from the environment (above; "" is
        TensorFlow's way of saying "the TPU of this machine"); a list of ``"host:port"``
        addresses, one per host, to name the hosts explicitly (this host's index is then
        `task_id`, default $TPU_WORKER_ID or 0). A ``grpc://`` address or a Cloud TPU name
        (a remote TPU node, driven from another machine in TensorFlow) is refused: torch_xla
        runs on the TPU VM itself.
      task_id: this host's index when `tpu` is a list.
      environ: the environment to read (default ``os.environ``; for tests).

    Attributes:
      task_type: "worker"; task_id: this host's index; num_hosts: the number of hosts.
      launcher: "torchrun", "tpu-vm", "explicit" or "local".

    Raises:
      ValueError: torchrun starting several processes on one host (TPUStrategy needs
        ``--nproc-per-node=1``), a host index outside the host list, malformed variables,
        a remote TPU (``grpc://`` address or TPU name) with how to run on its VM instead.
    """

    def __init__(self, tpu: str | Sequence[str] | None = None, task_id: int | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        hosts: JobTasks
        self.task_id: int
        self.task_type = "worker"
        self.rpc_layer = None
        if tpu == "":
            tpu = "local"   # TensorFlow: '' means the TPU attached to this machine
        self.environment = "" if tpu in (None, "local") else "tpu"
        if isinstance(tpu, (list, tuple)):
            hosts = list(tpu)
            self.task_id = task_id if task_id is not None else \
                (_int(env, "TPU_WORKER_ID") if "TPU_WORKER_ID" in env else 0)
            self.launcher = "explicit"
        elif isinstance(tpu, str) and tpu not in (None, "local"):
            raise ValueError(_remote_tpu_refusal(tpu))
        elif tpu not in (None, "local"):
            raise ValueError(f"tpu={tpu!r}: pass None / '' / 'local' to read the environment, "
                             "or the list of host addresses ['host:port', ...].")
        elif int(env.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in env:
            world = _int(env, "WORLD_SIZE")
            local = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1
            if local != 1:
                raise ValueError(
                    f"torchrun started {local} processes on this host, but TPUStrategy runs "
                    "one process per host that drives all of its devices. Start it with "
                    "`torchrun --nnodes=HOSTS --nproc-per-node=1 train.py`.")
            port = env.get("MASTER_PORT", str(DEFAULT_PORT))
            hosts = {0: f"{env['MASTER_ADDR']}:{port}"}
            self.task_id = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else _int(env, "RANK")
            self._num_hosts = world
            self.launcher = "torchrun"
        elif env.get("TPU_WORKER_HOSTNAMES"):
            names = [h.strip() for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h.strip()]
            hosts = [f"{h}:{DEFAULT_PORT}" for h in names]
            self.task_id = _int(env, "TPU_WORKER_ID") if "TPU_WORKER_ID" in env else 0
            self.launcher = "tpu-vm"
        else:
            hosts = ["localhost:%d" % DEFAULT_PORT]
            self.task_id = 0
            self.launcher = "local"
        if isinstance(hosts, list):
            self._num_hosts = len(hosts)
        if not 0 <= self.task_id < self._num_hosts:
            raise ValueError(f"This host's index {self.task_id} is outside the "
                             f"{self._num_hosts} host(s) of the job.")
        self._cluster_spec = ClusterSpec({"worker": hosts})

    @property
    def num_hosts(self) -> int:
        return self._num_hosts

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def training_tasks(self) -> list[tuple[str, int]]:
        return [("worker", i) for i in range(self._num_hosts)]

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of host 0 (where hosts meet), or of the named task when known."""
        if task_type is None and task_id is None:
            task_type, task_id = "worker", 0
        return super().master(task_type, task_id, rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """``{"TPU": n}`` (or the XLA device kind, e.g. "CPU") with n this host's XLA devices,
        asked from torch_xla's runtime; {} without torch_xla."""
        del task_type, task_id, config_proto
        try:
            import torch_xla.runtime as xr
        except ImportError:
            return {}
        return {xr.device_type() or "TPU": xr.addressable_runtime_device_count()}

    @staticmethod
    def connect(tpu: str | Sequence[str] | None = None) -> TPUClusterResolver:
        """tf.distribute's entry point: returns the resolver for `tpu` (torch_xla's runtime
        starts with the first TPUStrategy, so there is nothing else to initialise)."""
        return TPUClusterResolver(tpu)


def _remote_tpu_refusal(tpu: str) -> str:
    """Why a remote TPU (a ``grpc://`` address or a Cloud TPU name) cannot be used, and how
    to run on it instead."""
    what = "the grpc address of a remote TPU node" if "://" in tpu else \
        "the name of a Cloud TPU"
    return (f"TPUClusterResolver(tpu={tpu!r}): {what}. TensorFlow drives such a TPU from "
            "another machine over gRPC; torch_xla cannot: it runs on the TPU VM itself, one "
            "process per host driving that host's chips. Copy the script to the TPU VM and "
            "start it there on every host, e.g. `gcloud compute tpus tpu-vm ssh NAME "
            "--zone=ZONE --worker=all --command='python train.py'`, with "
            "TPUClusterResolver() (or tpu='' / 'local'), which reads the TPU VM's "
            "TPU_WORKER_HOSTNAMES / TPU_WORKER_ID.")
