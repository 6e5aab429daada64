"""Optimizer state and settings of a ParameterServerStrategy's optimizer: checkpoints hold
the optimizer's state as one process's ``optimizer.state_dict()`` would, and param_group
changes on the chief (lr schedulers) reach the parameter servers.

One worker, so the closures update the parameters one after another in schedule order and
the results equal one process's training exactly (to float rounding).
"""
import copy

import pytest
import torch

import ps_helpers as h
import torchstrategy as ts
from torchstrategy.parameter_server import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    with ts.parameter_server.local_cluster(num_workers=1, num_ps=2) as resolver:
        yield resolver


def _batches(count):
    return [h.regression_data(n=32, seed=10 + i) for i in range(count)]


def _plain_steps(model, optimizer, batches, scheduler=None):
    for batch in batches:
        h.train_step(model, optimizer, iter([batch]))
        if scheduler is not None:
            scheduler.step()


def _ps_steps(coordinator, model, optimizer, batches, scheduler=None):
    # Not fetched one by one: each closure must use the settings of its own schedule call.
    for batch in batches:
        coordinator.schedule(h.train_step, args=(model, optimizer, iter([batch])))
        if scheduler is not None:
            scheduler.step()
    coordinator.join()


def _assert_same_tensors(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=1e-6)


def _assert_same_optimizer_state(actual, expected):
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        _assert_same_tensors(actual["state"][index], state)


def _ps_model(strategy, initial):
    with strategy.scope():
        model = h.Regression()
    model.load_state_dict(initial)
    return model


def test_adam_checkpoint_restores_into_other_shards_and_into_a_plain_model(cluster, tmp_path):
    k, m = 4, 3
    batches = _batches(k + m)
    torch.manual_seed(0)
    plain = h.Regression()
    initial = copy.deepcopy(plain.state_dict())
    plain_adam = torch.optim.Adam(plain.parameters(), lr=0.01)
    _plain_steps(plain, plain_adam, batches[:k])
    after_k = copy.deepcopy({"model": plain.state_dict(), "optimizer": plain_adam.state_dict()})
    _plain_steps(plain, plain_adam, batches[k:])
    expected = plain.state_dict()

    # k steps on the cluster, hidden layer in 2 shards (16 rows: 8 + 8, one per server).
    strategy = ts.ParameterServerStrategy(cluster, FixedShardsPartitioner(2))
    model = _ps_model(strategy, initial)
    assert len(strategy.extended.layout_of(model.hidden.weight).shards) == 2
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    _ps_steps(ts.ClusterCoordinator(strategy), model, adam, batches[:k])
    path = tmp_path / "ckpt.pt"
    ts.checkpoint.save({"model": model.state_dict(), "optimizer": adam.state_dict()}, path)
    checkpoint = ts.checkpoint.load(path)
    # The checkpoint is what one process's model and Adam hold after the same k steps.
    _assert_same_tensors(checkpoint["model"], after_k["model"])
    _assert_same_optimizer_state(checkpoint["optimizer"], after_k["optimizer"])
    assert set(checkpoint["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    # Restored before the first schedule into 3 shards (16 rows: 6 + 5 + 5).
    strategy3 = ts.ParameterServerStrategy(cluster, FixedShardsPartitioner(3))
    model3 = _ps_model(strategy3, initial)
    assert len(strategy3.extended.layout_of(model3.hidden.weight).shards) == 3
    adam3 = torch.optim.Adam(model3.parameters(), lr=0.01)
    model3.load_state_dict(checkpoint["model"])
    adam3.load_state_dict(checkpoint["optimizer"])
    _ps_steps(ts.ClusterCoordinator(strategy3), model3, adam3, batches[k:])
    _assert_same_tensors(model3.state_dict(), expected)

    # Restored mid-run (after the optimizer already trained) into 1 shard per variable:
    # the loaded state replaces the servers' state.
    strategy1 = ts.ParameterServerStrategy(cluster)
    model1 = _ps_model(strategy1, initial)
    adam1 = torch.optim.Adam(model1.parameters(), lr=0.5)
    coordinator1 = ts.ClusterCoordinator(strategy1)
    _ps_steps(coordinator1, model1, adam1, batches[:2])
    model1.load_state_dict(checkpoint["model"])
    adam1.load_state_dict(checkpoint["optimizer"])
    assert adam1.param_groups[0]["lr"] == 0.01
    _ps_steps(coordinator1, model1, adam1, batches[k:])
    _assert_same_tensors(model1.state_dict(), expected)

    # Restored into a plain model and Adam (no strategy).
    restored = h.Regression()
    restored_adam = torch.optim.Adam(restored.parameters(), lr=0.01)
    restored.load_state_dict(checkpoint["model"])
    restored_adam.load_state_dict(checkpoint["optimizer"])
    _plain_steps(restored, restored_adam, batches[k:])
    _assert_same_tensors(restored.state_dict(), expected)


def test_step_lr_scheduler_on_the_chief_changes_the_servers_learning_rate(cluster):
    n = 6
    batches = _batches(n)
    torch.manual_seed(1)
    plain = h.Regression()
    initial = copy.deepcopy(plain.state_dict())

    def make(model):
        # Two groups with their own lr (on different servers), SGD with momentum.
        optimizer = torch.optim.SGD([{"params": model.hidden.parameters()},
                                     {"params": model.out.parameters(), "lr": 0.05}],
                                    lr=0.1, momentum=0.9)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3)

    plain_sgd, plain_scheduler = make(plain)
    _plain_steps(plain, plain_sgd, batches, plain_scheduler)

    strategy = ts.ParameterServerStrategy(cluster, FixedShardsPartitioner(2))
    model = _ps_model(strategy, initial)
    sgd, scheduler = make(model)
    _ps_steps(ts.ClusterCoordinator(strategy), model, sgd, batches, scheduler)
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([0.1 * 0.3 ** 3,
                                                                 0.05 * 0.3 ** 3])
    _assert_same_tensors(model.state_dict(), plain.state_dict())
    # Without the scheduler's changes reaching the servers, training differs visibly.
    constant = h.Regression()
    constant.load_state_dict(initial)
    constant_sgd, _ = make(constant)
    _plain_steps(constant, constant_sgd, batches)
    assert (constant.hidden.weight - plain.hidden.weight).abs().max() > 1e-3
