"""`ClusterSpec`: the jobs of a cluster and the address of every task, as TensorFlow names them."""
from __future__ import annotations

import re
from typing import Mapping, Sequence, Union

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):(\d{1,5})$")

# A job's tasks: addresses in task order, or {task index: address} for a sparse job.
JobTasks = Union[Sequence[str], Mapping[int, str]]


def parse_address(address: str) -> tuple[str, int]:
    """Splits ``"host:port"`` (or ``"[ipv6]:port"``) into ``(host, port)``.

    Raises:
      ValueError: naming the address when it is not of that form or the port is out of range.
    """
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None:
        raise ValueError(f"Task address {address!r} is not of the form 'host:port' "
                         f"(for IPv6: '[::1]:port').")
    if not 0 <= int(match.group(2)) <= 65535:
        raise ValueError(f"Task address {address!r}: port {int(match.group(2))} is out of "
                         "range; a port is 0..65535 (usually 1024..65535).")
    host = match.group(1)
    return host.strip("[]"), int(match.group(2))


def format_address(host: str, port: int) -> str:
    """``"host:port"``, the host bracketed when it is an IPv6 address (``"[::1]:port"``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def sparse_worker_spec(master_addr: str, master_port: int, worker_index: int, hostname: str
                       ) -> ClusterSpec:
    """The cluster a launcher's variables describe when they name only the rendezvous:
    worker 0 at ``master_addr:master_port`` and this machine (`worker_index`, `hostname`)
    on the same port. Other machines' addresses are not known there."""
    known = {0: format_address(master_addr, master_port)}
    if worker_index != 0:
        known[worker_index] = format_address(hostname, master_port)
    return ClusterSpec({"worker": known})


class ClusterSpec:
    """Which tasks make up a cluster, by job name, and where each one listens.

    ``ClusterSpec({"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
    "ps": ["10.0.0.4:2222"]})``. A job's tasks are a list (task i at position i) or a dict
    ``{task_index: address}`` for a sparse job. Every address is ``"host:port"``.

    Raises (from the constructor):
      TypeError / ValueError: naming the job and task when the spec is malformed.
    """

    def __init__(self, cluster: ClusterSpec | Mapping[str, JobTasks] | None) -> None:
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if cluster is None:
            cluster = {}
        if not isinstance(cluster, dict):
            raise TypeError(f"A cluster spec is a dict of job name -> list of 'host:port' "
                            f"addresses, got {type(cluster).__name__}.")
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise TypeError(f"Job names are non-empty strings, got {job!r}.")
            if isinstance(tasks, str):
                raise TypeError(f"Job {job!r}: tasks are a list of addresses, got the string "
                                f"{tasks!r} (write [{tasks!r}]).")
            indexed: dict[int, str]
            if isinstance(tasks, dict):
                indexed = {}
                for index, address in tasks.items():
                    if not isinstance(index, int) or index < 0:
                        raise TypeError(f"Job {job!r}: task indices are non-negative ints, "
                                        f"got {index!r}.")
                    indexed[index] = address
            elif isinstance(tasks, (list, tuple)):
                indexed = dict(enumerate(tasks))
            else:
                raise TypeError(f"Job {job!r}: tasks are a list (or dict index -> address), "
                                f"got {type(tasks).__name__}.")
            for index, address in indexed.items():
                try:
                    parse_address(address)
                except ValueError as err:
                    raise ValueError(f"Job {job!r}, task {index}: {err}") from None
            self._jobs[job] = dict(sorted(indexed.items()))

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The spec as a dict: a list per dense job (indices 0..n-1), a dict per sparse job."""
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = list(tasks) == list(range(len(tasks)))
            out[job] = list(tasks.values()) if dense else dict(tasks)
        return out

    def num_tasks(self, job_name: str) -> int:
        """Number of tasks in `job_name`. Raises ValueError for an unknown job."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of `job_name`, sorted."""
        return list(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The ``"host:port"`` of one task. Raises ValueError naming what is missing."""
        tasks = self._tasks(job_name)
        if task_index not in tasks:
            raise ValueError(f"No task {task_index} in job {job_name!r}; it has tasks "
                             f"{list(tasks)}.")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The job's addresses by index, with None where a sparse job has a gap."""
        tasks = self._tasks(job_name)
        if not tasks:
            return []
        return [tasks.get(i) for i in range(max(tasks) + 1)]

    def _tasks(self, job_name: str) -> dict[int, str]:
        if job_name not in self._jobs:
            raise ValueError(f"No job {job_name!r} in the cluster; its jobs are {self.jobs}.")
        return self._jobs[job_name]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"
