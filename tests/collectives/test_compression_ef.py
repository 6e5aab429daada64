"""Error-feedback gradient compression (ts.PowerSGD, ts.Int8): the C++ kernels against plain
torch, PowerSGD's sums against a plain-torch PowerSGD on 2 real replicas, the error-feedback
identity, warm-up, small tensors, no_sync accumulation, checkpoint resume, stats, bad
arguments."""
import json
import logging
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

import torchstrategy as ts
from torchstrategy import _ops
from torchstrategy.collectives.compression import GradBucket, with_compression
from torchstrategy.collectives.error_feedback import ErrorFeedbackStage, initial_q
from torchstrategy.collectives.stats import ReductionStats
from tests.helpers.replicas import from_every_replica, launch

STEPS = 5
SAVE_AT = 2        # the checkpoint is taken after this step
NO_SYNC_STEP = 3   # this step accumulates two micro-batches under no_sync first


# -- the kernels --------------------------------------------------------------------------
def _quantize_reference(grad, residual, chunk):
    c = grad.float().reshape(-1) + residual
    n = c.numel()
    chunks = -(-n // chunk)
    padded = torch.cat([c, c.new_zeros(chunks * chunk - n)]).view(chunks, chunk)
    scales = padded.abs().amax(1) / 127
    per = scales.repeat_interleave(chunk)[:n]
    levels = torch.where(per > 0, torch.round(c / per), torch.zeros_like(c)).clamp(-127, 127)
    return levels.to(torch.int8), scales, c - levels * per


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n,chunk", [(1, 4), (1000, 64), (5000, 1024), (300, 7)])
def test_quantize_kernel_matches_plain_torch(dtype, n, chunk):
    g = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=g) * 3).to(dtype)
    if n >= 2 * chunk:
        grad[chunk:2 * chunk] = 0   # an all-zero chunk: scale 0, levels 0
    residual = torch.randn(n, generator=g) * 0.01
    q_ref, s_ref, r_ref = _quantize_reference(grad, residual.clone(), chunk)
    for op in (_ops.ef_quantize_int8, torch.ops.torchstrategy.ef_quantize_int8_reference):
        r = residual.clone()
        q = torch.empty(n, dtype=torch.int8)
        s = torch.empty(-(-n // chunk))
        op(grad, r, q, s, chunk)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
        torch.testing.assert_close(r, r_ref, rtol=0, atol=1e-6)
        # What was sent plus what was kept is the compensated gradient.
        torch.testing.assert_close(q.float() * s.repeat_interleave(chunk)[:n] + r,
                                   grad.float() + residual, rtol=0, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_sum_matches_plain_torch(out_dtype):
    g = torch.Generator().manual_seed(0)
    n, chunk, replicas = 777, 100, 3
    q = torch.randint(-127, 128, (replicas, n), generator=g).to(torch.int8)
    scales = torch.rand(replicas, 8, generator=g)
    expected = torch.zeros(n)
    for r in range(replicas):
        expected += q[r].float() * scales[r].repeat_interleave(chunk)[:n]
    for op in (_ops.dequantize_sum, torch.ops.torchstrategy.dequantize_sum_reference):
        out = torch.empty(n, dtype=out_dtype)
        op(q, scales, out, chunk)
        assert torch.equal(out, expected.to(out_dtype))


def test_kernels_refuse_bad_shapes():
    with pytest.raises(RuntimeError, match="residual must be a contiguous float tensor"):
        _ops.ef_quantize_int8(torch.ones(4), torch.ones(3), torch.empty(4, dtype=torch.int8),
                              torch.empty(1), 4)
    with pytest.raises(RuntimeError, match="chunk must be positive"):
        _ops.dequantize_sum(torch.zeros(1, 4, dtype=torch.int8), torch.ones(1, 1),
                            torch.empty(4), 0)


@pytest.mark.parametrize("rank", [1, 2, 4, 8, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_batched_finish_gives_each_matrix_the_bits_of_its_own_call(rank, out_dtype):
    # Ranks 1, 2, 4, 8 take the fused loops (parallel over every matrix's rows together);
    # 3 and a bf16 bucket the per-matrix fallback. Several threads: tasks cut across the
    # matrices' borders.
    g = torch.Generator().manual_seed(rank)
    count, rows, cols = 5, 300, 70
    residual = torch.randn(count, rows, cols, generator=g)
    p = torch.linalg.qr(torch.randn(count, rows, rank, generator=g)).Q.contiguous()
    q_local_t = torch.randn(count, rank, cols, generator=g)
    q_t = torch.randn(count, rank, cols, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        batched, out = residual.clone(), torch.empty(count, rows, cols, dtype=out_dtype)
        _ops.powersgd_finish_batched(batched, p, q_local_t, q_t, out)
        for b in range(count):
            alone, out_alone = residual[b].clone(), torch.empty(rows, cols, dtype=out_dtype)
            _ops.powersgd_finish(alone, p[b], q_local_t[b], q_t[b], out_alone)
            assert torch.equal(batched[b], alone) and torch.equal(out[b], out_alone), b
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="q_local_t must be 5 x 3 x 70"):
        _ops.powersgd_finish_batched(batched, p[:, :, :1].expand(5, 300, 3), q_local_t[:, :1],
                                     q_t[:, :1].expand(5, 3, 70), out)


# -- 2 replicas ---------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    # 48x32 and 3x48: compressed at rank 2; 2x3 (2*(2+3) > 6) and the biases: not.
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _inputs(step, replica, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + micro)
    return torch.randn(8, 32, generator=g)


def _train(compression, load=None):
    """Trains STEPS steps (SGD) on 2 replicas; returns every replica's records: per step the
    local (true) gradients and the applied (reduced) ones, the state saved after SAVE_AT,
    the final parameters and reducer state, the stats."""
    strategy = ts.MirroredStrategy(cross_device_ops=ts.NcclAllReduce(compression=compression))
    r = strategy.extended.replica_id
    with strategy.scope():
        model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05)
    reducer = strategy.extended.gradient_reducer
    start = 0
    if load is not None:
        model.load_state_dict(load["model"][r])
        reducer.load_state_dict(load["reducer"][r])
        start = load["step"]
    records, saved = [], None
    for step in range(start, STEPS):
        micro = [_inputs(step, r, m) for m in range(2 if step == NO_SYNC_STEP else 1)]
        loss = lambda x: model(x).pow(2).sum()
        local = [sum(gs) for gs in zip(*[torch.autograd.grad(loss(x), params) for x in micro])]
        optimizer.zero_grad()
        if len(micro) > 1:
            with strategy.extended.no_sync():
                loss(micro[0]).backward()
        loss(micro[-1]).backward()
        records.append(([t.clone() for t in local], [p.grad.clone() for p in params],
                        reducer.state_dict()["error_feedback"][r]["residuals"]))
        optimizer.step()
        if step == SAVE_AT:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "reducer": reducer.state_dict(), "step": step + 1}
    stats = strategy.extended.stats()
    # The "contributed" flags of the last step, as the stages read them (white-box: the
    # reducer's core holds them).
    flags = reducer._core.flags().tolist()
    return from_every_replica((records, saved, [p.detach().clone() for p in params],
                               reducer.state_dict()["error_feedback"][r], tuple(stats),
                               flags))


def _reference_powersgd(records, rank, warmup, seed):
    """Plain-torch PowerSGD with error feedback (sums, local residuals, warm start)."""
    replicas = len(records)
    shapes = [g.shape for g in records[0][0][0]]
    residual = {}
    qs = {}
    applied = []
    for step in range(len(records[0])):
        local = [records[r][step][0] for r in range(replicas)]
        out = []
        for i, shape in enumerate(shapes):
            total = sum(local[r][i] for r in range(replicas))
            rows = shape[0]
            cols = total.numel() // rows
            if step < warmup or len(shape) < 2 or rank * (rows + cols) >= rows * cols:
                out.append(total)
                continue
            ms = [local[r][i].reshape(rows, cols) + residual.get((r, i), 0)
                  for r in range(replicas)]
            q = qs.get(i, initial_q(seed, i, cols, rank))
            p = torch.linalg.qr(sum(m @ q for m in ms), mode="reduced").Q
            # M^T P as the implementation computes it, (P^T M)^T (5-50x faster on CPU than
            # m.t() @ p); the two round differently, by ~1e-7 relative.
            q_locals = [(p.t() @ m).t() for m in ms]
            for r, (m, ql) in enumerate(zip(ms, q_locals)):
                residual[(r, i)] = m - p @ ql.t()
            qs[i] = sum(q_locals)
            out.append((p @ qs[i].t()).reshape(shape))
        applied.append(out)
    return applied


# -- the shared launches --------------------------------------------------------------
# Every 2-replica scenario of this file runs in one of two launches (each process start
# costs seconds of imports): the first trains, the second resumes from what the first
# saved, in fresh processes as a restarted job does. Each scenario runs under its own
# try/except, so one that fails is reported by its own tests with its own traceback, and
# the others still run and are checked.
_COMPRESSIONS = {"powersgd": lambda: ts.PowerSGD(rank=2, warmup_steps=1, seed=3),
                 "int8": lambda: ts.Int8(chunk_size=64)}
_BF16_COMPRESSIONS = {"powersgd": lambda: ts.PowerSGD(rank=2),
                      "int8": lambda: ts.Int8(chunk_size=64)}


class _Failed:
    """A scenario that raised inside a replica: its traceback, to be reported by its tests."""

    def __init__(self, where):
        self.where = where


def _scenarios(jobs):
    """Inside a replica: runs each (name, fn) in turn; returns {name: fn() or _Failed}. A
    scenario's result is what its function returns on replica 0 (the functions gather
    every replica's part themselves)."""
    outcomes = {}
    for name, fn in jobs:
        try:
            outcomes[name] = fn()
        except Exception:
            outcomes[name] = _Failed(f"replica {dist.get_rank()}: {traceback.format_exc()}")
    return outcomes


def _outcome(outcomes, name):
    if name not in outcomes:
        pytest.fail(f"scenario {name!r} did not run: the run it resumes failed", pytrace=False)
    result = outcomes[name]
    if isinstance(result, _Failed):
        pytest.fail(f"scenario {name!r} raised in a replica:\n{result.where}", pytrace=False)
    return result


def _first_job(directory):
    return _scenarios(
        [(name, lambda make=make: _train(make())) for name, make in _COMPRESSIONS.items()]
        + [(f"bf16_{name}", lambda make=make: _bf16_mean(make()))
           for name, make in _BF16_COMPRESSIONS.items()]
        + [("stage_runs", _stage_runs)]
        + [("backup_uninterrupted", lambda: _backup_run(os.path.join(directory, "a"), None)),
           ("backup_preempted", lambda: _backup_run(os.path.join(directory, "b"), 4))])


def _resume_job(directory, saved):
    return _scenarios(
        [(f"resume_{name}", lambda make=make, name=name: _train(make(), saved[name]))
         for name, make in _COMPRESSIONS.items() if saved[name] is not None]
        + [("backup_resumed", lambda: _backup_run(os.path.join(directory, "b"), None))])


@pytest.fixture(scope="module")
def first_launch(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("compression_ef"))
    return directory, launch(_first_job, directory, n=2)


@pytest.fixture(scope="module")
def powersgd_run(first_launch):
    return _outcome(first_launch[1], "powersgd")


@pytest.fixture(scope="module")
def int8_run(first_launch):
    return _outcome(first_launch[1], "int8")


def _saved(run):
    """What a run saved after SAVE_AT, as a checkpoint every replica loads."""
    return {"model": [s["model"] for _, s, *_ in run],
            "reducer": [run[0][1]["reducer"]] * 2, "step": run[0][1]["step"]}


@pytest.fixture(scope="module")
def resume_launch(first_launch):
    directory, outcomes = first_launch
    saved = {name: None if isinstance(outcomes[name], _Failed) else _saved(outcomes[name])
             for name in _COMPRESSIONS}
    return launch(_resume_job, directory, saved, n=2)


def _check_error_feedback_identity(run):
    """Applied sums over steps plus every replica's final residual = true sums over steps."""
    records = [rec for rec, *_ in run]
    residuals = [replica[3]["residuals"] for replica in run]   # the final reducer state
    n_params = len(records[0][0][0])
    for i in range(n_params):
        true = sum(records[r][t][0][i] for r in range(len(run)) for t in range(STEPS))
        applied = sum(records[0][t][1][i] for t in range(STEPS))
        kept = sum(res[i].reshape(true.shape) for res in residuals if i in res)
        torch.testing.assert_close(applied + kept, true, rtol=0, atol=2e-4)


def test_powersgd_equals_plain_torch_powersgd_on_2_replicas(powersgd_run):
    records = [rec for rec, *_ in powersgd_run]
    reference = _reference_powersgd(records, rank=2, warmup=1, seed=3)
    for step in range(STEPS):
        for r in range(2):   # every replica applies the same gradient
            for got, want in zip(records[r][step][1], reference[step]):
                # float32 products in another order, through 5 steps of residuals and QR
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _paper_powersgd(records, rank, warmup, seed):
    """PowerSGD as Vogels et al. (2019, Algorithm 1) and torch's DDP hook write it: *means*
    over W replicas and the residual against the shared decompressed mean,
    e_w = M_w - P mean_w(Q_w)^T, with that mean kept as the next warm start. Written
    independently of `_reference_powersgd`."""
    replicas = len(records)
    residual, qs, applied = {}, {}, []
    for step in range(len(records[0])):
        out = []
        for i, shape in enumerate(g.shape for g in records[0][0][0]):
            grads = [records[r][step][0][i] for r in range(replicas)]
            rows, cols = shape[0], grads[0].numel() // shape[0]
            if step < warmup or len(shape) < 2 or rank * (rows + cols) >= rows * cols:
                out.append(sum(grads) / replicas)
                continue
            ms = [g.reshape(rows, cols) + residual.get((r, i), 0) for r, g in enumerate(grads)]
            q = qs.get(i, initial_q(seed, i, cols, rank))
            p = torch.linalg.qr(sum(m @ q for m in ms) / replicas, mode="reduced").Q
            qs[i] = sum(m.t() @ p for m in ms) / replicas
            mean = p @ qs[i].t()
            for r, m in enumerate(ms):
                residual[(r, i)] = m - mean
            out.append(mean.reshape(shape))
        applied.append(out)
    return applied


def test_powersgd_applies_what_the_papers_residual_form_applies(powersgd_run):
    """Our residual, M_w - P Q_w^T (each replica keeps what its own term missed), differs
    replica by replica from the paper's and DDP's M_w - P mean(Q)^T, but the two sum to
    the same over replicas, and P and Q depend on the replicas' M only through their sum:
    the applied gradients are the same (ours is the sum, the paper's the mean)."""
    records = [rec for rec, *_ in powersgd_run]
    paper = _paper_powersgd(records, rank=2, warmup=1, seed=3)
    for step in range(STEPS):
        for got, mean in zip(records[0][step][1], paper[step]):
            torch.testing.assert_close(got, 2 * mean, rtol=1e-4, atol=1e-5)


def test_powersgd_warmup_and_small_tensors_are_exact_sums(powersgd_run):
    records = [rec for rec, *_ in powersgd_run]
    for step in range(STEPS):
        exact = [a + b for a, b in zip(records[0][step][0], records[1][step][0])]
        applied = records[0][step][1]
        # Step 0 is warm-up: every gradient is the plain all-reduce's sum, bit for bit.
        # Afterwards the biases and the 2x3 matrix still are; the two large matrices not.
        plain = range(6) if step == 0 else (1, 3, 4, 5)
        for i in plain:
            assert torch.equal(applied[i], exact[i]), (step, i)
        if step > 0:
            assert not torch.allclose(applied[0], exact[0], atol=1e-3)


def test_powersgd_error_feedback_keeps_what_was_not_sent(powersgd_run):
    _check_error_feedback_identity(powersgd_run)
    state = powersgd_run[0][3]
    assert state["step"] == STEPS   # one synchronised backward a step; no_sync ones not counted
    assert sorted(state["q"]) == [0, 2] and state["q"][0].shape == (32, 2)


def test_int8_error_feedback_keeps_what_was_not_sent(int8_run):
    _check_error_feedback_identity(int8_run)
    records = [rec for rec, *_ in int8_run]
    previous = [{}, {}]
    for step in range(STEPS):
        # Each step applies what the replicas sent: their gradient plus the residual they
        # kept, minus the residual they keep now.
        compensated = []
        for r in range(2):
            local, _, residual = records[r][step]
            compensated.append([g + previous[r].get(i, torch.zeros(g.numel())).view(g.shape)
                                for i, g in enumerate(local)])
            sent = [c - residual[i].view(c.shape) for i, c in enumerate(compensated[r])]
            if r == 0:
                total = sent
            else:
                total = [a + b for a, b in zip(total, sent)]
            # Rounding to 8 bits leaves at most half a level: max|c| / 254 in the bucket.
            largest = max(c.abs().max() for c in compensated[r])
            assert max(v.abs().max() for v in residual.values()) <= largest / 254 * 1.0001
            previous[r] = residual
        for got, want in zip(records[0][step][1], total):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_each_flag_counts_the_replicas_that_contributed(powersgd_run, int8_run):
    # Summed once, by the reducer, before the stage runs: 2 replicas, every parameter used
    # on both. (The stages used to sum them a second time: 4, and one more collective.)
    for run in (powersgd_run, int8_run):
        for replica in run:
            assert replica[5] == [2.0] * len(replica[2]), replica[5]


def test_stats_count_the_bytes_sent(powersgd_run, int8_run):
    fields = ReductionStats._fields
    p = dict(zip(fields, powersgd_run[0][4]))
    # The last step: one flat buffer (biases, the 2x3 matrix, 6 flags), P (48x2 + 3x2) and
    # Q (32x2 + 48x2), all float32.
    assert p["bytes_reduced"] == 4 * ((48 + 3 + 6 + 2 + 6) + (96 + 6) + (64 + 96))
    assert p["compression"] == repr(ts.PowerSGD(rank=2, warmup_steps=1, seed=3))
    assert p["compression_ratio"] > 4
    q = dict(zip(fields, int8_run[0][4]))
    assert 3.5 < q["compression_ratio"] < 4


@pytest.mark.parametrize("which", ["powersgd", "int8"])
def test_checkpoint_resume_equals_uninterrupted_run(which, first_launch, resume_launch):
    # The checkpoint saved after SAVE_AT by the first launch, loaded by fresh processes.
    run = _outcome(first_launch[1], which)
    resumed = _outcome(resume_launch, f"resume_{which}")
    for r in range(2):
        for a, b in zip(resumed[r][2], run[r][2]):
            assert torch.equal(a, b)


def _bf16_mean(compression):
    """bf16 parameters, the mean loss averaged over replicas (ts.scale_mean_loss)."""
    strategy = ts.MirroredStrategy(cross_device_ops=ts.NcclAllReduce(compression=compression))
    r = strategy.extended.replica_id
    with strategy.scope():
        model = _model().to(torch.bfloat16)
    params = list(model.parameters())
    records = []
    for step in range(3):
        x = _inputs(step, r, 0).to(torch.bfloat16)
        loss = lambda: model(x).float().pow(2).mean()
        local = torch.autograd.grad(loss(), params)
        model.zero_grad()
        ts.scale_mean_loss(loss()).backward()
        records.append(([g.float() for g in local], [p.grad.float() for p in params],
                        [p.grad.dtype for p in params]))
    reducer = strategy.extended.gradient_reducer
    states = reducer.state_dict()["error_feedback"]
    # Issue 36, item 12: a state saved by another number of replicas (here one replica's,
    # holding what both owe) loads, each replica taking an equal share, and says so.
    one_replica = ErrorFeedbackStage.spread_over(states, 1)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("torchstrategy").addHandler(handler)
    try:
        reducer.load_state_dict({"error_feedback": [one_replica]})
    finally:
        logging.getLogger("torchstrategy").removeHandler(handler)
    loaded = reducer.state_dict()["error_feedback"][r]["residuals"]
    return from_every_replica((records, states[r]["residuals"], (loaded, said)))


@pytest.mark.parametrize("which", ["powersgd", "int8"])   # PowerSGD(rank=2), Int8(64)
def test_bf16_gradients_and_mean_loss(which, first_launch):
    run = _outcome(first_launch[1], f"bf16_{which}")
    assert any("saved by 1 replicas and is loaded into 2" in line for line in run[0][2][1])
    assert run[1][2][1] == []   # said once, by replica 0
    for i in run[0][1]:
        saved = sum(res[i] for _, res, _ in run if i in res)
        shares = [loaded[i] for _, _, (loaded, _) in run]
        torch.testing.assert_close(shares[0], shares[1], rtol=0, atol=0)
        torch.testing.assert_close(shares[0] + shares[1], saved.float())
    for i in range(6):
        assert run[0][0][0][2][i] == torch.bfloat16   # .grad stays in the parameters' dtype
        mean = sum(run[r][0][t][0][i] for r in range(2) for t in range(3)) / 2
        applied = sum(run[0][0][t][1][i] for t in range(3))
        # Each replica's part was divided by 2 before compression: the residuals too.
        kept = sum(res[i].view(mean.shape) for _, res, _ in run if i in res)
        scale = mean.abs().max().item()
        torch.testing.assert_close(applied + kept, mean, rtol=0, atol=0.02 * scale + 1e-3)


class _Stop(Exception):
    pass


def _backup_run(directory, stop_at):
    """6 steps under ts.BackupAndRestore tracking the reducer; stops before global step
    `stop_at` (a preemption) or returns every replica's final parameters."""
    strategy = ts.MirroredStrategy(
        cross_device_ops=ts.NcclAllReduce(compression=ts.PowerSGD(rank=2)))
    r = strategy.extended.replica_id
    with strategy.scope():
        model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    backup = ts.BackupAndRestore(directory, save_freq=2)
    backup.track(model=model, optimizer=optimizer,
                 reducer=strategy.extended.gradient_reducer)
    try:
        for _ in backup.epochs(1):
            for _, i in backup.steps(list(range(6))):
                if backup.global_step == stop_at:
                    raise _Stop()
                optimizer.zero_grad()
                model(_inputs(i, r, 0)).pow(2).sum().backward()
                optimizer.step()
    except _Stop:
        return None
    return from_every_replica([p.detach().clone() for p in model.parameters()])


def test_backup_and_restore_resumes_exactly(first_launch, resume_launch):
    # Preempted before global step 4 in the first launch; resumed by the second's fresh
    # processes from the same directory.
    uninterrupted = _outcome(first_launch[1], "backup_uninterrupted")
    assert _outcome(first_launch[1], "backup_preempted") is None
    resumed = _outcome(resume_launch, "backup_resumed")
    for r in range(2):
        for a, b in zip(resumed[r], uninterrupted[r]):
            assert torch.equal(a, b)


# -- PowerSGD's runs of same-shaped matrices, driven on the stage itself ------------------
# Matrices of one shape back to back in a bucket go through PowerSGD's steps together (one
# batched call per run); the odd ones alone. Registration index -> shape: runs of 16 x 24
# and 8 x 40 broken by a vector, a small uncompressed matrix and other shapes.
_RUN_SHAPES = [(16, 24), (16, 24), (16, 24), (7,), (16, 24), (8, 40), (8, 40), (24, 16),
               (16, 24), (3, 2), (8, 40)]
_RUN_STEPS = 6
_REBUCKET_AT = 3   # from this step the buckets are laid out anew
_RUN_BUCKETS = {"first": [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10]],
                # runs of 5 (16 x 24) and 3 (8 x 40), in another order
                "rebucketed": [[8, 0, 1, 2, 4], [3, 5, 6, 10, 7, 9]],
                # one matrix a bucket: every matrix alone, the per-matrix path
                "alone": [[i] for i in range(len(_RUN_SHAPES))]}
_RUN_SAVE_AT = 2   # the round trip: state_dict after this step, loaded by a fresh stage


def _run_contributes(step, replica, index):
    """Index 2: not replica 1's at steps 1 and 4; index 6: nobody's at step 2; index 0:
    nobody's at step 4 (a hole inside the run of 16 x 24 of the re-bucketed layout)."""
    if index == 2 and replica == 1 and step in (1, 4):
        return False
    return not ((index == 6 and step == 2) or (index == 0 and step == 4))


def _run_gradient(step, replica, index):
    g = torch.Generator().manual_seed(10_000 * step + 100 * replica + index)
    return torch.randn(_RUN_SHAPES[index], generator=g)


def _run_stage(overlap, layouts, round_trip):
    """Drives an ErrorFeedbackStage as the reducer does (launches in bucket order, the
    flags summed, the waits in bucket order) for _RUN_STEPS steps on this replica; returns
    per step {index: what its slot holds after the reduction} and the final state."""
    r = dist.get_rank()
    compression = ts.PowerSGD(rank=2, seed=5, overlap=overlap)
    stage = ErrorFeedbackStage(compression)
    parameters = {i: torch.empty(shape) for i, shape in enumerate(_RUN_SHAPES)}
    applied = []
    for step in range(_RUN_STEPS):
        buckets = []
        for b, indices in enumerate(layouts[1] if step >= _REBUCKET_AT else layouts[0]):
            numels = tuple(parameters[i].numel() for i in indices)
            offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
            buffer = torch.zeros(sum(numels))
            flags = torch.zeros(len(indices))
            for k, i in enumerate(indices):
                if _run_contributes(step, r, i):
                    buffer.narrow(0, offsets[k], numels[k]).copy_(
                        _run_gradient(step, r, i).view(-1))
                    flags[k] = 1
            buckets.append(GradBucket(index=b, buffer=buffer,
                                      parameters=tuple(parameters[i] for i in indices),
                                      indices=tuple(indices), offsets=offsets, numels=numels,
                                      flags=flags))
        handles = [stage.launch(bucket) for bucket in buckets]
        for bucket in buckets:
            dist.all_reduce(bucket.flags)
        for handle in handles:
            handle.wait()
        stage.end_step(True)
        applied.append({i: bucket.gradient(k).view(_RUN_SHAPES[i]).clone()
                        for bucket in buckets for k, i in enumerate(bucket.indices)})
        if round_trip and step == _RUN_SAVE_AT:
            saved = stage.state_dict()
            stage = ErrorFeedbackStage(compression)
            stage.load_state_dict(saved)
    return applied, stage.state_dict()


def _stage_runs():
    first, rebucketed, alone = (_RUN_BUCKETS[k] for k in ("first", "rebucketed", "alone"))
    runs = {"batched": _run_stage(False, (first, rebucketed), False),
            "round_trip": _run_stage(False, (first, rebucketed), True),
            "overlap": _run_stage(True, (first, rebucketed), False),
            "alone": _run_stage(False, (alone, alone), False),
            "rebucketed_alone": _run_stage(False, (first, alone), False)}
    return from_every_replica(runs)


def _reference_runs(rank, seed):
    """Plain-torch PowerSGD, a matrix at a time, for the stage's scenario: per step the
    applied sums, and at the end every replica's residuals and the Q matrices. A matrix
    nobody contributed keeps its residual and Q, and its slot its zeros."""
    residual, qs, applied = {}, {}, []
    for step in range(_RUN_STEPS):
        out = {}
        for i, shape in enumerate(_RUN_SHAPES):
            local = [_run_gradient(step, r, i) if _run_contributes(step, r, i)
                     else torch.zeros(shape) for r in range(2)]
            compressed = ts.PowerSGD(rank=rank).compresses(torch.Size(shape))
            if not compressed or not any(_run_contributes(step, r, i) for r in range(2)):
                out[i] = local[0] + local[1]
                continue
            ms = [g + residual.get((r, i), torch.zeros(shape)) for r, g in enumerate(local)]
            q = qs.get(i, initial_q(seed, i, shape[1], rank))
            p = torch.linalg.qr(ms[0] @ q + ms[1] @ q, mode="reduced").Q
            q_locals = [(p.t() @ m).t() for m in ms]
            for r, (m, ql) in enumerate(zip(ms, q_locals)):
                residual[(r, i)] = m - p @ ql.t()
            qs[i] = q_locals[0] + q_locals[1]
            out[i] = p @ qs[i].t()
        applied.append(out)
    return applied, residual, qs


@pytest.fixture(scope="module")
def stage_runs(first_launch):
    return _outcome(first_launch[1], "stage_runs")


def test_powersgd_runs_of_same_shaped_matrices_equal_plain_torch(stage_runs):
    # Batched runs (a hole in one, a matrix one replica skipped, one nobody contributed),
    # a re-bucketing into longer runs, overlap, and every matrix alone: each equals a
    # plain-torch PowerSGD computed a matrix at a time.
    applied, residual, qs = _reference_runs(rank=2, seed=5)
    for name in ("batched", "round_trip", "overlap", "alone", "rebucketed_alone"):
        for r in range(2):
            got, state = stage_runs[r][name]
            for step in range(_RUN_STEPS):
                for i in range(len(_RUN_SHAPES)):
                    torch.testing.assert_close(
                        got[step][i], applied[step][i], rtol=1e-4, atol=1e-5,
                        msg=lambda m: f"{name} step {step} index {i}: {m}")
            assert sorted(state["residuals"]) == [0, 1, 2, 4, 5, 6, 7, 8, 10], name
            assert sorted(state["q"]) == sorted(state["residuals"]), name
            for i, kept in state["residuals"].items():
                torch.testing.assert_close(kept.view(_RUN_SHAPES[i]), residual[(r, i)],
                                           rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(state["q"][i], qs[i], rtol=1e-4, atol=1e-5)


def test_powersgd_runs_give_every_matrix_what_it_gets_alone(stage_runs):
    # The batched products (bmm) and the per-matrix ones (mm) may round differently on
    # some shapes (CPU bmm for small or rank-1 products); the finishing kernel gives each
    # matrix the same bits batched or not. Every replica applies the same result.
    for r in range(2):
        batched = stage_runs[r]["batched"][0]
        for name in ("alone", "rebucketed_alone", "overlap"):
            other = stage_runs[r][name][0]
            for step in range(_RUN_STEPS):
                for i in range(len(_RUN_SHAPES)):
                    torch.testing.assert_close(
                        batched[step][i], other[step][i], rtol=1e-5, atol=1e-6,
                        msg=lambda m: f"{name} step {step} index {i}: {m}")
                    other_replica = stage_runs[1 - r]["batched"][0]
                    assert torch.equal(batched[step][i], other_replica[step][i])
        # A matrix nobody contributed: its slot untouched (zeros), at step 2 and 4.
        assert torch.equal(batched[2][6], torch.zeros(8, 40))
        assert torch.equal(batched[4][0], torch.zeros(16, 24))


def test_powersgd_runs_state_round_trip_is_exact(stage_runs):
    # A fresh stage loading the state after _RUN_SAVE_AT lays the runs out again and
    # continues bit for bit; the state keeps its format (flat residuals, Q as cols x rank).
    for r in range(2):
        uninterrupted, state = stage_runs[r]["batched"]
        resumed, resumed_state = stage_runs[r]["round_trip"]
        for step in range(_RUN_STEPS):
            for i in range(len(_RUN_SHAPES)):
                assert torch.equal(resumed[step][i], uninterrupted[step][i]), (step, i)
        for i, kept in state["residuals"].items():
            assert kept.shape == (_RUN_SHAPES[i][0] * _RUN_SHAPES[i][1],)
            assert torch.equal(resumed_state["residuals"][i], kept)
            assert state["q"][i].shape == (_RUN_SHAPES[i][1], 2)
            assert state["q"][i].is_contiguous()
            assert torch.equal(resumed_state["q"][i], state["q"][i])


# -- bad arguments ------------------------------------------------------------------------
def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="PowerSGD rank must be an int >= 1"):
        ts.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="PowerSGD warmup_steps must be an int >= 0"):
        ts.PowerSGD(warmup_steps=-1)
    with pytest.raises(ValueError, match="Int8 chunk_size must be an int >= 1"):
        ts.Int8(chunk_size=0)
    with pytest.raises(ValueError, match="Int8 warmup_steps"):
        ts.Int8(warmup_steps=-2)
    with pytest.raises(ValueError, match=r"or ts.PowerSGD\(rank=...\) / ts.Int8\(\)"):
        ts.CommunicationOptions(compression="int8")
    with pytest.raises(ValueError, match="cannot run with cross_device_ops=Reduction"):
        with_compression(ts.ReductionToOneDevice(), ts.PowerSGD(rank=2))
    with pytest.raises(ValueError, match="cannot run with cross_device_ops=Hierarchical"):
        with_compression(ts.HierarchicalCopyAllReduce(), ts.Int8())
    with pytest.raises(ValueError, match="does not split them into packs; leave num_packs=1"):
        ts.NcclAllReduce(num_packs=2, compression=ts.Int8())
    with pytest.raises(ValueError, match="does not split them into packs; leave num_packs=1"):
        with_compression(ts.NcclAllReduce(num_packs=2), ts.PowerSGD())
    assert ts.CommunicationOptions(compression=ts.PowerSGD(rank=4)).compression == \
        ts.PowerSGD(rank=4)


# -- the convergence script ---------------------------------------------------------------
def test_convergence_script_quick_run(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "curves.json"
    result = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "convergence_compression.py"),
         "--steps", "4", "--eval-every", "2", "--corpus-bytes", "100000",
         "--runs", "powersgd-warmup,ddp-powersgd", "--warmup", "2", "--schedule", "cosine",
         "--json", str(out)],
        cwd=root, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "powersgd-warmup final val loss" in result.stdout
    runs = json.loads(out.read_text())["results"]
    assert [r["name"] for r in runs] == ["powersgd-warmup", "ddp-powersgd"]
    assert [step for step, _ in runs[0]["curve"]] == [0, 2, 4]
    # Same seed: the same starting model; both run 2 uncompressed steps (torch's hook
    # cannot start earlier), which equal each other.
    assert runs[0]["curve"][0] == runs[1]["curve"][0]
    torch.testing.assert_close(runs[0]["curve"][1][1], runs[1]["curve"][1][1])
    assert runs[0]["ratio"] > 10 and runs[1]["ratio"] > 10
    assert runs[1]["bytes"] < runs[0]["bytes"]   # the same matrices, without our flags
    assert runs[1]["setting"] == "AdamW lr 0.002, cosine decay" and runs[1]["warmup"] == 2
    # --replot puts the results of separate invocations together, without training
    merged = tmp_path / "merged.json"
    result = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "convergence_compression.py"),
         "--replot", str(out), str(out), "--json", str(merged)],
        cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ddp-powersgd rank 4, 2 warm-up steps" in result.stdout
    assert json.loads(merged.read_text())["results"] == runs + runs


def test_convergence_script_other_settings(tmp_path):
    # The digits MLP (a second model family), a learning-rate warm-up before the cosine
    # decay, and another number of replicas: each named in the run's setting.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "scripts", "convergence_compression.py")
    out = tmp_path / "digits.json"
    result = subprocess.run(
        [sys.executable, script, "--model", "digits", "--optimizer", "sgd", "--lr", "0.05",
         "--steps", "6", "--eval-every", "3", "--schedule", "cosine", "--lr-warmup", "2",
         "--replicas", "3", "--runs", "none,int8", "--json", str(out)],
        cwd=root, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(out.read_text())["results"]
    assert [r["name"] for r in runs] == ["none", "int8"]
    assert runs[0]["setting"] == ("digits MLP, SGD+momentum lr 0.05, cosine decay after 2 "
                                  "warm-up steps, 3 replicas")
    assert runs[0]["params"] == 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert [step for step, _ in runs[0]["curve"]] == [0, 3, 6]
    # The same starting model; the loss falls from about log(10) for 10 classes.
    assert runs[0]["curve"][0] == runs[1]["curve"][0]
    assert runs[0]["curve"][-1][1] < runs[0]["curve"][0][1] < 2.5
    assert 3.5 < runs[1]["ratio"] < 4.1
    refused = subprocess.run([sys.executable, script, "--lr-warmup", "10"], cwd=root,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--lr-warmup is the warm-up of --schedule cosine" \
        in refused.stderr


def test_a_state_saved_under_another_compression_is_refused():
    int8 = ErrorFeedbackStage(ts.Int8())
    powersgd = ErrorFeedbackStage(ts.PowerSGD(rank=2))
    with pytest.raises(ValueError, match=r"saved with compression=PowerSGD\(rank=2.*runs "
                                         r"Int8\(chunk_size=1024"):
        int8.load_state_dict(powersgd.state_dict())
    int8.load_state_dict(ErrorFeedbackStage(ts.Int8()).state_dict())
    assert int8.step == 0
