"""``ts.scale_mean_loss``: DDP's value and DDP's gradients, bit for bit, on 2 gloo replicas.

The returned loss keeps the mean loss's value (``loss.item()`` logs what DDP's program logs),
and only the gradient is averaged, where DDP averages it: the gradient reducer divides each
gradient by the number of replicas as it enters its bucket, before the SUM all-reduce. One
launch trains a model under MirroredStrategy beside the same model under
``DistributedDataParallel`` on the same process group and records, step by step, the logged
losses, the gradients and the weights:

- fp32, SGD with momentum and Adam, a DDP-style loop outside ``run`` and the same step
  inside ``strategy.run``;
- ``torch.autocast("cpu", dtype=torch.float16)`` with ``torch.amp.GradScaler("cpu")``,
  where one step overflows on replica 1 only, so that the scaler skips it on every replica
  (the reduced gradients carry the inf) and halves the scale;
- gradient accumulation: ``ts.accumulate``'s ``micro.scale_mean_loss`` against DDP's
  ``no_sync`` loop with ``loss / steps`` (DDP divides at the synchronising backward only);
- a term added outside the mean loss, whose bucket is launched before the mean loss's
  backward asks to average (so it is divided after its sum): averaged, as DDP averages
  every gradient;
- gradients kept without ``zero_grad`` over synchronised and ``no_sync`` backward passes:
  only the new gradients are averaged (DDP's sums to 1e-6: DDP averages what ``.grad``
  holds, a different rounding order).

CentralStorageStrategy's replica threads and ShardedStrategy (FSDP2) divide the loss's
gradient instead: the value logged is still the mean loss, the gradients the average (to
rounding).

Where no tolerance is named, the comparison is exact equality (NaN as NaN on both sides).
The fp16 run starts from a small loss scale (2**-8) so that its fp16 gradients come near
fp16's subnormal range: halving them inside the fp16 backward (the old ``loss / N``) then
rounds differently, and the test tells the two orders apart.
"""
import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import detached_state, from_every_replica, grads_of, launch

N = 2
D_IN, D_HIDDEN, D_OUT = 8, 32, 5
SEED = 123
LOCAL_B = 6
STEPS = 5
OVERFLOW_STEP = 2          # replica 1's input is scaled into fp16's overflow at this step
ACCUMULATE = 3
INITIAL_SCALE = 2.0 ** -8


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_HIDDEN),
                         nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))


def local_batches(count, rank, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return [(torch.randn(LOCAL_B, D_IN, generator=g),
             torch.randint(0, D_OUT, (LOCAL_B,), generator=g)) for _ in range(count)]


def pair(strategy, optimizer_class, **kwargs):
    """The same model under DDP and under `strategy`, each with its own optimizer."""
    reference = nn.parallel.DistributedDataParallel(make_model())
    with strategy.scope():
        model = make_model()
    return (reference, optimizer_class(reference.parameters(), **kwargs),
            model, optimizer_class(model.parameters(), **kwargs))


def record(log, name, loss, model):
    log.setdefault(name + "_losses", []).append(loss.item())
    log.setdefault(name + "_grads", []).append(grads_of(model))


def fp32_training(strategy, rank, optimizer_class, in_run, **kwargs):
    ddp, ddp_optimizer, model, optimizer = pair(strategy, optimizer_class, **kwargs)
    log = {}

    def step(x, y):
        loss = ts.scale_mean_loss(F.cross_entropy(model(x), y))
        loss.backward()
        record(log, "ours", loss, model)
        optimizer.step()
        optimizer.zero_grad()

    for x, y in local_batches(STEPS, rank, seed=1):
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        record(log, "ddp", loss, ddp.module)
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
        if in_run:
            strategy.run(step, args=(x, y))
        else:
            step(x, y)
    log["ddp_final"] = detached_state(ddp.module)
    log["ours_final"] = detached_state(model)
    return log


def fp16_training(strategy, rank):
    ddp, ddp_optimizer, model, optimizer = pair(strategy, torch.optim.Adam, lr=1e-3)
    # A small scale puts the fp16 gradients near fp16's subnormal range, where halving
    # them in the fp16 backward rounds differently from halving the fp32 sums (DDP).
    scalers = {name: torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE)
               for name in ("ddp", "ours")}
    log = {}
    for index, (x, y) in enumerate(local_batches(STEPS, rank, seed=2)):
        if index == OVERFLOW_STEP and rank == 1:
            x = x * 1e6     # beyond fp16's range: inf on this replica only
        for name, net, opt, convention in (("ddp", ddp, ddp_optimizer, lambda loss: loss),
                                           ("ours", model, optimizer, ts.scale_mean_loss)):
            scaler = scalers[name]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = convention(F.cross_entropy(net(x), y))
            scaler.scale(loss).backward()
            record(log, name, loss, ddp.module if net is ddp else net)
            scaler.step(opt)
            scaler.update()
            log.setdefault(name + "_scales", []).append(scaler.get_scale())
            opt.zero_grad()
    log["ddp_final"] = detached_state(ddp.module)
    log["ours_final"] = detached_state(model)
    return log


def accumulated_training(strategy, rank):
    ddp, ddp_optimizer, model, optimizer = pair(strategy, torch.optim.SGD, lr=0.1)
    batches = local_batches(STEPS * ACCUMULATE, rank, seed=3)
    log = {}
    for start in range(0, len(batches), ACCUMULATE):
        for i, (x, y) in enumerate(batches[start:start + ACCUMULATE]):
            ddp.require_backward_grad_sync = i == ACCUMULATE - 1
            loss = F.cross_entropy(ddp(x), y) / ACCUMULATE
            loss.backward()
            log.setdefault("ddp_losses", []).append(loss.item())
        log.setdefault("ddp_grads", []).append(grads_of(ddp.module))
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
    for micro in ts.accumulate(strategy, batches, ACCUMULATE):
        with micro:
            x, y = micro.batch
            loss = micro.scale_mean_loss(F.cross_entropy(model(x), y))
            loss.backward()
        log.setdefault("ours_losses", []).append(loss.item())
        if micro.is_last:
            log.setdefault("ours_grads", []).append(grads_of(model))
            optimizer.step()
            optimizer.zero_grad()
    log["ddp_final"] = detached_state(ddp.module)
    log["ours_final"] = detached_state(model)
    return log


class WithExtra(nn.Module):
    """A model and a large parameter (over 1 MiB: a bucket of its own, all-reduced first
    once the buckets follow the order gradients arrive in)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.extra = nn.Parameter(torch.linspace(-1, 1, 300_000))

    def forward(self, x):
        return self.net(x)


def extra_term_training(strategy, rank):
    """A term added outside the mean loss, built after it: autograd reaches its parameter
    (and launches its bucket) before the mean loss's backward asks to average, so that
    bucket is divided after its sum."""
    torch.manual_seed(SEED)
    ddp = nn.parallel.DistributedDataParallel(WithExtra())
    with strategy.scope():
        torch.manual_seed(SEED)
        model = WithExtra()
    log = {}
    weight = 0.01 * (rank + 1)   # differs per replica: a sum would not be the average
    for x, y in local_batches(3, rank, seed=4):
        loss = F.cross_entropy(ddp(x), y)
        (loss + weight * ddp.module.extra.square().sum()).backward()
        record(log, "ddp", loss, ddp.module)
        ddp.zero_grad()
        loss = ts.scale_mean_loss(F.cross_entropy(model(x), y))
        (loss + weight * model.extra.square().sum()).backward()
        record(log, "ours", loss, model)
        model.zero_grad()
    log["ddp_final"] = detached_state(ddp.module)
    log["ours_final"] = detached_state(model)
    return log


def gradients_kept_between_backwards(strategy, rank):
    """No zero_grad: two synchronised backward passes, then a no_sync one and a synchronised
    one; DDP averages what ``.grad`` holds, the reducer only the new gradients (the same
    sums, rounded in another order)."""
    ddp, _, model, _ = pair(strategy, torch.optim.SGD, lr=0.1)
    log = {}
    for index, (x, y) in enumerate(local_batches(4, rank, seed=7)):
        local = index == 2
        with ddp.no_sync() if local else contextlib.nullcontext():
            F.cross_entropy(ddp(x), y).backward()
        with strategy.extended.no_sync() if local else contextlib.nullcontext():
            ts.scale_mean_loss(F.cross_entropy(model(x), y)).backward()
        if not local:
            log.setdefault("ddp", []).append(grads_of(ddp.module))
            log.setdefault("ours", []).append(grads_of(model))
    return log


def _replica_checks():
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    out = {
        "sgd_outside_run": fp32_training(strategy, rank, torch.optim.SGD, in_run=False,
                                         lr=0.1, momentum=0.9),
        "adam_outside_run": fp32_training(strategy, rank, torch.optim.Adam, in_run=False,
                                          lr=1e-2),
        "sgd_in_run": fp32_training(strategy, rank, torch.optim.SGD, in_run=True, lr=0.1),
        "fp16_grad_scaler": fp16_training(strategy, rank),
        "accumulation": accumulated_training(strategy, rank),
        "extra_term": extra_term_training(strategy, rank),
        "kept_gradients": gradients_kept_between_backwards(strategy, rank),
    }
    return from_every_replica(out)


@pytest.fixture(scope="module")
def replicas():
    return launch(_replica_checks, n=N)


def same_losses(a, b):
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def assert_bit_identical(a, b, what):
    assert list(a) == list(b), what
    for key in a:
        assert (a[key] is None) == (b[key] is None), f"{what} {key}"
        if a[key] is not None:
            assert a[key].dtype == b[key].dtype, f"{what} {key}"
            # Exactly equal; NaN (the overflowing step's gradients) equal to NaN.
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{what} {key}: {m}")


def assert_equals_ddp(log, rank, case):
    assert same_losses(log["ours_losses"], log["ddp_losses"]), \
        (case, rank, log["ours_losses"], log["ddp_losses"])
    assert len(log["ours_grads"]) == len(log["ddp_grads"])
    for step, (ours, ddp) in enumerate(zip(log["ours_grads"], log["ddp_grads"])):
        assert_bit_identical(ours, ddp, f"{case} replica {rank} gradients of step {step}")
    assert_bit_identical(log["ours_final"], log["ddp_final"], f"{case} replica {rank} weights")


@pytest.mark.parametrize("case", ["sgd_outside_run", "adam_outside_run", "sgd_in_run"])
def test_fp32_logged_loss_gradients_and_weights_equal_ddp(replicas, case):
    for rank, r in enumerate(replicas):
        assert_equals_ddp(r[case], rank, case)
        assert all(math.isfinite(v) for v in r[case]["ours_losses"])


def test_the_logged_loss_is_the_mean_loss_not_a_scaled_one(replicas):
    # DDP's logged losses differ between the replicas (their own batches); ours are the same
    # values, not halved.
    for rank, r in enumerate(replicas):
        assert r["sgd_outside_run"]["ours_losses"] == r["sgd_outside_run"]["ddp_losses"]
    assert replicas[0]["sgd_outside_run"]["ours_losses"] != \
        replicas[1]["sgd_outside_run"]["ours_losses"]


def test_fp16_autocast_with_grad_scaler_equals_ddp_and_skips_the_overflow(replicas):
    for rank, r in enumerate(replicas):
        log = r["fp16_grad_scaler"]
        assert_equals_ddp(log, rank, "fp16")
        assert log["ours_scales"] == log["ddp_scales"]
        # The overflow on replica 1 reached both replicas through the sum: both skipped
        # the step and halved the scale.
        scales = [INITIAL_SCALE] + log["ours_scales"]
        assert scales[OVERFLOW_STEP + 1] == scales[OVERFLOW_STEP] / 2, scales
        assert all(scales[i + 1] == scales[i] for i in range(len(scales) - 1)
                   if i != OVERFLOW_STEP), scales
    assert math.isfinite(replicas[0]["fp16_grad_scaler"]["ours_losses"][OVERFLOW_STEP])
    assert not math.isfinite(replicas[1]["fp16_grad_scaler"]["ours_losses"][OVERFLOW_STEP])


def test_accumulate_equals_ddp_no_sync_loop(replicas):
    for rank, r in enumerate(replicas):
        assert_equals_ddp(r["accumulation"], rank, "accumulation")


def test_a_term_outside_the_mean_loss_is_averaged_as_ddp_averages_it(replicas):
    for rank, r in enumerate(replicas):
        assert_equals_ddp(r["extra_term"], rank, "extra term")


# -- strategies that reduce without the gradient reducer: the loss's gradient is divided ----
def one_device_mean_loss_grads(x, y):
    model = make_model()
    F.cross_entropy(model(x), y).backward()
    return grads_of(model)


def test_central_storage_replica_threads_average_and_log_the_mean_loss():
    strategy = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_model()
    (x0, y0), = local_batches(1, 0, seed=5)
    (x1, y1), = local_batches(1, 1, seed=5)
    logged = {}

    def step(x, y):
        mean = F.cross_entropy(model(x), y)
        loss = ts.scale_mean_loss(mean)
        logged[ts.get_replica_context().replica_id_in_sync_group] = (loss.item(), mean.item())
        loss *= 2.0     # a new tensor, not a view: it may be changed in place
        loss.backward()

    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: ((x0, y0), (x1, y1))[ctx.replica_id_in_sync_group])
    strategy.run(lambda batch: step(*batch), args=(inputs,))
    assert all(value == mean for value, mean in logged.values()) and len(logged) == 2
    want = one_device_mean_loss_grads(torch.cat([x0, x1]), torch.cat([y0, y1]))
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(grad, 2.0 * want[name], atol=1e-6, rtol=0)


def _sharded_against_ddp():
    strategy = ts.ShardedStrategy()
    rank = strategy.extended.replica_id
    ddp, ddp_optimizer, model, optimizer = pair(strategy, torch.optim.SGD, lr=0.1)
    log = {}
    for x, y in local_batches(STEPS, rank, seed=6):
        for name, net, opt, convention in (("ddp", ddp, ddp_optimizer, lambda loss: loss),
                                           ("ours", model, optimizer, ts.scale_mean_loss)):
            loss = convention(F.cross_entropy(net(x), y))
            loss.backward()
            log.setdefault(name + "_losses", []).append(loss.item())
            opt.step()
            opt.zero_grad()
    log["ddp_final"] = detached_state(ddp.module)
    log["ours_final"] = {k: v.full_tensor() for k, v in detached_state(model).items()}
    return from_every_replica(log)


def test_sharded_averages_and_logs_the_mean_loss():
    # FSDP2 reduce-scatters a SUM here; the loss's gradient is divided by the replicas
    # before the backward, so the weights equal DDP's up to that order's rounding.
    for rank, log in enumerate(launch(_sharded_against_ddp, n=N)):
        assert log["ours_losses"][0] == log["ddp_losses"][0], rank
        torch.testing.assert_close(log["ours_losses"], log["ddp_losses"], atol=1e-6, rtol=0)
        for key, want in log["ddp_final"].items():
            torch.testing.assert_close(log["ours_final"][key], want, atol=1e-6, rtol=0,
                                       msg=lambda m: f"replica {rank} {key}: {m}")


def test_gradients_kept_between_backwards_are_averaged_once(replicas):
    for rank, r in enumerate(replicas):
        log = r["kept_gradients"]
        assert len(log["ours"]) == len(log["ddp"]) == 3
        for step, (ours, ddp) in enumerate(zip(log["ours"], log["ddp"])):
            for name in ddp:
                torch.testing.assert_close(ours[name], ddp[name], atol=1e-6, rtol=0,
                                           msg=lambda m: f"replica {rank} {step} {name}: {m}")
