"""Creating (or adopting) the torch.distributed process group, always under a timeout."""
import atexit
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
    """Creates (or adopts) the default process group for `world`; returns None, which
    torch.distributed reads as "the default group".

    No Python reference to the group object is kept: a group object still referenced when
    the interpreter tears down is destroyed in the wrong order and can abort the process.

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
        return None
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if not (world.launcher == "reexec" and world.local_rank == 0 and
            world.local_world_size > 1):
        # Replica 0 of a re-executed job (on each machine) releases its group only after
        # the others have finished (the supervisor does it); everyone else releases it at
        # exit. A group left to the interpreter's teardown can abort the process
        # ("terminate called without an active exception") and turn a clean run into exit
        # code 134.
        atexit.register(release_process_group)
    if world.launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=_store_for(world, timeout), rank=world.rank,
                                world_size=world.world_size, timeout=timeout)
    return None


def release_process_group():
    """Destroys the default process group if there is one (idempotent), once the backend
    has let go of every buffer our collectives gave it."""
    from torchstrategy.collectives import reducer
    from torchstrategy.collectives.communicator import wait_until_released

    wait_until_released()
    reducer.close_all()
    if dist.is_initialized():
        dist.destroy_process_group()
