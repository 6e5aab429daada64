"""A real SLURM (Debian's slurmctld/slurmd 22.05 and munge, one node on loopback ports, see
tests/helpers/slurm.py) running what docs/fault_tolerance.md tells users to run.

- ``srun -n2 python train.py``: the strategy finds SlurmClusterResolver by itself and trains
  exactly like one process on the same global batches;
- ``sbatch --requeue`` of ``srun python train.py`` with a PreemptionCheckpointHandler,
  preempted by a job of a higher-priority partition (SIGTERM, GraceTime): the handler saves
  and exits 42, ``RequeueExit=42`` requeues the job, the restart resumes and ends with the
  parameters of the uninterrupted run, every sample seen once per epoch;
- the same with torchrun inside the step, signalled with ``scancel --signal=TERM``:
  torchrun exits 1, and ``python -m torchstrategy.launch.requeue_exit`` turns it into 42
  because the handler left its restart marker.

The training program is tests/scripts/slurm_train.py; the reference (one process, no
SLURM) runs once for the module, beside the first job. The last tests need no SLURM: the
wrapper's exit codes and errors, and the handler writing and clearing the marker.
"""
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import torchstrategy as ts
from tests.helpers import ROOT, SCRIPTS
from tests.helpers.multi_machine import clean_env, free_port
from tests.helpers.slurm import slurm_cluster  # noqa: F401  (the fixture)
from torchstrategy.launch import requeue_exit
from torchstrategy.launch.restart_marker import MARKER_VARIABLE

SCRIPT = os.path.join(SCRIPTS, "slurm_train.py")
SAMPLES, STEPS_PER_EPOCH, EPOCHS = 48, 8, 2
JOB_TIMEOUT = 120      # a bound on every wait for a job (a loaded 2-core machine is slow)
SLOW = 0.5             # seconds per step in a job's first attempt: time to preempt it

# Each test waits for at most two bounded phases of a job (JOB_TIMEOUT each); the suite's
# default of 300 s would cut the second short on a loaded machine.
pytestmark = pytest.mark.timeout(3 * JOB_TIMEOUT)


def _env(**extra):
    """The job's environment: no launcher's or outer SLURM's variables, the repository
    importable, collectives bounded."""
    env = clean_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    **extra)
    return {k: v for k, v in env.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory):  # noqa: F811
    """The uninterrupted run in one process, started now and awaited on first use."""
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.Popen([sys.executable, SCRIPT, str(out)], env=_env(), cwd=ROOT,
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


def _read_log(out, rank):
    """[(attempt, step, [sample indices])] of one replica."""
    with open(os.path.join(out, f"rank{rank}.log")) as f:
        return [(int(a), int(s), [int(i) for i in rest])
                for a, s, *rest in (line.split() for line in f if line.strip())]


def _check_training(out, replicas, reference_final, resolver,
                    steps_per_epoch=STEPS_PER_EPOCH):
    """What users rely on: the resolver found, every step run once, every sample seen once
    per epoch, the final parameters of one device (1e-6)."""
    for rank in range(replicas):
        with open(os.path.join(out, f"resolver{rank}")) as f:
            assert f.read().split() == [resolver, str(replicas)]
    logs = [_read_log(out, rank) for rank in range(replicas)]
    steps = [step for _, step, _ in logs[0]]
    assert steps == list(range(1, steps_per_epoch * EPOCHS + 1)), steps
    for rank in range(1, replicas):
        assert [step for _, step, _ in logs[rank]] == steps
    for epoch in range(EPOCHS):
        seen = sorted(i for log in logs for _, step, indices in log
                      if epoch * steps_per_epoch < step <= (epoch + 1) * steps_per_epoch
                      for i in indices)
        assert seen == list(range(SAMPLES)), f"epoch {epoch}: {seen}"
    final = torch.load(os.path.join(out, "final.pt"))
    for name, value in reference_final.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-6)
    return logs


def _wait_steps(cluster, job_id, out, steps):
    """Waits (bounded) until replica 0 logged `steps` steps of the job's first attempt."""
    log = os.path.join(out, "rank0.log")

    def done(fields):
        assert fields.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), fields
        return os.path.exists(log) and len(_read_log(out, 0)) >= steps

    cluster.wait_job(job_id, done, JOB_TIMEOUT, f"{steps} steps logged")


def _wait_requeued_and_done(cluster, job_id):
    return cluster.wait_job(
        job_id, lambda f: f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
        2 * JOB_TIMEOUT, "the end of the job")


def _job_output(out):
    with open(os.path.join(out, "job.out"), errors="replace") as f:
        return f.read()


def _submit(cluster, out, script, partition="low", env=None):
    path = os.path.join(out, "job.sh")
    with open(path, "w") as f:
        f.write(script)
    result = subprocess.run(
        ["sbatch", "--parsable", f"--partition={partition}",
         f"--output={os.path.join(out, 'job.out')}", path],
        env=dict(env or _env(), SLURM_CONF=cluster.conf), capture_output=True, text=True,
        timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def test_srun_two_tasks_train_like_one_device(slurm_cluster, reference, tmp_path):  # noqa: F811
    result = subprocess.run(
        ["srun", "--ntasks=2", "--partition=low", sys.executable, SCRIPT, str(tmp_path)],
        env=dict(_env(MASTER_PORT=free_port()), SLURM_CONF=slurm_cluster.conf), cwd=ROOT,
        capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    _check_training(tmp_path, 2, reference(), "SlurmClusterResolver")


def test_partition_preemption_requeues_on_exit_42(slurm_cluster, reference, tmp_path):  # noqa: F811
    """A job of the high partition preempts the running one (PreemptMode=REQUEUE): SIGTERM,
    the handler saves within GraceTime and exits 42, RequeueExit=42 requeues the job."""
    job = _submit(slurm_cluster, tmp_path, f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --requeue
#SBATCH --open-mode=append
srun {sys.executable} {SCRIPT} {tmp_path} --slow {SLOW}
""", env=_env(MASTER_PORT=free_port()))
    _wait_steps(slurm_cluster, job, tmp_path, 2)
    preemptor = slurm_cluster.run(["sbatch", "--parsable", "--partition=high",
                                   f"--ntasks={slurm_cluster.cpus}",
                                   f"--output={tmp_path}/high.out", "--wrap", "true"]
                                  ).stdout.strip().split(";")[0]
    fields = _wait_requeued_and_done(slurm_cluster, job)
    output = _job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED", (fields, output[-3000:])
    assert fields["Restarts"] == "1", fields
    assert slurm_cluster.job(preemptor)["JobState"] == "COMPLETED"
    assert "preemption checkpoint written" in output, output[-3000:]
    assert "Exited with exit code 42" in output, output[-3000:]
    logs = _check_training(tmp_path, 2, reference(), "SlurmClusterResolver")
    attempts = [attempt for attempt, _, _ in logs[0]]
    assert attempts[0] == 0 and attempts[-1] == 1, attempts   # preempted mid-run, resumed


def test_torchrun_in_the_step_requeued_through_requeue_exit(slurm_cluster, reference,  # noqa: F811
                                                           tmp_path):
    """``srun requeue_exit -- torchrun ...`` signalled as a scheduler does (scancel
    --signal=TERM to the step): torchrun exits 1, the wrapper exits 42, the job is
    requeued and resumes."""
    command = (f"{sys.executable} -m torchstrategy.launch.requeue_exit -- "
               f"{sys.executable} -m torch.distributed.run --nnodes=1 --nproc-per-node=2 "
               f"--max-restarts=0 --master-addr=127.0.0.1 --master-port={free_port()} "
               f"{SCRIPT} {tmp_path} --slow {SLOW}")
    job = _submit(slurm_cluster, tmp_path, f"""#!/bin/bash
#SBATCH --ntasks=1
#SBATCH --cpus-per-task={slurm_cluster.cpus}
#SBATCH --requeue
#SBATCH --open-mode=append
srun {command}
""")
    _wait_steps(slurm_cluster, job, tmp_path, 2)
    slurm_cluster.run(["scancel", "--signal=TERM", job])
    fields = _wait_requeued_and_done(slurm_cluster, job)
    output = _job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED", (fields, output[-3000:])
    assert fields["Restarts"] == "1", fields
    assert re.search(r"requeue_exit: .* ended with status 1 after a preemption checkpoint "
                     r"was saved .*exiting with 42", output), output[-3000:]
    logs = _check_training(tmp_path, 2, reference(), "TorchElasticClusterResolver")
    attempts = [attempt for attempt, _, _ in logs[0]]
    assert attempts[0] == 0 and attempts[-1] == 1, attempts


# -- the wrapper alone (no SLURM needed) ------------------------------------------------
def _sh(script):
    return ["/bin/sh", "-c", script]


def test_requeue_exit_maps_a_failure_after_the_marker_to_42():
    marked = f'echo "replica 0: saved" > "${MARKER_VARIABLE}"; exit 1'
    assert requeue_exit.run(_sh(marked)) == 42
    assert requeue_exit.run(_sh(marked), exit_code=143) == 143
    # The command's own status otherwise: success stays success, a failure without a
    # preemption stays a failure, a signal is reported as a shell does.
    assert requeue_exit.run(_sh(f'echo x > "${MARKER_VARIABLE}"; exit 0')) == 0
    assert requeue_exit.run(_sh("exit 3")) == 3
    assert requeue_exit.run(_sh("kill -TERM $$")) == 143


def test_requeue_exit_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        requeue_exit.main([])
    assert "no command given" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        requeue_exit.main(["--exit-code", "300", "--", "true"])
    assert "--exit-code must be in 1..255" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        requeue_exit.main(["--", "/nonexistent/launcher"])
    assert "/nonexistent/launcher" in capsys.readouterr().err


def test_handler_writes_the_marker_at_a_preemption_and_clears_it_on_restart(
        tmp_path, monkeypatch):
    """One process: the handler writes the marker after its save, just before exit_fn, a
    new handler (the restart) removes it, and an exit_fn that returns removes it too."""
    marker = tmp_path / "preempted"
    monkeypatch.setenv(MARKER_VARIABLE, str(marker))

    class Restart(Exception):
        pass

    seen = {}

    def exit_for_restart():
        seen["marker"] = marker.read_text() if marker.exists() else None
        raise Restart()

    def train(exit_fn, steps=4):
        model = torch.nn.Linear(2, 1)
        handler = ts.PreemptionCheckpointHandler(
            None, {"model": model}, tmp_path / "ckpt", ts.TerminationConfig(exit_fn=exit_fn))
        with handler.watch_preemption_scope():
            for step in range(handler.total_run_calls, steps):
                if step == 1 and not handler.restored:
                    os.kill(os.getpid(), signal.SIGTERM)
                handler.run(lambda: None)
        return handler

    with pytest.raises(Restart):
        train(exit_for_restart)
    assert seen["marker"].startswith("replica 0: preemption checkpoint ")
    assert "after 2 steps" in seen["marker"]
    assert marker.exists()                  # left for the wrapper: the process exits now
    handler = train(exit_for_restart)       # the restart
    assert handler.restored and not marker.exists()

    (tmp_path / "ckpt" / "preemption.pt").unlink()
    train(lambda: None)                     # exit_fn returns: training goes on
    assert not marker.exists()
