"""The start-up of a strategy that runs one replica per process, written once.

`start_replica_process` is what MirroredStrategy, MultiWorkerMirroredStrategy and
ShardedStrategy do when they are constructed, in this order:

1. find the world: the one a launcher (torchrun, ``ts.launch``, re-execution, srun, an
   adopted process group) describes, or, in a plain process, this machine's replicas,
   started by re-executing the program (several machines of a TF_CONFIG-style cluster meet
   at the first training task's address and agree on their number of replicas);
2. pick this replica's device and the backend that carries the collectives;
3. create (or adopt) the default process group, a group of one included (unless the
   strategy asks for none), so that DDP-style code asking torch.distributed
   (``dist.get_rank()``, ``DistributedSampler``, ``dist.barrier()``) works unchanged with
   one replica; the world's torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, ...) are
   in the environment from step 1 on (`Runtime.enter_world`);
4. build the `Communicator`, with the diagnosis that names the replicas (and machines)
   missing after a failed collective.

TPUStrategy does not use it: one process there drives every XLA device of its host, so
there is no per-replica world, device or re-execution; its processes (one per host) only
share a host-side gloo group.
"""
from __future__ import annotations

import dataclasses
import datetime
import uuid
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.cluster_resolver import ClusterResolver
from torchstrategy.collectives import roll_call
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import CrossDeviceOps
from torchstrategy.collectives.hierarchical import HierarchicalCopyAllReduce
from torchstrategy.communication_options import CommunicationImplementation, backend_for
from torchstrategy.devices import ReplicaDevice, default_local_devices, parse_devices
from torchstrategy.launch import world as world_lib


@dataclasses.dataclass(frozen=True)
class ReplicaProcess:
    """What `start_replica_process` established for this process.

    Attributes:
      world: this process's place among the replicas (a `World`, recorded by the runtime).
      local_devices: the devices of this machine's replicas, one per local process.
      torch_device: this process's replica's device (``local_devices[world.local_rank]``).
      backend: the torch.distributed backend of the collectives ("nccl" or "gloo"), also
        where no process group was created (one replica, ``group_for_one_replica=False``).
      communicator: the replicas' `Communicator` over the default process group, its
        ``diagnose`` naming missing replicas after a failed collective.
    """

    world: world_lib.World
    local_devices: tuple[ReplicaDevice, ...]
    torch_device: torch.device
    backend: str
    communicator: Communicator

    @property
    def device_names(self) -> tuple[str, ...]:
        """The local devices' names (``("cpu:0", "cpu:1")``), as strategies show them."""
        return tuple(device.name for device in self.local_devices)


def start_replica_process(
        *, devices: Sequence[str | torch.device] | None, timeout_seconds: float,
        cross_device_ops: CrossDeviceOps, cluster_resolver: ClusterResolver | None = None,
        implementation: CommunicationImplementation = CommunicationImplementation.AUTO,
        group_for_one_replica: bool = True,
        check_world: Callable[[world_lib.World], object] | None = None) -> ReplicaProcess:
    """Finds this process's world, creates or adopts its process group and builds its
    `Communicator` (see the module docstring for the order).

    Args:
      devices: the replicas' devices on this machine (None: every local GPU, else one CPU
        replica; under a launcher, one per local process). Under a launcher they must name
        one device per local process.
      timeout_seconds: bound on the rendezvous and on every collective of the group.
      cross_device_ops: the all-reduce algorithm the communicator uses.
      cluster_resolver: None for one machine (MirroredStrategy: the launchers' world, or
        this machine's devices); a resolver for a cluster (the machines of its training
        tasks). With a resolver the failure diagnosis names each replica's task, which
        costs one broadcast at start-up, and a `HierarchicalCopyAllReduce` gets its
        per-machine groups.
      implementation: the `CommunicationImplementation` the backend is chosen for; NCCL
        without GPUs warns (before anything is re-executed) and uses gloo.
      group_for_one_replica: whether one replica gets a process group too (default True:
        a gloo or NCCL group of size 1 over the world's own store; DDP-style code and FSDP2
        need one; a group that already exists is adopted); False leaves torch.distributed
        as it is for one replica.
      check_world: called with the world once it is known and before any process group
        is created: a strategy's checks of the replica count raise there.

    Returns:
      The `ReplicaProcess`. Every replica returns from this function only when all of them
      did (creating the group is a rendezvous).

    Raises:
      ValueError: devices disagreeing with a launched world; a cluster whose first
        training task has no real port; a ps or evaluator task; what `check_world` raises.
      RuntimeError: a machine that did not join within the timeout (named), machines
        with different numbers of replicas, an unreachable rendezvous, CUDA devices
        without CUDA, an existing process group of another shape.
    """
    world, local = _find_world(cluster_resolver, devices, implementation, timeout_seconds)
    torch_device = local[world.local_rank].torch_device
    backend = backend_for(implementation, torch_device.type)
    if check_world is not None:
        check_world(world)
    if world.world_size > 1 or group_for_one_replica:
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        if world.world_size == 1 and world.store is None and not dist.is_initialized():
            # One replica under a launcher: a group of size 1 whose store lives in memory.
            world = dataclasses.replace(world, store=dist.HashStore())
        runtime.current().init_process_group(world, backend, timeout_seconds)
        if cluster_resolver is not None and world.world_size > 1 and \
                isinstance(cross_device_ops, HierarchicalCopyAllReduce):
            machine_of_rank = [None] * world.world_size
            dist.all_gather_object(machine_of_rank, world.node_rank)
            cross_device_ops.create_groups(machine_of_rank, timeout_seconds)
    # group None: torch.distributed's default group, the one just created or adopted.
    communicator = Communicator(None, world.rank, world.world_size, torch_device,
                                cross_device_ops)
    if cluster_resolver is not None and world.world_size > 1:
        # The token must be the same on every replica and new for this group: replica 0's.
        token = communicator.broadcast_object(uuid.uuid4().hex)
        communicator.diagnose = _roll_call_naming_tasks(world, cluster_resolver, token)
    return ReplicaProcess(world=world, local_devices=tuple(local), torch_device=torch_device,
                          backend=backend, communicator=communicator)


# -- finding the world -----------------------------------------------------------------------
def _training_tasks(resolver: ClusterResolver | None) -> list[tuple[str, int]]:
    """The cluster's training tasks in machine order (chief first); [] without a cluster."""
    if resolver is None or not resolver.cluster_spec():
        return []
    return resolver.training_tasks()


def _find_world(resolver: ClusterResolver | None, devices: Sequence[str | torch.device] | None,
                implementation: CommunicationImplementation, timeout_seconds: float
                ) -> tuple[world_lib.World, list[ReplicaDevice]]:
    """(world, local devices) for this process, launching this machine's other replicas
    when a plain ``python train.py`` asks for several (one machine, or a TF_CONFIG-style
    cluster)."""
    parsed = parse_devices(devices) if devices is not None else None
    launched = runtime.world_from_environment(resolver)
    if launched is not None:  # srun's or an adopted group's world: recorded once
        runtime.current().enter_world(launched)
    tasks = _training_tasks(resolver)
    node_rank = 0
    if resolver is not None and tasks and resolver.task_type is not None:
        node_rank = resolver.worker_index  # raises for a ps or evaluator task
    if resolver is None or launched is not None or len(tasks) <= 1:
        if launched is None:  # one machine: check before re-executing anything
            local = parsed or default_local_devices()
            backend_for(implementation, local[0].kind)
        return _one_machine_world(parsed, timeout_seconds)
    return _cluster_world(resolver, tasks, node_rank, parsed, implementation,
                          timeout_seconds)


def _launched_devices(world: world_lib.World) -> list[ReplicaDevice]:
    """One device per local process when a launcher (torchrun, ts.launch) started us."""
    if torch.cuda.is_available():
        if torch.cuda.device_count() < world.local_world_size:
            raise RuntimeError(
                f"{world.local_world_size} processes on this machine but only "
                f"{torch.cuda.device_count()} GPU(s): start one process per GPU.")
        return [ReplicaDevice("cuda", i) for i in range(world.local_world_size)]
    return [ReplicaDevice("cpu", i) for i in range(world.local_world_size)]


def _one_machine_world(parsed: list[ReplicaDevice] | None, timeout_seconds: float
                       ) -> tuple[world_lib.World, list[ReplicaDevice]]:
    """(world, local devices) for a strategy asking for the devices `parsed` (None:
    default).

    - Under torchrun or ts.launch: the launched world; `parsed`, if given, must name one
      device per local process.
    - In a plain process: one replica per device; with several, this process becomes
      replica 0 and re-executes the program for the others.

    Raises:
      ValueError: `parsed` disagreeing with the launched world.
    """
    process = runtime.current()
    world = runtime.world_from_environment()
    if world is None:
        local = parsed or default_local_devices()
        if len(local) > 1:
            return process.start_local_replicas(len(local), timeout_seconds), local
        return process.start_alone(timeout_seconds), local
    else:
        if parsed is not None and len(parsed) != world.local_world_size and \
                world.launcher == "single":
            raise ValueError(
                f"devices={[d.name for d in parsed]} asks for {len(parsed)} replicas, but this "
                "program already created a one-replica strategy. A program has one replica "
                "layout: create the multi-replica strategy first (or only).")
        if parsed is not None and len(parsed) != world.local_world_size:
            raise ValueError(
                f"devices={[d.name for d in parsed]} names {len(parsed)} device(s), but "
                f"{world.launcher} started {world.local_world_size} process(es) on this "
                f"machine (LOCAL_WORLD_SIZE={world.local_world_size}). Pass "
                f"{world.local_world_size} devices, or none to take one per process.")
        local = parsed or _launched_devices(world)
    return process.enter_world(world), local


def _cluster_world(resolver: ClusterResolver, tasks: list[tuple[str, int]], node_rank: int,
                   parsed: list[ReplicaDevice] | None,
                   implementation: CommunicationImplementation, timeout_seconds: float
                   ) -> tuple[world_lib.World, list[ReplicaDevice]]:
    """(world, local devices) of machine `node_rank` of a cluster started with plain
    ``python train.py`` on every machine: this process re-executes itself for its
    machine's other replicas, and all of them meet at the first training task's address.

    Raises:
      ValueError: the first training task's address has no real port.
      RuntimeError: the rendezvous could not be served or reached; a machine missing after
        the timeout; machines with different numbers of replicas.
    """
    host, port = resolver.rendezvous_address()
    if port == 0:
        raise ValueError(f"The first training task's address {host}:{port} needs a real port: "
                         "the other machines connect to it.")
    local = parsed or default_local_devices()
    backend_for(implementation, local[0].kind)
    try:
        world = runtime.current().start_local_replicas(
            len(local), timeout_seconds, node_rank=node_rank, num_nodes=len(tasks),
            master_addr=host, master_port=port)
    except (RuntimeError, OSError) as error:  # DistStoreError / DistNetworkError included
        me = f"{resolver.task_type}:{resolver.task_id}"
        if node_rank == 0:
            problem = (f"task {me} could not serve the rendezvous at {host}:{port} (its "
                       "address in TF_CONFIG): is the port free and the address this "
                       "machine's?")
        else:
            problem = (f"task {me} could not reach the rendezvous at {host}:{port} within "
                       f"{timeout_seconds:g} s: start the first task "
                       f"({tasks[0][0]}:{tasks[0][1]}) too, and check its address and that "
                       "the port is open")
        raise RuntimeError(f"torchstrategy: {problem}. ({error})") from error
    _agree_on_replicas_per_machine(world, timeout_seconds, tasks)
    return world, local


def _agree_on_replicas_per_machine(world: world_lib.World, timeout_seconds: float,
                                   tasks: list[tuple[str, int]]) -> None:
    """Every machine announces its number of replicas in the rendezvous store of `world`
    (re-execution's world, which always carries it) and checks the others'; a machine that
    never shows up is named instead of hanging.

    Raises:
      RuntimeError: a machine missing after the timeout, or machines with different numbers
        of replicas (global ranks need the same number on each).
    """
    store = world.store
    assert store is not None, "re-execution's world carries its rendezvous store"
    key = "torchstrategy/replicas_on_machine/{}".format
    store.set(key(world.node_rank), str(world.local_world_size))
    keys = [key(m) for m in range(world.num_nodes)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_seconds))
    except Exception:  # the store's timeout error type differs across torch versions
        missing = [f"{tasks[m][0]}:{tasks[m][1]}" for m in range(world.num_nodes)
                   if not store.check([key(m)])]
        raise RuntimeError(
            f"torchstrategy: worker(s) {missing} did not join the cluster within "
            f"{timeout_seconds:g} s. Start `python train.py` with the same TF_CONFIG cluster "
            f"(and its own task) on every machine.") from None
    counts = [int(store.get(k)) for k in keys]
    if len(set(counts)) != 1:
        listing = ", ".join(f"{tasks[m][0]}:{tasks[m][1]} has {c}"
                            for m, c in enumerate(counts))
        raise RuntimeError(f"Every machine must run the same number of replicas ({listing}). "
                           "Give every worker the same number of devices.")


# -- the failure diagnosis -------------------------------------------------------------------
def _roll_call_naming_tasks(world: world_lib.World, resolver: ClusterResolver, token: str
                            ) -> Callable[[int], str]:
    """The failure diagnosis of this world: after a failed collective, name the replicas
    (and their machines' tasks) that did not answer."""
    tasks = _training_tasks(resolver)
    local = max(1, world.local_world_size)

    def name_of_rank(rank: int) -> str:
        machine = rank // local
        task = f"{tasks[machine][0]}:{tasks[machine][1]}" if machine < len(tasks) and \
            len(tasks) == world.num_nodes else f"worker:{machine}"
        return f"replica {rank} (on {task})"

    return roll_call.RollCall(token, world.world_size, name_of_rank).describe_missing
