"""MultiWorkerMirroredStrategy over two "machines" on this one: two torchrun agents
(``--nnodes=2``), or two ``python train.py`` processes with TF_CONFIG, each running two CPU
replicas, on loopback (tests/multi_worker/test_several_machines.py runs them on machines
of their own: network namespaces, each with its address, hostname and /etc/hosts).

Four replicas over two machines must train exactly like one device on the same global
batches (the core equivalence test's model, data and tolerance), with the default
all-reduce and with HierarchicalCopyAllReduce, and the strategy must know its cluster.
"""
import os
import re

import pytest
import torch

import torchstrategy as ts
from tests.helpers import ROOT
from tests.helpers.replicas import assert_same_tensors
from tests.helpers.multi_machine import start_tf_config_machines, start_torchrun_machines, \
    wait_all
from tests.core.test_equivalence import single_device_training

pytestmark = pytest.mark.multi_worker


@pytest.fixture(scope="module")
def reference():
    return single_device_training("sgd")


def _expected_sums(world_size=4):
    out = []
    for size, dtype in [(1, torch.float32), (7, torch.float64), (1000, torch.float32),
                        (33, torch.int64)]:
        out.append(sum((torch.arange(size) * (r + 1) + r).to(dtype)
                       for r in range(world_size)))
    return out


def _check_training(outdir, machines, reference, expected_tasks):
    codes = wait_all(machines)
    assert codes == [0, 0], "\n\n".join(m.log()[-3000:] for m in machines)
    results = [torch.load(os.path.join(outdir, f"train-rank{r}.pt")) for r in range(4)]
    facts = [r["facts"] for r in results]
    assert [f["rank"] for f in facts] == [0, 1, 2, 3]
    assert all(f["replicas"] == 4 and f["num_workers"] == 2 for f in facts)
    # Machine m holds ranks 2m, 2m+1: global rank = machine index x 2 + local rank.
    assert [f["worker_index"] for f in facts] == [0, 0, 1, 1]
    assert [(f["task_type"], f["task_id"]) for f in facts] == expected_tasks
    assert [f["is_chief"] for f in facts] == [True, False, False, False]
    for rank, result in enumerate(results):
        assert result["num_machines"] == 2
        for variant in ("default", "hierarchical"):
            got = result[variant]
            torch.testing.assert_close(torch.tensor(got["losses"]),
                                       torch.tensor(reference["losses"]), atol=1e-5, rtol=0)
            assert_same_tensors(got["final"], reference["final"], atol=1e-5, rtol=0,
                                what=f"{variant} rank {rank}")
            assert_same_tensors(got["final"], results[0][variant]["final"],
                                what=f"{variant} rank {rank} vs rank 0")
        # HierarchicalCopyAllReduce over the two-machine layout: the exact sums, and the
        # same as a plain all-reduce of the same buffers.
        for (via_hierarchy, plain), expected in zip(result["sums"], _expected_sums()):
            assert via_hierarchy.dtype == expected.dtype
            torch.testing.assert_close(via_hierarchy, expected, atol=0, rtol=0)
            torch.testing.assert_close(via_hierarchy, plain, atol=0, rtol=0)
    moved = max((reference["final"][k] - reference["init"][k]).abs().max().item()
                for k in reference["init"])
    assert moved > 1e-2


def test_two_torchrun_machines_train_like_one_device(tmp_path, reference):
    machines = start_torchrun_machines("train", tmp_path, nproc=2)
    # Under torchrun a task is a process, as in TensorFlow: task_id is the global rank.
    _check_training(tmp_path, machines, reference, [("worker", r) for r in range(4)])


def test_two_tf_config_machines_train_like_one_device(tmp_path, reference):
    # A chief and a worker, each a plain `python train.py` starting its own two replicas.
    machines = start_tf_config_machines("train", tmp_path, replicas=2,
                                        jobs=("chief", "worker"))
    _check_training(tmp_path, machines, reference, [("chief", 0)] * 2 + [("worker", 0)] * 2)


def test_the_example_trains_on_two_tf_config_machines(tmp_path):
    example = os.path.join(ROOT, "examples", "multi_worker.py")
    machines = start_tf_config_machines(None, tmp_path, None,
                                        argv=[example, "--replicas", "1", "--epochs", "5"])
    codes = wait_all(machines)
    chief_log = machines[0].log()
    assert codes == [0, 0], chief_log[-3000:] + machines[1].log()[-3000:]
    assert "2 worker(s), 2 replicas (this one: task worker:0)" in chief_log
    found = re.findall(r"^test accuracy: ([0-9.]+)", chief_log, flags=re.MULTILINE)
    assert len(found) == 1 and float(found[0]) > 0.9, chief_log
    assert "test accuracy" not in machines[1].log()  # only the chief prints


# -- malformed TF_CONFIG: a clear error before anything is launched or waited for ----------

MALFORMED = [
    ('{"cluster": {"worker": ["a:1"]}, "task": ', "TF_CONFIG is not valid JSON"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}}',
     "TF_CONFIG has a cluster but no 'task' saying which of its tasks this process is"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}',
     "TF_CONFIG's task index 2 is out of range: job 'worker' has 2 task(s), indices [0, 1]"),
    ('{"cluster": {"worker": ["a:1"], "trainer": ["b:1"]}, "task": {"type": "worker", '
     '"index": 0}}', "TF_CONFIG's cluster has unknown job(s) ['trainer']"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
     "TF_CONFIG's task type 'chief' is not a job of the cluster; its jobs are ['worker']"),
]


@pytest.mark.parametrize("tf_config,message", MALFORMED)
def test_malformed_tf_config_is_a_clear_error(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ts.cluster_resolver.TFConfigError) as caught:
        ts.MultiWorkerMirroredStrategy()
    assert message in str(caught.value)


def test_a_parameter_server_task_cannot_train_synchronously(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:1"], "ps": ["c:1"]}, '
                                    '"task": {"type": "ps", "index": 0}}')
    with pytest.raises(ValueError, match=r"Task ps:0 does not train synchronously; the "
                                         r"training tasks are \['worker:0', 'worker:1'\]"):
        ts.MultiWorkerMirroredStrategy()
