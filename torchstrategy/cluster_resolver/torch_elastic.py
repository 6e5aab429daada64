"""`TorchElasticClusterResolver`: the cluster as torchrun (torch elastic) describes it.

torchrun tells each process its global rank, its machine's rank (GROUP_RANK) and the
rendezvous address, but not the other machines' addresses. As a TensorFlow task is one
process, every torchrun process is one task of job "worker": `task_id` is its global rank
(so ``task_id == 0`` names one process, the chief), and `num_accelerators()` counts the one
GPU it drives. The machines are what synchronous training groups: `training_tasks()` and
`num_workers` count them, `worker_index` is this machine's rank (torchrun's node rank,
which can change across restarts).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from torchstrategy.cluster_resolver.base import RendezvousClusterResolver

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"torchrun's variable {name} is not set.")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"torchrun's variable {name}={value!r} is not an integer.") from None


class TorchElasticClusterResolver(RendezvousClusterResolver):
    """This process's machine and the number of machines, from torchrun's variables.

    Attributes (besides the ClusterResolver ones):
      task_id: this process's global rank (TensorFlow's task is a process).
      rank, world_size: this process among all replicas.
      local_rank, local_world_size: the same on this machine.
      node_rank: this machine's rank (GROUP_RANK).
      num_workers: machines taking part; worker_index: this machine's rank.

    `cluster_spec()` lists what torchrun knows: worker 0 at the rendezvous address
    (MASTER_ADDR:MASTER_PORT) and this machine under its hostname; other machines' addresses
    are not known to torchrun's processes, so the spec is sparse.

    Raises:
      RuntimeError: when not started by torchrun (its variables are missing).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        missing = [k for k in _REQUIRED if k not in env]
        if missing:
            raise RuntimeError(f"TorchElasticClusterResolver needs torchrun's environment; "
                               f"{missing} are not set. Start the program with "
                               f"`torchrun --nnodes=N --nproc-per-node=M train.py`.")
        self.rank = _env_int(env, "RANK")
        self.world_size = _env_int(env, "WORLD_SIZE")
        self.local_rank = _env_int(env, "LOCAL_RANK")
        self.local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", self.world_size)
        if "GROUP_WORLD_SIZE" in env:
            nodes = _env_int(env, "GROUP_WORLD_SIZE")
        else:
            nodes = max(1, self.world_size // max(1, self.local_world_size))
        self._num_workers = nodes
        self.node_rank = _env_int(env, "GROUP_RANK",
                                  self.rank // max(1, self.local_world_size))
        self.task_id = self.rank
        self.rpc_layer = None
        self.environment = ""
        self.master_addr = env["MASTER_ADDR"]
        self.master_port = _env_int(env, "MASTER_PORT")

    @property
    def worker_index(self) -> int:
        """This machine's rank among the machines (torchrun's GROUP_RANK)."""
        return self.node_rank

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """The accelerators of one task, as in TensorFlow: a torchrun process drives one
        GPU (``{"GPU": 1}``) when this machine has GPUs, else none ({})."""
        machine = super().num_accelerators(task_type, task_id, config_proto)
        return {"GPU": 1} if machine.get("GPU") else {}
