"""CentralStorageStrategy: one process, parameters stored once, replicas in threads.

The foundation is the same equivalence as tests/core/test_equivalence.py: N CPU replicas
(``compute_devices=["cpu:0", ...]``) train exactly like one device on the same global
batches (20 steps and a short last batch, SGD with momentum and Adam, to 1e-5).
"""
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from torchstrategy.strategies import replica_copies
from tests.helpers.replicas import assert_same_tensors, detached_state
from tests.core.test_equivalence import (REFERENCE_SEED, VARIANTS, l2_term, make_data, make_model,
                                   single_device_training)

pytestmark = pytest.mark.timeout(120)


def cpu_strategy(n, **kwargs):
    return ts.CentralStorageStrategy(compute_devices=[f"cpu:{i}" for i in range(n)], **kwargs)


@pytest.fixture(scope="module")
def references():
    return {variant: single_device_training(variant) for variant in VARIANTS}


def central_training(strategy, variant):
    make_optimizer, explicit_batch = VARIANTS[variant]
    torch.manual_seed(REFERENCE_SEED)
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(model.parameters())

    def train_step(x, y, global_batch):
        per_example = F.cross_entropy(model(x), y, reduction="none")
        if explicit_batch:
            loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
        else:
            loss = ts.compute_average_loss(per_example)
        loss = loss + ts.scale_regularization_loss(l2_term(model))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach(), x.shape[0]

    losses, local_batches = [], []
    batches = make_data()
    dataset = strategy.experimental_distribute_dataset(batches)
    for (x, y), (global_x, _) in zip(dataset, batches):
        loss, sizes = strategy.run(train_step, args=(x, y, global_x.shape[0]))
        local_batches.append(strategy.experimental_local_results(sizes))
        losses.append(strategy.reduce(ts.ReduceOp.SUM, loss, axis=None).item())
    return model, optimizer, losses, local_batches


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_training_matches_single_device(num_replicas, references):
    for variant, reference in references.items():
        strategy = cpu_strategy(num_replicas)
        model, optimizer, losses, local_batches = central_training(strategy, variant)
        if num_replicas == 4:
            assert local_batches[0] == (3, 3, 2, 2) and local_batches[-1] == (1, 1, 1, 0)
        else:
            assert local_batches[0] == (5, 5) and local_batches[-1] == (2, 1)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]),
                                   atol=1e-5, rtol=0)
        assert_same_tensors(detached_state(model), reference["final"], atol=1e-5, rtol=0,
                            what=f"{variant} x{num_replicas}")
        # Parameters and optimizer state stayed on the parameter device, stored once.
        for p in model.parameters():
            assert p.device == torch.device("cpu") and p.grad is None
        state = optimizer.state[next(model.parameters())]
        if variant == "sgd":
            assert state["momentum_buffer"].device == torch.device("cpu")
        if variant == "adam":  # one update per step, not one per replica
            assert int(state["step"]) == len(make_data())


def test_training_with_copied_parameters_matches_single_device(references, monkeypatch):
    """The path of compute devices other than the parameter device (GPUs): each replica
    reads a copy of the parameters made when run starts, refreshed after the update."""
    monkeypatch.setattr(replica_copies.RunSession, "share_parameter_storage", False)
    for variant in ("sgd", "adam"):
        model, _, losses, _ = central_training(cpu_strategy(2), variant)
        torch.testing.assert_close(torch.tensor(losses),
                                   torch.tensor(references[variant]["losses"]),
                                   atol=1e-5, rtol=0)
        assert_same_tensors(detached_state(model), references[variant]["final"], atol=1e-5,
                            rtol=0, what=f"{variant} with copies")


def test_backward_sums_gradients_and_step_applies_once():
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = nn.Linear(2, 1, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    seen = {}

    def step(x):
        model(x).sum().backward()
        rid = ts.get_replica_context().replica_id_in_sync_group
        seen[rid] = model.weight.grad.clone()   # every replica sees the SUM
        optimizer.step()
        seen[f"after{rid}"] = model.weight.detach().clone()
        return x.sum()

    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((1, 2), float(ctx.replica_id_in_sync_group + 1)))
    strategy.run(step, args=(x,))
    expected_grad = torch.tensor([[3.0, 3.0]])   # 1 from replica 0, 2 from replica 1
    assert torch.equal(seen[0], expected_grad) and torch.equal(seen[1], expected_grad)
    assert torch.equal(model.weight.grad, expected_grad)
    # One update by the summed gradient (two updates would give [[-5, -4]]).
    expected_weight = torch.tensor([[-2.0, -1.0]])
    assert torch.equal(model.weight.detach(), expected_weight)
    assert torch.equal(seen["after0"], expected_weight) and torch.equal(seen["after1"],
                                                                        expected_weight)


def test_gradient_accumulation_within_and_across_runs():
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = nn.Linear(2, 1, bias=False)

    def two_backwards():
        model(torch.ones(1, 2)).sum().backward()
        model(torch.ones(1, 2)).sum().backward()   # the first sum is not summed again
        return model.weight.grad.clone()

    seen = strategy.run(two_backwards)
    expected = torch.full((1, 2), 4.0)             # 2 replicas x 2 backward passes
    assert all(torch.equal(g, expected) for g in seen.values)
    assert torch.equal(model.weight.grad, expected)
    strategy.run(lambda: model(torch.ones(1, 2)).sum().backward())   # no zero_grad
    assert torch.equal(model.weight.grad, torch.full((1, 2), 6.0))


def test_gradient_clipping_inside_run_matches_single_device():
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    reference = nn.Linear(4, 1)
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(reference.state_dict())
    F.mse_loss(reference(x), y, reduction="sum").backward()
    nn.utils.clip_grad_norm_(reference.parameters(), 0.5)

    def step(xb, yb):
        loss = ts.compute_average_loss(F.mse_loss(model(xb), yb, reduction="none"),
                                       global_batch_size=1)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # on each replica's view, once
        optimizer.step()

    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])
    strategy.run(step, args=(xb, yb))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)


def test_run_returns_per_replica_and_cross_replica_ops():
    strategy = cpu_strategy(3)
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended.parameter_devices == (torch.device("cpu"),)
    batches = [torch.arange(7.0).reshape(7, 1)]
    (batch,) = list(strategy.experimental_distribute_dataset(batches))

    def fn(x):
        ctx = ts.get_replica_context()
        assert ts.get_strategy() is strategy and not ts.in_cross_replica_context()
        total = ctx.all_reduce(ts.ReduceOp.SUM, x.sum())
        gathered = ctx.all_gather(x, axis=0)
        return {"id": torch.tensor(ctx.replica_id_in_sync_group), "x": x,
                "total": total, "gathered": gathered}

    out = strategy.run(fn, args=(batch,))
    assert isinstance(out["x"], ts.PerReplica)
    assert repr(out["id"]) == ("PerReplica{replica 0 of 3: tensor(0), replica 1 of 3: "
                               "tensor(1), replica 2 of 3: tensor(2)}")
    assert [t.shape[0] for t in strategy.experimental_local_results(out["x"])] == [3, 2, 2]
    for total in out["total"].values:
        assert total.item() == 21.0
    for gathered in out["gathered"].values:
        assert torch.equal(gathered, batches[0])
    assert strategy.reduce("SUM", out["id"], axis=None).item() == 3
    assert strategy.reduce("MEAN", out["x"], axis=0).item() == pytest.approx(3.0)
    assert strategy.reduce("SUM", out["x"], axis=0).item() == 21.0
    assert torch.equal(strategy.gather(out["x"], axis=0), batches[0])
    with pytest.raises(ValueError, match="plain tensor, not a per-replica value"):
        strategy.reduce("SUM", torch.ones(2), axis=None)
    assert torch.equal(strategy.reduce("MEAN", torch.ones(2), axis=None), torch.ones(2))


def test_merge_call_runs_once_with_per_replica_arguments():
    strategy = cpu_strategy(2)
    calls = []

    def merge_fn(strategy_, value):
        calls.append(value)
        assert ts.in_cross_replica_context()
        return strategy_.reduce("SUM", value, axis=None)

    def fn():
        rid = ts.get_replica_context().replica_id_in_sync_group
        return ts.get_replica_context().merge_call(merge_fn, args=(torch.tensor(rid + 1.0),))

    out = strategy.run(fn)
    assert len(calls) == 1 and isinstance(calls[0], ts.PerReplica)
    assert [v.item() for v in out.values] == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_merge_fn_runs_in_cross_replica_context_without_a_second_rendezvous():
    # merge_fn runs once, in cross-replica context: a variable update, a barrier or an
    # optimizer step there is local, not a rendezvous nested inside merge_call's (which
    # would wait for replicas that are all waiting in merge_call, and time out). The
    # timeout is generous: a busy machine must not make the correct path time out.
    strategy = cpu_strategy(2, timeout_seconds=30)
    with strategy.scope():
        total = ts.Variable(0.0, aggregation=ts.VariableAggregation.SUM, trainable=False)
        model = nn.Linear(2, 1, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()

    def merge_fn(strategy_, value):
        assert ts.get_replica_context() is None
        total.assign(strategy_.reduce("SUM", value, axis=None))
        strategy_.extended.communicator.barrier()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        return total.read_value()

    def fn():
        rid = ts.get_replica_context().replica_id_in_sync_group
        return ts.get_replica_context().merge_call(merge_fn, args=(torch.tensor(rid + 1.0),))

    out = strategy.run(fn)
    assert [v.item() for v in out.values] == [3.0, 3.0]
    assert total.read_value().item() == 3.0
    torch.testing.assert_close(model.weight.detach(), before - 1.0)


@pytest.mark.timeout(120)
def test_error_in_one_replica_propagates_without_deadlock():
    # A collective timeout far beyond this test's time limit: replica 0, waiting in
    # backward's gradient sum, can only be released by replica 1's error.
    strategy = cpu_strategy(2, timeout_seconds=3600)
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def fn():
        ctx = ts.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            time.sleep(0.2)      # replica 0 is already waiting in backward's gradient sum
            raise KeyError("replica 1 broke")
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    with pytest.raises(KeyError, match="replica 1 broke"):
        strategy.run(fn)
    assert not [t for t in threading.enumerate() if t.name.startswith("torchstrategy-replica")]
    # The strategy still works afterwards.
    out = strategy.run(lambda: ts.get_replica_context().all_reduce("SUM", torch.ones(1)))
    assert [v.item() for v in out.values] == [2.0, 2.0]


def test_missing_collective_times_out_with_a_clear_error():
    strategy = cpu_strategy(2, timeout_seconds=1)

    def fn():
        if ts.get_replica_context().replica_id_in_sync_group == 0:
            ts.get_replica_context().all_reduce("SUM", torch.ones(1))

    with pytest.raises(ts.CollectiveError, match=r"all_reduce on replica 0 timed out after "
                                                 r"1 s: replica\(s\) \[1\] did not reach it"):
        strategy.run(fn)


def test_variables_and_buffers():
    strategy = cpu_strategy(2)
    with strategy.scope():
        counter = ts.Variable(0.0, aggregation=ts.VariableAggregation.SUM, trainable=False)
        first = ts.Variable(0.0, aggregation="ONLY_FIRST_REPLICA", trainable=False)
        unaggregated = ts.Variable(0.0)
        bn = nn.BatchNorm1d(1)
        with pytest.raises(ValueError, match="does not support SyncOnReadVariable"):
            ts.Variable(0.0, synchronization=ts.VariableSynchronization.ON_READ,
                        aggregation="SUM")

    def fn(x):
        rid = ts.get_replica_context().replica_id_in_sync_group
        counter.assign_add(rid + 1.0)     # SUM of the replicas' updates, applied once
        first.assign(10.0 + rid)
        bn(x)

    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((4, 1), 2.0 * ctx.replica_id_in_sync_group))
    strategy.run(fn, args=(x,))
    assert counter.read_value().item() == 3.0
    assert first.read_value().item() == 10.0
    # running_mean: 0.9 * 0 + 0.1 * batch mean, averaged over replicas (0 and 2).
    assert bn.running_mean.item() == pytest.approx(0.1)
    assert bn.num_batches_tracked.item() == 1
    with pytest.raises(ValueError, match="aggregation is NONE"):
        strategy.run(lambda: unaggregated.assign(1.0))


def test_checkpoint_loads_into_a_plain_model(tmp_path):
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = make_model()
    ts.checkpoint.save(model.state_dict(), tmp_path / "model.pt")
    plain = make_model()
    plain.load_state_dict(ts.checkpoint.load(tmp_path / "model.pt"))
    assert_same_tensors(detached_state(plain), detached_state(model))


def test_distribute_datasets_from_function_gives_batches_in_turn():
    strategy = cpu_strategy(2)
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [torch.full((ctx.get_per_replica_batch_size(4),), float(i)) for i in range(3)]

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert (contexts[0].num_input_pipelines, contexts[0].num_replicas_in_sync) == (1, 2)
    assert [[v.tolist() for v in s.values] for s in steps] == [[[0.0, 0.0], [1.0, 1.0]],
                                                                [[2.0, 2.0], []]]


def test_devices_and_errors():
    strategy = ts.CentralStorageStrategy()
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert strategy.num_replicas_in_sync == expected
    one = ts.CentralStorageStrategy(compute_devices=["cpu:0"])
    assert one.run(lambda: torch.ones(1)).item() == 1.0   # plain values with one replica
    assert repr(cpu_strategy(2)) == ("CentralStorageStrategy(compute_devices=['cpu:0', "
                                     "'cpu:1'], parameter_device='cpu')")
    with pytest.raises(ValueError, match="Duplicate device"):
        ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:0"])
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = nn.Linear(1, 1)
        optimizer = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="closure"):
        strategy.run(lambda: optimizer.step(lambda: model(torch.ones(1, 1)).sum()))
    with pytest.raises(RuntimeError, match="Nested run"):
        strategy.run(lambda: strategy.run(lambda: None))
