"""Faults of the network between machines, on two nodes of a cluster of network namespaces
(tests/helpers/cluster.py; the nodes share this machine's file system, as a cluster's
machines share their storage, so BackupAndRestore's directory is common to both).

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
"""
import os
import time

import pytest
import torch

from tests.helpers.cluster import cluster
from tests.helpers.multi_machine import start_tf_config_machines, wait_all
from tests.helpers.replicas import assert_same_tensors

pytestmark = pytest.mark.multi_worker

TIMEOUT = 40   # the collective timeout (and the start-up wait: imports are slow under load)


@pytest.fixture(scope="module")
def nodes():
    with cluster(2, hostname_resolves_to="loopback") as made:
        yield made


def _start(nodes, outdir, **env):
    os.makedirs(outdir, exist_ok=True)
    return start_tf_config_machines("backup", outdir, replicas=2, hosts=["node0", "node1"],
                                    netns=nodes.nodes, TORCHSTRATEGY_TIMEOUT_SECONDS=TIMEOUT,
                                    **env)


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


@pytest.fixture(scope="module")
def flapped(nodes, tmp_path_factory):
    """The run whose link flaps for 2 s: (exit codes, logs, each replica's result)."""
    outdir = tmp_path_factory.mktemp("flapped")
    node1 = nodes.nodes[1]
    machines = _start(nodes, outdir, STEP_SLEEP=0.1)
    try:
        _wait_for_step(outdir, 6, machines)
        nodes.cut(node1)
        time.sleep(2)
    finally:
        nodes.restore(node1)
    codes = wait_all(machines, timeout=240)
    logs = [m.log() for m in machines]
    return codes, logs, (_finals(outdir) if codes == [0, 0] else None)


def test_a_two_second_flap_is_survived(flapped):
    codes, logs, finals = flapped
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    for got in finals:
        assert got["attempt"] == 0 and not got["restored"]


def test_a_node_cut_off_mid_training_ends_every_process_then_resumes_exactly(
        nodes, tmp_path, flapped):
    node1 = nodes.nodes[1]
    machines = _start(nodes, tmp_path, STEP_SLEEP=0.3)
    try:
        _wait_for_step(tmp_path, 9, machines)   # the last backup: after step 8
        nodes.cut(node1)
        cut_at = time.monotonic()
        codes = wait_all(machines, timeout=6 * TIMEOUT)
        ended_after = time.monotonic() - cut_at
    finally:
        nodes.restore(node1)
    logs = [m.log() for m in machines]
    print(f"every process ended {ended_after:.1f} s after the cut (timeout {TIMEOUT} s)")
    assert codes[0] != 0 and codes[1] != 0, logs
    assert not any(node.pids() for node in nodes.nodes)
    assert ended_after < 2 * TIMEOUT + 20, ended_after
    # node0's replicas name the machine they lost; node1's, that the chief's machine is
    # unreachable from theirs.
    assert "replica 2 (on worker:1)" in logs[0] and "not responding" in logs[0], logs[0][-4000:]
    assert "worker:0" in logs[1] and "unreachable" in logs[1], logs[1][-4000:]
    # Started again with the link back: it resumes from the backup and ends exactly as the
    # flapped run (see the module docstring).
    machines = _start(nodes, tmp_path, TORCHELASTIC_RESTART_COUNT=1)
    codes = wait_all(machines, timeout=240)
    assert codes == [0, 0], "\n\n".join(m.log()[-3000:] for m in machines)
    flap_codes, _, reference = flapped
    assert flap_codes == [0, 0], "the flapped run failed (see its test)"
    for rank, (resumed, expected) in enumerate(zip(_finals(tmp_path), reference)):
        assert resumed["attempt"] == 1 and resumed["restored"]
        assert_same_tensors(resumed["final"], expected["final"], atol=1e-6, rtol=0,
                            what=f"rank {rank}")
