"""Live recovery (issue 34 item 6) under the two launchers docs/fault_tolerance.md names for
it, with real processes: a replica SIGKILLed mid-step, the survivors regroup in the same
processes, redo the step on the same global batch split among them and finish with the
fp64 weights of one device (1e-6). tests/reliability/test_live_recovery.py starts its
replicas itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); here a real launcher does,
and what matters is what that launcher does when one of its processes dies: it must leave
the survivors running.

- **SLURM** (the private one-node cluster of tests/helpers/slurm.py, Debian's 22.05):
  ``srun --ntasks=3 --kill-on-bad-exit=0``, one task per replica, no launcher variables in
  the environment (the strategy finds SlurmClusterResolver by itself; MASTER_PORT only
  picks the port). Task 2 is SIGKILLed between forward and backward of step 3; tasks 0
  and 1 regroup, redo step 3 and finish (srun reports them "Completed", exit 0). srun
  itself exits 137 (128 + SIGKILL: the worst task's status), so the job step counts as
  failed although training finished. ``--kill-on-bad-exit=1`` (or ``KillOnBadExit=1`` in
  slurm.conf) would end the step at the kill: srun SIGTERMs the survivors, which, given
  ``leave_on_signals=(SIGTERM,)``, all leave and exit 42 (checked by hand, not here).
- **torchrun**: two agents on loopback (``--nnodes=2 --nproc-per-node=2
  --max-restarts=0 --rdzv-backend=c10d``), the workers sharing the agent's store (torch's
  default), ``leave_on_signals=(SIGTERM,)``. Agent A hosts the rendezvous
  (``--rdzv-conf=is_host=1``), agent B's local worker 1 is SIGKILLed mid-step at step 3:
  agent B SIGTERMs its worker 0, which takes part in the recovery (3 replicas redo step
  3) and leaves at that step's commit (exit 0); agent B exits 1. Agent A's workers finish
  with 2 replicas, equal to one device, and exit 0; agent A then waits in torchrun's exit
  barrier for agent B, which never comes (a failed agent skips it): 300 s, torchrun's
  ``exit_barrier_timeout``, not settable from its command line, after which it exits 0
  (observed by hand; the test stops at the barrier and kills the agent). With the
  rendezvous in agent B instead, agent A exits at once, but the survivors' store then
  lives in the failed machine's agent, which exits as soon as its workers are gone: a job
  still training then ends (agent A fails on the closed rendezvous and SIGTERMs its
  workers, which exit 42; agent A exits 1; observed by hand).

The replicas run tests/scripts/live_recovery_train.py (torchrun's workers through this
module's ``__main__``, which turns a kill given by local rank into one by global rank:
under torchrun the ranks a machine's workers get are decided at the rendezvous). Every
wait is bounded (collectives 60 s, a job JOB_TIMEOUT), and whatever happened every
process a test started is killed at its end (the SLURM job cancelled).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from tests.helpers import ROOT, SCRIPTS
from tests.helpers.multi_machine import clean_env, free_port
from tests.helpers.slurm import slurm_cluster  # noqa: F401  (the fixture)
from tests.scripts import live_recovery_train as script

SCRIPT = os.path.join(SCRIPTS, "live_recovery_train.py")
JOB_TIMEOUT = 120    # a bound on every wait for a job (a hang guard: a loaded machine is slow)
STEPS = 6
KILL_STEP = 3

pytestmark = pytest.mark.timeout(3 * JOB_TIMEOUT)


def _env(**extra):
    """A job's environment: no launcher's or outer SLURM's variables, the repository
    importable, collectives bounded (60 s)."""
    env = clean_env(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    TORCHSTRATEGY_TIMEOUT_SECONDS="60", **extra)
    # torch's default: the workers use their agent's rendezvous store.
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return {k: v for k, v in env.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}


def _one_device(steps, global_batch):
    model, optimizer = script.model_and_optimizer()
    x, y = script.data(steps, global_batch)
    for s in range(steps):
        batch = slice(s * global_batch, (s + 1) * global_batch)
        (model(x[batch]) - y[batch]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def _results(out):
    """{rank: result} of the replicas that finished and wrote out/rank<R>.json."""
    results = {}
    for name in os.listdir(out):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                results[int(name[4:-5])] = json.load(f)
    return results


def _assert_one_device(results, global_batch):
    expected = _one_device(STEPS, global_batch)
    first = next(iter(results.values()))
    for result in results.values():
        assert result["steps"] == STEPS and result["tracked"] == STEPS, result
        for got, theirs, want in zip(result["params"], first["params"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       rtol=0, atol=1e-6)
            assert got == theirs      # the survivors hold the same weights


# -- SLURM ------------------------------------------------------------------------------
def _srun_task_ends(output):
    """{task: how it ended} from srun's lines "localhost: task 2: Killed" and (--verbose)
    "localhost: tasks 0-1: Completed" (tasks that ended together)."""
    ends = {}
    for tasks, how in re.findall(r"localhost: tasks? ([\d,-]+): (\w+)", output):
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            for task in range(int(first), int(last or first) + 1):
                ends[task] = how
    return ends


def test_srun_task_killed_mid_step_the_others_recover(slurm_cluster, tmp_path):  # noqa: F811
    config = {"out": str(tmp_path), "steps": STEPS, "global_batch": 6, "min_replicas": 1,
              "kills": [[2, KILL_STEP, "backward"]]}
    name = f"live-recovery-{uuid.uuid4().hex[:8]}"
    # --overcommit: 3 tasks on a node that may declare 2 CPUs; --kill-on-bad-exit=0: what
    # live recovery needs whatever slurm.conf's KillOnBadExit says; --verbose: srun names
    # each task's end ("Completed", "Killed").
    command = ["srun", "--ntasks=3", "--overcommit", "--kill-on-bad-exit=0", "--label",
               "--verbose", "--partition=low", f"--job-name={name}", sys.executable, SCRIPT,
               json.dumps(config)]
    try:
        result = subprocess.run(
            command, env=dict(_env(MASTER_PORT=free_port()), SLURM_CONF=slurm_cluster.conf),
            cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    finally:
        slurm_cluster.run(["scancel", f"--name={name}"], check=False)
    output = result.stdout + result.stderr
    assert _srun_task_ends(output) == {0: "Completed", 1: "Completed", 2: "Killed"}, \
        output[-6000:]
    # srun's status is the worst task's: 128 + SIGKILL, though the job trained to its end.
    assert result.returncode == 128 + signal.SIGKILL, output[-6000:]
    assert "0: torchstrategy: live recovery: replica(s) [2] lost (torchstrategy: the " \
           "gradient all-reduce" in output, output[-6000:]
    assert "2 replica(s) regrouped in" in output and \
           f"redo step(s) {KILL_STEP}..{KILL_STEP} on the same global batches" in output
    results = _results(tmp_path)
    assert sorted(results) == [0, 1], output[-6000:]
    for result in results.values():
        assert result["replicas_per_step"] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
        assert [(r[0], r[1], r[2], r[4]) for r in result["recoveries"]] == \
            [(KILL_STEP, [2], 2, False)]
    _assert_one_device(results, 6)


# -- torchrun ---------------------------------------------------------------------------
def _descendants(pid):
    """The live processes under `pid` (torchrun starts its workers in sessions of their
    own: a process-group kill would miss them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class _Agent:
    """One torchrun agent (a "machine"), its output in agent-<name>.log."""

    def __init__(self, name, tmp_path, port, run_id, is_host, local_kills):
        self.name = name
        self.out = tmp_path / name
        self.out.mkdir()
        config = {"out": str(self.out), "steps": STEPS, "global_batch": 12,
                  "min_replicas": 1, "kills": [], "local_kills": local_kills}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                   f"--rdzv-conf=is_host={int(is_host)}",
                   f"--log-dir={tmp_path / ('torchelastic-' + name)}",
                   os.path.abspath(__file__), json.dumps(config)]
        self.log_path = tmp_path / f"agent-{name}.log"
        with open(self.log_path, "w") as log:
            # LOGLEVEL=INFO: the agent logs its exit barrier.
            self.process = subprocess.Popen(command, env=_env(LOGLEVEL="INFO"), cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def log(self):
        return self.log_path.read_text(errors="replace")

    def kill(self):
        if self.process.poll() is None:
            for pid in _descendants(self.process.pid) + [self.process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait(30)


def test_torchrun_machine_loses_a_worker_the_other_machine_recovers(tmp_path):
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    agents = []
    try:
        # A hosts the rendezvous (and the workers' store): the machine that survives.
        agents.append(_Agent("A", tmp_path, port, run_id, True, []))
        agents.append(_Agent("B", tmp_path, port, run_id, False, [[1, KILL_STEP, "backward"]]))
        a, b = agents
        try:
            b_code = b.process.wait(JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent B still running after {JOB_TIMEOUT} s:\n"
                                 f"{b.log()[-4000:]}\n{a.log()[-4000:]}")
        deadline = time.monotonic() + JOB_TIMEOUT
        while "worker group successfully finished" not in a.log() \
                and a.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        a_log, b_log = a.log(), b.log()
        logs = f"--- agent A:\n{a_log[-5000:]}\n--- agent B:\n{b_log[-5000:]}"
        # A's workers exited 0; A waits in torchrun's exit barrier for B, which a failed
        # agent never enters (300 s, then A exits 0: observed by hand, too long here).
        assert "worker group successfully finished" in a_log, logs
        assert "Waiting 300 seconds for other agents to finish" in a_log, logs
        assert a.process.poll() is None, logs
    finally:
        for agent in agents:
            agent.kill()
    # B: its worker 1 SIGKILLed, its worker 0 SIGTERMed by the agent, leaving at the next
    # commit with exit 0 (the only failure torchrun reports is the SIGKILL); B exits 1.
    assert b_code == 1, logs
    results = _results(a.out)
    assert len(results) == 2 and not _results(b.out), logs
    b_ranks = sorted(set(range(4)) - set(results))
    killed, left = b_ranks[1], b_ranks[0]     # local ranks 1 and 0 of B
    assert "closing signal SIGTERM" in b_log, logs
    assert f"rank      : {killed} (local_rank: 1)" in b_log and \
        "exitcode  : -9" in b_log and "<NO_OTHER_FAILURES>" in b_log, logs
    assert f"replica {left} leaves the job after step {KILL_STEP} (termination notice)" \
        in b_log, logs
    # A's workers: 3 replicas redid step 3 (B's worker 0 with them), then B's worker 0 left
    # at its commit; they finished with 2 replicas, equal to one device.
    assert f"replica(s) [{killed}] lost (" in a_log and \
        "3 replica(s) regrouped in" in a_log, logs
    assert f"replica(s) [{left}] left at a commit (termination notice); 2 replica(s) " \
           "regrouped" in a_log, logs
    for result in results.values():
        assert result["replicas_per_step"] == [4] * KILL_STEP + [2] * (STEPS - KILL_STEP)
        assert [(r[0], r[1], r[2], r[4]) for r in result["recoveries"]] == \
            [(KILL_STEP, [killed], 3, False), (KILL_STEP + 1, [left], 2, True)]
    _assert_one_device(results, 12)


if __name__ == "__main__":
    # A torchrun worker of the test above: live_recovery_train with its `local_kills`
    # ([[local_rank, step, where], ...], this machine's) turned into kills by global rank.
    job = json.loads(sys.argv[1])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    job["kills"] = job["kills"] + [[rank, step, where]
                                   for local, step, where in job.pop("local_kills")
                                   if local == local_rank]
    script.main(job)
