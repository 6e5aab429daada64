"""1-bit Adam (ts.OneBitAdam + ts.OneBitAdamW) on 2 real gloo replicas: the warm-up is
AdamW on the summed gradients, the variance freezes, error feedback keeps what the one-bit
momentum did not carry (sent + kept = true, over steps), gradient accumulation under
no_sync, a checkpoint resumed bit for bit, a state spread over another number of
replicas, the kernels against plain torch, bad arguments."""
import pytest
import torch

import torchstrategy as ts
from torchstrategy.collectives import onebit
from torchstrategy.collectives.error_feedback import ErrorFeedbackStage
from torchstrategy.collectives.stats import ReductionStats
from tests.helpers.replicas import from_every_replica, launch

STEPS = 7
WARMUP = 2
SAVE_AT = 3        # the checkpoint is taken after this step
NO_SYNC_STEP = 4   # this step accumulates two micro-batches under no_sync first
BETAS = (0.9, 0.99)
LR, DECAY = 0.01, 0.1
COMPRESSION = ts.OneBitAdam(betas=BETAS, eps=1e-8, warmup_steps=WARMUP, block_size=64)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _inputs(step, replica, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + micro)
    return torch.randn(8, 16, generator=g)


def _train(load=None):
    """STEPS steps on 2 replicas; every replica's records: per step its local gradient, the
    direction left in .grad, the parameters after the step and its reduction state."""
    strategy = ts.MirroredStrategy(cross_device_ops=ts.NcclAllReduce(compression=COMPRESSION))
    r = strategy.extended.replica_id
    with strategy.scope():
        model = _model()
    params = list(model.parameters())
    optimizer = ts.OneBitAdamW(params, lr=LR, weight_decay=DECAY)
    reducer = strategy.extended.gradient_reducer
    start, records, saved = 0, [], None
    initial = [p.detach().clone() for p in params]
    if load is not None:
        model.load_state_dict(load["model"])
        reducer.load_state_dict(load["reducer"])
        start = load["step"]
    for step in range(start, STEPS):
        micro = [_inputs(step, r, m) for m in range(2 if step == NO_SYNC_STEP else 1)]
        loss = lambda x: model(x).pow(2).sum()
        local = [sum(gs) for gs in zip(*[torch.autograd.grad(loss(x), params) for x in micro])]
        optimizer.zero_grad()
        if len(micro) > 1:
            with strategy.extended.no_sync():
                loss(micro[0]).backward()
        loss(micro[-1]).backward()
        direction = [p.grad.clone() for p in params]
        optimizer.step()
        records.append((local, direction, [p.detach().clone() for p in params],
                        reducer.state_dict()["error_feedback"][r]))
        if step == SAVE_AT:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "reducer": reducer.state_dict(), "step": step + 1}
    return from_every_replica((initial, records, saved, tuple(strategy.extended.stats())))


@pytest.fixture(scope="module")
def run():
    return launch(_train, n=2)


def _true_sums(run, step):
    return [a + b for a, b in zip(run[0][1][step][0], run[1][1][step][0])]


def test_warmup_is_adamw_on_the_summed_gradients(run):
    initial = run[0][0]
    reference = [p.clone().requires_grad_() for p in initial]
    adamw = torch.optim.AdamW(reference, lr=LR, betas=BETAS, eps=1e-8, weight_decay=DECAY,
                              foreach=False)
    for step in range(WARMUP):
        for p, g in zip(reference, _true_sums(run, step)):
            p.grad = g
        adamw.step()
        for replica in run:   # both replicas, each parameter: AdamW's, to float rounding
            for got, want in zip(replica[1][step][2], reference):
                torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


def test_moments_are_shared_and_the_variance_freezes(run):
    states = [[rec[3] for rec in replica[1]] for replica in run]
    for step in range(STEPS):
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = states[0][step]["onebit"][key], states[1][step]["onebit"][key]
            assert all(torch.equal(a[i], b[i]) for i in a), (step, key)
        assert states[0][step]["step"] == step + 1   # the no_sync backward is not counted
    frozen = states[0][WARMUP - 1]["onebit"]["exp_avg_sq"]
    for step in range(WARMUP, STEPS):
        v = states[0][step]["onebit"]["exp_avg_sq"]
        assert all(torch.equal(v[i], frozen[i]) for i in v)
    # After the warm-up the direction is the shared momentum over the frozen denominator.
    beta1, beta2 = BETAS
    for step in range(WARMUP, STEPS):
        m = states[0][step]["onebit"]["exp_avg"]
        for i, d in enumerate(run[0][1][step][1]):
            denominator = frozen[i].sqrt() / (1 - beta2 ** WARMUP) ** 0.5 + 1e-8
            want = m[i] / denominator / (1 - beta1 ** (step + 1))
            torch.testing.assert_close(d.reshape(-1), want, rtol=1e-5, atol=1e-6)
            assert torch.equal(run[1][1][step][1][i], d)   # every replica applies it


def test_error_feedback_keeps_what_one_bit_did_not_carry(run):
    """Per element: the momentum increments sent after the warm-up plus every replica's
    error now equal (1 - beta1) times the sum of the true gradients since."""
    beta1 = BETAS[0]
    states = [rec[3] for rec in run[0][1]]
    for i in range(len(run[0][0])):
        sent = sum(states[t]["onebit"]["exp_avg"][i] - beta1 * states[t - 1]["onebit"][
            "exp_avg"][i] for t in range(WARMUP, STEPS))
        kept = sum(replica[1][-1][3]["residuals"][i] for replica in run)
        true = (1 - beta1) * sum(_true_sums(run, t)[i].reshape(-1) for t in range(WARMUP, STEPS))
        torch.testing.assert_close(sent + kept, true, rtol=0, atol=2e-5)
        # One bit is far from exact: the error is not small, it is kept.
        assert kept.abs().max() > 1e-3


def test_stats_count_signs_and_scales(run):
    stats = dict(zip(ReductionStats._fields, run[0][3]))
    assert stats["compression"] == repr(COMPRESSION)
    # 483 gradient elements and 4 flags in one bucket: a sign (1/8 byte) an element and a
    # float per 64 elements, instead of 4 bytes an element.
    assert 15 < stats["compression_ratio"] < 32


def test_checkpoint_resume_equals_uninterrupted_run(run):
    saved = run[0][2]
    resumed = launch(_train, saved, n=2)
    for replica, again in zip(run, resumed):
        for got, want in zip(again[1][-1][2], replica[1][-1][2]):
            assert torch.equal(got, want)


def test_a_state_spreads_over_another_number_of_replicas(run):
    """Loaded into 3 replicas (or 1): each takes a third of what both errors owe; the
    moments, the same everywhere, carry over."""
    states = [replica[1][-1][3] for replica in run]
    for world in (1, 3):
        spread = ErrorFeedbackStage.spread_over(states, world)
        for i, total in ((i, states[0]["residuals"][i] + states[1]["residuals"][i])
                         for i in states[0]["residuals"]):
            torch.testing.assert_close(spread["residuals"][i] * world, total)
        assert spread["onebit"] is states[0]["onebit"] and spread["step"] == STEPS
        stage = ErrorFeedbackStage(COMPRESSION)
        stage.load_state_dict(spread)
        assert stage.step == STEPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_plain_torch(dtype):
    g = torch.Generator().manual_seed(0)
    block, padded, size = 64, 640, 600
    error = torch.randn(padded, generator=g) * 0.1
    error[size:] = 0
    m = torch.randn(padded, generator=g)
    m[size:] = 0
    grad = torch.randn(size, generator=g).to(dtype)
    x = error.clone()
    x.add_(m, alpha=0.45)
    x.narrow(0, 0, size).add_(grad.float(), alpha=0.1)
    x_ref = x.clone()
    bits_ref, scales_ref = onebit.compress_reference(x_ref, block)
    e = error.clone()
    bits = torch.empty(padded // 8, dtype=torch.uint8)
    scales = torch.empty(padded // block)
    torch.ops.torchstrategy.onebit_compress(e, m, grad, 0.45, 0.1, bits, scales, block)
    assert torch.equal(bits, bits_ref)
    torch.testing.assert_close(scales, scales_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(e, x_ref, rtol=0, atol=1e-5)
    # sign * scale + kept error = the compensated momentum
    signs = torch.where((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1 == 1, 1.0,
                        -1.0).view(-1)
    torch.testing.assert_close(signs * scales.repeat_interleave(block) + e, x, rtol=0,
                               atol=1e-5)
    all_bits, all_scales = torch.stack([bits, ~bits]), torch.stack([scales, 2 * scales])
    want = torch.empty(padded)
    onebit.decompress_reference(all_bits, all_scales, want, block)
    torch.testing.assert_close(want, signs * scales.repeat_interleave(block) * -1, rtol=0,
                               atol=1e-6)
    inverse = torch.rand(padded, generator=g)
    got_m, out = torch.empty(padded), torch.empty(size, dtype=dtype)
    torch.ops.torchstrategy.onebit_decompress(all_bits, all_scales, got_m, inverse, 0.5, out,
                                              block)
    assert torch.equal(got_m, want)
    assert torch.equal(out, (want[:size] * inverse[:size] * 0.5).to(dtype))
    with pytest.raises(RuntimeError, match="block must be a positive multiple of 8"):
        torch.ops.torchstrategy.onebit_compress(e, m, grad, 0.1, 0.1, bits, scales, 12)


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
        ts.OneBitAdam(betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
        ts.OneBitAdam(warmup_steps=0)
    with pytest.raises(ValueError, match="block_size must be a multiple of 8"):
        ts.OneBitAdam(block_size=100)
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        ts.OneBitAdam(eps=-1.0)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="leaves in .grad, but .* runs compression=None"):
        ts.OneBitAdamW(model.parameters())   # the default strategy: one replica, no compression
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        ts.OneBitAdamW(model.parameters(), lr=-1.0)
