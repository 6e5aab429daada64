"""``ts.accumulate``: lazy iteration in the loop's order, no collective for a mean loss, any
iterable for sync control, and equality with DDP's ``no_sync`` loop under dropout.

The launched test trains the same small model with dropout 0.1 and batches drawn from the
global random generator (as nanoGPT's ``get_batch`` draws them) four ways on 2 gloo
replicas: ``ts.accumulate`` with ``micro.scale_mean_loss``, a hand-written
``strategy.extended.no_sync()`` loop in nanoGPT's prefetching order, ``ts.accumulate`` over
``range(k)`` (sync control only), and torch's ``DistributedDataParallel`` with
``no_sync()``. Random draws interleave identically in all four, so the weights are
bit-identical (two replicas: the 1/2 of the averaging is exact in floating point, whether
the loss or the summed gradient is scaled).
"""
import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers import ROOT
from tests.helpers.replicas import detached_state, from_every_replica, launch

N = 2
MICRO_B, ACC, ITERS, SEED = 4, 3, 3, 7


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4))


def get_batch():
    """A micro-batch from the global generator, as nanoGPT's ``get_batch`` draws it."""
    return torch.randn(MICRO_B, 8), torch.randint(0, 4, (MICRO_B,))


class CountedAllReduces:
    """Counts the communicator's all-reduces (every collective but the gradient reducer's
    buckets goes through it) while inside."""

    def __init__(self, strategy):
        self.comm = strategy.extended.communicator
        self.count = 0

    def __enter__(self):
        original = self.comm.all_reduce

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        self.comm.all_reduce = counted
        return self

    def __exit__(self, *exc):
        del self.comm.all_reduce


def train(strategy, rank, loop):
    """Trains a fresh adopted model with `loop(model)` per iteration; returns its weights,
    the communicator's all-reduces and the synchronised backward passes."""
    model = strategy.adopt(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)            # data and dropout: this replica's stream
    state = {}
    synchronised = 0
    with CountedAllReduces(strategy) as counted:
        for _ in range(ITERS):
            loop(model, state)
            synchronised += strategy.extended.stats().steps > 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return detached_state(model), counted.count, synchronised


def _replica():
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id

    def accumulate_mean_loss(model, state):
        batches = (get_batch() for _ in range(ACC))
        for micro in ts.accumulate(strategy, batches, steps=ACC):
            with micro:
                x, y = micro.batch
                micro.scale_mean_loss(F.cross_entropy(model(x), y)).backward()

    def hand_written_no_sync(model, state):
        """nanoGPT's order: the next batch is read after the forward, before the backward."""
        if "next" not in state:
            state["next"] = get_batch()
        for m in range(ACC):
            last = m == ACC - 1
            with contextlib.nullcontext() if last else strategy.extended.no_sync():
                x, y = state["next"]
                loss = F.cross_entropy(model(x), y) / ACC
                state["next"] = get_batch()
                ts.scale_mean_loss(loss).backward()

    def sync_control_only(model, state):
        for micro in ts.accumulate(strategy, range(ACC), ACC):
            with micro:
                x, y = get_batch()
                ts.scale_mean_loss(F.cross_entropy(model(x), y) / ACC).backward()

    def accumulate_average_loss(model, state):
        batches = (get_batch() for _ in range(ACC))
        for micro in ts.accumulate(strategy, batches, steps=ACC):
            with micro:
                x, y = micro.batch
                per_example = F.cross_entropy(model(x), y, reduction="none")
                micro.compute_average_loss(per_example).backward()
                state.setdefault("examples", []).append(micro.group_examples)

    def rest_of_group_read_after_first_forward(model, state):
        """The order `compute_average_loss` documents: its first call of a group (after the
        first forward) reads the group's remaining micro-batches."""
        group = [get_batch()]
        for m in range(ACC):
            with contextlib.nullcontext() if m == ACC - 1 else strategy.extended.no_sync():
                x, y = group[m]
                loss = F.cross_entropy(model(x), y) / ACC
                group += [get_batch() for _ in range(ACC - len(group))]
                ts.scale_mean_loss(loss).backward()

    out = {name: train(strategy, rank, loop) for name, loop in (
        ("accumulate", accumulate_mean_loss), ("no_sync", hand_written_no_sync),
        ("range", sync_control_only), ("average", accumulate_average_loss),
        ("read_ahead", rest_of_group_read_after_first_forward))}

    torch.manual_seed(100 + rank)
    ddp = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    x, y = get_batch()
    for _ in range(ITERS):
        for m in range(ACC):
            with contextlib.nullcontext() if m == ACC - 1 else ddp.no_sync():
                loss = F.cross_entropy(ddp(x), y) / ACC
                x, y = get_batch()
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out["ddp"] = detached_state(ddp.module)
    return from_every_replica(out)


@pytest.fixture(scope="module")
def replicas():
    return launch(_replica, n=N)


def assert_identical(a, b, what, atol=0.0):
    assert list(a) == list(b), what
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0,
                                   msg=lambda m: f"{what} {key}: {m}")


def test_accumulate_with_dropout_equals_ddp_no_sync_bit_for_bit(replicas):
    for rank, r in enumerate(replicas):
        weights = r["accumulate"][0]
        assert_identical(weights, r["no_sync"][0], f"replica {rank} vs hand-written no_sync")
        assert_identical(weights, r["ddp"], f"replica {rank} vs DDP no_sync")
        assert_identical(weights, r["range"][0], f"replica {rank} vs range(k) sync control")
    assert_identical(replicas[0]["accumulate"][0], replicas[1]["accumulate"][0], "replicas")


def test_mean_loss_pays_no_collective_beyond_the_hand_written_loop(replicas):
    for r in replicas:
        hand_written = r["no_sync"][1]
        assert r["accumulate"][1] == hand_written
        assert r["range"][1] == hand_written
        for name in ("accumulate", "no_sync", "range", "average"):
            assert r[name][2] == ITERS, name       # one synchronised backward per group


def test_average_loss_counts_each_group_once(replicas):
    for rank, r in enumerate(replicas):
        assert r["average"][1] == r["no_sync"][1] + ITERS
        # Equal micro-batches: the group mean equals the mean of the micro-batch means, up
        # to rounding (a sum divided by 24 against means divided by 3 and by 2).
        assert_identical(r["average"][0], r["read_ahead"][0], f"replica {rank} average",
                         atol=1e-6)


# -- in one process, under the default strategy ---------------------------------------------
def recorded(items, log):
    for index, item in enumerate(items):
        log.append(f"read {index}")
        yield item


def test_batches_are_read_one_at_a_time_in_order():
    log = []
    for micro in ts.accumulate(ts.get_strategy(), recorded("abcd", log), steps=2):
        log.append(f"step {micro.batch}")
    assert log == ["read 0", "step a", "read 1", "step b", "read 2", "step c",
                   "read 3", "step d"]


def test_any_sized_iterable_controls_syncing_with_a_short_last_group():
    micros = list(ts.accumulate(ts.get_strategy(), range(5), 2))
    assert [m.batch for m in micros] == [0, 1, 2, 3, 4]
    assert [m.group_size for m in micros] == [2, 2, 2, 2, 1]
    assert [m.is_last for m in micros] == [False, True, False, True, True]


def test_an_unsized_iterable_ending_inside_a_group_is_an_error():
    micros = ts.accumulate(ts.get_strategy(), iter(range(5)), 2)
    assert [next(micros).index for _ in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(RuntimeError, match=r"ended after 1 micro-batch\(es\) of a group "
                                           r"of 2.*len\(\)"):
        next(micros)
    assert list(ts.accumulate(ts.get_strategy(), iter(range(0)), 2)) == []


def test_the_example_count_reads_the_rest_of_the_group_once():
    log = []
    batches = [torch.zeros(n, 1) for n in (3, 2, 4, 1, 1, 1)]
    counts = []
    for micro in ts.accumulate(ts.get_strategy(), recorded(batches, log), steps=3):
        log.append(f"step {micro.index}")
        counts.append(micro.group_examples)
    assert log == ["read 0", "step 0", "read 1", "read 2", "step 1", "step 2",
                   "read 3", "step 0", "read 4", "read 5", "step 1", "step 2"]
    assert counts == [9.0] * 3 + [3.0] * 3


def test_scale_mean_loss_scales_the_gradient_by_the_group():
    (first, *_), = [list(ts.accumulate(ts.get_strategy(), range(4), 4))]
    loss = torch.tensor(6.0, requires_grad=True)
    first.scale_mean_loss(loss * 1).backward()
    assert loss.grad.item() == 0.25


def test_compute_average_loss_needs_a_batch_dimension():
    micro = next(ts.accumulate(ts.get_strategy(), range(4), 2))
    with pytest.raises(TypeError, match=r"first tensor.*micro.scale_mean_loss"):
        micro.compute_average_loss(torch.ones(3))
    weighted = next(ts.accumulate(ts.get_strategy(), [torch.ones(3, 2)], 2))
    assert weighted.compute_average_loss(torch.full((3,), 2.0)).item() == 2.0


def test_replica_threads_count_the_group_inside_run_once_each():
    """CentralStorageStrategy's replicas are threads of this process: each counts its own
    part of the group inside ``run`` and they meet in one all-reduce per group."""
    strategy = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(SEED)
        model = nn.Linear(3, 2)
    batches = [(torch.randn(n, 3), torch.randint(0, 2, (n,))) for n in (6, 4, 3)]
    dataset = strategy.experimental_distribute_dataset(batches)

    def micro_step(batch, micro):
        x, y = batch
        micro.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        return torch.tensor(micro.group_examples)

    counts = []
    for micro in ts.accumulate(strategy, dataset, steps=2):
        with micro:
            counted = strategy.run(micro_step, args=(micro.batch, micro))
        counts.append([c.item() for c in strategy.experimental_local_results(counted)])
    assert counts == [[10.0, 10.0], [10.0, 10.0], [3.0, 3.0]]
    torch.manual_seed(SEED)
    reference = nn.Linear(3, 2)
    for group in (batches[:2], batches[2:]):
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        F.cross_entropy(reference(x), y).backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=0)


def test_bench_accumulate_quick_runs():
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER", "TORCHSTRATEGY_PARENT_PID")}
    env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = "60"
    result = subprocess.run([sys.executable, os.path.join("scripts", "bench_accumulate.py"),
                             "--quick"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    for config in ("accumulate", "no-sync"):
        assert re.search(rf"^{config}\s+[0-9.]+", result.stdout, flags=re.MULTILINE)
    assert re.search(r"median of 4 paired ratios: [0-9.]+ \(p25 [0-9.]+, p75 [0-9.]+\); "
                     r"CPU time [0-9.]+", result.stdout), result.stdout
    assert re.search(r"loop machinery alone: accumulate [0-9.]+ us", result.stdout)
