"""Several "machines" on one machine, for the multi-worker tests.

- `run_torchrun_machines`: one torchrun agent per machine (``--nnodes``, c10d rendezvous on
  a free port), each starting its local replicas.
- `run_tf_config_machines`: one plain ``python script`` per machine, with TF_CONFIG naming
  the cluster and that machine's task.
- with `netns` (tests/helpers/cluster.py's nodes), each machine runs on a node of a
  cluster of network namespaces: its own address, hostname and /etc/hosts.

Every process runs under a timeout; ports are picked by the OS.
"""
import json
import os
import socket
import subprocess
import sys
import uuid

from tests.helpers import SCRIPTS

SCRIPT = os.path.join(SCRIPTS, "multi_worker_train.py")
PROCESS_TIMEOUT = 240


def clean_env(**extra):
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHSTRATEGY_LAUNCHER", "TF_CONFIG",
                 "TORCHSTRATEGY_PARENT_PID", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "TORCHSTRATEGY_PUBLISHED_WORLD"):
        env.pop(name, None)
    env.setdefault("TORCHSTRATEGY_TIMEOUT_SECONDS", "60")
    # The "machines" share this one's cores: one thread per replica, as torchrun sets.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port(host="127.0.0.1", netns=None):
    """A port the OS reports free on `host` (inside `netns` when given: a namespace's name,
    or a `tests.helpers.cluster.Node`)."""
    if netns is not None and not isinstance(netns, str):
        return int(netns.python("import socket; s = socket.socket(); s.bind(('', 0)); "
                                "print(s.getsockname()[1])"))
    if netns is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    code = (f"import socket; s = socket.socket(); s.bind(({host!r}, 0)); "
            "print(s.getsockname()[1])")
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


class Machine:
    """A started machine: its process, its log file."""

    def __init__(self, command, env, log_path, netns=None):
        if isinstance(netns, str):
            command = ["ip", "netns", "exec", netns] + command
        elif netns is not None:  # a tests.helpers.cluster.Node: its hostname too
            command = netns.command(command)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout=PROCESS_TIMEOUT):
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._log.close()

    def kill(self):
        """Kills the machine's whole process group (its agent and replicas)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
            self.process.wait(30)

    def log(self):
        with open(self.log_path) as f:
            return f.read()


def wait_all(machines, timeout=PROCESS_TIMEOUT):
    """Exit codes of every machine (all are killed if one overruns `timeout`)."""
    try:
        return [m.wait(timeout) for m in machines]
    finally:
        for m in machines:
            m.kill()


def start_torchrun_machines(mode, outdir, nproc, *, nnodes=2, hosts=None, netns=None,
                            ifnames=None, max_restarts=0, user_flags_only=False,
                            is_host_only=False, **env):
    """Starts `nnodes` torchrun agents (node 0 hosts the c10d rendezvous). With
    `user_flags_only`, only the flags a user types are given (no ``--local-addr``, no
    ``is_host``): torchrun recognises the store's host by its name; with `is_host_only`,
    those and ``--rdzv-conf=is_host=...`` (the documented recipe)."""
    hosts = hosts or ["127.0.0.1"] * nnodes
    port = free_port(hosts[0], netns[0] if netns else None)
    run_id = uuid.uuid4().hex[:12]
    machines = []
    for node in range(nnodes):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                   f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={hosts[0]}:{port}", f"--rdzv-id={run_id}",
                   f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]
        if not user_flags_only:
            command.append(f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}")
        if not (user_flags_only or is_host_only):
            command.append(f"--local-addr={hosts[node]}")
        command += [SCRIPT, mode, str(outdir)]
        extra = dict(env)
        # torch >= 2.4 shares one rendezvous store across restarted rounds; a restarted
        # round could read the previous round's addresses (see the strategy's warning).
        extra.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if ifnames:
            extra["GLOO_SOCKET_IFNAME"] = ifnames[node]
        machines.append(Machine(command, clean_env(**extra), os.path.join(outdir,
                                f"machine{node}.log"), netns[node] if netns else None))
    return machines


def start_tf_config_machines(mode, outdir, replicas, *, jobs=("worker", "worker"),
                             hosts=None, netns=None, ifnames=None, argv=None, only=None,
                             **env):
    """Starts one ``python script`` per task of a TF_CONFIG cluster (task i = machine i);
    `argv` replaces the test script and its arguments (e.g. an example's); `only` lists the
    tasks to start (default all)."""
    os.makedirs(outdir, exist_ok=True)
    hosts = hosts or ["127.0.0.1"] * len(jobs)
    port = free_port(hosts[0], netns[0] if netns else None)
    # Only the first task's port is used (machine 0 hosts the rendezvous store there).
    cluster = {}
    for i, job in enumerate(jobs):
        cluster.setdefault(job, []).append(f"{hosts[i]}:{port if i == 0 else 2222}")
    machines = []
    for i, job in enumerate(jobs):
        if only is not None and i not in only:
            continue
        index = cluster[job].index(f"{hosts[i]}:{port if i == 0 else 2222}")
        config = {"cluster": cluster, "task": {"type": job, "index": index}}
        extra = dict(env, TF_CONFIG=json.dumps(config))
        if ifnames:
            extra["GLOO_SOCKET_IFNAME"] = ifnames[i]
        command = [sys.executable] + (argv or [SCRIPT, mode, str(outdir), str(replicas)])
        machines.append(Machine(command, clean_env(**extra),
                                os.path.join(outdir, f"machine{i}.log"),
                                netns[i] if netns else None))
    return machines
