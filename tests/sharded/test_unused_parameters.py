"""ShardedStrategy when the replicas use different parameters in the same step (issue 36,
item 1): a branch chosen by each replica's own batch, as DDP's "Expected to have finished
reduction" case. FSDP2 leaves a parameter without a gradient out of its unit's
reduce-scatter, so two replicas that used different parameters laid out different flat
buffers and summed mismatched slices: silently wrong gradients (5.4e-2 after 6 steps).

One launch of 2 replicas, float64, AdamW with weight decay (a zero gradient and no gradient
move a weight differently: a parameter that no replica used must keep ``.grad is None``, as
on one device), 6 steps in which the replicas take different heads, the same head, and
never the spare one; then the same with 2 micro-batches per step (the first under
``extended.no_sync()``), each choosing its own head: a head used in one micro-batch of one
replica only. Every step's full gradients and the final weights equal one device training
on the global batch (1e-6 is rounding; the bug was 5e-2). The same launch shows what
``same_parameters_every_step=True`` gives where every replica does use the same parameters:
one device's gradients too.
"""
import pytest
import torch
import torch.nn as nn

import torchstrategy as ts
from tests.helpers.replicas import launch

pytestmark = pytest.mark.timeout(240)

SEED = 3
GLOBAL_BATCH = 8
REPLICAS = 2
# Which head each replica's half of the batch takes, step by step (True: left). Steps 2 and
# 5 (both left) leave the right head unused on every replica after it was used: AdamW must
# then skip it (its grad None), as one device does.
LEFT = [(True, False), (False, True), (True, True), (False, False), (True, False),
        (True, True)]
# With 2 micro-batches per step: the head of (replica 0's first, its second, replica 1's
# first, its second) quarter of the batch. Step 1 uses the right head in one quarter only;
# step 2 nowhere (after step 1 did).
LEFT_ACCUMULATED = [(True, True, False, True), (False, True, True, True),
                    (True, True, True, True), (False, False, True, False)]
# Every replica takes the same head in each step.
LEFT_SAME = [(True, True), (False, False), (True, True)]
ATOL = 1e-6


class Branchy(nn.Module):
    """A trunk, then one of two heads chosen by the batch itself; a spare head never
    used."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.left = nn.Linear(8, 3)
        self.right = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 3)

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        head = self.left if x[:, 0].mean() > 0 else self.right
        return head(hidden)


def build():
    torch.manual_seed(SEED)
    return Branchy().double()


def batches(pattern):
    """The global batches: the batch is cut into len(pattern[step]) chunks of consecutive
    rows (a replica's, or a micro-batch of one), and the first feature of a chunk's rows is
    positive where that chunk takes the left head."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for lefts in pattern:
        size = GLOBAL_BATCH // len(lefts)
        x = torch.randn(GLOBAL_BATCH, 4, generator=g, dtype=torch.float64)
        for chunk, left in enumerate(lefts):
            sign = 1 if left else -1
            rows = slice(chunk * size, (chunk + 1) * size)
            x[rows, 0] = sign * (x[rows, 0].abs() + 0.1)
        y = torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)
        out.append((x, y))
    return out


def per_example_loss(model, x, y):
    return ((model(x) - y) ** 2).sum(1)


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _grads(model, full=lambda g: g):
    return {name: None if p.grad is None else full(p.grad).detach().clone()
            for name, p in model.named_parameters()}


def one_device(pattern):
    """Gradients per step and final weights of one device: each chunk of the batch goes
    through the head its own rows choose, as on the replicas."""
    model = build()
    optimizer = optimizer_for(model)
    grads = []
    for x, y in batches(pattern):
        chunks = len(pattern[0])
        size = GLOBAL_BATCH // chunks
        loss = sum(per_example_loss(model, x[c * size:(c + 1) * size],
                                    y[c * size:(c + 1) * size]).sum()
                   for c in range(chunks)) / GLOBAL_BATCH
        loss.backward()
        grads.append(_grads(model))
        optimizer.step()
        optimizer.zero_grad()
    return grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(strategy, pattern, micro_batches):
    with strategy.scope():
        model = build()
        optimizer = optimizer_for(model)
    per_replica = GLOBAL_BATCH // REPLICAS
    size = per_replica // micro_batches
    grads = []

    def step(x, y):
        rank = ts.get_replica_context().replica_id_in_sync_group
        for micro in range(micro_batches):
            start = rank * per_replica + micro * size
            rows = slice(start, start + size)
            loss = ts.compute_average_loss(per_example_loss(model, x[rows], y[rows]),
                                           global_batch_size=GLOBAL_BATCH)
            if micro < micro_batches - 1:
                with strategy.extended.no_sync():
                    loss.backward()
            else:
                loss.backward()
        # Full gradients (a collective on every replica, in the same order: a parameter
        # has a gradient on every replica or on none).
        grads.append(_grads(model, full=lambda g: g.full_tensor()))
        optimizer.step()
        optimizer.zero_grad()

    for x, y in batches(pattern):
        strategy.run(step, args=(x, y))
    return grads, strategy.extended.export_state_dict(model)


def sharded_replica():
    """The three trainings, each a model of its own; the last with the declaration."""
    strategy = ts.ShardedStrategy()
    different = _train(strategy, LEFT, micro_batches=1)
    accumulated = _train(strategy, LEFT_ACCUMULATED, micro_batches=2)
    declared = ts.ShardedStrategy(same_parameters_every_step=True)
    same = _train(declared, LEFT_SAME, micro_batches=1)
    return different, accumulated, same


@pytest.fixture(scope="module")
def launched():
    return launch(sharded_replica, n=REPLICAS)


def _assert_equal(ours, theirs, what):
    assert list(ours) == list(theirs), what
    for name in theirs:
        if theirs[name] is None:
            assert ours[name] is None, f"{what} {name}: a gradient where one device has none"
            continue
        assert ours[name] is not None, f"{what} {name}: no gradient where one device has one"
        torch.testing.assert_close(ours[name], theirs[name], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{what} {name}: {m}")


def _assert_trains_as_one_device(ours, pattern):
    reference_grads, reference_weights = one_device(pattern)
    grads, weights = ours
    assert len(grads) == len(pattern)
    for step, (mine, theirs) in enumerate(zip(grads, reference_grads)):
        _assert_equal(mine, theirs, f"step {step}:")
    _assert_equal(weights, reference_weights, "final weights:")
    return reference_grads


def test_replicas_taking_different_branches_train_as_one_device(launched):
    reference_grads = _assert_trains_as_one_device(launched[0], LEFT)
    # The data does what the test says: the right head unused everywhere at step 2, after
    # it was used; the spare head never.
    assert reference_grads[2]["right.weight"] is None
    assert reference_grads[1]["right.weight"] is not None
    assert all(g["spare.weight"] is None for g in reference_grads)


def test_micro_batches_under_no_sync_taking_different_branches(launched):
    reference_grads = _assert_trains_as_one_device(launched[1], LEFT_ACCUMULATED)
    assert reference_grads[1]["right.weight"] is not None
    assert reference_grads[2]["right.weight"] is None


def test_declared_same_parameters_every_step_trains_as_one_device(launched):
    _assert_trains_as_one_device(launched[2], LEFT_SAME)


def test_the_declaration_is_a_bool():
    with pytest.raises(TypeError, match=r"same_parameters_every_step='yes'\): give True or "
                                         r"False"):
        ts.ShardedStrategy(same_parameters_every_step="yes")


def test_a_torch_without_unused_parameter_reduction_is_refused_naming_the_fix(monkeypatch):
    # torch 2.11's FSDP2 (the GPU machine's) has no set_reduce_scatter_unused_params:
    # the default would sum mismatched slices, so it is refused before any process starts.
    from torch.distributed.fsdp import FSDPModule
    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    with pytest.raises(RuntimeError, match=r"lacks \(torch 2.11 has none; 2.13 has it\)\. "
                                           r"Fix: pass same_parameters_every_step=True"):
        ts.ShardedStrategy(devices=["cpu:0"])
