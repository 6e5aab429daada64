"""`local_cluster`: a whole parameter-server cluster on this machine, for tests and notebooks.

    with ts.parameter_server.local_cluster(num_workers=2, num_ps=1) as resolver:
        strategy = ts.ParameterServerStrategy(resolver)
        ...

Each worker and parameter server is a ``python -m torchstrategy.server`` subprocess; every
address is 127.0.0.1 on a port the OS picked; this process is the chief. The servers end
when the ``with`` block ends, at interpreter exit, or when this process dies (they get
SIGKILL from the kernel then), so none is left behind.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from typing import Mapping

from torchstrategy import runtime
from torchstrategy.cluster_resolver import SimpleClusterResolver
from torchstrategy.launch.reexec import set_parent_death_signal
from torchstrategy.parameter_server import rpc_world, server

_TERMINATE_GRACE_SECONDS = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalCluster(SimpleClusterResolver):
    """The resolver of a local cluster (this process is its chief), which also owns the
    server processes: `kill` and `restart` one to try failures, `stop` them all."""

    def __init__(self, num_workers: int = 2, num_ps: int = 1,
                 env: Mapping[str, str] | None = None,
                 rpc_timeout: float | None = None) -> None:
        if num_workers < 1 or num_ps < 1:
            raise ValueError(f"A parameter-server cluster needs at least one worker and one "
                             f"ps, got num_workers={num_workers}, num_ps={num_ps}.")
        spec = {"chief": [f"127.0.0.1:{_free_port()}"],
                "worker": [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)],
                "ps": [f"127.0.0.1:{_free_port()}" for _ in range(num_ps)]}
        super().__init__(spec, task_type="chief", task_id=0)
        self._env = dict(env or {})
        self._rpc_timeout = rpc_timeout
        self._processes: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self._stopped = False
        runtime.current().on_shutdown(f"parameter_server.local_cluster.{id(self)}", self.stop)
        for job in ("ps", "worker"):
            for index in range(len(spec[job])):
                self.start_task(job, index)

    def _command(self, job: str, index: int) -> list[str]:
        command = [sys.executable, "-m", "torchstrategy.server"]
        if self._rpc_timeout is not None:
            command += ["--rpc_timeout", str(self._rpc_timeout)]
        return command

    def start_task(self, job: str, index: int) -> subprocess.Popen[bytes]:
        """Starts (or restarts) the server process of task ``job:index``."""
        env = dict(os.environ)
        env.update(self._env)
        env["TF_CONFIG"] = json.dumps({"cluster": self.cluster_spec().as_dict(),
                                       "task": {"type": job, "index": index}})
        # The servers import what the chief imports (tests, the user's modules) by name.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # The server gets SIGKILL when this process (the chief) dies (Linux; elsewhere
        # servers end when they lose the chief).
        self._processes[(job, index)] = subprocess.Popen(
            self._command(job, index), env=env, preexec_fn=set_parent_death_signal)
        return self._processes[(job, index)]

    restart = start_task

    def process(self, job: str, index: int) -> subprocess.Popen[bytes]:
        """The `subprocess.Popen` of task ``job:index``."""
        return self._processes[(job, index)]

    def kill(self, job: str, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` (default SIGKILL) to task ``job:index`` and waits for it to end."""
        process = self._processes[(job, index)]
        if process.poll() is None:
            process.send_signal(sig)
        process.wait(timeout=30)

    def stop(self) -> None:
        """Ends the cluster: the chief (this process) leaves the rpc world after asking the
        servers to stop; servers still running after a grace period are killed."""
        if self._stopped:
            return
        self._stopped = True
        current = rpc_world.current()
        if current is not None and current.spec == self.cluster_spec():
            server.shutdown_cluster(current)
        for process in self._processes.values():
            try:
                process.wait(timeout=_TERMINATE_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self._processes.values():
            try:
                process.wait(timeout=_TERMINATE_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def local_cluster(num_workers: int = 2, num_ps: int = 1, env: Mapping[str, str] | None = None,
                  rpc_timeout: float | None = None) -> LocalCluster:
    """Starts a local cluster of `num_workers` workers and `num_ps` parameter servers in
    subprocesses (this process is the chief) and returns its resolver, a `LocalCluster`.

    Use it as a context manager, or let interpreter exit stop it.
    """
    return LocalCluster(num_workers, num_ps, env, rpc_timeout)
