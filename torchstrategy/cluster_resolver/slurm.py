"""`SlurmClusterResolver`: the cluster of a SLURM job step started with ``srun`` (no torchrun).

``srun`` starts every process itself, one per replica (``--ntasks-per-node`` = devices
per node), and tells each its place: SLURM_PROCID (global rank), SLURM_NTASKS (number of
replicas), SLURM_LOCALID (rank on its node), SLURM_NODEID (its node's index) and the node
list in SLURM's hostlist syntax (``node[01-03,07]``). Every SLURM task is one replica, so
the world is already launched, as under torchrun: nothing is re-executed.

The rendezvous is on the first host of the node list, at ``MASTER_PORT`` when that is set,
else at ``port_base + SLURM_JOB_ID % 10000`` (8888..18887 with the default port_base): every
task of a job computes the same port without talking to the others, and two jobs sharing a
node get different ports unless their ids are equal modulo 10000.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping

from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.cluster_resolver.cluster_spec import ClusterSpec, format_address
from torchstrategy.launch import world as world_lib

DEFAULT_PORT_BASE = 8888
PORT_SPREAD = 10000  # ports port_base .. port_base + 9999, chosen by the job id

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(hostlist: str | None, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The host names of a SLURM hostlist, in order: ``"node[01-03,07]"`` gives node01,
    node02, node03, node07; ``"a[1-2],b3"`` gives a1, a2, b3; zero padding is kept (the
    width of a range's first bound), several bracket groups in one name expand as a product
    (``"r[1-2]n[1-2]"``).

    Raises:
      ValueError: naming `variable` and the value when the list is empty or malformed
        (unbalanced brackets, an empty or reversed range, a bound that is not a number).
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"{variable}={hostlist!r} is not a SLURM node list: {why}. Expected "
                          f"names like 'node[01-03,07]' or 'a[1-2],b3' (what `scontrol show "
                          f"hostnames` expands).")

    if not isinstance(hostlist, str) or not hostlist.strip():
        raise bad("it is empty")
    hosts: list[str] = []
    for expression in _split_top_level(hostlist.strip(), bad):
        if not expression:
            raise bad("it has an empty name between commas")
        if "[]" in expression:
            raise bad(f"{expression!r} has empty brackets")
        names = [""]
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", expression):
            names = [n + literal for n in names]
            if group:
                names = [n + s for n in names for s in _expand_group(group, bad)]
        hosts.extend(names)
    return hosts


def _split_top_level(text: str, bad: Callable[[str], ValueError]) -> list[str]:
    """Splits at the commas outside brackets."""
    parts: list[str] = []
    depth, current = 0, ""
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise bad("brackets are nested")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise bad("a ']' has no '['")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise bad("a '[' is not closed")
    parts.append(current)
    return parts


def _expand_group(group: str, bad: Callable[[str], ValueError]) -> list[str]:
    suffixes: list[str] = []
    for item in group.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise bad(f"[{group}] has {item!r}, which is neither a number nor a range 'a-b'")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise bad(f"the range {item!r} is reversed")
        width = len(first) if first.startswith("0") else 0
        suffixes.extend(str(i).zfill(width) for i in range(int(first), int(last) + 1))
    return suffixes


def expand_tasks_per_node(value: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (SLURM's compressed tasks-per-node list).

    Raises:
      ValueError: naming `variable` and the value when it is malformed.
    """
    counts = []
    for item in str(value).split(","):
        match = _TASKS_PER_NODE.match(item.strip())
        if match is None:
            raise ValueError(f"{variable}={value!r} is malformed: expected counts like "
                             "'2(x3),1' (two tasks on each of three nodes, then one).")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _int(env: Mapping[str, str | None], name: str) -> int:
    raw = env.get(name)
    try:
        return int(raw or "")  # missing: a ValueError, as for any non-integer
    except (TypeError, ValueError):
        raise ValueError(f"SLURM's variable {name}={raw!r} is not an integer.") from None


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str | None]:
    """(name, value) of the first of `names` that is set, or (names[-1], None)."""
    for name in names:
        if env.get(name, "") != "":
            return name, env[name]
    return names[-1], None


class SlurmClusterResolver(ClusterResolver):
    """This process's place in a SLURM job step launched with ``srun`` (tf.distribute's name).

    Args:
      jobs: None, or ``{"worker": n}`` with n = the step's number of tasks (TensorFlow's
        argument; every SLURM task is one synchronous worker here, other jobs are refused).
      port_base: the rendezvous port is ``port_base + SLURM_JOB_ID % 10000`` unless
        MASTER_PORT is set (default 8888, TensorFlow's).
      gpus_per_node: GPUs on each node; None reads SLURM_STEP_GPUS, else
        CUDA_VISIBLE_DEVICES, else counts this machine's GPUs.
      gpus_per_task: GPUs each task uses (what `num_accelerators()` reports, as in
        TensorFlow); None divides the node's GPUs by its tasks. More GPUs per node than
        the node has is refused, as TensorFlow refuses it.
      tasks_per_node: tasks on each node; None reads SLURM_STEP_TASKS_PER_NODE or
        SLURM_TASKS_PER_NODE (or divides the tasks evenly over the nodes).
      auto_set_gpu: TensorFlow's default (True) narrows CUDA_VISIBLE_DEVICES to the task's
        GPUs. Here each task is one replica and the strategy gives it the GPU of its local
        id (``cuda:SLURM_LOCALID``) among the node's GPUs, which narrowing would hide, so
        the default is False and True is refused (the task's GPU is the same one TF's
        narrowing gives with one GPU per task; pin tensors to
        ``strategy.extended.torch_device``, not ``cuda:0``).
      rpc_layer: prefix of `master()` addresses, as TensorFlow's (default none).
      environ: the variables to read (default os.environ), e.g. for tests (keyword only).

    The step's variables are preferred to the job's (SLURM_STEP_NODELIST to
    SLURM_JOB_NODELIST, SLURM_STEP_NUM_TASKS to SLURM_NTASKS), since a step may run on part
    of the job's nodes.

    Attributes: rank, world_size, local_rank, local_world_size, node_rank, num_nodes, hosts
    (the step's nodes), master_addr, master_port, job_id.

    Raises:
      ValueError: a variable that is missing or malformed, named with the fix; tasks not
        spread evenly or not in block order over the nodes.
    """

    def __init__(self, jobs: Mapping[str, int] | None = None,
                 port_base: int = DEFAULT_PORT_BASE, gpus_per_node: int | None = None,
                 gpus_per_task: int | None = None, tasks_per_node: int | None = None,
                 auto_set_gpu: bool = False, rpc_layer: str | None = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        if auto_set_gpu:
            raise ValueError(
                "SlurmClusterResolver(auto_set_gpu=True): every SLURM task is one replica, "
                "and the strategy gives it the GPU of its local id (cuda:SLURM_LOCALID) "
                "among the node's GPUs; narrowing CUDA_VISIBLE_DEVICES to the task's GPUs, as "
                "TensorFlow does, would hide that GPU. Leave auto_set_gpu=False (the task "
                "uses the same GPU) and place tensors on strategy.extended.torch_device.")
        for name, count in (("gpus_per_node", gpus_per_node), ("gpus_per_task", gpus_per_task)):
            if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                                      or count < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {name}={count!r}.")
        env = os.environ if environ is None else environ
        missing = [n for n in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")
                   if env.get(n, "") == ""]
        if _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")[1] is None:
            missing.append("SLURM_NTASKS")
        if _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")[1] is None:
            missing.append("SLURM_JOB_NODELIST")
        if missing:
            raise ValueError(f"SlurmClusterResolver needs the variables srun sets; {missing} "
                             f"{'is' if len(missing) == 1 else 'are'} not set. Start every "
                             "replica with `srun` inside the allocation (e.g. `srun "
                             "--ntasks-per-node=4 python train.py`), not `python train.py` "
                             "in the batch script.")
        if isinstance(port_base, bool) or not isinstance(port_base, int) or \
                not 1024 <= port_base <= 65535 - PORT_SPREAD:
            raise ValueError(f"port_base must be an integer in 1024..{65535 - PORT_SPREAD}, "
                             f"got port_base={port_base!r}.")
        ntasks_name, ntasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        self.world_size = _int({ntasks_name: ntasks}, ntasks_name)
        self.rank = _int(env, "SLURM_PROCID")
        self.local_rank = _int(env, "SLURM_LOCALID")
        self.job_id = _int(env, "SLURM_JOB_ID")
        if jobs is not None and jobs != {"worker": self.world_size}:
            raise ValueError(f"jobs={jobs!r}: every SLURM task is one synchronous worker here, "
                             f"so jobs can only be {{'worker': {self.world_size}}} "
                             f"({ntasks_name}={self.world_size}); leave it None.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"SLURM_PROCID={self.rank} is outside 0..{self.world_size - 1} "
                             f"({ntasks_name}={self.world_size}).")
        nodes_name, nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        self.hosts = expand_hostlist(nodelist, nodes_name)
        self.num_nodes = len(self.hosts)
        for count_name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
            if env.get(count_name, "") != "" and count_name.startswith("SLURM_STEP") == \
                    nodes_name.startswith("SLURM_STEP"):
                if _int(env, count_name) != self.num_nodes:
                    raise ValueError(f"{nodes_name}={nodelist!r} names {self.num_nodes} "
                                     f"node(s) but {count_name}={env[count_name]}.")
        self.local_world_size = self._tasks_per_node(env, tasks_per_node, ntasks_name)
        self.node_rank = (_int(env, "SLURM_NODEID") if env.get("SLURM_NODEID", "") != ""
                          else self.rank // self.local_world_size)
        if self.rank != self.node_rank * self.local_world_size + self.local_rank or \
                not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"SLURM_PROCID={self.rank} with SLURM_NODEID={self.node_rank} and "
                f"SLURM_LOCALID={self.local_rank} ({self.local_world_size} task(s) per node): "
                "replicas need consecutive ranks on each node (block distribution). Run srun "
                "with --distribution=block (SLURM_DISTRIBUTION).")
        self.master_addr = self.hosts[0]
        if env.get("MASTER_PORT", "") != "":
            self.master_port = _int(env, "MASTER_PORT")
            if not 1 <= self.master_port <= 65535:
                raise ValueError(f"MASTER_PORT={self.master_port} is not a port (1..65535).")
        else:
            self.master_port = port_base + self.job_id % PORT_SPREAD
        self._gpus_per_node = gpus_per_node
        self._env = dict(env)
        self._gpus_per_task = gpus_per_task
        if gpus_per_task is not None:
            node_gpus = self._node_gpus()
            if gpus_per_task * self.local_world_size > node_gpus:
                raise ValueError(
                    f"gpus_per_task={gpus_per_task} x {self.local_world_size} task(s) per "
                    f"node needs {gpus_per_task * self.local_world_size} GPUs, but a node has "
                    f"{node_gpus}: requested more GPUs per node than available (as "
                    "TensorFlow refuses it).")
        self.task_type = "worker"
        self.task_id = self.rank
        self.rpc_layer = rpc_layer
        self.environment = ""
        self._cluster_spec = ClusterSpec({"worker": [
            format_address(self.hosts[t // self.local_world_size],
                           self.master_port + t % self.local_world_size)
            for t in range(self.world_size)]})

    def _tasks_per_node(self, env: Mapping[str, str], tasks_per_node: int | None,
                        ntasks_name: str) -> int:
        if tasks_per_node is not None:
            if isinstance(tasks_per_node, bool) or not isinstance(tasks_per_node, int) or \
                    tasks_per_node < 1:
                raise ValueError(f"tasks_per_node must be a positive integer, got "
                                 f"tasks_per_node={tasks_per_node!r}.")
            counts = [tasks_per_node] * self.num_nodes
            name = "tasks_per_node"
        else:
            name, raw = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
            if raw is not None:
                counts = expand_tasks_per_node(raw, name)
            else:
                counts = [self.world_size // self.num_nodes] * self.num_nodes
        if len(set(counts)) != 1 or sum(counts) != self.world_size or \
                len(counts) != self.num_nodes:
            raise ValueError(
                f"{name} gives {counts} task(s) per node for {self.num_nodes} node(s) and "
                f"{ntasks_name}={self.world_size}: every node must run the same number of "
                "replicas. Use `srun --ntasks-per-node=N` with N the devices per node.")
        return counts[0]

    def cluster_spec(self) -> ClusterSpec:
        """Job "worker" with one task per SLURM task: ``host:port + local id``."""
        return self._cluster_spec

    def rendezvous_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """GPUs per task, as in TensorFlow: `gpus_per_task`, else the node's GPUs divided
        by its tasks; {} when there are none. The node's GPUs: `gpus_per_node`, else
        SLURM_STEP_GPUS, else CUDA_VISIBLE_DEVICES (counted), else this machine's."""
        del task_type, task_id, config_proto  # every task of a step is alike
        count = self._gpus_per_task
        if count is None:
            count = self._node_gpus() // self.local_world_size
        return {"GPU": count} if count else {}

    def gpus_per_node(self) -> int:
        """The GPUs of a node (see `num_accelerators`, which counts a task's)."""
        return self._node_gpus()

    def _node_gpus(self) -> int:
        if self._gpus_per_node is not None:
            return self._gpus_per_node
        for name in ("SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
            raw = self._env.get(name)
            if raw is not None:
                return len([d for d in raw.split(",") if d.strip() and d != "NoDevFiles"])
        return super().num_accelerators().get("GPU", 0)

    def world(self) -> world_lib.World:
        """The launched `World` of this step: one replica per SLURM task, rank 0's host
        serving the rendezvous store."""
        return world_lib.World(rank=self.rank, world_size=self.world_size,
                               local_rank=self.local_rank,
                               local_world_size=self.local_world_size, launcher="slurm",
                               master_addr=self.master_addr, master_port=self.master_port,
                               node_rank=self.node_rank, num_nodes=self.num_nodes)


def srun_step(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process is a task of an ``srun`` step of more than one task.

    A batch script, ``salloc``'s shell or a one-task step is a plain process: there the
    strategy takes the local devices itself (SLURM_STEP_ID is set by srun only).
    """
    env = os.environ if environ is None else environ
    if env.get("SLURM_STEP_ID", "") == "" or env.get("SLURM_PROCID", "") == "":
        return False
    _, ntasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    try:
        return ntasks is not None and int(ntasks) > 1
    except ValueError:
        return True  # the resolver names the malformed variable
