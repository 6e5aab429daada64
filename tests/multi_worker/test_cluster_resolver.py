"""Cluster specs, resolvers (TF_CONFIG, torchrun, simple) and CommunicationOptions."""
import json

import pytest

import torchstrategy as ts
from torchstrategy.cluster_resolver import TFConfigError

CLUSTER = {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
           "ps": ["host3:2222"], "evaluator": ["host4:2222"]}


def tf_config(monkeypatch, config):
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


def test_cluster_spec_dense_and_sparse():
    spec = ts.ClusterSpec({"worker": ["a:1", "b:2"], "ps": {3: "c:3"}})
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 2 and spec.task_address("worker", 1) == "b:2"
    assert spec.job_tasks("ps") == [None, None, None, "c:3"]
    assert spec.as_dict() == {"worker": ["a:1", "b:2"], "ps": {3: "c:3"}}
    assert ts.ClusterSpec(spec) == spec and bool(spec) and not ts.ClusterSpec({})


@pytest.mark.parametrize("cluster, message", [
    ({"worker": "a:1"}, "tasks are a list of addresses"),
    ({"worker": ["a"]}, "Job 'worker', task 0: Task address 'a' is not of the form"),
    # Issue 19: an out-of-range port is named as such, not as a malformed address.
    ({"worker": ["a:99999"]}, "port 99999 is out of range"),
    ([("worker", "a:1")], "is a dict of job name"),
])
def test_cluster_spec_rejects_malformed(cluster, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ts.ClusterSpec(cluster)


def test_cluster_spec_unknown_job_and_task():
    spec = ts.ClusterSpec({"worker": ["a:1"]})
    with pytest.raises(ValueError, match=r"No job 'ps' in the cluster; its jobs are \['worker'\]"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match=r"No task 3 in job 'worker'"):
        spec.task_address("worker", 3)


def test_tf_config_roles(monkeypatch):
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 1},
                            "rpc_layer": "grpc"})
    resolver = ts.TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec() == ts.ClusterSpec(CLUSTER)
    assert resolver.master() == "grpc://host2:2222"
    assert resolver.master("ps", 0, rpc_layer="") == "host3:2222"
    # Synchronous training: chief, then workers; ps and evaluator do not train.
    assert resolver.training_tasks() == [("chief", 0), ("worker", 0), ("worker", 1)]
    assert resolver.num_workers == 3 and resolver.worker_index == 2
    assert not resolver.is_chief
    assert resolver.rendezvous_address() == ("host0", 2222)


def test_tf_config_chief_is_chief_or_first_worker(monkeypatch):
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "chief", "index": 0}})
    assert ts.TFConfigClusterResolver().is_chief
    no_chief = {"worker": ["h1:1", "h2:1"]}
    tf_config(monkeypatch, {"cluster": no_chief, "task": {"type": "worker", "index": 0}})
    assert ts.TFConfigClusterResolver().is_chief
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    ps = ts.TFConfigClusterResolver()
    assert not ps.is_chief
    with pytest.raises(ValueError, match="Task ps:0 does not train synchronously"):
        ps.worker_index


def test_tf_config_override_and_unset(monkeypatch):
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 0}})
    assert ts.TFConfigClusterResolver(task_type="ps", task_id=0).task_type == "ps"
    monkeypatch.delenv("TF_CONFIG")
    empty = ts.TFConfigClusterResolver()
    assert not empty.cluster_spec() and empty.task_type is None and empty.master() == ""


@pytest.mark.parametrize("config, message", [
    ('{"cluster": ', "TF_CONFIG is not valid JSON"),
    ('[1, 2]', "TF_CONFIG must be a JSON object"),
    ({"task": {"type": "worker", "index": 0}}, "TF_CONFIG has no 'cluster'"),
    ({"cluster": CLUSTER}, "TF_CONFIG has a cluster but no 'task'"),
    ({"cluster": CLUSTER, "task": {"type": "worker"}}, "must be an object with 'type' and 'index'"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": 2}},
     r"index 2 is out of range: job 'worker' has 2 task\(s\), indices \[0, 1\]"),
    ({"cluster": CLUSTER, "task": {"type": "trainer", "index": 0}},
     "task type 'trainer' is not a job of the cluster"),
    ({"cluster": {"worker": ["a:1"], "trainer": ["b:1"]}, "task": {"type": "worker", "index": 0}},
     r"unknown job\(s\) \['trainer'\]"),
    ({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}},
     "2 chief tasks; there can be at most one"),
    ({"cluster": {"worker": ["nohost"]}, "task": {"type": "worker", "index": 0}},
     "cluster is malformed: Job 'worker', task 0"),
])
def test_tf_config_malformed(monkeypatch, config, message):
    tf_config(monkeypatch, config)
    with pytest.raises(TFConfigError, match=message):
        ts.TFConfigClusterResolver()


def test_simple_cluster_resolver():
    resolver = ts.SimpleClusterResolver({"worker": ["a:1", "b:2"]}, task_type="worker",
                                        task_id=1, num_accelerators={"GPU": 2})
    assert resolver.master() == "b:2" and resolver.num_accelerators() == {"GPU": 2}
    assert resolver.worker_index == 1 and not resolver.is_chief
    assert ts.SimpleClusterResolver({"worker": ["a:1"]}, master="grpc://x:1").master() == \
        "grpc://x:1"
    with pytest.raises(ValueError, match="Give task_type and task_id together"):
        ts.SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker")
    with pytest.raises(ValueError, match="No task 5 in job 'worker'"):
        ts.SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=5)


def test_torch_elastic_resolver():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "2", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"}
    resolver = ts.TorchElasticClusterResolver(environ=env)
    # A TensorFlow task is a process: task_id is the global rank; the machine is GROUP_RANK.
    assert (resolver.task_type, resolver.task_id, resolver.node_rank) == ("worker", 5, 2)
    assert resolver.num_workers == 4 and resolver.worker_index == 2 and not resolver.is_chief
    assert resolver.rendezvous_address() == ("10.1.1.1", 29400)
    assert resolver.cluster_spec().task_address("worker", 0) == "10.1.1.1:29400"
    assert (resolver.local_rank, resolver.local_world_size) == (1, 2)
    with pytest.raises(RuntimeError, match="needs torchrun's environment"):
        ts.TorchElasticClusterResolver(environ={})


def test_communication_options():
    options = ts.CommunicationOptions(bytes_per_pack=1 << 20, timeout_seconds=5,
                                      implementation="ring")
    assert options.implementation is ts.CommunicationImplementation.RING
    assert ts.CommunicationOptions().implementation is ts.CommunicationImplementation.AUTO
    with pytest.raises(ValueError, match="bytes_per_pack must be a non-negative int"):
        ts.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds must be a positive number"):
        ts.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match=r"implementation must be one of \['AUTO', 'RING'"):
        ts.CommunicationOptions(implementation="mpi")
