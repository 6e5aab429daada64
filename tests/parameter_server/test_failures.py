"""Failures on a parameter-server cluster (2 workers, 1 ps): a worker SIGKILLed mid-run and
its restart, a parameter server dying, and restoring a restarted cluster from a checkpoint.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers import ps_cluster as h
import torchstrategy as ts
from torchstrategy.parameter_server import ParameterServerUnavailableError
from torchstrategy.parameter_server.local_cluster import _free_port

pytestmark = pytest.mark.timeout(300)


def test_server_needs_a_worker_or_ps_task():
    resolver = ts.SimpleClusterResolver({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                                         "ps": ["127.0.0.1:3"]}, task_type="chief", task_id=0)
    with pytest.raises(ValueError, match="A Server is a 'worker' or 'ps' task"):
        ts.Server(resolver)


def test_worker_death_ps_death_and_restore(tmp_path):
    with ts.parameter_server.local_cluster(num_workers=2, num_ps=1) as cluster:
        strategy = ts.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = h.Regression()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            steps = ts.Variable(0.0, trainable=False)
        coordinator = ts.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(h.dataset_fn))

        # 1 ps: trains to the target loss
        for _ in range(120):
            coordinator.schedule(h.train_step, args=(model, optimizer, iterator))
        coordinator.join()
        assert h.evaluate(model) < 0.3

        # a worker SIGKILLed mid-run: every scheduled step still completes, join returns
        values = [coordinator.schedule(h.counted_slow_step, args=(steps, 0.05))
                  for _ in range(40)]
        time.sleep(0.5)
        cluster.kill("worker", 1)
        coordinator.join()
        names = [v.fetch()[0] for v in values]           # none raises
        assert "worker:0" in names and len(names) == 40
        assert float(steps.read_value()) >= 40           # at least once each

        # it comes back: the restarted process rejoins and gets work, with its iterator
        cluster.restart("worker", 1)
        deadline = time.monotonic() + 120
        seen = set()
        while "worker:1" not in seen:
            assert time.monotonic() < deadline, "the restarted worker never got work"
            batch = [coordinator.schedule(h.whoami_after_next, args=(iterator,))
                     for _ in range(4)]
            seen |= {name for name, _ in coordinator.fetch(batch)}
        ts.checkpoint.save(model.state_dict(), tmp_path / "model.pt")
        saved = ts.checkpoint.load(tmp_path / "model.pt")

        # a dead ps: a clear error from schedule and join
        cluster.kill("ps", 0)
        coordinator.schedule(h.train_step, args=(model, optimizer, iterator))
        with pytest.raises(ParameterServerUnavailableError,
                           match=r"Parameter server ps:0 is unavailable .*restore the "
                                 r"variables from the last checkpoint"):
            coordinator.join()
        with pytest.raises(ParameterServerUnavailableError, match="ps:0"):
            coordinator.schedule(h.whoami)

    # restart the cluster and restore from the last checkpoint
    with ts.parameter_server.local_cluster(num_workers=1, num_ps=2) as cluster:
        strategy = ts.ParameterServerStrategy(
            cluster, ts.parameter_server.FixedShardsPartitioner(2))
        with strategy.scope():
            restored = h.Regression()
        restored.load_state_dict(ts.checkpoint.load(tmp_path / "model.pt"))
        with torch.no_grad():
            for p in restored.parameters():
                p.zero_()
        for key, value in restored.state_dict().items():   # read back from the servers
            torch.testing.assert_close(value, saved[key])
        assert h.evaluate(restored) < 0.3


def test_server_without_tf_config_names_the_fix():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "torchstrategy.server"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "A Server is a 'worker' or 'ps' task" in result.stderr
    assert "Set TF_CONFIG's task" in result.stderr


_ORPHAN_CHILD = """
import sys, time
import torchstrategy as ts
cluster = ts.parameter_server.local_cluster(num_workers=1, num_ps=1)
print(cluster.process("worker", 0).pid, cluster.process("ps", 0).pid, flush=True)
time.sleep(600)
"""


def test_servers_die_with_the_process_that_started_them():
    """No orphans: SIGKILL the process that made a local cluster; its servers end too."""
    child = subprocess.Popen([sys.executable, "-c", _ORPHAN_CHILD], stdout=subprocess.PIPE,
                             text=True)
    try:
        pids = [int(p) for p in child.stdout.readline().split()]
        assert len(pids) == 2
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _is_running(p)]
            time.sleep(0.1)
        assert not alive, f"servers {alive} outlived the process that started them"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _is_running(pid):

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"   # a zombie has ended
    except FileNotFoundError:
        return False


_CHIEF = """
import json, sys, time
import torchstrategy as ts
strategy = ts.ParameterServerStrategy(ts.SimpleClusterResolver(
    json.loads(sys.argv[1]), task_type="chief", task_id=0), startup_timeout=120)
# Ready once both servers answer an rpc: they have finished joining and are serving, so
# what the test sees is a serving server losing its chief, not a join cut short.
import torch
from torch.distributed import rpc
for name in ("worker:0", "ps:0"):
    rpc.rpc_sync(name, torch.add, args=(torch.ones(1), 1), timeout=120)
print("ready", flush=True)
time.sleep(600)
"""


def test_servers_started_by_flags_exit_when_the_chief_dies():
    """Servers run on their own (`--cluster_spec` flags); a SIGKILLed chief cannot leave
    them hanging: they notice within seconds and exit with code 3."""
    spec = {"chief": [f"127.0.0.1:{_free_port()}"], "worker": ["127.0.0.1:1"],
            "ps": ["127.0.0.1:2"]}
    servers = [subprocess.Popen([sys.executable, "-m", "torchstrategy.server",
                                 "--cluster_spec", json.dumps(spec), "--task_type", job,
                                 "--task_id", "0", "--startup_timeout", "120"])
               for job in ("worker", "ps")]
    chief = subprocess.Popen([sys.executable, "-c", _CHIEF, json.dumps(spec)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert chief.stdout.readline().strip() == "ready"
        assert all(server.poll() is None for server in servers)
        chief.send_signal(signal.SIGKILL)
        chief.wait(timeout=30)
        assert [server.wait(timeout=60) for server in servers] == [3, 3]
    finally:
        for process in servers + [chief]:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_no_coordinator_thread_outlives_the_rpc_agent():
    # Issue 36, item 13: a worker thread of the coordinator, waiting for a lost worker to
    # rejoin, went on using rpc after the cluster was left: "Current RPC agent is not set"
    # in a thread (PytestUnhandledThreadExceptionWarning).
    raised = []
    previous = threading.excepthook
    threading.excepthook = lambda args: raised.append(
        f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
    try:
        with ts.parameter_server.local_cluster(num_workers=2, num_ps=1) as cluster:
            strategy = ts.ParameterServerStrategy(cluster)
            coordinator = ts.ClusterCoordinator(strategy)
            coordinator.fetch([coordinator.schedule(h.whoami) for _ in range(4)])
            cluster.kill("worker", 1)
            # worker:1's thread finds it gone at its next closure, then waits for it.
            coordinator.fetch([coordinator.schedule(h.whoami) for _ in range(8)])
            threads = [t for t in threading.enumerate()
                       if t.name.startswith("torchstrategy-worker")]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            time.sleep(0.1)
        assert not any(t.is_alive() for t in threads), [t.name for t in threads if t.is_alive()]
    finally:
        threading.excepthook = previous
    assert raised == []
