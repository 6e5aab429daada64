"""Live recovery (issue 34): replicas SIGKILLed mid-step, the survivors regroup in the same
processes and finish with the weights of one device; a replica given SIGTERM leaves at the
next commit; where recovery is impossible, every survivor ends with the reason and exit
code 42.

Each job is real processes on gloo over loopback, given a launcher's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store), running
tests/scripts/live_recovery_train.py. Every process is bounded (a collective timeout of
60 s, the job killed at 150 s) and killed at the end whatever happened.
"""
import datetime
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.cluster import cluster
import torchstrategy as ts
from tests.scripts import live_recovery_train as script
from torchstrategy.fault_tolerance.live_recovery import LiveRecovery
from torchstrategy.fault_tolerance.batch_split import check_divisible, replica_slice
from torchstrategy.fault_tolerance.step_snapshot import StepSnapshot

JOB_SECONDS = 150


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_job(context, out, replicas, kills, min_replicas, steps, global_batch=6,
               commit_every=1, joiners=0, max_replicas=None, reduce_after_steps=(),
               decay_steps=(), hold_for_joiners=None, die_during_admission=None,
               collective_timeout=60, vote_every=1, recovery_timeout=30):
    os.makedirs(out, exist_ok=True)
    config = {"out": str(out), "steps": steps, "global_batch": global_batch,
              "min_replicas": min_replicas, "kills": kills, "commit_every": commit_every,
              "max_replicas": max_replicas, "reduce_after_steps": list(reduce_after_steps),
              "decay_steps": list(decay_steps), "hold_for_joiners": hold_for_joiners,
              "die_during_admission": die_during_admission, "vote_every": vote_every,
              "recovery_timeout": recovery_timeout}
    port = _free_port()
    processes = []
    for joiner in range(joiners):
        # Started with the job, without a launcher's variables: it asks to join, and is
        # admitted at the job's first commit after that.
        process = context.Process(
            target=script.replica, name=f"live-recovery-joiner-{joiner}",
            args=({"TORCHSTRATEGY_TIMEOUT_SECONDS": str(collective_timeout)},
                  dict(config, join=["127.0.0.1", port]),
                  os.path.join(out, f"log{replicas + joiner}")))
        process.start()
        processes.append(process)
    for rank in range(replicas):
        environment = {"RANK": str(rank), "WORLD_SIZE": str(replicas),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(replicas),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHSTRATEGY_TIMEOUT_SECONDS": str(collective_timeout)}
        process = context.Process(target=script.replica, name=f"live-recovery-{rank}",
                                  args=(environment, config,
                                        os.path.join(out, f"log{rank}")))
        process.start()
        processes.append(process)
    return processes


def _finish_jobs(jobs):
    """Waits for every process of `jobs` ({name: (out, processes)}), bounded; kills what is
    left; returns {name: (exit codes, logs, results by rank)}."""
    deadline = time.monotonic() + JOB_SECONDS
    try:
        for _, processes in jobs.values():
            for process in processes:
                process.join(max(0.1, deadline - time.monotonic()))
    finally:
        for _, processes in jobs.values():
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join()
    outcome = {}
    for name, (out, processes) in jobs.items():
        logs, results = [], {}
        for rank in range(len(processes)):
            with open(os.path.join(out, f"log{rank}")) as f:
                logs.append(f.read())
            path = os.path.join(out, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[rank] = json.load(f)
        outcome[name] = ([p.exitcode for p in processes], logs, results)
    return outcome


def _one_device(steps, global_batch, decay_steps=()):
    model, optimizer = script.model_and_optimizer()
    x, y = script.data(steps, global_batch)
    for s in range(steps):
        if s in decay_steps:
            script.decay(model)
        xb, yb = x[s * global_batch:(s + 1) * global_batch], y[s * global_batch:(s + 1) * global_batch]
        (model(xb) - yb).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The jobs: 4 replicas committing every 2 steps, one leaving on SIGTERM, then two lost,
    one at a time (training goes on); 2 replicas losing the chief (exit 42); 2 replicas
    with min_replicas=2 losing one (exit 42); 2 replicas whose joiner dies during its
    admission; 2 replicas joined by a third, then one lost; 4 replicas losing 3 around the
    vote. All but the first commit every step. The two small
    jobs run together (4 processes at most at any time). The replicas are forked by one
    fork server that imported torch and torchstrategy once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torchstrategy", "torch.optim",
                                    "tests.scripts.live_recovery_train"])
    root = tmp_path_factory.mktemp("live_recovery")
    recovered = {"recovered": (root / "recovered", _start_job(
        context, root / "recovered", 4,
        [[3, 1, "sigterm"], [2, 3, "backward"], [1, 6, "after_step"]],
        min_replicas=1, steps=8, global_batch=12, commit_every=2))}
    outcome = _finish_jobs(recovered)
    impossible = {
        "chief_lost": (root / "chief_lost", _start_job(
            context, root / "chief_lost", 2, [[0, 2, "backward"]], min_replicas=1,
            steps=5)),
        "below_minimum": (root / "below_minimum", _start_job(
            context, root / "below_minimum", 2, [[1, 2, "backward"]], min_replicas=2,
            steps=5)),
    }
    outcome.update(_finish_jobs(impossible))
    # Together: 6 processes, the joiners dying at their admission.
    outcome.update(_finish_jobs({
        f"admission_broken_{where}": (root / f"admission_broken_{where}", _start_job(
            context, root / f"admission_broken_{where}", 2, [], min_replicas=2, steps=6,
            joiners=1, max_replicas=3, hold_for_joiners=[0, 1], die_during_admission=where,
            collective_timeout=15))
        for where in ("share", "group")}))
    outcome.update(_finish_jobs({"joined": (root / "joined", _start_job(
        context, root / "joined", 2, [[1, 8, "backward"]], min_replicas=2, steps=10,
        joiners=1, max_replicas=3, hold_for_joiners=[0, 1]))}))
    outcome.update(_finish_jobs({"committed": (root / "committed", _start_job(
        context, root / "committed", 4,
        [[3, 1, "before_step"], [2, 2, "after_vote"], [1, 4, "after_step"]],
        min_replicas=1, steps=7, global_batch=12, reduce_after_steps=[4],
        decay_steps=[4, 5, 6]))}))
    outcome.update(_finish_jobs({"vote_every": (root / "vote_every", _start_job(
        context, root / "vote_every", 3, [[1, 4, "break"], [2, 6, "backward"]],
        min_replicas=1, steps=8, vote_every=3))}))
    outcome.update(_finish_jobs({"abandon_open": (root / "abandon_open", _start_job(
        context, root / "abandon_open", 2, [[1, 2, "abandon_open"]], min_replicas=1,
        steps=5))}))
    return outcome


def test_departure_and_two_losses_mid_step_survivors_equal_one_device(jobs):
    codes, logs, results = jobs["recovered"]
    # Commits every 2 steps, global batch 12. Replica 3 gets SIGTERM during step 1: it
    # leaves at the commit after step 1 (exit 0, nothing redone). Replica 2 killed between
    # forward and backward of step 3 (the others wait in the gradient all-reduce): steps 2
    # and 3 are redone by 2 replicas. Replica 1 killed after its optimizer step at step 6:
    # replica 0's step 6 ran to its end too and returned; it fails in step 7, and steps 6
    # and 7 are undone and redone by replica 0 alone (step 6 applied once, not twice).
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL, 0], logs[0][-3000:]
    assert "replica 3 leaves the job after step 1 (termination notice)" in logs[3]
    result = results[0]
    assert result["steps"] == 8
    assert result["replicas_per_step"] == [4, 3, 3, 2, 2, 2, 2, 1]
    assert result["tracked"] == 8
    assert [(r[0], r[1], r[2], r[4]) for r in result["recoveries"]] == \
        [(2, [3], 3, True), (2, [2], 2, False), (6, [1], 1, False)]
    for recovery in result["recoveries"]:
        assert recovery[3] < 10, result["recoveries"]
    assert "replica(s) [3] left at a commit (termination notice); 3 replica(s) regrouped" \
        in logs[0]
    assert "replica(s) [2] lost (torchstrategy: the gradient all-reduce" in logs[0]
    assert "2 replica(s) regrouped in" in logs[0] and "redo step(s) 2..3" in logs[0]
    expected = _one_device(8, 12)
    for got, want in zip(result["params"], expected):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                   rtol=0, atol=1e-6)


def test_joiner_admitted_at_a_commit_then_a_loss_equal_one_device(jobs):
    codes, logs, results = jobs["joined"]
    # processes: the joiner first (started with the job), then replicas 0 and 1, which wait
    # before step 0 until the joiner asked to join (its start-up can take seconds on a
    # loaded machine), so step 0's commit admits it; replica 1 is SIGKILLed mid-step at
    # step 8: 2 -> 3 -> 2 replicas.
    assert codes == [0, 0, -signal.SIGKILL], "\n\n".join(log[-2000:] for log in logs)
    members, joiner = results[0], results[2]
    # The call running step 0 returns with 3 replicas; the joiner runs the steps after it,
    # starting at the job's step counter.
    assert members["replicas_per_step"] == [3] * 8 + [2, 2]
    assert joiner["steps"] == 10
    assert joiner["replicas_per_step"] == [3] * 7 + [2, 2]
    assert [(r[0], r[1], r[2]) for r in members["recoveries"]] == [(8, [1], 2)]
    assert "replica(s) [2] admitted (joiner(s) [2]); 3 replica(s) regrouped" in logs[0] \
        or "replica(s) [2] admitted (joiner(s) [2]); 3 replica(s) regrouped" in logs[1]
    # The tracker's BatchNorm ran in step 8's forward before the loss broke the step: put
    # back with the step, its count is one per step (the joiner's received at admission).
    assert members["tracked"] == joiner["tracked"] == 10
    expected = _one_device(10, 6)
    for got, theirs, want in zip(members["params"], joiner["params"], expected):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                   rtol=0, atol=1e-6)
        assert got == theirs


def test_killed_between_vote_and_optimizer_step_or_after_commit_step_applied_once(jobs):
    codes, logs, results = jobs["committed"]
    # 4 replicas, a commit every step (the vote in the optimizer's step pre-hook). Step 1:
    # replica 3 SIGKILLed after its backward (the all-reduce done), before its vote: the
    # others wait for its vote in the pre-hook until its heartbeat stops, the decision is
    # "abort", and the step stops there (no optimizer stepped) and is redone by 3. Step 2:
    # replica 2 votes (the step commits) and is SIGKILLed before its optimizer steps;
    # replicas 0 and 1 apply step 2 and fail in step 3's gradient all-reduce: step 3 is
    # undone (only its buffers and gradients: no optimizer stepped) and redone by 2.
    # Step 4: replica 1 SIGKILLed after its optimizer step; replica 0 committed step 4 and
    # fails in the all-reduce after its optimizer step: step 4 is not redone. Steps 4-6
    # run a step function that scales the parameters before its optimizer step: its first
    # step (4) finds that out under a full copy, and its next ones vote after the step.
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL, -signal.SIGKILL], logs[0][-3000:]
    result = results[0]
    assert result["steps"] == 7
    assert result["replicas_per_step"] == [4, 3, 3, 2, 1, 1, 1]
    assert [(r[0], r[1], r[2]) for r in result["recoveries"]] == \
        [(1, [3], 3), (3, [2], 2), (5, [1], 1)]
    assert "step 4 committed, then a collective after its optimizer step broke" in logs[0]
    assert "the step function 'decayed_step' votes after its steps, against a full copy " \
           "of the state taken before each one (it changes parameters before its first " \
           "optimizer step)" in logs[0]
    assert "'train_step' votes after" not in logs[0]
    assert result["tracked"] == 7
    for got, want in zip(result["params"], _one_device(7, 12, decay_steps=(4, 5, 6))):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                   rtol=0, atol=1e-6)


def test_vote_every_3_survivors_one_step_apart_catch_up_and_equal_one_device(jobs):
    codes, logs, results = jobs["vote_every"]
    everything = "\n\n".join(f"--- replica {r}\n{log[-2500:]}" for r, log in enumerate(logs))
    # 3 replicas voting every 3rd step. In step 4 (no vote) replica 1's step fails after
    # the gradient all-reduce completed everywhere: replicas 0 and 2 apply it and fail in
    # step 5's all-reduce. All three regroup; replica 1, one step behind, takes replica 0's
    # state instead of redoing step 4; step 5 is redone by 3. Replica 2 is SIGKILLed mid-step
    # 6: replicas 0 and 1 redo it by 2.
    assert codes == [0, 0, -9], everything
    assert "replica(s) [1] had not applied step 4, which replica 0 had" in logs[0], everything
    for rank in (0, 1):
        result = results[rank]
        assert result["tracked"] == 8, everything
        # Replica 1 took replica 0's step counters: its recoveries read the same.
        assert [(r[0], r[1], r[2]) for r in result["recoveries"]] == \
            [(5, [], 3), (6, [2], 2)], everything
        # Replica 1's step 4 returned None and its loop went on with step 5.
        assert result["replicas_per_step"] == [3] * 6 + [2, 2]
        # The votes cast: step 0 (its function's first step votes), steps 2 and 5 (every
        # 3rd commit), and an abort for each failed step (5, or 4 on replica 1, and 6):
        # 5, against 10 with a vote in every step.
        assert result["votes"] == 5, result["votes"]
    for got, mirror, want in zip(results[0]["params"], results[1]["params"],
                                 _one_device(8, 6)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                   rtol=0, atol=1e-6)
        assert got == mirror


def test_a_survivor_whose_peer_began_the_recovery_breaks_its_own_all_reduce(jobs):
    codes, logs, results = jobs["abandon_open"]
    everything = "\n\n".join(f"--- replica {r}\n{log[-2500:]}" for r, log in enumerate(logs))
    # Replica 1's step 2 fails before its backward and it begins the recovery, its old
    # group's connections left open: replica 0 waits in the gradient all-reduce for it and
    # no closed connection tells it anything. Its step watch finds replica 1 registered in
    # the agreement, breaks its own end and interrupts the reducer's wait; both regroup and
    # redo step 2. With the collective timeout (60 s) above the recovery timeout (30 s),
    # a replica 0 left waiting would have made replica 1 give up (exit 42).
    assert codes == [0, 0], everything
    assert ("another replica's step failed and it has begun the recovery while replica 0 "
            "waited") in logs[0], everything
    assert "timed out" not in logs[0].lower(), everything
    expected = _one_device(5, 6)
    for rank in (0, 1):
        assert results[rank]["steps"] == 5
        assert results[rank]["replicas_per_step"] == [2] * 5
        assert results[rank]["tracked"] == 5     # step 2 undone and redone: counted once
        for param, want in zip(results[rank]["params"], expected):
            torch.testing.assert_close(torch.tensor(param, dtype=torch.float64), want,
                                       atol=1e-6, rtol=0)


def test_vote_every_is_refused_with_commit_every_and_must_be_positive():
    strategy = ts.MirroredStrategy(["cpu"])
    model = torch.nn.Linear(2, 1)
    objects = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(ValueError, match=r"vote_every=2 needs commit_every=1"):
        LiveRecovery(strategy, objects, global_batch_size=4, commit_every=2, vote_every=2)
    with pytest.raises(ValueError, match=r"vote_every must be a positive int, got 0"):
        LiveRecovery(strategy, objects, global_batch_size=4, vote_every=0)


def test_a_joiner_with_other_settings_than_the_job_is_refused_before_it_asks():
    # A job's store as replica 0 leaves it (its token, size, max_replicas, commit_every and
    # vote_every published); the joiner reads them before it takes a ticket.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    prefix = "torchstrategy/live/abc/"
    server.set(f"{prefix}size", "2")
    server.set(f"{prefix}settings",
               json.dumps({"max_replicas": 3, "commit_every": 1, "vote_every": 10}))
    server.set("torchstrategy/live/job", "abc")
    strategy = ts.MirroredStrategy(["cpu"])
    model = torch.nn.Linear(2, 1)
    objects = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    join = ("127.0.0.1", server.port)
    with pytest.raises(ValueError, match=r"max_replicas=5 differs from the job's \(3\)"):
        LiveRecovery(strategy, objects, global_batch_size=60, min_replicas=2, max_replicas=5,
                     join=join)
    with pytest.raises(ValueError, match=r"vote_every=1 differs from the job's \(10\): a "
                                         r"joiner votes at the job's steps; pass vote_every=10"):
        LiveRecovery(strategy, objects, global_batch_size=6, min_replicas=2, join=join)
    assert not server.check([f"{prefix}joiners"])   # neither asked


def test_chief_lost_ends_survivor_with_42(jobs):
    codes, logs, _ = jobs["chief_lost"]
    assert codes == [-signal.SIGKILL, 42], logs[1][-3000:]
    assert "live recovery cannot continue on replica 1: the rendezvous store stopped " \
           "answering" in logs[1]
    assert "Exiting with code 42" in logs[1]


def test_fewer_survivors_than_minimum_ends_with_42(jobs):
    codes, logs, _ = jobs["below_minimum"]
    assert codes == [42, -signal.SIGKILL], logs[0][-3000:]
    assert "1 replica(s) survive the loss of replica(s) [1], fewer than min_replicas=2" \
        in logs[0]


def test_global_batch_every_size_must_divide_is_refused_naming_sizes():
    check_divisible(6, range(1, 4))
    with pytest.raises(ValueError, match=r"any of \[2, 3\] replicas, but a global batch of "
                                         r"4 samples cannot be split equally among \[3\].*"
                                         r"a multiple of 6"):
        check_divisible(4, range(2, 4))


def test_replica_slice_takes_the_global_batch_in_order():
    batch = (torch.arange(6), torch.arange(6) * 10)
    shares = [replica_slice(batch, r, 3, 6) for r in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shares]), batch[0])
    assert torch.equal(shares[1][1], torch.tensor([20, 30]))
    with pytest.raises(ValueError, match="drop_last=True"):
        replica_slice(torch.arange(5), 0, 1, 6)


def test_snapshot_restores_parameters_gradients_optimizer_state_and_random_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    snapshot = StepSnapshot({"model": model, "optimizer": optimizer})
    before = [p.detach().clone() for p in model.parameters()]
    snapshot.take()
    expected_noise = torch.rand(3)
    model(torch.rand(4, 3)).sum().backward()
    optimizer.step()          # creates Adam's state: removed by restore
    optimizer.param_groups[0]["lr"] = 0.5
    snapshot.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert len(optimizer.state) == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(torch.rand(3), expected_noise)
    with pytest.raises(TypeError, match="'data' is a list"):
        StepSnapshot({"data": []})


def _job_on_two_machines(made, out, config, collective_timeout=60, cut_when_paused=None,
                         replacement=False):
    """2 machines x 2 replicas of tests/scripts/live_recovery_train.py on `made` (a cluster
    of network namespaces), replicas 0 and 1 on node0 (which hosts the store), 2 and 3 on
    node1. With `cut_when_paused` (a rank), node1's link is taken down as soon as that
    replica pauses (its ``"pause"`` kill). With `replacement`, once replica 0 waits for a
    joiner, a fresh process on node1 (the machine replaced) asks to join the job (its log
    is the fifth). Returns the exit codes, the logs and the seconds from the cut (or the
    start) to each process's end (None for one killed at the bound)."""
    node0, node1 = made.nodes
    os.chmod(out.parent, 0o755)
    script_path = os.path.join(os.path.dirname(__file__), "..", "scripts",
                               "live_recovery_train.py")
    processes = []
    started = time.monotonic()
    plain = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                          "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHSTRATEGY_LAUNCHER",
                          "TORCHSTRATEGY_PUBLISHED_WORLD")}
    try:
        for rank in range(4):
            node = node0 if rank < 2 else node1
            env = dict(plain)
            env.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR=node0.address,
                       MASTER_PORT="29517",
                       TORCHSTRATEGY_TIMEOUT_SECONDS=str(collective_timeout),
                       OMP_NUM_THREADS="1")
            with open(out / f"log{rank}", "w") as log:
                processes.append(subprocess.Popen(
                    node.command([sys.executable, script_path, json.dumps(config)]),
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + JOB_SECONDS
        if cut_when_paused is not None:
            marker = out / f"paused{cut_when_paused}"
            while not marker.exists() and time.monotonic() < deadline and \
                    all(p.poll() is None for p in processes):
                time.sleep(0.02)
            assert marker.exists(), "replica %d never paused:\n%s" % (
                cut_when_paused, (out / f"log{cut_when_paused}").read_text()[-2000:])
            made.cut(node1)
            started = time.monotonic()
        ended: list[float | None] = [None] * (len(processes) + int(replacement))
        if replacement:
            # Started once replica 0 waits for a joiner (its config's hold_for_joiners):
            # admitted at that step's commit, whatever its start-up time.
            while not (out / "holding0").exists() and time.monotonic() < deadline and \
                    processes[0].poll() is None:
                time.sleep(0.05)
            env = dict(plain, TORCHSTRATEGY_TIMEOUT_SECONDS=str(collective_timeout),
                       OMP_NUM_THREADS="1")
            joining = dict(config, join=[node0.address, 29517])
            with open(out / "log4", "w") as log:
                processes.append(subprocess.Popen(
                    node1.command([sys.executable, script_path, json.dumps(joining)]),
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        # When each process ended, from the cut (or the start): what the tests compare is
        # the order (the cut-off replicas at the collective timeout, the others once done).
        while time.monotonic() < deadline:
            for index, process in enumerate(processes):
                if process.poll() is not None and ended[index] is None:
                    ended[index] = time.monotonic() - started
            if all(e is not None for e in ended):
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    logs = [(out / f"log{rank}").read_text() for rank in range(len(processes))]
    return [p.returncode for p in processes], logs, ended


def _assert_machine0_finished_alone(out, logs, steps, global_batch, lost_at):
    result = json.loads((out / "rank0.json").read_text())
    assert result["replicas_per_step"] == [4] * lost_at + [2] * (steps - lost_at)
    assert result["tracked"] == steps
    assert [(r[0], sorted(r[1]), r[2]) for r in result["recoveries"]] == \
        [(lost_at, [2, 3], 2)], "\n\n".join(log[-2000:] for log in logs)
    other = json.loads((out / "rank1.json").read_text())
    for got, mirror, want in zip(result["params"], other["params"],
                                 _one_device(steps, global_batch)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                   rtol=0, atol=1e-6)
        assert got == mirror


def test_a_machine_lost_then_replaced_on_a_cluster_of_two_machines(tmp_path):
    """2 machines x 2 replicas on a cluster of network namespaces (tests/helpers/cluster.py:
    each machine its own address, hostname and /etc/hosts): both replicas of machine 1 are
    SIGKILLed between forward and backward of step 3 (a machine lost); machine 0's
    replicas regroup between themselves and go on. Then a replacement process starts on
    machine 1 and asks to join (machine 0's replicas wait for it before step 5); it is
    admitted at step 5's commit, receives the state from replica 0 over the link, and the
    three finish with the same weights, equal to one device. Skipped, with the reason,
    where namespaces cannot be made (not root)."""
    with cluster(2) as made:
        out = tmp_path / "two_machines"
        out.mkdir()
        config = {"out": str(out), "steps": 9, "global_batch": 12, "min_replicas": 2,
                  "kills": [[2, 3, "backward"], [3, 3, "backward"]],
                  "hold_for_joiners": [5, 1]}
        codes, logs, _ = _job_on_two_machines(made, out, config, replacement=True)
        everything = "\n\n".join(f"--- process {r}\n{log[-2500:]}"
                                   for r, log in enumerate(logs))
        assert codes == [0, 0, -9, -9, 0], everything
        result = json.loads((out / "rank0.json").read_text())
        # (the replicas after each step: the joiner is admitted at step 5's commit)
        assert result["replicas_per_step"] == [4] * 3 + [2] * 2 + [3] * 4, everything
        assert "TCPStore" not in logs[1] + logs[4], everything   # a quiet end
        assert result["tracked"] == 9
        assert [(r[0], sorted(r[1]), r[2]) for r in result["recoveries"]] == [(3, [2, 3], 2)]
        assert "replica(s) [4] admitted" in logs[0], everything
        joiner = json.loads((out / "rank4.json").read_text())
        assert joiner["steps"] == 9 and joiner["replicas_per_step"] == [3] * 3
        for got, mirror, joined, want in zip(result["params"],
                                             json.loads((out / "rank1.json").read_text())[
                                                 "params"],
                                             joiner["params"], _one_device(9, 12)):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       rtol=0, atol=1e-6)
            assert got == mirror == joined


def test_a_departure_and_a_joiner_killed_in_its_admission_on_a_cluster(tmp_path):
    """The same 2 x 2 job: replica 3 (on node1) gets SIGTERM during step 1 and leaves at
    its commit (4 -> 3 replicas); before step 4 the three wait for a joiner, which starts
    on node1 and is SIGKILLed as replica 0 starts sending it the state over the link. The
    three log the broken admission, regroup without it, and finish equal to one device."""
    with cluster(2) as made:
        out = tmp_path / "departure_admission"
        out.mkdir()
        config = {"out": str(out), "steps": 8, "global_batch": 12, "min_replicas": 2,
                  "kills": [[3, 1, "sigterm"]], "hold_for_joiners": [4, 1],
                  "die_during_admission": "share"}
        codes, logs, _ = _job_on_two_machines(made, out, config, collective_timeout=30,
                                              replacement=True)
        everything = "\n\n".join(f"--- process {r}\n{log[-2500:]}"
                                   for r, log in enumerate(logs))
        assert codes == [0, 0, 0, 0, -9], everything
        assert "replica(s) [3] left at a commit (termination notice)" in logs[0], everything
        assert "the admission of joiner(s) [4] broke" in logs[0], everything
        result = json.loads((out / "rank0.json").read_text())
        assert result["replicas_per_step"] == [4] + [3] * 7, everything
        assert result["tracked"] == 8
        for rank in (1, 2):
            assert json.loads((out / f"rank{rank}.json").read_text())["params"] == \
                result["params"]
        for got, want in zip(result["params"], _one_device(8, 12)):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       rtol=0, atol=1e-6)


def test_a_link_taken_down_mid_step_machine0_goes_on_machine1_ends_with_42(tmp_path):
    """The same 2 x 2 job; in step 3 node1's link is taken down (its switch port: no
    carrier, no connection closes) while replica 2 is between its forward and its backward
    and the others wait in the gradient all-reduce, which nothing breaks. Node0's replicas
    find node1's heartbeats stopped while their step runs long, break their step's
    connections, regroup between themselves, redo step 3 and finish equal to one device,
    well before the collective timeout (20 s); node1's replicas cannot reach the store (on
    node0) and end with 42 and the reason, at the collective timeout, so that a scheduler
    can restart them."""
    timeout = 20
    with cluster(2) as made:
        out = tmp_path / "link_down"
        out.mkdir()
        config = {"out": str(out), "steps": 6, "global_batch": 12, "min_replicas": 2,
                  "kills": [[2, 3, "pause"]], "pause_seconds": 2}
        codes, logs, ended = _job_on_two_machines(made, out, config, timeout,
                                                  cut_when_paused=2)
        everything = "\n\n".join(f"--- replica {r}\n{log[-2500:]}"
                                   for r, log in enumerate(logs))
        assert codes == [0, 0, 42, 42], everything
        _assert_machine0_finished_alone(out, logs, 6, 12, lost_at=3)
        # Node0's replicas noticed the stalled step before the collective timeout (at which
        # node1's replicas end): they finished first.
        assert None not in ended and max(ended[:2]) < min(ended[2:]), (ended, everything)
        print(f"link down: replicas 0 and 1 finished {max(ended[:2]):.1f} s after the cut, "
              f"2 and 3 ended {min(ended[2:]):.1f} s after it")
        assert "replica(s) [2, 3] lost" in logs[0], everything
        assert "stopped beating while replica" in logs[0] + logs[1], everything
        for rank in (2, 3):
            assert "live recovery cannot continue on replica" in logs[rank], everything
            assert f"the rendezvous store has not answered for {timeout} s" in logs[rank], \
                everything


@pytest.mark.parametrize("where", ["share", "group"])
def test_a_joiner_killed_during_its_admission_leaves_the_members_training(jobs, where):
    codes, logs, results = jobs[f"admission_broken_{where}"]
    # processes (`codes`): the joiner, then replicas 0 and 1; logs[r] is replica r's log
    # (the joiner's is logs[2]). The joiner is admitted at step 0's commit and SIGKILLed
    # either in the new group of 3 as replica 0 starts sending it the state ("share": the
    # members' broadcast breaks at once), or after it registered among the survivors, as
    # the group is being built ("group": building the members' group fails at the
    # collective timeout, which bounds it: 15 s here). The members regroup as 2 (nothing to redo: step
    # 0 committed) and finish equal to one device.
    assert codes == [-signal.SIGKILL, 0, 0], "\n\n".join(log[-2000:] for log in logs)
    members = results[0]
    assert members["steps"] == 6 and set(results) == {0, 1}
    assert members["replicas_per_step"] == [2] * 6
    assert "the admission of joiner(s) [2] broke" in logs[0]
    assert "2 replica(s) regrouped in" in logs[0] and "go on from step 1" in logs[0]
    # The regrouping after the broken admission: at once (the broken group's connections
    # close when it is abandoned; a member waiting in replica 0's broadcast is not held).
    assert members["recoveries"][0][3] < 5, members["recoveries"]
    expected = _one_device(6, 6)
    for got, theirs, want in zip(members["params"], results[1]["params"], expected):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                   rtol=0, atol=1e-6)
        assert got == theirs
