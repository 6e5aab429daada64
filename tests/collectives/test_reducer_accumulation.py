"""Gradient accumulation corner cases of the reducer, against exact sums."""
import torch

import torchstrategy as ts
from tests.helpers.replicas import launch


def _synced_then_no_sync_then_synced():
    strategy = ts.MirroredStrategy()
    r = strategy.extended.replica_id
    with strategy.scope():
        w = torch.nn.Parameter(torch.zeros(3))
        module = torch.nn.Module()
        module.w = w
    x = lambda k: torch.tensor([1.0, 2.0, 3.0]) * (r + 1) * k  # replica- and step-dependent

    def backward(k):
        (w * x(k)).sum().backward()

    strategy.run(backward, args=(1,))           # synced: sum over replicas of x(1)
    first = w.grad.clone()
    with strategy.extended.no_sync():
        strategy.run(backward, args=(2,))       # local accumulation on top of the sum
    strategy.run(backward, args=(3,))           # synced: sums what was accumulated locally
    return first, w.grad.clone(), strategy.num_replicas_in_sync


def test_no_sync_on_top_of_an_already_summed_gradient():
    first, final, n = launch(_synced_then_no_sync_then_synced, n=2)
    base = torch.tensor([1.0, 2.0, 3.0])
    replica_sum = sum(r + 1 for r in range(n))  # sum over replicas of (r + 1)
    torch.testing.assert_close(first, base * replica_sum)
    # g1 summed once, then (g2 + g3) summed across replicas: never g1 N times.
    torch.testing.assert_close(final, base * replica_sum * (1 + 2 + 3))


def _multi_dim_loss():
    strategy = ts.MirroredStrategy()

    def step():
        per_token = torch.ones(2, 5)   # [local batch, tokens]
        return ts.compute_average_loss(per_token, global_batch_size=4)
    return strategy.reduce("SUM", strategy.run(step)).item()


def test_compute_average_loss_sums_every_element_as_tensorflow_does():
    # 2 replicas x (2 x 5 ones) / global batch 4 = 5 per replica... summed: 20 / 4 = 5.
    assert launch(_multi_dim_loss, n=2) == 5.0


def _autograd_grad_on_one_replica():
    strategy = ts.MirroredStrategy()
    r = strategy.extended.replica_id
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
    model(torch.ones(1, 3)).sum().backward()   # synced: both replicas
    before = [p.grad.clone() for p in model.parameters()]
    local = ()
    if r == 0:   # only replica 0: must stay local, or the reduce below would mismatch
        local = torch.autograd.grad(model(torch.ones(1, 3) * 5).sum(), list(model.parameters()))
    after = [p.grad.clone() for p in model.parameters()]
    total = strategy.reduce("SUM", torch.ones(1)).item()
    return before, after, total, [g.clone() for g in local]


def test_autograd_grad_is_local_and_leaves_grad_untouched():
    before, after, total, local = launch(_autograd_grad_on_one_replica, n=2)
    assert total == 2.0
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(local[0], torch.full((1, 3), 5.0))   # d/dW of W.x with x = 5
