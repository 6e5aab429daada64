"""Misuse gives clear errors, raised before any process blocks in a collective, and
ts.launch reports replica failures."""
import os

import pytest
import torch

import torchstrategy as ts
from torchstrategy.launch.spawn import ReplicaFailed
from tests.helpers.processes import assert_ended_not_awaited, sleep_then_mark
from tests.helpers.replicas import from_every_replica, launch


# -- in-process: device arguments and one-replica strategies ---------------------------------
@pytest.mark.parametrize("devices,error,match", [
    (["gpu0x"], ValueError, r"Malformed device 'gpu0x'"),
    ("gpu0x", ValueError, r"Malformed device 'gpu0x'"),
    (["cpu:0", "cpu:0"], ValueError, r"Duplicate device 'cpu:0'"),
    (["cpu:0", "/cpu:0"], ValueError, r"Duplicate device '/cpu:0'"),
    ([], ValueError, r"`devices` is empty"),
    (["cpu:0", "cuda:1"], ValueError, r"mixes CPU and CUDA"),
])
def test_bad_devices_are_rejected_before_anything_starts(devices, error, match):
    with pytest.raises(error, match=match):
        ts.MirroredStrategy(devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda():
    with pytest.raises(RuntimeError, match=r"CUDA device\(s\) \['cuda:0'\] requested but "
                                           "torch has no usable CUDA"):
        ts.MirroredStrategy(devices=["cuda:0"])
    with pytest.raises(RuntimeError, match="no usable CUDA"):
        ts.OneDeviceStrategy("cuda:0")


def test_bad_arguments_to_one_replica_strategies():
    strategy = ts.OneDeviceStrategy("cpu")
    value = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"Unknown reduce op 'MAX'"):
        strategy.reduce("MAX", value, axis=None)
    with pytest.raises(ValueError, match="Unknown reduce op"):
        strategy.run(lambda: ts.get_replica_context().all_reduce("max", value))
    with pytest.raises(TypeError, match=r"reduce needs tensors, but leaf 1 .* is a str"):
        strategy.reduce("SUM", {"a": value, "b": "loss"}, axis=None)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        strategy.reduce("SUM", value, axis=2)
    with pytest.raises(ValueError, match="MEAN of bool tensors is not defined"):
        strategy.reduce("MEAN", torch.tensor([True, False]), axis=0)
    with pytest.raises(ValueError, match="Cannot gather a scalar"):
        strategy.gather(torch.tensor(1.0), axis=0)
    with pytest.raises(TypeError, match="cross_device_ops must be a ts.CrossDeviceOps"):
        ts.MirroredStrategy(devices=["cpu:0"], cross_device_ops="nccl")
    with pytest.raises(ValueError, match="per-example losses"):
        ts.compute_average_loss(torch.tensor(1.0), global_batch_size=4)
    with pytest.raises(ValueError, match="global_batch_size must be positive"):
        ts.compute_average_loss(torch.ones(3), global_batch_size=0)


def test_nesting_and_context_errors_in_process():
    mirrored = ts.MirroredStrategy(devices=["cpu:0"])
    one_device = ts.OneDeviceStrategy("cpu")
    with mirrored.scope():
        with pytest.raises(RuntimeError, match="Mixing different strategies is not allowed"):
            with one_device.scope():
                pass
        with pytest.raises(RuntimeError, match="Mixing different strategies"):
            one_device.run(lambda: None)
        with mirrored.scope():  # re-entering the same strategy is fine
            assert ts.get_strategy() is mirrored
    assert not ts.has_strategy()  # the failed entry left nothing behind
    with pytest.raises(RuntimeError, match="strategy.run was called inside strategy.run"):
        one_device.run(lambda: one_device.run(lambda: None))
    with pytest.raises(RuntimeError, match="strategy.reduce must be called in cross-replica "
                                           "context"):
        one_device.run(lambda: one_device.reduce("SUM", torch.ones(1), axis=None))
    with pytest.raises(RuntimeError, match="strategy.gather must be called in cross-replica"):
        one_device.run(lambda: one_device.gather(torch.ones(1), axis=0))
    assert not ts.has_strategy() and ts.get_replica_context() is not None


# -- in replicas: the errors are raised before any collective ---------------------------------
def _capture(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the tests inspect it
        return type(error).__name__, str(error)
    return None


def _errors_in_replicas():
    strategy = ts.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    r = strategy.extended.replica_id
    value = strategy.run(lambda: torch.tensor([r + 1.0]))
    res = {}
    # Replica 1 alone makes each mistake: were anything sent before the check, the
    # collectives of the two replicas would pair up wrongly and the checks below would fail
    # (or hang).
    if r == 1:
        res["max"] = _capture(lambda: strategy.reduce("MAX", value, axis=None))
        res["string_leaf"] = _capture(lambda: strategy.reduce("SUM", {"a": value, "b": "x"}))
        res["gather_scalar"] = _capture(lambda: strategy.gather(torch.tensor(1.0), axis=0))
        res["gather_axis"] = _capture(lambda: strategy.gather(torch.ones(2), axis=3))
        res["nested_run"] = _capture(lambda: strategy.run(lambda: strategy.run(lambda: 1)))
        res["reduce_in_run"] = _capture(
            lambda: strategy.run(lambda: strategy.reduce("SUM", value, axis=None)))
        res["all_reduce_mean_int"] = _capture(
            lambda: strategy.run(lambda: ts.get_replica_context().all_reduce(
                "MEAN", torch.tensor([1]))))

        def mix():
            with strategy.scope():
                with ts.OneDeviceStrategy("cpu").scope():
                    pass
        res["mixing"] = _capture(mix)
        res["devices"] = _capture(lambda: ts.MirroredStrategy(devices=["cpu:0", "cpu:0"]))
        res["has_strategy_after"] = ts.has_strategy()
    # Both replicas still agree: the next collectives pair up correctly.
    res["sum_after"] = strategy.reduce("SUM", value, axis=None).tolist()
    res["gather_after"] = strategy.gather(torch.full((r + 1,), float(r)), axis=0).tolist()
    return from_every_replica(res)


def test_errors_in_one_replica_do_not_desynchronise_the_others():
    per_replica = launch(_errors_in_replicas, n=2)
    for res in per_replica:
        assert res["sum_after"] == [3.0]
        assert res["gather_after"] == [0.0, 1.0, 1.0]
    res = per_replica[1]
    expected = {
        "max": ("ValueError", "Unknown reduce op 'MAX'"),
        "string_leaf": ("TypeError", "leaf 1 of the structure is a str"),
        "gather_scalar": ("ValueError", "Cannot gather a scalar"),
        "gather_axis": ("ValueError", "axis 3 is out of range"),
        "nested_run": ("RuntimeError", "strategy.run was called inside strategy.run"),
        "reduce_in_run": ("RuntimeError", "strategy.reduce must be called in cross-replica"),
        "all_reduce_mean_int": ("ValueError", "truncating the mean; cast to a floating"),
        "mixing": ("RuntimeError", "Mixing different strategies is not allowed"),
        "devices": ("ValueError", "Duplicate device 'cpu:0'"),
    }
    for key, (kind, text) in expected.items():
        assert res[key] is not None, key
        assert res[key][0] == kind and text in res[key][1], (key, res[key])
    assert res["has_strategy_after"] is False


def _devices_disagree_with_world():
    ts.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])


def test_devices_disagreeing_with_the_launched_world():
    with pytest.raises(ValueError, match=r"names 3 device\(s\), but launch started 2 "
                                         r"process\(es\)"):
        launch(_devices_disagree_with_world, n=2)


# -- ts.launch failure reporting -------------------------------------------------------------
def _replica_one_raises(tag, outdir):
    strategy = ts.MirroredStrategy()
    if strategy.extended.replica_id == 1:
        raise ValueError(f"bad value in replica 1 ({tag})")
    # Replica 0 is busy (not in a collective, whose own error could race with replica 1's
    # report); launch must end it.
    sleep_then_mark(outdir, 120)
    return "unreachable"


def _replica_one_exits(outdir):
    strategy = ts.MirroredStrategy()
    if strategy.extended.replica_id == 1:
        os._exit(3)
    sleep_then_mark(outdir, 120)
    return "unreachable"


def test_launch_reraises_the_replica_exception_type(tmp_path):
    with pytest.raises(ValueError, match=r"bad value in replica 1 \(tag-42\)") as info:
        launch(_replica_one_raises, "tag-42", str(tmp_path), n=2)
    assert "Replica 1 raised" in str(info.value.__cause__)
    assert_ended_not_awaited(tmp_path)  # the busy replica 0 was terminated, not awaited


def test_launch_reports_a_replica_that_died(tmp_path):
    # Either the pipe's end or the process's exit is noticed first; both name the code.
    with pytest.raises(ReplicaFailed, match=r"Replica 1 (exited with code 3|ended \(exit "
                                            r"code 3\))"):
        launch(_replica_one_exits, str(tmp_path), n=2)
    assert_ended_not_awaited(tmp_path)
    assert issubclass(ReplicaFailed, RuntimeError)
