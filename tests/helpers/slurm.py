"""A private one-node SLURM cluster for the tests (Debian's slurmctld, slurmd, munge).

`slurm_cluster` is a module-scoped fixture: it writes a slurm.conf into a temporary
directory (loopback ports the OS reports free, state, spool, logs and munge's key and
socket all in that directory), starts munged, slurmctld and slurmd in the foreground as
root, waits until ``sinfo`` shows the node idle, and at the end stops the daemons (every
process they started included: slurmstepd and the job's processes). It skips, saying why,
where that cannot run: not root, a binary missing, a daemon that does not start (with the
tail of its log).

The cluster has two partitions on the one node: ``low`` (the default) and ``high``, whose
jobs preempt ``low``'s with ``PreemptMode=REQUEUE`` after a grace time of `GRACE_SECONDS`;
``RequeueExit=42`` requeues a batch job that exits with 42 (the handler's "restart me"),
and ``AuthInfo=cred_expire=5`` lets a requeued job start again about 5 s after it ended
instead of SLURM's default 120 s. Client commands find the cluster through ``SLURM_CONF``:
`SlurmCluster.env` is the environment to run them (and the jobs, which inherit it) with.

`slurm_on_nodes(nodes)` starts the same daemons on the nodes of a cluster of network
namespaces (tests/helpers/cluster.py) instead: slurmctld on the first node
(``SlurmctldHost=node0(ADDRESS)``), one slurmd per node (``NodeName=nodeI
NodeAddr=ADDRESS``, each with its own spool, pid and log file: ``%n`` in their paths), and
one munged on this machine, whose socket (a file) every node reaches, as a shared munge
key lets a real cluster's nodes authenticate each other. Client commands run on the
first node (the "login node"); `SlurmCluster.run` does so.
"""
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time

import pytest

GRACE_SECONDS = 60
START_TIMEOUT = 30
BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sinfo", "srun", "sbatch",
            "scontrol", "scancel")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as error:
        return f"({path} unreadable: {error})"


class SlurmCluster:
    """A started cluster: `env` runs its client commands; `run` runs one of them."""

    def __init__(self, directory, nodes=None, cpus=None):
        self.directory = directory
        # The nodes of a tests.helpers.cluster.Cluster to run on; None: this machine alone.
        self.nodes = nodes
        self.conf = os.path.join(directory, "slurm.conf")
        self.munge_socket = os.path.join(directory, "munge", "munge.socket")
        # The CPUs each node declares: by default this machine's, two at least (the tests
        # run two replicas); more lets several jobs share a node at once. slurmd accepts
        # more CPUs than it finds with SlurmdParameters=config_overrides.
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int)
                                 or cpus < 1):
            raise ValueError(f"cpus is a positive number of CPUs per node, got {cpus!r}")
        self.cpus = cpus if cpus is not None else max(os.cpu_count() or 1, 2)
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        # The suite may itself run inside a SLURM job: its variables must not leak into
        # the private cluster's commands.
        for name in list(self.env):
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) \
                    and name != "SLURM_CONF":
                del self.env[name]
        self._daemons = []   # (name, Popen, log path)

    # -- setting up ------------------------------------------------------------------
    def write_config(self):
        state = os.path.join(self.directory, "state")
        spool = os.path.join(self.directory, "spool")
        for path in (state, spool, os.path.dirname(self.munge_socket)):
            os.makedirs(path, mode=0o700, exist_ok=True)
        if self.nodes is None:
            ctld_port, slurmd_port, srun_low = _free_port(), _free_port(), _free_port()
            controller = "localhost(127.0.0.1)"
            node_lines = [f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} "
                          "RealMemory=1000 State=UNKNOWN"]
            names = "localhost"
        else:
            # Namespaces made for this cluster: every port is free on their addresses.
            ctld_port, slurmd_port, srun_low = 6817, 6818, 40000
            controller = f"{self.nodes[0].hostname}({self.nodes[0].address})"
            node_lines = [f"NodeName={node.hostname} NodeAddr={node.address} "
                          f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                          for node in self.nodes]
            names = ",".join(node.hostname for node in self.nodes)
        # %n: the node's name, so that the slurmds of several nodes keep apart.
        slurmd_files = "" if self.nodes is None else ".%n"
        if self.nodes is not None:
            spool = os.path.join(spool, "%n")
        lines = [
            "ClusterName=tstest",
            f"SlurmctldHost={controller}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            # srun listens for its tasks' I/O on a port of this range.
            f"SrunPortRange={srun_low}-{srun_low + 50}" if srun_low + 50 < 65536
            else "",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self.directory}/slurmctld.pid",
            f"SlurmdPidFile={self.directory}/slurmd{slurmd_files}.pid",
            f"SlurmctldLogFile={self.directory}/slurmctld.log",
            f"SlurmdLogFile={self.directory}/slurmd{slurmd_files}.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire=5: a requeued batch job may start again 5 s after it ended
            # (the default, 120 s, holds it back that long).
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # The main scheduling loop every second: a requeued job starts as soon as it
            # may (the default loop runs every 60 s).
            "SchedulerParameters=sched_interval=1",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobRequeue=1",
            "RequeueExit=42",
            "KillWait=5",
            "MinJobAge=600",
            "InactiveLimit=0",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            *node_lines,
            f"PartitionName=low Nodes={names} Default=YES MaxTime=INFINITE State=UP "
            f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_SECONDS}",
            f"PartitionName=high Nodes={names} MaxTime=INFINITE State=UP PriorityTier=10 "
            "PreemptMode=OFF",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(line for line in lines if line) + "\n")
        if self.nodes is not None:
            # `ip netns exec` mounts a fresh /sys for the node, without /sys/fs/cgroup, where
            # slurmd's autodetection of the cgroup version fails; nothing here uses
            # cgroups (proctrack/linuxproc, task/none), so name the version instead.
            with open(os.path.join(self.directory, "cgroup.conf"), "w") as f:
                f.write("CgroupPlugin=cgroup/v1\n")
        key = os.path.join(self.directory, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(secrets.token_bytes(1024))

    def _start(self, name, argv, node=None):
        log = os.path.join(self.directory, f"{name}.out")
        if node is not None:
            argv = node.command(argv)
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._daemons.append((name, proc, log))
        return proc

    def start(self):
        munge_dir = os.path.dirname(self.munge_socket)
        self._start("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={munge_dir}/munge.key", f"--pid-file={munge_dir}/munged.pid",
            f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"])
        self._wait(lambda: os.path.exists(self.munge_socket), "munged",
                   os.path.join(munge_dir, "munged.log"))
        # -i: ignore state files (none yet); -c: start clean.
        self._start("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", self.conf],
                    self.login_node)
        self._wait(lambda: "UP" in self.run(["scontrol", "ping"], check=False).stdout,
                   "slurmctld", os.path.join(self.directory, "slurmctld.log"))
        if self.nodes is None:
            self._start("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", self.conf])
            logs = [os.path.join(self.directory, "slurmd.log")]
        else:
            os.makedirs(os.path.join(self.directory, "spool"), mode=0o700, exist_ok=True)
            for node in self.nodes:
                os.makedirs(os.path.join(self.directory, "spool", node.hostname),
                            mode=0o700, exist_ok=True)
                self._start(f"slurmd.{node.hostname}",
                            ["slurmd", "-D", "-N", node.hostname, "-f", self.conf], node)
            logs = [os.path.join(self.directory, f"slurmd.{node.hostname}.log")
                    for node in self.nodes]
        self._wait(self._nodes_idle, "slurmd", logs[-1])

    @property
    def login_node(self):
        """The node client commands and slurmctld run on (None: this machine)."""
        return None if self.nodes is None else self.nodes[0]

    def _nodes_idle(self):
        # One line per node and partition: "NAME STATE".
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        expected = 1 if self.nodes is None else len(self.nodes)
        return len(states) == expected and all(s.startswith("idle") for s in states.values())

    def _wait(self, ready, name, log):
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for daemon, proc, out in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{daemon} exited with {proc.returncode} while starting the private "
                        f"SLURM cluster:\n{_tail(out)}\n{_tail(log)}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} was not ready after {START_TIMEOUT} s:\n{_tail(log)}")

    # -- using -----------------------------------------------------------------------
    def run(self, argv, check=True, timeout=30):
        """Runs a client command against this cluster (on its login node); returns its
        CompletedProcess."""
        if self.login_node is not None:
            argv = self.login_node.command(argv)
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited with {result.returncode}:\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def job(self, job_id):
        """``scontrol show job``'s fields for `job_id` as a dict (no accounting database
        here, so no sacct)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(re.findall(r"(\S+?)=(\S*)", out))

    def wait_job(self, job_id, done, timeout, what):
        """Polls `scontrol show job` until `done(fields)`; returns the fields. Fails after
        `timeout` seconds, with the fields and the daemons' log tails."""
        deadline = time.monotonic() + timeout
        fields = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if done(fields):
                return fields
            time.sleep(0.3)
        raise AssertionError(f"job {job_id}: {what} not reached after {timeout} s: "
                             f"{fields}\n{self.log_tails()}")

    def log_tails(self):
        slurmds = (["slurmd.log"] if self.nodes is None
                   else [f"slurmd.{node.hostname}.log" for node in self.nodes])
        return "\n".join(f"--- {name}:\n{_tail(os.path.join(self.directory, name))}"
                         for name in ["slurmctld.log"] + slurmds)

    # -- tearing down ----------------------------------------------------------------
    def stop(self):
        """Cancels every job, stops the daemons, kills every process left that belongs to
        this cluster (slurmstepd, a job's processes: all carry its SLURM_CONF), and
        raises if one is still alive 10 s later."""
        if any(name == "slurmctld" and proc.poll() is None for name, proc, _ in self._daemons):
            self.run(["scancel", "--full", "--user=root"], check=False)
        for _, proc, _ in reversed(self._daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc, _ in reversed(self._daemons):
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._daemons = []
        deadline = time.monotonic() + 10
        left = self.processes()
        while left and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
            left = self.processes()
        if left:
            raise AssertionError(f"processes of the private SLURM cluster outlived it: {left}")

    def processes(self):
        """The live processes of this cluster: those whose environment names its
        slurm.conf (the daemons, slurmstepd and the jobs inherit it), zombies excluded."""
        found = []
        needle = f"SLURM_CONF={self.conf}\0".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read() + b"\0"
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if needle in environ and state != "Z":
                found.append(int(entry))
        return found


def why_not_runnable():
    """The reason a private cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the private SLURM cluster runs its daemons as root; this is not root"
    missing = [name for name in BINARIES if shutil.which(name) is None
               and not os.path.exists(f"/usr/sbin/{name}")]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing); scripts/setup.sh "
                "installs slurmctld slurmd slurm-client munge where root and apt-get allow")
    return None


@contextlib.contextmanager
def started_cluster(directory, nodes=None, cpus=None):
    """A started private SLURM cluster in `directory` (on `nodes`, a list of
    tests.helpers.cluster.Node, when given; each node declaring `cpus` CPUs, default this
    machine's, two at least), stopped on exit with everything it started. Skips the calling
    test, with the reason, where none can run."""
    reason = why_not_runnable()
    if reason is not None:
        pytest.skip(reason)
    os.chmod(directory, 0o700)
    cluster = SlurmCluster(directory, nodes, cpus)
    try:
        cluster.write_config()
        cluster.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        try:
            cluster.stop()
        finally:
            pytest.skip(f"the private SLURM cluster did not start: {error}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A started private one-node SLURM cluster (see the module's docstring); skips with
    the reason where none can run."""
    with started_cluster(str(tmp_path_factory.mktemp("slurm"))) as cluster:
        yield cluster
