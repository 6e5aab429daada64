"""Creating (or adopting) the torch.distributed process group, always under a timeout."""
import datetime
import logging

import torch.distributed as dist

logger = logging.getLogger("torchstrategy")


def _store_for(world, timeout):
    if world.store is not None:
        return world.store
    return dist.TCPStore(world.master_addr, world.master_port, world.world_size,
                         is_master=False, timeout=timeout)


def ensure_process_group(world, backend, timeout_seconds):
    """Returns the default process group for `world`, creating it if needed.

    A group the user created beforehand (``dist.init_process_group``) is adopted if its size
    matches. Every collective on the group is bounded by `timeout_seconds`: a dead or stuck
    peer gives an error, not a hang.

    Raises:
      RuntimeError: an existing group whose size disagrees with `world`.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world.world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised with world size "
                f"{dist.get_world_size()}, but this strategy needs {world.world_size} "
                "replicas. Create the strategy with matching devices, or destroy the "
                "existing process group first.")
        return dist.group.WORLD
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if world.launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=_store_for(world, timeout), rank=world.rank,
                                world_size=world.world_size, timeout=timeout)
    return dist.group.WORLD
