"""Error-feedback compression during backward (``overlap=True``) on 2 real gloo replicas,
against the same compressor run after backward (the default): PowerSGD and 1-bit Adam give
the same bits, Int8 keeps the error-feedback identity; a bucket is compressed and sent
before backward has finished; parameters used on one replica only, or on none, keep what
error feedback owes them; no_sync accumulation, the mean loss and several buckets."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import from_every_replica, launch

STEPS = 6
NO_SYNC_STEP = 3      # two micro-batches, the first under no_sync
SPARE_IDLE = (2, 4)   # steps at which no replica uses `spare`
WIDTH = 24


class _Net(torch.nn.Module):
    """Five layers, so that small buckets make several; `side` is used on replica 0 at odd
    steps only, `spare` by no replica at SPARE_IDLE."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, WIDTH)
        self.mid = torch.nn.Linear(WIDTH, WIDTH)
        self.side = torch.nn.Linear(WIDTH, WIDTH)
        self.spare = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, 3)

    def forward(self, x, use_side, use_spare):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        if use_side:
            h = h + torch.tanh(self.side(h))
        if use_spare:
            h = h + torch.tanh(self.spare(h))
        return self.out(h)


def _inputs(step, replica, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + micro)
    return torch.randn(8, 16, generator=g)


_COMPRESSORS = {
    "powersgd": lambda overlap: ts.PowerSGD(rank=2, warmup_steps=1, seed=3, overlap=overlap),
    "int8": lambda overlap: ts.Int8(chunk_size=64, overlap=overlap),
    "onebit": lambda overlap: ts.OneBitAdam(warmup_steps=2, block_size=64, overlap=overlap),
}


def _train(which, overlap):
    """STEPS steps; per step and replica: this replica's local gradients (mean-loss units),
    the .grad left after backward, the bytes the stage had sent when backward reached the
    first layer, and the residuals; then the final parameters."""
    compression = _COMPRESSORS[which](overlap)
    strategy = ts.MirroredStrategy(cross_device_ops=ts.NcclAllReduce(compression=compression))
    r = strategy.extended.replica_id
    with strategy.scope():
        torch.manual_seed(0)
        model = _Net()
    params = list(model.parameters())
    optimizer = ts.OneBitAdamW(params, lr=0.01) if which == "onebit" else \
        torch.optim.SGD(params, lr=0.05)
    reducer = strategy.extended.gradient_reducer
    reducer.rebucket(bucket_cap_bytes=1024, first_bucket_bytes=512)   # about a layer each
    # Counts every byte the stage sends (white-box: its one accounting call).
    stage = reducer._error_feedback
    count = stage._sent
    sent = [0]

    def counted(*tensors):
        sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        count(*tensors)
    stage._sent = counted
    sent_before_first_layer = []
    model.inp.register_full_backward_pre_hook(
        lambda module, grad: sent_before_first_layer.append(sent[0]))
    records = []
    for step in range(STEPS):
        use_side = r == 0 and step % 2 == 1
        use_spare = step not in SPARE_IDLE
        micro = [_inputs(step, r, m) for m in range(2 if step == NO_SYNC_STEP else 1)]

        def plain_loss(x):
            return F.mse_loss(model(x, use_side, use_spare), torch.zeros(x.shape[0], 3))

        def loss(x):
            return ts.scale_mean_loss(plain_loss(x))
        # This replica's part of the mean over the 2 replicas (a division by 2 is exact).
        local = [torch.zeros_like(p) for p in params]
        for x in micro:
            grads = torch.autograd.grad(plain_loss(x), params, allow_unused=True)
            for acc, g in zip(local, grads):
                if g is not None:
                    acc.add_(g / 2)
        optimizer.zero_grad()
        if len(micro) > 1:
            with strategy.extended.no_sync():
                loss(micro[0]).backward()
        before = sent[0]
        loss(micro[-1]).backward()
        records.append({
            "local": local,
            "grad": [None if p.grad is None else p.grad.clone() for p in params],
            "sent_early": sent_before_first_layer[-1] - before,
            "state": reducer.state_dict()["error_feedback"][r]})
        optimizer.step()
    return from_every_replica((records, [p.detach().clone() for p in params]))


def _both(which):
    return {overlap: _train(which, overlap) for overlap in (False, True)}


def _all(jobs):
    return {which: _both(which) for which in jobs}


@pytest.fixture(scope="module")
def runs():
    return launch(_all, list(_COMPRESSORS), n=2)


SPARE = 6   # registration index of spare.weight (inp, mid, side: weight and bias each)


def _assert_same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
    else:
        assert torch.equal(a, b), f"{what}: largest difference {(a - b).abs().max()}"


@pytest.mark.parametrize("which", ["powersgd", "onebit"])
def test_overlapped_compression_gives_the_same_bits(runs, which):
    # PowerSGD's matrices and 1-bit Adam's blocks do not depend on one another's presence,
    # so compressing before the flags are summed changes nothing but when it runs.
    after, during = runs[which][False], runs[which][True]
    for r in range(2):
        for step in range(STEPS):
            a, b = after[r][0][step], during[r][0][step]
            for k, (x, y) in enumerate(zip(a["grad"], b["grad"])):
                _assert_same(x, y, f"replica {r} step {step} .grad {k}")
            for key in ("residuals",) + (("q",) if which == "powersgd" else ("onebit",)):
                sa, sb = a["state"][key], b["state"][key]
                if key == "onebit":
                    sa, sb = sa["exp_avg"], sb["exp_avg"]
                # A matrix first seen when no replica used it gets a zero residual early.
                for i in sa:
                    _assert_same(sa[i], sb[i], f"replica {r} step {step} {key} {i}")
        for k, (x, y) in enumerate(zip(after[r][1], during[r][1])):
            _assert_same(x, y, f"replica {r} final parameter {k}")


def test_overlapped_int8_keeps_the_error_feedback_identity(runs):
    # Int8 quantises whole chunks, across parameters: a parameter this replica did not
    # contribute sends nothing from it while backward runs (its residual waits), so the
    # bits differ from the deferred run where another replica used it; what error feedback
    # owes is still never lost: applied sums + residuals = true sums.
    for overlap in (False, True):
        records = [rec for rec, _ in runs["int8"][overlap]]
        final = [rec[-1]["state"]["residuals"] for rec in records]
        for i in range(len(records[0][0]["local"])):
            true = sum(records[r][t]["local"][i] for r in range(2) for t in range(STEPS))
            applied = sum(records[0][t]["grad"][i] for t in range(STEPS)
                          if records[0][t]["grad"][i] is not None)
            kept = sum(res[i].view(true.shape) for res in final if i in res)
            torch.testing.assert_close(applied + kept, true, rtol=0, atol=1e-5,
                                       msg=lambda m: f"overlap={overlap} parameter {i}: {m}")


@pytest.mark.parametrize("which", list(_COMPRESSORS))
def test_a_parameter_no_replica_used_keeps_its_state(runs, which):
    for overlap in (False, True):
        records = runs[which][overlap][0][0]
        for step in SPARE_IDLE:
            assert records[step]["grad"][SPARE] is None, (overlap, step)
            before = records[step - 1]["state"]["residuals"].get(SPARE)
            _assert_same(records[step]["state"]["residuals"].get(SPARE), before,
                         f"{which} overlap={overlap}: spare's residual at step {step}")
            if which == "powersgd":
                _assert_same(records[step]["state"]["q"].get(SPARE),
                             records[step - 1]["state"]["q"].get(SPARE),
                             f"overlap={overlap}: spare's Q at step {step}")


@pytest.mark.parametrize("which", list(_COMPRESSORS))
def test_with_overlap_buckets_are_sent_while_backward_runs(runs, which):
    # When backward reaches the first layer, the output layer's bucket has been
    # compressed and sent with overlap, and nothing has without it. Step 0 lays the
    # buckets out in arrival order (the output layer's first, with `spare`'s: at
    # SPARE_IDLE it waits, and the buckets after it, until backward has finished).
    for step in range(STEPS):
        if step > 0 and step not in SPARE_IDLE:
            assert runs[which][True][0][0][step]["sent_early"] > 0, step
        assert runs[which][False][0][0][step]["sent_early"] == 0, step


def test_overlap_is_a_setting_shown_and_checked_but_not_part_of_the_state():
    # Each compressor's default is the one measured faster: on for Int8, off for the others.
    assert ts.Int8().overlap and not ts.PowerSGD().overlap and not ts.OneBitAdam().overlap
    assert repr(ts.Int8()) == "Int8(chunk_size=1024, warmup_steps=0)"
    assert repr(ts.Int8(overlap=False)) == "Int8(chunk_size=1024, warmup_steps=0, overlap=False)"
    assert repr(ts.PowerSGD(overlap=True)) == \
        "PowerSGD(rank=4, warmup_steps=0, seed=0, overlap=True)"
    assert ts.PowerSGD(overlap=True) != ts.PowerSGD()
    assert ts.PowerSGD(overlap=True).state_tag() == ts.PowerSGD().state_tag()
    assert ts.Int8(overlap=False).state_tag() == "Int8(chunk_size=1024, warmup_steps=0)"
    for make in (ts.PowerSGD, ts.Int8, ts.OneBitAdam):
        with pytest.raises(ValueError, match="overlap must be True or False"):
            make(overlap=1)
