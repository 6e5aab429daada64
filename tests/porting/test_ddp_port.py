"""Porting a DDP program: the traps and frictions of the porting issue, on 2 gloo replicas.

One launch of two replicas checks, in order (each part on its own fresh strategy or model):

- a model built outside the scope and not adopted: the first ``run`` warns once
  (RuntimeWarning naming ``strategy.adopt``), later runs say nothing;
- ``strategy.adopt(model, optimizer)``: replicas that built different models (seeds) and
  optimizer states leave it identical, a Parameter replaced after adoption is mirrored too,
  no warning, and training equals one device;
- ``ts.compute_average_loss`` / ``ts.scale_mean_loss`` *outside* ``strategy.run`` (and in
  the scope's cross-replica context) scale for the live two-replica strategy: the summed
  gradient equals the one-device gradient of the global batch;
- a DDP-style loop with a mean loss and ``ts.scale_mean_loss`` equals
  ``DistributedDataParallel`` on the same process group, to 1e-6;
- ``ts.accumulate`` with 3 micro-batches per step and a short last group equals one device
  taking one step per group on the group's examples, and communicates once per group.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.strategies.data_parallel import DataParallelExtended
from torchstrategy.strategies.parameters import ParameterHandling
from tests.helpers.replicas import detached_state, from_every_replica, launch

N = 2
D_IN, D_HIDDEN, D_OUT = 6, 16, 3
SEED = 1000          # replica r builds its model with SEED + r; replica 0's wins
GLOBAL_B = 8
STEPS = 4
MICRO_B, MICRO_STEPS, ACCUMULATE = 4, 7, 3   # groups of 3, 3 and a short 1


def make_model():
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))


def seeded_model(seed):
    torch.manual_seed(seed)
    return make_model()


def batches(count, size, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, D_IN, generator=g), torch.randint(0, D_OUT, (size,), generator=g))
            for _ in range(count)]


def local_slice(batch, rank):
    return tuple(t.tensor_split(N)[rank] for t in batch)


def pre_adoption_step(model, optimizer, rank):
    """A step each replica takes alone before adopting (its own data): states differ."""
    ((x, y),) = batches(1, 5, 50 + rank)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def replace_bias(model, optimizer, rank):
    """A Parameter registered after adoption (as nanoGPT's crop_block_size does), then
    given to the optimizer."""
    model[2].bias = nn.Parameter(torch.full((D_OUT,), 0.1 * (rank + 1)))
    optimizer.add_param_group({"params": [model[2].bias]})


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _not_mirrored_warnings(caught):
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and "does not mirror" in str(w.message)]


def _replica_checks():
    out = {}
    # -- a model created outside the scope and not adopted: warned once --------------------
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    model = seeded_model(SEED + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def plain_step(x, y):
        ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                global_batch_size=GLOBAL_B).backward()
        optimizer.step()
        optimizer.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches(3, GLOBAL_B, 1):
            strategy.run(plain_step, args=local_slice(batch, rank))
    out["unadopted_warnings"] = _not_mirrored_warnings(caught)

    # -- adopting a model and its optimizer built outside the scope ---------------------------
    strategy = ts.MirroredStrategy()
    model = seeded_model(SEED + rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    pre_adoption_step(model, optimizer, rank)
    returned = strategy.adopt(model, optimizer)
    out["adopt_returns_module"] = returned is model
    out["adopted_init"] = detached_state(model)
    out["adopted_optimizer_state"] = [
        {k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    replace_bias(model, optimizer, rank)
    out["replaced_bias"] = model[2].bias.detach().clone()

    def adam_step(x, y):
        ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                global_batch_size=GLOBAL_B).backward()
        optimizer.step()
        optimizer.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches(STEPS, GLOBAL_B, 2):
            strategy.run(adam_step, args=local_slice(batch, rank))
    out["adopted_warnings"] = _not_mirrored_warnings(caught)
    out["adopted_final"] = detached_state(model)

    # -- loss scaling outside run, with the strategy live ------------------------------------
    with strategy.scope():
        model = seeded_model(SEED + rank)
    (batch,) = batches(1, GLOBAL_B, 3)
    x, y = local_slice(batch, rank)
    ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
    out["outside_run_grads"] = grads(model)
    model.zero_grad()
    with strategy.scope():      # cross-replica context
        ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
    out["in_scope_grads"] = grads(model)
    model.zero_grad()
    ts.scale_mean_loss(F.cross_entropy(model(x), y)).backward()
    out["mean_loss_grads"] = grads(model)

    # -- DDP's convention: mean loss, ts.scale_mean_loss, against DistributedDataParallel -----
    torch.manual_seed(SEED)
    reference = make_model()
    ddp = nn.parallel.DistributedDataParallel(reference)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with strategy.scope():
        model = seeded_model(SEED + rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in (local_slice(b, rank) for b in batches(STEPS, GLOBAL_B, 4)):
        F.cross_entropy(ddp(x), y).backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
        ts.scale_mean_loss(F.cross_entropy(model(x), y)).backward()
        optimizer.step()
        optimizer.zero_grad()
    out["ddp_final"] = detached_state(reference)
    out["mean_loss_final"] = detached_state(model)

    # -- gradient accumulation --------------------------------------------------------------
    with strategy.scope():
        model = seeded_model(SEED + rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = strategy.experimental_distribute_dataset(batches(MICRO_STEPS, MICRO_B, 5))

    def micro_step(batch, micro):
        x, y = batch
        micro.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()

    steps_before = strategy.extended.stats().steps
    groups = []
    for micro in ts.accumulate(strategy, dataset, steps=ACCUMULATE):
        with micro:
            strategy.run(micro_step, args=(micro.batch, micro))
        if micro.is_last:
            groups.append((micro.group_size, micro.group_examples))
            optimizer.step()
            optimizer.zero_grad()
    out["accumulation_groups"] = groups
    out["accumulation_synchronised_backwards"] = strategy.extended.stats().steps - steps_before
    out["accumulation_final"] = detached_state(model)
    return from_every_replica(out)


# -- single-device references ----------------------------------------------------------------
def adoption_reference():
    model = seeded_model(SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    pre_adoption_step(model, optimizer, 0)
    init = detached_state(model)
    state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    replace_bias(model, optimizer, 0)
    for x, y in batches(STEPS, GLOBAL_B, 2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return init, state, detached_state(model)


def full_batch_grads():
    model = seeded_model(SEED)
    ((x, y),) = batches(1, GLOBAL_B, 3)
    F.cross_entropy(model(x), y).backward()
    return grads(model)


def accumulation_reference():
    model = seeded_model(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = batches(MICRO_STEPS, MICRO_B, 5)
    for start in range(0, MICRO_STEPS, ACCUMULATE):
        group = micro[start:start + ACCUMULATE]
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return detached_state(model)


@pytest.fixture(scope="module")
def replicas():
    return launch(_replica_checks, n=N)


def close(a, b, atol, what):
    assert list(a) == list(b), what
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0,
                                   msg=lambda m: f"{what} {key}: {m}")


def test_model_outside_scope_warns_once_on_first_run(replicas):
    for rank, r in enumerate(replicas):
        assert len(r["unadopted_warnings"]) == 1, (rank, r["unadopted_warnings"])
        message = r["unadopted_warnings"][0]
        assert "'0.weight'" in message and "strategy.adopt(model, optimizer)" in message


def test_adopt_gives_the_guarantees_of_the_scope(replicas):
    init, state, final = adoption_reference()
    for rank, r in enumerate(replicas):
        assert r["adopt_returns_module"]
        assert r["adopted_warnings"] == []
        close(r["adopted_init"], init, 0, f"replica {rank} after adopt")
        for got, want in zip(r["adopted_optimizer_state"], state):
            close(got, want, 0, f"replica {rank} optimizer state")
        torch.testing.assert_close(r["replaced_bias"], torch.full((D_OUT,), 0.1))
        close(r["adopted_final"], final, 1e-6, f"replica {rank} adopted training")


def test_loss_scaling_outside_run_uses_the_live_strategy(replicas):
    want = full_batch_grads()
    for rank, r in enumerate(replicas):
        for key in ("outside_run_grads", "in_scope_grads", "mean_loss_grads"):
            close(r[key], want, 1e-6, f"replica {rank} {key}")


def test_mean_loss_loop_equals_ddp(replicas):
    for rank, r in enumerate(replicas):
        close(r["mean_loss_final"], r["ddp_final"], 1e-6, f"replica {rank} vs DDP")
    close(replicas[0]["ddp_final"], replicas[1]["ddp_final"], 0, "DDP replicas")


def test_accumulate_equals_one_device_on_the_large_batch(replicas):
    want = accumulation_reference()
    for rank, r in enumerate(replicas):
        assert r["accumulation_groups"] == [(3, 12.0), (3, 12.0), (1, 4.0)]
        assert r["accumulation_synchronised_backwards"] == 3
        close(r["accumulation_final"], want, 1e-6, f"replica {rank} accumulation")


def test_accumulate_and_scale_mean_loss_refuse_bad_input():
    with pytest.raises(ValueError, match=r"steps=0"):
        ts.accumulate(ts.get_strategy(), [], steps=0)
    with pytest.raises(TypeError, match="ts.Strategy"):
        ts.accumulate(None, [], steps=2)
    with pytest.raises(ValueError, match=r"scalar mean loss.*\[3\]"):
        ts.scale_mean_loss(torch.ones(3))
    with pytest.raises(NotImplementedError, match="inside `with strategy.scope\\(\\):`"):
        ts.CentralStorageStrategy(compute_devices=["cpu"]).adopt(make_model())
    with pytest.raises(NotImplementedError, match="_RecordsItsOwnWay cannot adopt"):
        _RecordsItsOwnWay().adopt(make_model())


class _RecordsItsOwnWay(ts.Strategy):
    """A data-parallel strategy whose parameter handling records parameters its own way (as
    the parameter-server strategy does): adoption must refuse rather than guess."""

    def __init__(self):
        comm = Communicator(None, 0, 1, torch.device("cpu"), ts.NcclAllReduce())

        class OwnRecording(ParameterHandling):
            def record_parameter(self, module, name, param):
                pass  # the scope records parameters its own way

            def settle(self):
                pass

        super().__init__(DataParallelExtended(self, comm, None, OwnRecording()))
