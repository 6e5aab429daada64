"""`ClusterResolver`: where a program learns the cluster it is part of and its own role in it.

As in TensorFlow, a resolver answers four questions: the cluster (`cluster_spec()`), this
task's job and index (`task_type`, `task_id`), the address to reach a task (`master()`), and
the accelerators per task (`num_accelerators()`). On top of TensorFlow's interface it names
the tasks that train synchronously (`training_tasks()`: the chief, then the workers), which
is what the multi-worker strategy needs to give each machine its rank.
"""
from __future__ import annotations

import socket
from typing import Any, Mapping

import torch

from torchstrategy.cluster_resolver.cluster_spec import (ClusterSpec, JobTasks, parse_address,
                                                        sparse_worker_spec)

# Jobs whose tasks run the synchronous training step, in rank order.
TRAINING_JOBS = ("chief", "worker")


class ClusterResolver:
    """Base class: subclasses implement `cluster_spec()` and set the task attributes."""

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str = ""

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` of the whole cluster."""
        raise NotImplementedError("abstract: subclasses implement cluster_spec()")

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of a task (this one by default), prefixed ``rpc_layer://`` if set.

        Returns "" when this resolver does not know a task address to give.
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        layer = self.rpc_layer if rpc_layer is None else rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """Accelerators on this machine by kind, e.g. ``{"GPU": 2}``; {} when there are none."""
        del task_type, task_id, config_proto  # every task is assumed alike, as TF does locally
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"GPU": count} if count else {}

    # --- what synchronous training needs -----------------------------------------------

    def training_tasks(self) -> list[tuple[str, int]]:
        """The ``(job, index)`` of every task that trains, in rank order: chief, then workers."""
        spec = self.cluster_spec()
        return [(job, index) for job in TRAINING_JOBS if job in spec.jobs
                for index in spec.task_indices(job)]

    @property
    def num_workers(self) -> int:
        """How many machines (tasks) take part in synchronous training."""
        return len(self.training_tasks())

    @property
    def worker_index(self) -> int:
        """This task's position in `training_tasks()` (its machine rank).

        Raises:
          ValueError: when this task is not a training task (a ps or evaluator).
        """
        me = (self.task_type, self.task_id)
        tasks = self.training_tasks()
        if me not in tasks:
            raise ValueError(f"Task {self.task_type}:{self.task_id} does not train "
                             f"synchronously; the training tasks are "
                             f"{[f'{j}:{i}' for j, i in tasks]}.")
        return tasks.index(me)

    @property
    def is_chief(self) -> bool:
        """True for the task that does the cluster's one-off work (checkpoints, logs).

        That is the chief when the cluster has one, else worker 0; a task outside
        synchronous training (ps, evaluator) is never the chief.
        """
        tasks = self.training_tasks()
        return bool(tasks) and tasks[0] == (self.task_type, self.task_id)

    def rendezvous_address(self) -> tuple[str, int]:
        """``(host, port)`` of the first training task: where the training tasks meet."""
        tasks = self.training_tasks()
        if not tasks:
            raise ValueError(f"The cluster has no chief or worker task to train with: "
                             f"{self.cluster_spec()!r}.")
        return parse_address(self.cluster_spec().task_address(*tasks[0]))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r}, "
                f"cluster_spec={self.cluster_spec()!r})")


class RendezvousClusterResolver(ClusterResolver):
    """Base of the resolvers whose launcher names only where the machines meet (torchrun, a
    Kubeflow PyTorchJob): every machine is a task of job "worker", worker 0 at the
    rendezvous ``master_addr:master_port``. Subclasses set `master_addr`, `master_port`,
    `task_id` and `_num_workers` (the machines)."""

    task_type: str | None = "worker"
    master_addr: str
    master_port: int
    _num_workers: int

    def cluster_spec(self) -> ClusterSpec:
        """Worker 0 and this machine only: other machines' addresses are not known here."""
        return sparse_worker_spec(self.master_addr, self.master_port, self.task_id or 0,
                                  socket.gethostname())

    def training_tasks(self) -> list[tuple[str, int]]:
        return [("worker", i) for i in range(self._num_workers)]

    def rendezvous_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port


class SimpleClusterResolver(ClusterResolver):
    """A resolver holding what it is given: a spec and this task's role.

    Args:
      cluster_spec: a `ClusterSpec` or the dict to make one.
      master: what `master()` returns when no task is named ("" to derive it from the spec).
      task_type, task_id: this task's job and index (both, or neither).
      environment: free-form, as TensorFlow's.
      num_accelerators: e.g. ``{"GPU": 2}``; None to look at this machine.
      rpc_layer: prefix for `master()` addresses, e.g. "grpc".
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, JobTasks], master: str = "",
                 task_type: str | None = None, task_id: int | None = None,
                 environment: str = "", num_accelerators: Mapping[str, int] | None = None,
                 rpc_layer: str | None = None) -> None:
        self._cluster_spec = ClusterSpec(cluster_spec)
        if (task_type is None) != (task_id is None):
            raise ValueError("Give task_type and task_id together (e.g. task_type='worker', "
                             "task_id=0), or neither.")
        if task_type is not None and task_id is not None:
            self._cluster_spec.task_address(task_type, task_id)  # raises naming what is wrong
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self.environment = environment
        self._num_accelerators = num_accelerators
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        if self._master and task_type is None and task_id is None:
            return self._master
        return super().master(task_type, task_id, rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)
