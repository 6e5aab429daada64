"""Faults of the network between machines, on a cluster of network namespaces
(tests/helpers/cluster.py; the nodes share this machine's file system, as a cluster's
machines share their storage, so BackupAndRestore's directory is common to all).

- A node's link taken down in the middle of training (``ip link set ... down`` on its
  switch port: a pulled cable): every process of both machines ends within the collective
  timeout (plus the error diagnosis' few seconds) with an error naming the unreachable
  machine, no process is left, and the job started again resumes from ts.BackupAndRestore
  and ends exactly like a run that was never interrupted.
- A 2 s flap (the link down, then up again) while the replicas train: TCP retransmits what
  was lost, no collective waits anywhere near the timeout, and training finishes exactly
  like an uninterrupted run.

The run with the flap is also the reference of the cut one (one launch fewer than a
separate uninterrupted run): the two must end with the same parameters (1e-6), each being
what an uninterrupted run computes, so a flap that lost or repeated a gradient and a
resumption that did not restore exactly both break the equality.

Cost: one module-scoped cluster of four nodes runs both scenarios at once, the cut job on
node0/node1 and the flapped one on node2/node3 (separate links: the cut of one pair does
not touch the other), both started together: the flapped job ends (its teardown included)
while the cut job's processes sit idle waiting for their collective timeout, so the cut
job's error handling and its restart do not share the cores with it.
The timeout is the user's setting, `TIMEOUT` here: 20 s is all the behaviour needs (a 2 s
flap far below it, a cut link ending in an error naming the machine), with a margin over
the 15 s that passed 6 runs at load 5-7, since it also bounds the start-up rendezvous of
replicas importing torch side by side on a loaded 2-core machine. Each scenario runs in its own
thread and records its own failure, so one that breaks does not hide the other.
"""
import os
import threading
import time
import traceback

import pytest
import torch

from tests.helpers.cluster import cluster
from tests.helpers.multi_machine import start_tf_config_machines, wait_all
from tests.helpers.replicas import assert_same_tensors

pytestmark = pytest.mark.multi_worker

# The collective timeout (also the bound on the machines' start-up rendezvous), as a user
# sets it with $TORCHSTRATEGY_TIMEOUT_SECONDS.
TIMEOUT = 20
CUT_AT_STEP = 9       # the last backup (every 4 steps) is after step 8
FLAP_AT_STEP = 6
FLAP_SECONDS = 2


def _start(nodes, outdir, **env):
    os.makedirs(outdir, exist_ok=True)
    return start_tf_config_machines("backup", outdir, replicas=2,
                                    hosts=[node.hostname for node in nodes], netns=nodes,
                                    TORCHSTRATEGY_TIMEOUT_SECONDS=TIMEOUT, **env)


def _finals(outdir):
    return [torch.load(os.path.join(outdir, f"backup-rank{r}.pt")) for r in range(4)]


def _wait_for_step(outdir, step, machines, limit=120):
    deadline = time.monotonic() + limit
    path = os.path.join(outdir, "progress")
    while time.monotonic() < deadline:
        if any(m.process.poll() is not None for m in machines):
            raise AssertionError("a machine ended early:\n" + "\n".join(
                m.log()[-3000:] for m in machines))
        try:
            with open(path) as f:
                if int(f.read() or 0) >= step:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"training did not reach step {step}")


class _Scenario:
    """What one scenario observed, or the error that stopped it (`failure`: a traceback)."""

    def __init__(self):
        self.failure = None
        self.machines = []

    def fail(self):
        self.failure = traceback.format_exc()
        for machine in self.machines:
            machine.kill()

    def check(self):
        if self.failure is not None:
            pytest.fail(f"the scenario failed before its checks:\n{self.failure}")


def _cut_then_resume(made, nodes, cut, mark):
    """The cut scenario, on `nodes` (two of `made`'s), recorded in `cut`: node1's link goes
    down at step `CUT_AT_STEP`, every process's end is awaited (its time measured here,
    whatever the other scenario does meanwhile), the link comes back, and the job is
    started again and awaited."""
    try:
        cut.machines = _start(nodes, cut.outdir, STEP_SLEEP=0.3)
        _wait_for_step(cut.outdir, CUT_AT_STEP, cut.machines)
        made.cut(nodes[1])
        cut_at = time.monotonic()
        mark(f"node1 cut at step {CUT_AT_STEP}")
        try:
            cut.codes = wait_all(cut.machines, timeout=6 * TIMEOUT)
            cut.ended_after = time.monotonic() - cut_at
            mark("every process of the cut job ended")
        finally:
            made.restore(nodes[1])
        cut.logs = [m.log() for m in cut.machines]
        cut.left = [pid for node in nodes for pid in node.pids()]
        # Started again with the link back: it resumes from the backup.
        cut.machines = _start(nodes, cut.outdir, TORCHELASTIC_RESTART_COUNT=1)
        mark("the cut job started again")
        cut.resumed = wait_all(cut.machines, timeout=240)
        cut.resumed_logs = [m.log() for m in cut.machines]
        mark("the resumed job ended")
    except Exception:
        cut.fail()


def _flap(made, nodes, flapped, outdir, mark):
    """The flap scenario, on `nodes`, recorded in `flapped`: node3's link down for
    `FLAP_SECONDS` at step `FLAP_AT_STEP`, then the job awaited."""
    try:
        flapped.machines = _start(nodes, outdir, STEP_SLEEP=0.1)
        _wait_for_step(outdir, FLAP_AT_STEP, flapped.machines)
        made.cut(nodes[1])
        try:
            time.sleep(FLAP_SECONDS)
        finally:
            made.restore(nodes[1])
        mark(f"node3's {FLAP_SECONDS} s flap over")
        flapped.codes = wait_all(flapped.machines, timeout=240)
        flapped.logs = [m.log() for m in flapped.machines]
        flapped.finals = _finals(outdir) if flapped.codes == [0, 0] else None
        mark("the flapped job ended")
    except Exception:
        flapped.fail()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both scenarios, run at once on one cluster: (cut, flapped) `_Scenario`s.

    cut: `ended_after` (seconds from the cut to the end of every process), `codes`,
    `logs`, `left` (processes left on node0/node1), `resumed` and `resumed_logs` (the
    job started again), `outdir` and `timeline`; flapped: `codes`, `logs`, `finals`."""
    cut, flapped = _Scenario(), _Scenario()
    began = time.monotonic()
    cut.timeline = []   # (what, seconds since the start), printed by the cut's test

    def mark(what):
        cut.timeline.append((what, time.monotonic() - began))

    with cluster(4, hostname_resolves_to="loopback") as made:
        cut.outdir = str(tmp_path_factory.mktemp("cut"))
        cutting = threading.Thread(target=_cut_then_resume, name="cut", daemon=True,
                                   args=(made, made.nodes[:2], cut, mark))
        cutting.start()
        _flap(made, made.nodes[2:], flapped, str(tmp_path_factory.mktemp("flapped")), mark)
        cutting.join(600)
        if cutting.is_alive():
            cut.failure = "the cut scenario still ran after 600 s"
            for machine in cut.machines:
                machine.kill()
            cutting.join(60)
        yield cut, flapped


def test_a_two_second_flap_is_survived(runs):
    _, flapped = runs
    flapped.check()
    assert flapped.codes == [0, 0], "\n\n".join(log[-3000:] for log in flapped.logs)
    for got in flapped.finals:
        assert got["attempt"] == 0 and not got["restored"]


def test_a_node_cut_off_mid_training_ends_every_process_then_resumes_exactly(runs):
    cut, flapped = runs
    cut.check()
    codes, logs = cut.codes, cut.logs
    print(f"every process ended {cut.ended_after:.1f} s after the cut (timeout {TIMEOUT} s); "
          + ", ".join(f"{what}: {at:.0f} s" for what, at in cut.timeline))
    assert codes[0] != 0 and codes[1] != 0, logs
    assert not cut.left, cut.left
    assert cut.ended_after < 2 * TIMEOUT + 20, cut.ended_after
    # node0's replicas name the machine they lost; node1's, that the chief's machine is
    # unreachable from theirs.
    assert "replica 2 (on worker:1)" in logs[0] and "not responding" in logs[0], logs[0][-4000:]
    assert "worker:0" in logs[1] and "unreachable" in logs[1], logs[1][-4000:]
    # Started again with the link back: it resumes from the backup and ends exactly as the
    # flapped run (see the module docstring).
    assert cut.resumed == [0, 0], "\n\n".join(log[-3000:] for log in cut.resumed_logs)
    flapped.check()
    assert flapped.codes == [0, 0], "the flapped run failed (see its test)"
    for rank, (resumed, expected) in enumerate(zip(_finals(cut.outdir), flapped.finals)):
        assert resumed["attempt"] == 1 and resumed["restored"]
        assert_same_tensors(resumed["final"], expected["final"], atol=1e-6, rtol=0,
                            what=f"rank {rank}")
