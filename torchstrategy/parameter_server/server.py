"""`Server`: a worker or parameter-server task of a parameter-server cluster.

A server joins the cluster's rpc world under its task name and then only answers calls: a
parameter server holds variables and applies optimizer updates, a worker runs the closures
the coordinator schedules. Start one per task::

    python -m torchstrategy.server                      # reads TF_CONFIG
    python -m torchstrategy.server --cluster_spec '{"chief": [...], "worker": [...], "ps": [...]}' \\
        --task_type worker --task_id 1

or from Python: ``ts.Server(resolver).join()``.

A server ends when the chief asks it to (when the chief's program ends), or when it loses
the chief (the chief died: restart the cluster, and the chief restores from its checkpoint).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed.rpc as rpc

from torchstrategy import runtime
from torchstrategy.cluster_resolver import (ClusterResolver, ClusterSpec, SimpleClusterResolver,
                                            TFConfigClusterResolver)
from torchstrategy.cluster_resolver.cluster_spec import JobTasks
from torchstrategy.parameter_server import rpc_world

logger = logging.getLogger("torchstrategy")

# How often a server checks that the chief is still there, and how many missed checks end it.
_CHIEF_CHECK_SECONDS = 2.0
_CHIEF_MISSES = 3
# How long the chief waits for each server to acknowledge the request to stop.
_STOP_REQUEST_TIMEOUT_SECONDS = 5


class _ServerState:
    """Whether the chief asked this server process to stop (``runtime.current().state``)."""

    def __init__(self) -> None:
        self.stop_requested = threading.Event()


def _state() -> _ServerState:
    return runtime.current().state("parameter_server.server", _ServerState)


def request_stop() -> bool:
    """Rpc target: the chief asks this server to end."""
    _state().stop_requested.set()
    return True


def ping() -> int:
    """Rpc target: liveness check."""
    return os.getpid()


def _server_resolver(cluster: ClusterResolver | ClusterSpec | Mapping[str, JobTasks],
                     job_name: str | None, task_index: int | None, protocol: str | None,
                     config: Any) -> ClusterResolver:
    """The resolver a `Server` serves: `cluster` as it is, or its spec with the task that
    `job_name` / `task_index` name (TensorFlow's defaults: the only job, the only task)."""
    if protocol not in (None, "grpc"):
        raise ValueError(f"Server(protocol={protocol!r}): the tasks talk over torch rpc's "
                         "one transport (TensorPipe), which stands for TensorFlow's default "
                         "'grpc'; no other protocol can be chosen. Leave protocol None.")
    if config is not None:
        raise ValueError("Server(config=...): a TensorFlow ConfigProto has nothing to "
                         "configure in torch rpc. Leave config None; bound calls with "
                         "rpc_timeout= and startup_timeout= instead.")
    if isinstance(cluster, ClusterResolver):
        if job_name is None and task_index is None:
            return cluster
        spec = cluster.cluster_spec()
        job_name = cluster.task_type if job_name is None else job_name
        task_index = cluster.task_id if task_index is None else task_index
    else:
        spec = ClusterSpec(cluster)
    if job_name is None:
        if len(spec.jobs) != 1:
            raise ValueError(f"Server: the cluster has the jobs {spec.jobs}; name this task's "
                             "job with job_name= (as TensorFlow asks).")
        job_name = spec.jobs[0]
    if task_index is None:
        indices = spec.task_indices(job_name)
        if len(indices) != 1:
            raise ValueError(f"Server: job {job_name!r} has the tasks {indices}; name this "
                             "task with task_index= (as TensorFlow asks).")
        task_index = indices[0]
    rpc_layer = cluster.rpc_layer if isinstance(cluster, ClusterResolver) else None
    return SimpleClusterResolver(spec, task_type=job_name, task_id=task_index,
                                 rpc_layer=rpc_layer)


class Server:
    """One task (worker or ps) of a parameter-server cluster (tf.distribute.Server).

    Args:
      server_or_cluster_def: a `ClusterResolver` whose ``task_type`` is "worker" or "ps"
        and whose ``task_id`` says which one (``ts.TFConfigClusterResolver()`` reads
        TF_CONFIG), or, as in TensorFlow, a `ClusterSpec` (or its dict) with `job_name`
        and `task_index` naming this task.
      job_name, task_index: this task's job and index; default the resolver's task, or
        for a spec its only job and that job's only task (as TensorFlow).
      protocol: None or "grpc" (TensorFlow's default; the tasks here use torch rpc's one
        transport); another is refused.
      config: must be None (a TensorFlow ConfigProto has nothing to configure here).
      start: join the cluster now (the default), or later with `start()`.
      rpc_timeout: seconds before any rpc this server makes fails (keyword only).
      startup_timeout: seconds to wait for the chief's rendezvous (keyword only).

    Raises:
      ValueError: no task named (or several jobs or tasks to choose from), a job other than
        worker/ps, an address this machine does not have, a protocol or config that cannot
        be honoured.
    """

    def __init__(self, server_or_cluster_def: ClusterResolver | ClusterSpec |
                 Mapping[str, JobTasks], job_name: str | None = None,
                 task_index: int | None = None, protocol: str | None = None,
                 config: Any = None, start: bool = True, *,
                 rpc_timeout: float = rpc_world.DEFAULT_RPC_TIMEOUT_SECONDS,
                 startup_timeout: float = rpc_world.DEFAULT_STARTUP_TIMEOUT_SECONDS) -> None:
        cluster_resolver = _server_resolver(server_or_cluster_def, job_name, task_index,
                                            protocol, config)
        self._resolver = cluster_resolver
        task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
        if task_type not in ("worker", "ps") or task_type is None or task_id is None:
            raise ValueError(f"A Server is a 'worker' or 'ps' task; the resolver says "
                             f"task_type={task_type!r}, task_id={task_id!r}. Set "
                             f"TF_CONFIG's task (or the resolver's task_type/task_id).")
        self.task_type: str = task_type
        self.task_id: int = task_id
        self._spec = cluster_resolver.cluster_spec()
        rpc_world.check_cluster(self._spec)
        self._spec.task_address(self.task_type, self.task_id)
        self._rpc_timeout = rpc_timeout
        self._startup_timeout = startup_timeout
        self._membership: rpc_world.Membership | None = None
        if start:
            self.start()

    @property
    def target(self) -> str:
        """This task's rpc name, e.g. ``"worker:1"``."""
        return rpc_world.task_name(self.task_type, self.task_id)

    def start(self) -> None:
        """Joins the cluster (waits for the chief's rendezvous)."""
        if self._membership is None:
            self._membership = rpc_world.join(self._spec, self.task_type, self.task_id,
                                              self._rpc_timeout, self._startup_timeout)

    def join(self) -> bool:
        """Serves until the chief asks this server to stop or the chief is gone, then
        leaves the rpc world. Returns True when stopped by the chief, False when it lost
        the chief."""
        self.start()
        host_job, host_index = rpc_world.store_task(self._spec)
        host = rpc_world.task_name(host_job, host_index)
        stop_requested = _state().stop_requested
        misses = 0
        while not stop_requested.wait(_CHIEF_CHECK_SECONDS):
            try:
                rpc.rpc_sync(host, ping, timeout=_CHIEF_CHECK_SECONDS * 2)
                misses = 0
            except RuntimeError:  # rpc's error for a lost or silent peer (and timeouts)
                misses += 1
                if misses >= _CHIEF_MISSES:
                    break
        stopped = stop_requested.is_set()
        time.sleep(0.3)  # let the answer to the stop request go out first
        rpc_world.leave()
        return stopped


def shutdown_cluster(membership: rpc_world.Membership) -> None:
    """Ends this chief's part in the cluster of `membership`: asks every server to stop,
    then leaves the rpc world (nothing when this process already left it). Bounded: dead
    servers cannot hang it."""
    if rpc_world.current() is not membership:
        return
    servers = [name for name in membership.live_members() if name != membership.name]
    errors = rpc_world.call_each(servers, request_stop, (), _STOP_REQUEST_TIMEOUT_SECONDS)
    for name, error in errors.items():
        # Gone or silent: it ends by itself when it loses the chief.
        logger.debug(f"{name} did not acknowledge the stop request: {error}")
    rpc_world.leave()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m torchstrategy.server``: runs one task until the chief stops it, then
    ends the process (exit code 0; 3 when it lost the chief)."""
    parser = argparse.ArgumentParser(
        prog="python -m torchstrategy.server",
        description="Run one worker or ps task of a parameter-server cluster. Without flags "
                    "the cluster and task come from TF_CONFIG.")
    parser.add_argument("--cluster_spec", help="JSON cluster spec (default: TF_CONFIG's)")
    parser.add_argument("--task_type", choices=["worker", "ps"])
    parser.add_argument("--task_id", type=int)
    parser.add_argument("--rpc_timeout", type=float, default=rpc_world.DEFAULT_RPC_TIMEOUT_SECONDS)
    parser.add_argument("--startup_timeout", type=float,
                        default=rpc_world.DEFAULT_STARTUP_TIMEOUT_SECONDS)
    args = parser.parse_args(argv)
    resolver: ClusterResolver
    if args.cluster_spec:
        if args.task_type is None or args.task_id is None:
            parser.error("--cluster_spec needs --task_type and --task_id")
        resolver = SimpleClusterResolver(json.loads(args.cluster_spec),
                                         task_type=args.task_type, task_id=args.task_id)
    else:
        resolver = TFConfigClusterResolver(task_type=args.task_type, task_id=args.task_id)
    if os.environ.get("OMP_NUM_THREADS") is None:
        torch.set_num_threads(1)  # a server's work is small ops; leave cores to the others
    stopped = Server(resolver, rpc_timeout=args.rpc_timeout,
                     startup_timeout=args.startup_timeout).join()
    # TensorPipe's threads can outlive a peer-less shutdown: end the process right here.
    os._exit(0 if stopped else 3)


if __name__ == "__main__":
    main()
