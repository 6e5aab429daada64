"""`TorchElasticClusterResolver`: the cluster as torchrun (torch elastic) describes it.

torchrun tells each process its global rank, its machine's rank (GROUP_RANK) and the
rendezvous address, but not the other machines' addresses. Every machine is one task of
job "worker"; its index is torchrun's node rank (which can change across restarts).
"""
from __future__ import annotations

import os
from typing import Mapping

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
      rank, world_size: this process among all replicas.
      local_rank, local_world_size: the same on this machine.
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
        self.task_id = _env_int(env, "GROUP_RANK", self.rank // max(1, self.local_world_size))
        self.rpc_layer = None
        self.environment = ""
        self.master_addr = env["MASTER_ADDR"]
        self.master_port = _env_int(env, "MASTER_PORT")
