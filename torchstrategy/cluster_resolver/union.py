"""`UnionResolver`: one cluster made of what several resolvers know (TensorFlow's
``tf.distribute.cluster_resolver.UnionResolver``)."""
from __future__ import annotations

from typing import Any

from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.cluster_resolver.cluster_spec import ClusterSpec


class UnionResolver(ClusterResolver):
    """The union of several `ClusterResolver`s.

    ``cluster_spec()`` merges their specs: a job that appears in several is merged; when
    every one of them lists its tasks as a list, the lists are concatenated in the order
    the resolvers were given; when any gives a dict (a sparse job), the tasks are merged by
    index and an index given twice is an error. The task's own facts (`task_type`,
    `task_id`, `rpc_layer`, `environment`, `num_accelerators`, `master()`) come from the
    first resolver unless overridden here.

    Args:
      *resolvers: the `ClusterResolver`s, at least one.
      task_type / task_id / rpc_layer: keyword only; override the first resolver's.

    Raises:
      TypeError: an argument that is not a `ClusterResolver`, or an unknown keyword.
      ValueError: no resolver.
      KeyError (from ``cluster_spec()``): two resolvers giving the same task index of a job.
    """

    def __init__(self, *resolvers: ClusterResolver, task_type: str | None = None,
                 task_id: int | None = None, rpc_layer: str | None = None) -> None:
        if not resolvers:
            raise ValueError("UnionResolver needs at least one ClusterResolver.")
        for index, resolver in enumerate(resolvers):
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(f"UnionResolver: argument {index} is a "
                                f"{type(resolver).__name__}, not a "
                                "ts.cluster_resolver.ClusterResolver.")
        self._resolvers = resolvers
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer

    @property
    def resolvers(self) -> tuple[ClusterResolver, ...]:
        return self._resolvers

    # The overrides win; None (not 0, which is a task id) means "the first resolver's".
    @property
    def task_type(self) -> str | None:
        return self._task_type if self._task_type is not None else self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = value

    @property
    def task_id(self) -> int | None:
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self._task_id = value

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str:  # type: ignore[override]  # read-only: the first resolver's
        return self._resolvers[0].environment

    def cluster_spec(self) -> ClusterSpec:
        """The merged `ClusterSpec` (see the class docstring).

        Raises:
          KeyError: a task index of one job given by two resolvers.
        """
        specs = [resolver.cluster_spec().as_dict() for resolver in self._resolvers]
        sparse = {job for spec in specs for job, tasks in spec.items()
                  if isinstance(tasks, dict)}
        merged: dict[str, Any] = {}  # job -> a list of addresses, or {index: address}
        for spec in specs:
            for job, tasks in spec.items():
                if job not in sparse:
                    merged.setdefault(job, []).extend(tasks)
                    continue
                indexed = tasks if isinstance(tasks, dict) else dict(enumerate(tasks))
                into = merged.setdefault(job, {})
                clash = sorted(set(indexed) & set(into))
                if clash:
                    raise KeyError(f"UnionResolver: job {job!r} task(s) {clash} are given by "
                                   "two resolvers; each task index may come from one only.")
                into.update(indexed)
        return ClusterSpec(merged)

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The named task's address, or the first resolver's `master()`."""
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
            layer = rpc_layer or self.rpc_layer
            return f"{layer}://{address}" if layer else address
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """The first resolver's answer (e.g. a `SimpleClusterResolver` overriding GPUs)."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)
