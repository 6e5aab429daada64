"""One elastic job that shrinks and grows: two torchrun agents ("machines") on loopback with
``--nnodes=1:2`` and a c10d rendezvous, each running one replica of
tests/scripts/elastic_train.py (MultiWorkerMirroredStrategy under ts.BackupAndRestore).

1. Both machines train at 2 replicas; mid-epoch one machine is lost: its agent and its
   worker get SIGKILL (no notice, nothing saved at that moment).
2. The surviving worker's collective fails; its agent restarts it (one of --max-restarts),
   the rendezvous drops the dead machine once its heartbeats stop, and the job goes on at
   1 replica from the last backup, at the step the backup holds.
3. The lost machine's agent is started again: the surviving agent sees a node waiting,
   stops its worker (a membership change, not counted as a restart) and the job goes on at
   2 replicas from the last backup, to the end.

The final parameters equal one device trained on the same global batches.
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.multi_machine import clean_env, free_port
from tests.helpers.processes import alive
from tests.scripts import elastic_train

pytestmark = pytest.mark.timeout(300)

SCRIPT = os.path.join(ROOT, "tests", "scripts", "elastic_train.py")
STEPS_PER_EPOCH = elastic_train.SAMPLES // elastic_train.GLOBAL_BATCH     # 8
TOTAL_STEPS = STEPS_PER_EPOCH * elastic_train.EPOCHS                      # 24
KILL_AFTER = 3           # steps at 2 replicas before a machine is lost (epoch 0 has 8)
HOLD_AT = 14             # the job of one replica waits after this step (in epoch 1)
SLOW = 0.5               # seconds per step in epoch 0 (not in the job of one replica)
# Every wait below is bounded by this (a hang guard, not a timing assertion: starting a
# worker is an import of torch, slow on a loaded machine).
WAIT = 120
# Rendezvous settings that keep the test short (torch's defaults: a lost machine is
# dropped after 3 missed heartbeats 5 s apart, and a round of fewer than --nnodes' maximum
# waits 30 s for latecomers). is_host: both "machines" are 127.0.0.1, so say which one
# hosts the rendezvous store (the one that is never killed).
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _command(port, run_id, out, is_host):
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
            "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=is_host={int(is_host)},{RDZV_CONF}", "--max-restarts=3",
            "--monitor-interval=0.2",
            # Not a /tmp/torchelastic_* directory per agent, which a lost agent leaves.
            f"--log-dir={os.path.join(out, 'torchelastic')}", SCRIPT, str(out), "--slow", str(SLOW),
            "--slow-steps", str(STEPS_PER_EPOCH), "--hold-at", str(HOLD_AT),
            "--hold-seconds", str(WAIT)]


class _Machine:
    """One torchrun agent, its output in `log_path`."""

    def __init__(self, name, command, out):
        self.name = name
        self.log_path = os.path.join(out, f"agent-{name}.log")
        env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.out = out

    def workers(self):
        """The agent's live worker processes (torchrun starts each in a session of its own,
        so a process-group kill would miss them)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            if ppid == self.process.pid:
                pids.append(int(entry))
        return pids

    def kill(self):
        """SIGKILL to the agent and its workers at once: a machine that is lost."""
        victims = self.workers() + [self.process.pid]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(WAIT)
        return victims

    def log(self):
        with open(self.log_path) as f:
            return f.read()


def _read_steps(out):
    """{worker pid: (replicas, rank, [(step, time, indices)], hold time or None)}."""
    workers = {}
    for name in os.listdir(out):
        if not name.startswith("steps."):
            continue
        replicas = rank = None
        steps, hold = [], None
        with open(os.path.join(out, name)) as f:
            for line in f:
                fields = line.split()
                if not line.endswith("\n"):
                    continue      # being written
                if fields[0] == "hold":
                    hold = float(fields[1])
                    continue
                replicas, rank = int(fields[0]), int(fields[1])
                steps.append((int(fields[2]), float(fields[3]), [int(i) for i in fields[4:]]))
        if steps or hold is not None:
            workers[int(name.split(".")[1])] = (replicas, rank, steps, hold)
    return workers


def _wait_for(condition, machines, what):
    deadline = time.monotonic() + WAIT
    while not condition():
        for machine in machines:
            if machine.process.poll() is not None:
                raise AssertionError(f"agent {machine.name} ended ({machine.process.returncode})"
                                     f" while waiting for {what}:\n{machine.log()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {WAIT} s:\n"
                                 + "\n".join(m.log()[-3000:] for m in machines))
        time.sleep(0.05)


def _rounds(workers):
    """The workers grouped into the job's rounds, in the order they ran: [(replicas, first
    step, {rank: steps})]. Workers of one round have the same size and first step."""
    rounds = {}
    for replicas, rank, steps, _ in workers.values():
        if not steps:
            continue
        began, ranks = rounds.setdefault((replicas, steps[0][0]), [steps[0][1], {}])
        rounds[(replicas, steps[0][0])][0] = min(began, steps[0][1])
        assert rank not in ranks, f"two workers of rank {rank} in one round: {workers}"
        ranks[rank] = steps
    ordered = sorted(rounds.items(), key=lambda item: item[1][0])
    return [(replicas, first, ranks) for (replicas, first), (_, ranks) in ordered]


def _reference(out):
    """The script on one device, uninterrupted: final parameters and global batches."""
    out.mkdir()
    elastic_train.main([str(out)])
    (_, _, steps, _), = _read_steps(out).values()
    assert [s for s, _, _ in steps] == list(range(1, TOTAL_STEPS + 1))
    return torch.load(os.path.join(out, "final.pt"), weights_only=True), \
        [indices for _, _, indices in steps]


def _skip_without_torchrun():
    try:
        import torch.distributed.run  # noqa: F401  (the launcher this test drives)
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend  # noqa: F401
    except ImportError as error:
        pytest.skip(f"torchrun (torch.distributed.run with the c10d rendezvous) is not "
                    f"available: {error}")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")


def test_elastic_job_shrinks_when_a_machine_is_lost_and_grows_back(tmp_path):
    _skip_without_torchrun()
    out = tmp_path / "job"
    out.mkdir()
    port, run_id = free_port(), f"elastic-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    machines = []
    try:
        host = _Machine("host", _command(port, run_id, out, True), out)
        lost = _Machine("lost", _command(port, run_id, out, False), out)
        machines += [host, lost]

        # 1. Two replicas train; a machine is lost mid-epoch.
        _wait_for(lambda: any(replicas == 2 and steps and steps[-1][0] >= KILL_AFTER
                              for replicas, _, steps, _ in _read_steps(out).values()),
                  machines, f"step {KILL_AFTER} at 2 replicas")
        killed = lost.kill()
        killed_at = time.time()
        machines.remove(lost)

        # 2. The job goes on at one replica and waits at HOLD_AT for a machine to join.
        _wait_for(lambda: any(replicas == 1 and hold is not None
                              for replicas, _, _, hold in _read_steps(out).values()),
                  machines, f"the job of one replica at step {HOLD_AT}")
        # 3. The machine comes back: the job grows to two replicas and finishes.
        rejoined_at = time.time()
        back = _Machine("back", _command(port, run_id, out, False), out)
        machines.append(back)
        codes = {}
        for machine in (host, back):
            try:
                codes[machine.name] = machine.process.wait(WAIT)
            except subprocess.TimeoutExpired:
                codes[machine.name] = None
        elapsed = time.monotonic() - started
        assert codes == {"host": 0, "back": 0}, "\n".join(
            f"--- agent {m.name} (exit {codes.get(m.name)}):\n{m.log()[-6000:]}"
            for m in (host, back))
    finally:
        for machine in machines:
            if machine.process.poll() is None:
                machine.kill()
    # Nothing left behind: the lost machine's worker and every worker of the job are gone.
    workers = _read_steps(out)
    for pid in list(workers) + killed:
        assert not alive(pid), f"process {pid} outlived the job"

    weights, batches = _reference(tmp_path / "reference")
    rounds = _rounds(workers)
    sizes = [replicas for replicas, _, _ in rounds]
    # A slow start can give one round of one replica before the second machine joins; the
    # three rounds the test made come last.
    assert sizes[-3:] == [2, 1, 2], rounds
    last = {}          # step -> the global batch of its last execution, ranks in order
    for index, (replicas, first, ranks) in enumerate(rounds):
        assert sorted(ranks) == list(range(replicas)), rounds
        for rank, steps in ranks.items():
            # Every worker of a round ran the same steps, contiguous, from `first`.
            assert [s for s, _, _ in steps] == \
                list(range(first, first + len(steps))), (rank, steps)
            assert all(len(ix) == elastic_train.GLOBAL_BATCH // replicas for _, _, ix in steps)
        if index == 0:
            assert first == 1
        else:
            # Resumed from the previous round's last backup: one is written after every
            # step both replicas finished, so it is the last step every replica finished,
            # or the one before (a replica lost between its step and the backup).
            previous = rounds[index - 1][2]
            finished = min(steps[-1][0] for steps in previous.values())
            assert finished - 1 <= first - 1 <= finished, (index, rounds)
        # A step every replica of the round finished (the lost one may have missed the last).
        for position in range(min(len(steps) for steps in ranks.values())):
            step = ranks[0][position][0]
            last[step] = sum((ranks[rank][position][2] for rank in range(replicas)), [])

    (_, kill_first, kill_ranks), (_, shrink_first, shrink), (_, grow_first, grown) = rounds[-3:]
    killed_step = max(steps[-1][0] for steps in kill_ranks.values())
    assert KILL_AFTER <= killed_step < STEPS_PER_EPOCH, "not killed mid-epoch"
    # The job of one replica went on from the backup to HOLD_AT, across an epoch boundary;
    # the grown job went on from HOLD_AT's backup to the end.
    assert shrink_first <= killed_step + 1 and shrink[0][-1][0] == HOLD_AT
    assert grow_first == HOLD_AT + 1 and grown[0][-1][0] == TOTAL_STEPS
    # The data position was kept: every step's last execution trained on the global batch
    # one device trains on at that step (so each sample once per epoch).
    assert sorted(last) == list(range(1, TOTAL_STEPS + 1))
    assert [last[step] for step in sorted(last)] == batches
    for epoch in range(elastic_train.EPOCHS):
        samples = sum(batches[epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH], [])
        assert sorted(samples) == list(range(elastic_train.SAMPLES))

    final = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    differences = {name: (final[name] - weights[name]).abs().max().item() for name in weights}
    for name in weights:
        torch.testing.assert_close(final[name], weights[name], rtol=0, atol=1e-6)

    host_log = host.log()
    assert "Detected 1 new nodes" in host_log       # grown by a membership change
    # The survivor's failed collective (in a step or in the backup's save) names the lost
    # replica, or says the store went with it when the lost machine hosted it.
    assert "CollectiveError" in host_log and ("not responding (died or stuck)" in host_log
                                              or "store is unreachable" in host_log), host_log
    kill_time = max(t for steps in kill_ranks.values() for _, t, _ in steps)
    print(f"\nelastic job: {elapsed:.1f} s in all; killed after step {killed_step} "
          f"(epoch 0), resumed at 1 replica from step {shrink_first} "
          f"{min(t for _, t, _ in shrink[0]) - killed_at:.1f} s after the kill; "
          f"grown back from step {grow_first} "
          f"{min(t for _, t, _ in grown[0]) - rejoined_at:.1f} s after the agent restarted; "
          f"max |final - one device| = {max(differences.values()):.2e} "
          f"(last step at 2 replicas before the kill at {kill_time - killed_at:+.2f} s)")
