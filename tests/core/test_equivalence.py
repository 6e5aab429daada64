"""N replicas under MirroredStrategy train exactly like one device on the same global batches.

Each replica takes slice r of every global batch (``torch.tensor_split`` along dim 0; the
global batch of 10 splits unevenly over 4 replicas: 3, 3, 2, 2, and a short last batch of 3
leaves replica 3 an empty slice), scales its loss with
``ts.compute_average_loss(..., global_batch_size=B)`` and its L2 term with
``ts.scale_regularization_loss``; the summed gradients then equal single-device gradients.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import assert_same_tensors, detached_state, from_every_replica, launch

STEPS = 20
B = 10
LAST_B = 3  # a short last global batch after the STEPS full ones
D_IN, D_HIDDEN, D_OUT = 6, 16, 3
L2 = 1e-3
REFERENCE_SEED = 1000  # replica r seeds REFERENCE_SEED + r; replica 0's init is broadcast

# name -> (optimizer factory, pass global_batch_size explicitly?)
VARIANTS = {
    "sgd": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), True),
    "adam": (lambda params: torch.optim.Adam(params, lr=0.01), True),
    # global_batch_size=None: the library finds B with a collective (uneven split included).
    "sgd_inferred_batch": (lambda params: torch.optim.SGD(params, lr=0.1), False),
}


def make_model():
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))


def make_data():
    """STEPS global batches of B examples, then one of LAST_B."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * B + LAST_B, D_IN, generator=g)
    y = torch.randint(0, D_OUT, (STEPS * B + LAST_B,), generator=g)
    return list(zip(torch.split(x, B), torch.split(y, B)))


def l2_term(model):
    return L2 * sum(p.pow(2).sum() for p in model.parameters())


def single_device_training(variant):
    make_optimizer, _ = VARIANTS[variant]
    torch.manual_seed(REFERENCE_SEED)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    init = detached_state(model)
    losses = []
    for x, y in make_data():
        loss = F.cross_entropy(model(x), y) + l2_term(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"init": init, "final": detached_state(model), "losses": losses}


def _replica_training(variants):
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    n = strategy.num_replicas_in_sync
    batches = make_data()
    out = {}
    for variant in variants:
        make_optimizer, explicit_batch = VARIANTS[variant]
        torch.manual_seed(REFERENCE_SEED + rank)  # a different init on every replica...
        with strategy.scope():
            model = make_model()
            optimizer = make_optimizer(model.parameters())
            before_broadcast = detached_state(model)
        init = detached_state(model)  # ...until the scope exits and replica 0's is broadcast

        def train_step(xb, yb, global_batch):
            per_example = F.cross_entropy(model(xb), yb, reduction="none")
            if explicit_batch:
                loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
            else:
                loss = ts.compute_average_loss(per_example)
            loss = loss + ts.scale_regularization_loss(l2_term(model))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        losses, local_batches = [], []
        for x, y in batches:
            xb = torch.tensor_split(x, n)[rank]
            yb = torch.tensor_split(y, n)[rank]
            local_batches.append(xb.shape[0])
            per_replica = strategy.run(train_step, args=(xb, yb, x.shape[0]))
            losses.append(strategy.reduce(ts.ReduceOp.SUM, per_replica, axis=None).item())
        out[variant] = {"before_broadcast": before_broadcast, "init": init,
                        "final": detached_state(model), "losses": losses,
                        "local_batches": (local_batches[0], local_batches[-1])}
    return from_every_replica(out)


@pytest.fixture(scope="module")
def references():
    return {variant: single_device_training(variant) for variant in VARIANTS}


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_mirrored_training_matches_single_device(num_replicas, references):
    per_replica = launch(_replica_training, list(VARIANTS), n=num_replicas)
    assert len(per_replica) == num_replicas
    if num_replicas == 4:
        assert [r["sgd"]["local_batches"] for r in per_replica] == \
            [(3, 1), (3, 1), (2, 1), (2, 0)]
    for variant, reference in references.items():
        for rank, results in enumerate(per_replica):
            got = results[variant]
            what = f"{variant} replica {rank}/{num_replicas}"
            # Different seeds gave different initial values; the broadcast made them replica
            # 0's (which equal the single-device model built with replica 0's seed).
            differs = any(not torch.equal(got["before_broadcast"][k], reference["init"][k])
                          for k in reference["init"])
            assert differs == (rank != 0), what
            assert_same_tensors(got["init"], reference["init"], what=what + " init")
            # The global loss (sum over replicas of the scaled losses) is the single-device loss.
            torch.testing.assert_close(torch.tensor(got["losses"]),
                                       torch.tensor(reference["losses"]), atol=1e-5, rtol=0)
            assert_same_tensors(got["final"], reference["final"], atol=1e-5, rtol=0,
                                what=what + " final")
            # Every replica ends with bit-identical parameters.
            assert_same_tensors(got["final"], per_replica[0][variant]["final"],
                                what=what + " vs replica 0")
        # Training really moved the parameters (the comparison above is not vacuous).
        moved = max((reference["final"][k] - reference["init"][k]).abs().max().item()
                    for k in reference["init"])
        assert moved > 1e-2, variant
