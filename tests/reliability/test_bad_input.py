"""Issue 19, items 4 and 11: bad arguments and environments give errors naming the argument,
the value and the fix."""
import math
import os
import subprocess
import sys

import pytest
import torch

import torchstrategy as ts
from torchstrategy.cluster_resolver.cluster_spec import ClusterSpec
from torchstrategy.launch import world as world_lib
from tests.helpers import ROOT


@pytest.mark.parametrize("value", [math.nan, math.inf, 2.5, 0, -1, True],
                         ids=["nan", "inf", "2.5", "0", "-1", "True"])
def test_compute_average_loss_refuses_a_bad_global_batch_size(value):
    with pytest.raises(ValueError, match="global_batch_size") as caught:
        ts.compute_average_loss(torch.ones(4), global_batch_size=value)
    assert f"global_batch_size={value!r}" in str(caught.value)


def test_compute_average_loss_accepts_whole_numbers():
    assert ts.compute_average_loss(torch.ones(4), global_batch_size=8).item() == 0.5
    assert ts.compute_average_loss(torch.ones(4), global_batch_size=8.0).item() == 0.5
    assert ts.compute_average_loss(torch.ones(4),
                                   global_batch_size=torch.tensor(8)).item() == 0.5


@pytest.mark.parametrize("value", [math.nan, math.inf, "abc", -1.0, True],
                         ids=["nan", "inf", "abc", "-1", "True"])
def test_timeout_seconds_refused_with_name_value_and_fix(value):
    with pytest.raises(ValueError) as caught:
        ts.MirroredStrategy(devices=["cpu:0"], timeout_seconds=value)
    message = str(caught.value)
    assert f"timeout_seconds={value!r}" in message and "positive, finite number" in message


def test_timeout_environment_variable_refused(monkeypatch):
    monkeypatch.setenv("TORCHSTRATEGY_TIMEOUT_SECONDS", "abc")
    with pytest.raises(ValueError) as caught:
        world_lib.timeout_seconds()
    message = str(caught.value)
    assert "TORCHSTRATEGY_TIMEOUT_SECONDS='abc'" in message and "unset it" in message


def test_rank_outside_world_size_is_named():
    env = dict(os.environ, RANK="5", WORLD_SIZE="2", LOCAL_RANK="5", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1", PYTHONPATH=ROOT)
    env.pop("TORCHSTRATEGY_LAUNCHER", None)
    code = "import torchstrategy as ts\nts.MirroredStrategy()\n"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "IndexError" not in result.stderr
    assert "ValueError: RANK=5 with WORLD_SIZE=2" in result.stderr, result.stderr[-2000:]


def test_cluster_spec_port_out_of_range():
    with pytest.raises(ValueError, match="port 99999 is out of range") as caught:
        ClusterSpec({"worker": ["10.0.0.1:99999"]})
    assert "not of the form" not in str(caught.value)
    with pytest.raises(ValueError, match="not of the form"):
        ClusterSpec({"worker": ["10.0.0.1"]})


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]], ids=["one", "two"])
def test_negative_bucket_cap_refused_before_launch(devices):
    # Two devices: the check comes before re-execution (which pytest cannot do).
    with pytest.raises(ValueError, match=r"bucket_cap_mb=-1\b"):
        ts.MirroredStrategy(devices=devices, bucket_cap_mb=-1)



def _batch_norm_with_a_small_last_batch():
    strategy = ts.MirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    data = [torch.randn(4, 3), torch.randn(3, 3)]   # the last global batch: 2 + 1
    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(lambda x: model(x).sum().backward(), args=(batch,))


def test_batch_norm_given_one_example_by_the_split_says_why_and_the_fix():
    # Issue 36, item 8: before, torch's "Expected more than 1 value per channel when
    # training" alone (one device trains on the same data without error).
    with pytest.raises(ValueError, match=r"BatchNorm in training mode got one example on "
                       r"this replica \(input size torch.Size\(\[1, 4\]\)\): its share of "
                       r"a global batch split over 2 replicas") as caught:
        ts.launch(_batch_norm_with_a_small_last_batch, num_replicas=2, timeout_seconds=60)
    assert "drop_last=True" in str(caught.value)
    assert "drop_remainder=True" in str(caught.value)
