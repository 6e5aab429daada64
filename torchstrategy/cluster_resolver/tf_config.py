"""`TFConfigClusterResolver`: the cluster described by TensorFlow's ``TF_CONFIG`` variable.

``TF_CONFIG`` is JSON: ``{"cluster": {"chief": [...], "worker": [...], "ps": [...],
"evaluator": [...]}, "task": {"type": "worker", "index": 1}}``, optionally with
``"rpc_layer"`` and ``"environment"``. Programs written for tf.distribute keep their launch
scripts: the same variable configures the same roles here.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.cluster_resolver.cluster_spec import ClusterSpec

TF_CONFIG_ENV = "TF_CONFIG"
KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = ('TF_CONFIG=\'{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}\'')


class TFConfigError(ValueError):
    """TF_CONFIG is set but does not describe a valid cluster and task."""


def read_tf_config(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The parsed and checked ``TF_CONFIG`` as a dict; {} when the variable is unset or empty.

    Guarantees, when it returns: ``cluster`` is a valid `ClusterSpec` dict whose jobs are
    among chief, worker, ps and evaluator (at most one chief and one evaluator); ``task``, if
    present, names one of its jobs with an index inside that job.

    Raises:
      TFConfigError: naming what is wrong (bad JSON, missing or malformed cluster or task,
        unknown job, index out of range), with an example of a valid value.
    """
    raw = (os.environ if environ is None else environ).get(TF_CONFIG_ENV, "")
    if not raw.strip():
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise TFConfigError(f"TF_CONFIG is not valid JSON ({err.msg} at line {err.lineno} "
                            f"column {err.colno}). A valid one: {_EXAMPLE}") from None
    if not isinstance(config, dict):
        raise TFConfigError(f"TF_CONFIG must be a JSON object, got {type(config).__name__}. "
                            f"A valid one: {_EXAMPLE}")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise TFConfigError(f"TF_CONFIG has no 'cluster' (a JSON object of job name -> list "
                            f"of 'host:port'). A valid one: {_EXAMPLE}")
    unknown = sorted(set(cluster) - set(KNOWN_JOBS))
    if unknown:
        raise TFConfigError(f"TF_CONFIG's cluster has unknown job(s) {unknown}; jobs are "
                            f"{list(KNOWN_JOBS)}.")
    try:
        spec = ClusterSpec(cluster)
    except (TypeError, ValueError) as err:
        raise TFConfigError(f"TF_CONFIG's cluster is malformed: {err}") from None
    for single in ("chief", "evaluator"):
        if single in cluster and spec.num_tasks(single) > 1:
            raise TFConfigError(f"TF_CONFIG's cluster has {spec.num_tasks(single)} "
                                f"{single} tasks; there can be at most one.")
    task = config.get("task")
    if task is not None:
        if not isinstance(task, dict) or "type" not in task or "index" not in task:
            raise TFConfigError(f"TF_CONFIG's 'task' must be an object with 'type' and "
                                f"'index', got {task!r}. A valid one: {_EXAMPLE}")
        _check_task(spec, task["type"], task["index"], "TF_CONFIG's task")
    return config


def _check_task(spec: ClusterSpec, task_type: str, task_id: int, what: str) -> None:
    if task_type not in spec.jobs:
        raise TFConfigError(f"{what} type {task_type!r} is not a job of the cluster; its jobs "
                            f"are {spec.jobs}.")
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise TFConfigError(f"{what} index must be an integer, got {task_id!r}.")
    if task_id not in spec.task_indices(task_type):
        raise TFConfigError(f"{what} index {task_id} is out of range: job {task_type!r} has "
                            f"{spec.num_tasks(task_type)} task(s), indices "
                            f"{spec.task_indices(task_type)}.")


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task's role from ``TF_CONFIG``, as TensorFlow does.

    Args:
      task_type, task_id: override TF_CONFIG's task (both or neither).
      rpc_layer: override TF_CONFIG's ``rpc_layer``.
      environment: override TF_CONFIG's ``environment``.

    The variable is read when the resolver is made. With TF_CONFIG unset the cluster is
    empty and the task None (a single machine).

    Raises:
      TFConfigError (a ValueError): TF_CONFIG is malformed, see `read_tf_config`.
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str | None = None) -> None:
        config = read_tf_config()
        self._cluster_spec = ClusterSpec(config.get("cluster", {}))
        task = config.get("task") or {}
        if (task_type is None) != (task_id is None):
            raise ValueError("Give task_type and task_id together, or neither.")
        if task_type is not None and task_id is not None:
            _check_task(self._cluster_spec, task_type, task_id, "The given task")
        self.task_type = task_type if task_type is not None else task.get("type")
        self.task_id = task_id if task_id is not None else task.get("index")
        self.rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self.environment = (environment if environment is not None
                            else config.get("environment", ""))
        if self._cluster_spec and self.task_type is None:
            raise TFConfigError(f"TF_CONFIG has a cluster but no 'task' saying which of its "
                                f"tasks this process is. A valid one: {_EXAMPLE}")

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec
