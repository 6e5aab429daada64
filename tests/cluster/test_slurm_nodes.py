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
the job's checkpoint directory and output are the same files on both nodes. One SLURM
cluster serves the module; the reference (one process, no SLURM) runs beside the first job.
"""
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.cluster.test_slurm_real import _check_training, _env, _job_output, _read_log, \
    _wait_requeued_and_done
from tests.helpers import ROOT, SCRIPTS
from tests.helpers.cluster import cluster
from tests.helpers.slurm import started_cluster

SCRIPT = os.path.join(SCRIPTS, "slurm_train.py")
GLOBAL_BATCH = 16      # 48 samples: 3 steps per epoch, 2 epochs, 4 samples per replica
STEPS_PER_EPOCH = 48 // GLOBAL_BATCH
JOB_TIMEOUT = 120      # a bound on every wait for a job (a loaded 2-core machine is slow)
SLOW = 1.0             # seconds per step in a job's first attempt: time to preempt it

pytestmark = pytest.mark.timeout(3 * JOB_TIMEOUT)


@pytest.fixture(scope="module")
def nodes():
    with cluster(2, hostname_resolves_to="loopback") as made:
        yield made


@pytest.fixture(scope="module")
def slurm(nodes, tmp_path_factory):
    with started_cluster(str(tmp_path_factory.mktemp("slurm")), nodes.nodes) as started:
        yield started


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """The uninterrupted run in one process (on this machine, no SLURM), started now and
    awaited on first use."""
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.Popen([sys.executable, SCRIPT, str(out),
                             f"--global-batch={GLOBAL_BATCH}"], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {}

    def get():
        if not result:
            try:
                output = proc.communicate(timeout=JOB_TIMEOUT)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
            assert proc.returncode == 0, output[-3000:]
            result["final"] = torch.load(out / "final.pt")
        return result["final"]

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.wait()


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


def test_srun_on_two_nodes_trains_like_one_device(slurm, reference, tmp_path):
    result = _on_login_node(slurm, ["srun", "-N2", "--ntasks-per-node=2", sys.executable,
                                    SCRIPT, str(tmp_path), f"--global-batch={GLOBAL_BATCH}"],
                            timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # Block distribution: ranks 0-1 on node0, 2-3 on node1.
    assert _hosts(tmp_path, 0) == ["node0", "node0", "node1", "node1"]
    _check(tmp_path, reference())


def _submit_two_node_job(slurm, out, *options):
    """An ``sbatch --requeue`` job of 2 nodes x 2 tasks running the training script with
    `options`; returns its id."""
    script = os.path.join(out, "job.sh")
    with open(script, "w") as f:
        f.write(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
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


def test_sbatch_requeue_one_node_preempted_resumes_exactly(slurm, reference, tmp_path):
    job = _submit_two_node_job(slurm, tmp_path)
    _wait_for_steps(slurm, job, tmp_path, 1)
    # node1 is preempted: its two tasks alone get SIGTERM.
    assert _hosts(tmp_path, 0)[2:] == ["node1", "node1"]
    for rank in (2, 3):
        with open(os.path.join(tmp_path, f"started{rank}.0")) as f:
            os.kill(int(f.read().split()[0]), signal.SIGTERM)
    fields = _wait_requeued_and_done(slurm, job)
    output = _job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED", (fields, output[-3000:])
    assert fields["Restarts"] == "1", fields
    assert "preemption checkpoint written" in output, output[-3000:]
    assert "Exited with exit code 42" in output, output[-3000:]
    logs = _check(tmp_path, reference())
    for rank in range(4):   # every replica of both machines: preempted mid-run, resumed
        attempts = [attempt for attempt, _, _ in logs[rank]]
        assert attempts[0] == 0 and attempts[-1] == 1, (rank, attempts)
    assert _hosts(tmp_path, 1) == ["node0", "node0", "node1", "node1"]


def test_scontrol_requeue_of_two_nodes_resumes_from_backup_and_restore(slurm, reference,
                                                                       tmp_path):
    """``scontrol requeue`` of the running job (an administrator's requeue; a node lost is
    alike): SLURM kills every task of both nodes, no handler runs, the job starts again and
    ts.BackupAndRestore resumes from the last backup the chief wrote to the shared
    directory (every 2 steps), ending with one device's parameters."""
    job = _submit_two_node_job(slurm, tmp_path, "--backup-every=2")
    _wait_for_steps(slurm, job, tmp_path, 3)      # a backup after step 2 exists
    slurm.run(["scontrol", "requeue", job])
    fields = _wait_requeued_and_done(slurm, job)
    output = _job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED", (fields, output[-3000:])
    assert fields["Restarts"] == "1", fields
    for rank in range(4):
        log = _read_log(tmp_path, rank)
        first = [step for attempt, step, _ in log if attempt == 0]
        again = [step for attempt, step, _ in log if attempt == 1]
        # Killed after step 3 or later; resumed after the last backup (an even step, 2 at
        # least: not a fresh start), each step from there on run once.
        assert len(first) >= 3 and first == list(range(1, len(first) + 1)), (rank, log)
        assert again and again[0] >= 3 and again[0] % 2 == 1, (rank, log)
        assert again[0] <= first[-1] + 1, (rank, log)
        assert again == list(range(again[0], 2 * STEPS_PER_EPOCH + 1)), (rank, log)
    final = torch.load(os.path.join(tmp_path, "final.pt"))
    for name, value in reference().items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-6)
