"""A real SLURM across two machines: Debian's slurmctld, slurmd and munge on two nodes of a
cluster of network namespaces (tests/helpers/cluster.py: each node its own address,
hostname and Debian-style /etc/hosts, where its own name resolves to 127.0.1.1, and nothing
about the network set; tests/helpers/slurm.py's `started_cluster` on those nodes:
slurmctld on node0, one slurmd per node, ``NodeName=nodeI NodeAddr=<its address>``).

- ``srun -N2 --ntasks-per-node=2 python train.py``: four replicas on two machines find
  SlurmClusterResolver by themselves, meet at node0 and train exactly like one process on
  the same global batches (fp64, 1e-6);
- ``sbatch --requeue -N2 --ntasks-per-node=2`` with a PreemptionCheckpointHandler, one
  machine preempted (SIGTERM to its two tasks only, as a cloud reclaiming one VM signals
  that machine alone): every replica of both machines saves after the same step, exits 42,
  ``RequeueExit=42`` requeues the job, and the restarted job resumes and ends with the
  parameters of the uninterrupted run, every sample seen once per epoch;
- ``scontrol requeue`` of such a job training under ts.BackupAndRestore: every task of
  both nodes killed, the job started again resumes from the last backup and ends with one
  device's parameters.

The nodes share this machine's file system, as a cluster's machines share their storage:
the job's checkpoint directory and output are the same files on both nodes. The reference
(one process, no SLURM) is computed once, in this process.

Cost: one SLURM cluster serves the module, and its three jobs run at the same time (each
node declares `JOBS_AT_ONCE` times the two CPUs one job takes there), each driven by its
own thread from the start of the module: a job's idle waits (SLURM requeueing, a task's
slow steps, another's start-up) overlap the others' work, instead of adding up. Each
scenario keeps its own actions, bounds and error: one that fails is reported by its test
alone and does not stop the others.
"""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.cluster.test_slurm_real import _check_training, _env, _job_output, _read_log, \
    _wait_requeued_and_done
from tests.helpers import ROOT, SCRIPTS
from tests.helpers.cluster import cluster
from tests.helpers.slurm import started_cluster
from tests.scripts import slurm_train

SCRIPT = os.path.join(SCRIPTS, "slurm_train.py")
GLOBAL_BATCH = 16      # 48 samples: 3 steps per epoch, 2 epochs, 4 samples per replica
STEPS_PER_EPOCH = 48 // GLOBAL_BATCH
# A bound on every wait for a job: 12 replicas start at once on a loaded 2-core machine.
JOB_TIMEOUT = 240
SLOW = 1.0             # seconds per step in a job's first attempt: time to preempt it
JOBS_AT_ONCE = 3
TASKS_PER_NODE = 2

pytestmark = pytest.mark.timeout(3 * JOB_TIMEOUT)


@pytest.fixture(scope="module")
def nodes():
    with cluster(2, hostname_resolves_to="loopback") as made:
        yield made


@pytest.fixture(scope="module")
def slurm(nodes, tmp_path_factory):
    with started_cluster(str(tmp_path_factory.mktemp("slurm")), nodes.nodes,
                         cpus=JOBS_AT_ONCE * TASKS_PER_NODE) as started:
        yield started


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's final parameters: the training script's own `main`, in this
    process (one process, no SLURM; its random state left as it was)."""
    out = tmp_path_factory.mktemp("reference")
    with torch.random.fork_rng():
        slurm_train.main([str(out), f"--global-batch={GLOBAL_BATCH}"])
    return torch.load(out / "final.pt")


class _Scenario:
    """`function(*args)` run in a thread from now on: `result()` waits for it and returns
    what it returned, or raises what it raised."""

    def __init__(self, name, function, *args):
        self._value = None
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(function, args), name=name,
                                        daemon=True)
        self._thread.start()

    def _run(self, function, args):
        try:
            self._value = function(*args)
        except BaseException as error:   # re-raised by result(), in the test
            self._error = error

    def result(self, timeout=3 * JOB_TIMEOUT):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"scenario {self._thread.name!r} still runs after "
                                 f"{timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture(scope="module")
def scenarios(slurm, tmp_path_factory):
    """The three jobs, started at once (the two requeued ones first: theirs is the longer
    way), each driven by a `_Scenario`."""
    outdirs = {name: str(tmp_path_factory.mktemp(name))
               for name in ("preempted", "requeued", "srun")}
    started = {
        "preempted": _Scenario("preempted", _preempt_one_node, slurm, outdirs["preempted"]),
        "requeued": _Scenario("requeued", _scontrol_requeue, slurm, outdirs["requeued"]),
        "srun": _Scenario("srun", _srun, slurm, outdirs["srun"]),
    }
    yield {name: (scenario, outdirs[name]) for name, scenario in started.items()}
    for scenario in started.values():   # before the cluster stops
        try:
            scenario.result()
        except BaseException:   # reported by its test already
            pass


def _on_login_node(slurm, argv, **kwargs):
    """`argv` run on node0 (the login node) in the job's environment."""
    return subprocess.run(slurm.login_node.command(argv), cwd=ROOT, capture_output=True,
                          text=True, env=dict(_env(), SLURM_CONF=slurm.conf), **kwargs)


def _hosts(out, attempt):
    """Each replica's hostname in `attempt`, by rank."""
    hosts = []
    for rank in range(4):
        with open(os.path.join(out, f"started{rank}.{attempt}")) as f:
            hosts.append(f.read().split()[1])
    return hosts


def _check(out, reference_final):
    return _check_training(out, 4, reference_final, "SlurmClusterResolver",
                           steps_per_epoch=STEPS_PER_EPOCH)


def _srun(slurm, out):
    return _on_login_node(slurm, ["srun", "-N2", f"--ntasks-per-node={TASKS_PER_NODE}",
                                  sys.executable, SCRIPT, out,
                                  f"--global-batch={GLOBAL_BATCH}"], timeout=JOB_TIMEOUT)


def test_srun_on_two_nodes_trains_like_one_device(scenarios, reference):
    scenario, out = scenarios["srun"]
    result = scenario.result()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # Block distribution: ranks 0-1 on node0, 2-3 on node1.
    assert _hosts(out, 0) == ["node0", "node0", "node1", "node1"]
    _check(out, reference)


def _submit_two_node_job(slurm, out, *options):
    """An ``sbatch --requeue`` job of 2 nodes x 2 tasks running the training script with
    `options`; returns its id."""
    script = os.path.join(out, "job.sh")
    with open(script, "w") as f:
        f.write(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node={TASKS_PER_NODE}
#SBATCH --requeue
#SBATCH --open-mode=append
srun {sys.executable} {SCRIPT} {out} --slow {SLOW} --global-batch={GLOBAL_BATCH} \
    {' '.join(options)}
""")
    submitted = _on_login_node(slurm, ["sbatch", "--parsable", f"--output={out}/job.out",
                                       script], timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def _wait_for_steps(slurm, job, out, steps):
    def done(fields):
        assert fields.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), fields
        path = os.path.join(out, "rank0.log")
        return os.path.exists(path) and len(_read_log(out, 0)) >= steps

    slurm.wait_job(job, done, JOB_TIMEOUT, f"{steps} step(s) logged")


def _preempt_one_node(slurm, out):
    """node1 preempted after the first step: its two tasks alone get SIGTERM. Returns the
    job's final fields and node1's ranks' hosts in the first attempt."""
    job = _submit_two_node_job(slurm, out)
    _wait_for_steps(slurm, job, out, 1)
    hosts = _hosts(out, 0)[2:]
    if hosts == ["node1", "node1"]:
        for rank in (2, 3):
            with open(os.path.join(out, f"started{rank}.0")) as f:
                os.kill(int(f.read().split()[0]), signal.SIGTERM)
    else:   # not what the test preempts: let the job end without the signal
        slurm.run(["scancel", job], check=False)
    return _wait_requeued_and_done(slurm, job), hosts


def test_sbatch_requeue_one_node_preempted_resumes_exactly(scenarios, reference):
    scenario, out = scenarios["preempted"]
    fields, preempted_hosts = scenario.result()
    assert preempted_hosts == ["node1", "node1"]
    output = _job_output(out)
    assert fields["JobState"] == "COMPLETED", (fields, output[-3000:])
    assert fields["Restarts"] == "1", fields
    assert "preemption checkpoint written" in output, output[-3000:]
    assert "Exited with exit code 42" in output, output[-3000:]
    logs = _check(out, reference)
    for rank in range(4):   # every replica of both machines: preempted mid-run, resumed
        attempts = [attempt for attempt, _, _ in logs[rank]]
        assert attempts[0] == 0 and attempts[-1] == 1, (rank, attempts)
    assert _hosts(out, 1) == ["node0", "node0", "node1", "node1"]


def _scontrol_requeue(slurm, out):
    """The backup-trained job requeued by ``scontrol requeue`` after its third step;
    returns the job's final fields."""
    job = _submit_two_node_job(slurm, out, "--backup-every=2")
    _wait_for_steps(slurm, job, out, 3)      # a backup after step 2 exists
    slurm.run(["scontrol", "requeue", job])
    return _wait_requeued_and_done(slurm, job)


def test_scontrol_requeue_of_two_nodes_resumes_from_backup_and_restore(scenarios,
                                                                       reference):
    """``scontrol requeue`` of the running job (an administrator's requeue; a node lost is
    alike): SLURM kills every task of both nodes, no handler runs, the job starts again and
    ts.BackupAndRestore resumes from the last backup the chief wrote to the shared
    directory (every 2 steps), ending with one device's parameters."""
    scenario, out = scenarios["requeued"]
    fields = scenario.result()
    output = _job_output(out)
    assert fields["JobState"] == "COMPLETED", (fields, output[-3000:])
    assert fields["Restarts"] == "1", fields
    for rank in range(4):
        log = _read_log(out, rank)
        first = [step for attempt, step, _ in log if attempt == 0]
        again = [step for attempt, step, _ in log if attempt == 1]
        # Killed after step 3 or later; resumed after the last backup (an even step, 2 at
        # least: not a fresh start), each step from there on run once.
        assert len(first) >= 3 and first == list(range(1, len(first) + 1)), (rank, log)
        assert again and again[0] >= 3 and again[0] % 2 == 1, (rank, log)
        assert again[0] <= first[-1] + 1, (rank, log)
        assert again == list(range(again[0], 2 * STEPS_PER_EPOCH + 1)), (rank, log)
    final = torch.load(os.path.join(out, "final.pt"))
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-6)
