"""DDP's environment under every launch (issue 27): torchrun's variables with torchrun's
meaning on every replica, and a process group even for one replica, so that DDP-style code
(nanoGPT's `ddp` test, minGPT's LOCAL_RANK, DistributedSampler, dist.barrier) runs
unchanged under re-execution, ts.launch, torchrun and alone."""
import json
import os
import subprocess
import sys

import torchstrategy as ts
from tests.helpers import SCRIPTS
from tests.helpers.processes import plain_environment
from tests.scripts.ddp_environment import every_report
from torchstrategy.cluster_resolver import detect
from torchstrategy.launch import world as world_lib

SCRIPT = os.path.join(SCRIPTS, "ddp_environment.py")


def _run(argv, tmp_path, replicas):
    result = subprocess.run(argv, env=plain_environment(), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.load(open(tmp_path / f"replica{r}.json")) for r in range(replicas)]


def _assert_torchrun_meaning(reports):
    """What torchrun gives worker r of n on one machine, and DDP-style code's view of it."""
    n = len(reports)
    for r, report in enumerate(reports):
        env = report["env"]
        assert report["replica_id"] == r and report["replicas"] == n
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                    "GROUP_RANK", "ROLE_RANK")} == \
            {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
             "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "ROLE_RANK": str(r)}
        assert env["MASTER_ADDR"] and env["MASTER_PORT"].isdigit() and \
            int(env["MASTER_PORT"]) > 0
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == \
            (reports[0]["env"]["MASTER_ADDR"], reports[0]["env"]["MASTER_PORT"])
        assert report["nanogpt_ddp"] is True             # the same answer on every replica
        assert report["mingpt_local_rank"] == r
        assert report["dist"] == [True, r, n]
        assert report["sampler"] == list(range(r, 10, n))


def test_plain_python_gives_replica_zero_the_same_variables_as_the_others(tmp_path):
    reports = _run([sys.executable, SCRIPT, "reexec", str(tmp_path)], tmp_path, 2)
    _assert_torchrun_meaning(reports)
    # Replica 0 is the program the user started: nothing was set before its strategy.
    assert set(reports[0]["env_before"].values()) == {None}


def test_torchrun_values_are_kept_as_torchrun_set_them(tmp_path):
    reports = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                    "--standalone", SCRIPT, "torchrun", str(tmp_path)], tmp_path, 2)
    _assert_torchrun_meaning(reports)
    for report in reports:
        assert report["env"] == report["env_before"]


def test_ts_launch_gives_every_replica_torchrun_variables():
    _assert_torchrun_meaning(ts.launch(every_report, num_replicas=2))


def test_one_replica_alone_has_the_variables_and_a_process_group_of_one(tmp_path):
    (report,) = _run([sys.executable, SCRIPT, "alone", str(tmp_path)], tmp_path, 1)
    _assert_torchrun_meaning([report])
    assert report["env"]["MASTER_ADDR"] == "127.0.0.1"
    # A program it starts inherits the variables but is not taken for a launched replica.
    assert report["child_sees_a_launcher"] is False


def _world(launcher, rank=1):
    return world_lib.World(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2,
                           launcher=launcher, master_addr="10.0.0.1", master_port=29500,
                           node_rank=rank // 2, num_nodes=2)


def _clear_launcher_variables(monkeypatch):
    """Removes every variable `publish_environment` reads or writes, for this test only
    (setenv first: monkeypatch restores only variables it saw, absent ones included)."""
    for name in world_lib.TORCHRUN_VARIABLES + (world_lib.LAUNCHER_ENV,
                                                  world_lib.PUBLISHED_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_a_launchers_values_are_never_replaced(monkeypatch):
    _clear_launcher_variables(monkeypatch)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "1234")
    world_lib.publish_environment(_world("torchrun"))
    assert os.environ["RANK"] == "3" and os.environ["MASTER_PORT"] == "1234"   # kept
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["GROUP_RANK"] == "0"  # added
    assert os.environ["LOCAL_WORLD_SIZE"] == "2" and os.environ["MASTER_ADDR"] == "10.0.0.1"
    assert world_lib.PUBLISHED_ENV not in os.environ


def test_variables_published_by_a_parent_are_not_a_launchers(monkeypatch):
    _clear_launcher_variables(monkeypatch)
    monkeypatch.setattr(os, "getpid", lambda: 1)      # the parent publishes its world
    world_lib.publish_environment(_world("reexec", rank=2))
    assert os.environ["RANK"] == "2" and os.environ["GROUP_RANK"] == "1"
    assert world_lib.from_environment() is not None   # in the parent: its own world
    monkeypatch.setattr(os, "getpid", lambda: 2)      # a child inherits the environment
    assert world_lib.inherited_from_parent() and world_lib.from_environment() is None
    monkeypatch.setenv("RANK", "0")                   # a launcher rewrote the variables
    assert not world_lib.inherited_from_parent()
    assert world_lib.from_environment().rank == 0



def test_published_variables_are_no_cluster_managers(monkeypatch):
    _clear_launcher_variables(monkeypatch)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.9")   # any pod of a cluster
    world_lib.publish_environment(world_lib.World(master_port=29400))   # one replica alone
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert detect.detect() is None                # not torchrun's, nor a Kubeflow job's
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:1"]}, '
                                    '"task": {"type": "worker", "index": 1}}')
    assert detect.detect() == "tf_config"         # and no conflict with TF_CONFIG
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setenv("WORLD_SIZE", "2")         # a launcher's own values count again
    assert detect.detect() == "torchrun"
