"""Optimizer state and settings of a ParameterServerStrategy's optimizer: checkpoints hold
the optimizer's state as one process's ``optimizer.state_dict()`` would, and param_group
changes on the chief (lr schedulers) reach the parameter servers.

One worker, so the closures update the parameters one after another in schedule order and
the results equal one process's training exactly (to float rounding). A checkpoint written
on one cluster (fixture `run`) is restored into a fresh cluster with another number of
parameter servers and shards (fixture `cluster`, started after the first one ended: a
process is a task of one cluster at a time).
"""
import copy

import pytest
import torch

from tests.helpers import ps_cluster as h
import torchstrategy as ts
from torchstrategy.parameter_server import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(300)


K, M = 4, 3   # steps before and after the checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """K Adam steps on a cluster of 2 ps (the hidden layer in 2 shards, 16 rows: 8 + 8),
    checkpointed; and one process's run of the same K + M steps."""
    batches = _batches(K + M)
    torch.manual_seed(0)
    plain = h.Regression()
    initial = copy.deepcopy(plain.state_dict())
    plain_adam = torch.optim.Adam(plain.parameters(), lr=0.01)
    _plain_steps(plain, plain_adam, batches[:K])
    after_k = copy.deepcopy({"model": plain.state_dict(), "optimizer": plain_adam.state_dict()})
    _plain_steps(plain, plain_adam, batches[K:])

    path = tmp_path_factory.mktemp("ps_optimizer") / "ckpt.pt"
    with ts.parameter_server.local_cluster(num_workers=1, num_ps=2) as cluster:
        strategy = ts.ParameterServerStrategy(cluster, FixedShardsPartitioner(2))
        model = _ps_model(strategy, initial)
        assert len(strategy.extended.layout_of(model.hidden.weight).shards) == 2
        adam = torch.optim.Adam(model.parameters(), lr=0.01)
        _ps_steps(ts.ClusterCoordinator(strategy), model, adam, batches[:K])
        ts.checkpoint.save({"model": model.state_dict(), "optimizer": adam.state_dict()}, path)
    return dict(batches=batches, initial=initial, after_k=after_k,
                expected=plain.state_dict(), checkpoint=ts.checkpoint.load(path))


@pytest.fixture(scope="module")
def cluster(run):
    """A fresh cluster with 3 ps, started once the checkpointed run's cluster has ended."""
    with ts.parameter_server.local_cluster(num_workers=1, num_ps=3) as resolver:
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


def _checkpoint(run):
    # A copy per test: Optimizer.load_state_dict keeps the loaded tensors, and steps then
    # update them in place.
    return copy.deepcopy(run["checkpoint"])


def _ps_model(strategy, initial):
    with strategy.scope():
        model = h.Regression()
    model.load_state_dict(initial)
    return model


def test_checkpoint_holds_the_optimizer_state_of_one_process(run):
    checkpoint = run["checkpoint"]
    assert set(checkpoint) == {"model", "optimizer"}
    _assert_same_tensors(checkpoint["model"], run["after_k"]["model"])
    _assert_same_optimizer_state(checkpoint["optimizer"], run["after_k"]["optimizer"])
    assert set(checkpoint["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert checkpoint["optimizer"]["state"][0]["exp_avg"].shape == (16, 4)  # shards joined


def test_checkpoint_resumes_in_a_plain_model_and_adam(run):
    checkpoint = _checkpoint(run)
    restored = h.Regression()
    adam = torch.optim.Adam(restored.parameters(), lr=0.01)
    restored.load_state_dict(checkpoint["model"])
    adam.load_state_dict(checkpoint["optimizer"])
    _plain_steps(restored, adam, run["batches"][K:])
    _assert_same_tensors(restored.state_dict(), run["expected"])


def test_checkpoint_resumes_in_a_fresh_cluster_with_3_shards(run, cluster):
    checkpoint = _checkpoint(run)
    # Loaded before the optimizer's first schedule: sent to the servers then.
    strategy = ts.ParameterServerStrategy(cluster, FixedShardsPartitioner(3))
    model = _ps_model(strategy, run["initial"])
    assert [s.rows for s in strategy.extended.layout_of(model.hidden.weight).shards] \
        == [6, 5, 5]
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model.load_state_dict(checkpoint["model"])
    adam.load_state_dict(checkpoint["optimizer"])
    _ps_steps(ts.ClusterCoordinator(strategy), model, adam, run["batches"][K:])
    _assert_same_tensors(model.state_dict(), run["expected"])
    # And state_dict() gathers the 3 shards' state as one process's Adam would hold it.
    assert float(adam.state_dict()["state"][0]["step"]) == K + M


def test_checkpoint_loaded_mid_run_replaces_the_servers_state(run, cluster):
    checkpoint = _checkpoint(run)
    strategy = ts.ParameterServerStrategy(cluster)   # 1 shard per variable
    model = _ps_model(strategy, run["initial"])
    adam = torch.optim.Adam(model.parameters(), lr=0.5)
    coordinator = ts.ClusterCoordinator(strategy)
    _ps_steps(coordinator, model, adam, run["batches"][:2])
    model.load_state_dict(checkpoint["model"])
    adam.load_state_dict(checkpoint["optimizer"])
    assert adam.param_groups[0]["lr"] == 0.01
    _ps_steps(coordinator, model, adam, run["batches"][K:])
    _assert_same_tensors(model.state_dict(), run["expected"])


def test_step_lr_scheduler_on_the_chief_changes_the_servers_learning_rate(cluster):
    n = 6
    batches = _batches(n)
    torch.manual_seed(1)
    plain = h.Regression()
    initial = copy.deepcopy(plain.state_dict())

    def make(model):
        # Two groups with their own lr, SGD with momentum.
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
    trained = model.state_dict()
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([0.1 * 0.3 ** 3,
                                                                 0.05 * 0.3 ** 3])
    _assert_same_tensors(trained, plain.state_dict())
    # Without the scheduler's changes reaching the servers, training differs visibly.
    constant = h.Regression()
    constant.load_state_dict(initial)
    constant_sgd, _ = make(constant)
    _plain_steps(constant, constant_sgd, batches)
    assert (constant.hidden.weight - plain.hidden.weight).abs().max() > 1e-3
