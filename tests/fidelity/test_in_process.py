"""tf.distribute fidelity, in one process: values, reductions, variables, the extended API,
deprecated aliases, run options (issue 17). The multi-process half is
test_mirrored_fidelity.py."""

import pytest
import torch

import torchstrategy as ts


@pytest.fixture(scope="module")
def central():
    return ts.CentralStorageStrategy(["cpu:0", "cpu:1"])


def _replica_id():
    return ts.get_replica_context().replica_id_in_sync_group


# -- CentralStorageStrategy: one structure per replica ---------------------------------------
def test_central_storage_local_results_of_nested_structures(central):
    out = central.run(lambda: {"a": torch.tensor(float(_replica_id())),
                               "b": (torch.full((2,), 10.0 + _replica_id()),)})
    per_replica = central.experimental_local_results(out)
    assert len(per_replica) == 2
    for r, part in enumerate(per_replica):
        assert set(part) == {"a", "b"} and isinstance(part["b"], tuple)
        assert part["a"].item() == r and part["b"][0].tolist() == [10.0 + r] * 2
    pair = central.experimental_local_results(({"x": out["a"]}, {"y": out["b"][0]}))
    assert [p[0]["x"].item() for p in pair] == [0.0, 1.0]
    assert [p[1]["y"].tolist() for p in pair] == [[10.0, 10.0], [11.0, 11.0]]
    assert central.experimental_local_results(3.0) == (3.0,)


def test_distributed_values_print_what_they_are_and_which_replicas(central):
    out = central.run(lambda: torch.tensor(_replica_id()))
    assert repr(out) == "PerReplica{replica 0 of 2: tensor(0), replica 1 of 2: tensor(1)}"
    assert str(ts.Mirrored((torch.tensor(1.0),), (1,), num_replicas=2)) == \
        "Mirrored{replica 1 of 2 (this process): tensor(1.)}"
    assert repr(ts.PerReplica((torch.tensor(5),), (3,))) == \
        "PerReplica{replica 3 (this process): tensor(5)}"


# -- reduce of non-distributed values and integer MEAN ---------------------------------------
def test_reduce_of_a_plain_number_follows_tensorflow(central):
    with pytest.raises(ValueError, match=r"plain number 1.0, one value rather than one per "
                                         r"replica.*cannot be summed over 2 replicas.*"
                                         r"torch.tensor\(x\)"):
        central.reduce("SUM", 1.0, axis=None)
    assert central.reduce("MEAN", 1.0, axis=None) == 1.0
    assert central.reduce("SUM", 0, axis=None) == 0              # TF's special case
    with pytest.raises(ValueError, match="leaf 1 is the plain number 2"):
        central.reduce("SUM", {"a": central.run(lambda: torch.tensor(1.0)), "b": 2})
    mixed = central.reduce("MEAN", {"a": central.run(lambda: torch.tensor(1.0 + _replica_id())),
                                    "b": 2})
    assert mixed["b"] == 2 and mixed["a"].item() == 1.5
    default = ts.get_strategy()                                   # one replica: returned
    assert default.reduce("SUM", 1.0) == 1.0 and default.reduce(ts.ReduceOp.MEAN, 7) == 7


def test_mean_of_integers_is_a_floating_true_division(central):
    ints = central.run(lambda: torch.tensor([1, 2 + _replica_id()]))      # [1, 2], [1, 3]
    mean = central.reduce("MEAN", ints, axis=None)
    assert mean.dtype == torch.float64 and mean.tolist() == [1.0, 2.5]
    assert central.reduce("SUM", ints, axis=None).tolist() == [2, 5]     # SUM stays integral
    rows = central.run(lambda: torch.arange(3, dtype=torch.int16) + _replica_id())
    along = central.reduce("MEAN", rows, axis=0)                         # (0+1+2+1+2+3) / 6
    assert along.dtype == torch.float32 and along.item() == pytest.approx(1.5)
    plain = ts.get_strategy().reduce("MEAN", torch.tensor([3, 4]))
    assert plain.dtype == torch.float64 and plain.tolist() == [3.0, 4.0]
    with pytest.raises(ValueError, match="MEAN of bool tensors is not defined"):
        central.reduce("MEAN", central.run(lambda: torch.tensor(True)))


# -- variables -------------------------------------------------------------------------------
def test_variable_outside_every_scope_is_plain(central):
    plain = ts.Variable(2.0)
    assert type(plain) is ts.Variable and not isinstance(plain, ts.MirroredVariable)
    plain.assign_add(1.0)
    assert float(plain) == 3.0 and plain.assign(5.0).read_value().item() == 5.0
    counter = ts.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
    assert type(counter) is ts.Variable
    with central.scope():
        mirrored = ts.Variable(1.0)
    assert type(mirrored) is ts.MirroredVariable


def test_extended_variable_helpers(central):
    ext = central.extended
    outside = ts.Variable(1.0)
    with central.scope():
        v = ts.Variable(torch.zeros(2), aggregation="SUM", trainable=False)
        layer = torch.nn.Linear(2, 1)
        with ext.colocate_vars_with(v):
            beside = ts.Variable(3.0)
    assert ext.variable_created_in_scope(v) and ext.variable_created_in_scope(layer.weight)
    assert ext.variable_created_in_scope(beside) and beside.device == v.device
    assert not ext.variable_created_in_scope(outside)
    assert not ext.variable_created_in_scope(torch.zeros(1))
    assert ext.value_container(v.tensor) is v and ext.value_container(layer.weight) is layer.weight
    with pytest.raises(ValueError, match="colocate_vars_with needs a variable created in this "
                                         "strategy's scope"):
        ext.colocate_vars_with(outside)
    # update: fn(var, *args) once, mirrored arguments, no gradient recorded.
    assert ext.update(v, lambda var, d: var.assign_add(d), args=(torch.ones(2),)) is v
    assert ext.update(layer.weight, lambda w: w.mul_(0.0), group=False)[0] is layer.weight
    assert v.read_value().tolist() == [1.0, 1.0] and layer.weight.abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="needs Mirrored arguments.*reduce_to"):
        ext.update(v, lambda var, d: var.assign_add(d),
                   args=(central.run(lambda: torch.ones(2)),))

    def in_replica():
        ext.update(v, lambda var: var)
    with pytest.raises(RuntimeError, match="cross-replica context.*merge_call"):
        central.run(in_replica)


# -- deprecated aliases ----------------------------------------------------------------------
def test_deprecated_aliases_warn_then_work():
    strategy = ts.OneDeviceStrategy("cpu")
    with pytest.warns(DeprecationWarning, match="experimental_run_v2 is deprecated.*"
                                                "strategy.run"):
        assert strategy.experimental_run_v2(lambda x: x * 2, args=(torch.tensor(3),)) == 6
    with pytest.warns(DeprecationWarning, match="distribute_datasets_from_function instead"):
        data = strategy.experimental_distribute_datasets_from_function(
            lambda ctx: [torch.tensor([ctx.input_pipeline_id, ctx.num_input_pipelines])])
    assert [b.tolist() for b in data] == [[0, 1]]


# -- run options and communication options ---------------------------------------------------
def test_run_options_are_honoured_or_refused_with_the_reason(central):
    strategy = ts.OneDeviceStrategy("cpu")
    assert strategy.run(lambda: 1, options=ts.RunOptions()) == 1
    with pytest.raises(ValueError, match="experimental_enable_dynamic_batch_size=False.*"
                                         "Leave it at True"):
        strategy.run(lambda: 1, options=ts.RunOptions(
            experimental_enable_dynamic_batch_size=False))
    with pytest.raises(ValueError, match="bucketizing_dynamic_shape=True.*Pad batches"):
        central.run(lambda: 1, options=ts.RunOptions(experimental_bucketizing_dynamic_shape=True))
    with pytest.raises(ValueError, match="applies to TPUStrategy only; CentralStorageStrategy"):
        central.run(lambda: 1, options=ts.RunOptions(experimental_xla_options={"a": 1}))
    with pytest.raises(TypeError, match="options must be a ts.RunOptions"):
        strategy.run(lambda: 1, options={"experimental_enable_dynamic_batch_size": True})
    # TensorFlow's hints are accepted (issue 27); compression, which would round, is not.
    assert central.extended.reduce_to("SUM", central.run(lambda: torch.ones(1)), "cpu",
                                      options=ts.CommunicationOptions(bytes_per_pack=8)
                                      ).item() == 2.0
    with pytest.raises(ValueError, match="CentralStorageStrategy cannot honour compression"):
        central.extended.reduce_to("SUM", central.run(lambda: torch.ones(1)), "cpu",
                                   options=ts.CommunicationOptions(compression="bf16"))


def test_cross_device_ops_api_in_process(central):
    ops = central.extended.cross_device_ops
    per_replica = central.run(lambda: torch.tensor(1.0 + _replica_id()))
    with pytest.raises(RuntimeError, match=r"none is active here.*strategy.scope\(\)"):
        ops.reduce("SUM", per_replica, destinations="cpu")
    with central.scope():
        assert ops.reduce("SUM", per_replica, destinations="cpu").item() == 3.0
        assert [t.item() for t in ops.batch_reduce(
            "MEAN", [(per_replica, None), (per_replica, "cpu")])] == [1.5, 1.5]
        broadcast = ops.broadcast(torch.tensor([7.0]), "cpu")
        assert isinstance(broadcast, ts.Mirrored)
        assert [t.tolist() for t in broadcast.values] == [[7.0], [7.0]]
        with pytest.raises(ValueError, match="plain number 2.0"):
            ops.reduce("SUM", 2.0, None)
        with pytest.raises(ValueError, match=r"reduces with NcclAllReduce\(num_packs=1\).*"
                                             r"create the strategy with cross_device_ops="):
            ts.ReductionToOneDevice().reduce("SUM", per_replica, None)
    with pytest.raises(TypeError, match="accumulation_fn must be a function"):
        ts.ReductionToOneDevice(accumulation_fn=3)
