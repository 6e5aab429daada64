"""The bucketed gradient reducer: after ``backward()`` inside ``strategy.run`` every mirrored
parameter's ``.grad`` holds the sum over replicas, with the corner cases users hit:
unused parameters, parameters used on some replicas only, accumulation with and without
``no_sync``, shared parameters, BatchNorm buffers, many small buckets, fp64 / bf16 / mixed
dtypes."""
import pytest
import torch
import torch.nn as nn

import torchstrategy as ts
from tests.helpers.replicas import (assert_same_tensors, detached_state, from_every_replica,
                          grads_of, launch, local)

A = torch.tensor([1.0, 2.0, 3.0])
B = torch.tensor([1.0, -1.0, 0.5])
C = torch.tensor([0.25, -4.0, 2.0])


def _holder(value):
    """A module with one parameter `p` (registered through the module, so it is mirrored)."""
    module = nn.Module()
    module.p = nn.Parameter(value.clone())
    return module


# -- the accumulation and partial-use cases ------------------------------------------------
def _reducer_semantics():
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    res = {}
    with strategy.scope():
        used = nn.Linear(3, 2)
        unused = nn.Linear(3, 2)
        partial = _holder(torch.zeros(3))
        w = _holder(torch.ones(3))

    def partial_step():
        x = torch.full((4, 3), float(rank + 1))
        loss = used(x).sum()
        if rank == 1:
            loss = loss + (partial.p * C).sum()
        loss.backward()
        return {"used": grads_of(used), "unused": grads_of(unused),
                "partial": partial.p.grad.clone()}

    # run wraps every non-None leaf in a PerReplica; take this replica's components.
    res["partial"] = local(strategy.run(partial_step))

    def twice_without_zero_grad():
        (w.p * A * (rank + 1)).sum().backward()
        first = w.p.grad.clone()
        (w.p * B * (rank + 1) ** 2).sum().backward()
        second = w.p.grad.clone()
        w.p.grad = None
        (w.p * C).sum().backward()
        after_reset = w.p.grad.clone()
        return first, second, after_reset

    res["twice"] = local(strategy.run(twice_without_zero_grad))

    def accumulate_with_no_sync():
        w.p.grad = None
        with strategy.extended.no_sync():
            (w.p * A * (rank + 1)).sum().backward()
            (w.p * C * (rank + 1)).sum().backward()
        local = w.p.grad.clone()
        (w.p * B).sum().backward()  # synchronised: sums everything accumulated since
        synced = w.p.grad.clone()
        # Gradients summed by an earlier step and untouched since are not summed again.
        return local, synced, partial.p.grad.clone(), used.bias.grad.clone()

    res["no_sync"] = local(strategy.run(accumulate_with_no_sync))
    return from_every_replica(res)


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_reducer_sums_gradients_with_partial_use_and_accumulation(num_replicas):
    n = num_replicas
    per_replica = launch(_reducer_semantics, n=n)
    s1 = sum(range(1, n + 1))                       # sum_r (r + 1)
    s2 = sum((r + 1) ** 2 for r in range(n))        # sum_r (r + 1)^2
    for rank, res in enumerate(per_replica):
        partial = res["partial"]
        # d/dW sum(Wx + b) = sum over the 4 rows of x = 4 (r + 1), summed over replicas.
        torch.testing.assert_close(partial["used"]["weight"], torch.full((2, 3), 4.0 * s1))
        torch.testing.assert_close(partial["used"]["bias"], torch.full((2,), 4.0 * n))
        # No replica used it: .grad stays None, as without a strategy.
        assert partial["unused"] == {"weight": None, "bias": None}
        # Only replica 1 used it: every replica gets replica 1's gradient.
        torch.testing.assert_close(partial["partial"], C)

        first, second, after_reset = res["twice"]
        torch.testing.assert_close(first, A * s1)
        torch.testing.assert_close(second, A * s1 + B * s2)  # g1_sum + g2_sum, not N * g1
        torch.testing.assert_close(after_reset, C * n)

        local, synced, stale_partial, stale_bias = res["no_sync"]
        torch.testing.assert_close(local, (A + C) * (rank + 1))  # no communication inside
        torch.testing.assert_close(synced, (A + C) * s1 + B * n)
        torch.testing.assert_close(stale_partial, C)
        torch.testing.assert_close(stale_bias, torch.full((2,), 4.0 * n))


def _flags_across_steps(uses):
    """Synchronised steps in which `sometimes` is used on the replicas listed for the step.
    Where every parameter got its gradient here the flags' sum is not waited for and is
    still in flight as the next step starts (csrc/reducer.h, flags_work_); a replica that
    left `sometimes` unused reads the sum and must find this step's."""
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    with strategy.scope():
        always = _holder(torch.zeros(3))
        sometimes = _holder(torch.zeros(3))

    def step(users):
        always.p.grad = None
        sometimes.p.grad = None
        loss = (always.p * A * (rank + 1)).sum()
        if rank in users:
            loss = loss + (sometimes.p * B * (rank + 1)).sum()
        loss.backward()
        grad = sometimes.p.grad
        return always.p.grad.clone(), None if grad is None else grad.clone()

    return from_every_replica([local(strategy.run(step, args=(users,))) for users in uses])


def test_each_step_reads_its_own_flags_while_the_last_are_summed():
    uses = [(0, 1), (1,), (0, 1), (), (0, 1), (1,), (1,), (0, 1)]
    for per_step in launch(_flags_across_steps, uses, n=2):
        for users, (always, sometimes) in zip(uses, per_step):
            torch.testing.assert_close(always, A * 3)
            if users:
                torch.testing.assert_close(sometimes, B * sum(r + 1 for r in users))
            else:
                assert sometimes is None, users  # no replica used it: stays None


# -- models compared with a single-process reference ------------------------------------------
class SharedNet(nn.Module):
    """`second.weight` is the same nn.Parameter as `first.weight` (weight tying)."""

    def __init__(self, dtype=None):
        super().__init__()
        self.first = nn.Linear(4, 4, dtype=dtype)
        self.second = nn.Linear(4, 4, dtype=dtype)
        self.second.weight = self.first.weight
        self.head = nn.Linear(4, 2, dtype=dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


class MixedNet(nn.Module):
    """fp32 and fp64 parameters in one model: one bucket group per dtype."""

    def __init__(self):
        super().__init__()
        self.low = nn.Linear(4, 8)
        self.high = nn.Linear(8, 2, dtype=torch.float64)

    def forward(self, x):
        return self.high(torch.relu(self.low(x)).double())


class WideNet(nn.Module):
    """Many parameters of different sizes, to spread over many small buckets."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(5)])
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


MODELS = {
    "shared": (lambda: SharedNet(), torch.float32),
    "shared_fp64": (lambda: SharedNet(torch.float64), torch.float64),
    "bf16": (lambda: SharedNet(torch.bfloat16), torch.bfloat16),
    "mixed": (lambda: MixedNet(), torch.float32),
    "wide": (lambda: WideNet(), torch.float32),
}


def replica_input(name, rank, steps=1):
    g = torch.Generator().manual_seed(100 + rank)
    dtype = MODELS[name][1]
    x = torch.randn(steps, 3 + rank, 6 if name == "wide" else 4, generator=g) * (rank + 1)
    return x.to(dtype)


def model_loss(model, x):
    return model(x).float().pow(2).sum()


CROSS_DEVICE_OPS = {
    "default": lambda: None,
    "one_device": lambda: ts.ReductionToOneDevice(),
    "packs": lambda: ts.NcclAllReduce(num_packs=3),
}


def _reducer_models(names, bucket_cap_mb, cross_device_ops):
    strategy = ts.MirroredStrategy(bucket_cap_mb=bucket_cap_mb,
                                   cross_device_ops=CROSS_DEVICE_OPS[cross_device_ops]())
    rank = strategy.extended.replica_id
    res = {"buckets": None, "models": {}}
    for name in names:
        torch.manual_seed(rank)
        with strategy.scope():
            model = MODELS[name][0]()
        init = detached_state(model)
        x = replica_input(name, rank, steps=2)
        got = {}

        def step():
            model_loss(model, x[0]).backward()
            got["one"] = grads_of(model)
            # A second synchronised backward without zero_grad adds its summed gradients.
            model_loss(model, x[1]).backward()
            got["two"] = grads_of(model)
            model.zero_grad()
            # The same two micro-batches, the first accumulated locally under no_sync.
            with strategy.extended.no_sync():
                model_loss(model, x[0]).backward()
            model_loss(model, x[1]).backward()
            got["no_sync"] = grads_of(model)

        strategy.run(step)
        plain = MODELS[name][0]()
        res["models"][name] = {"init": init, **got,
                               "keys": list(model.state_dict()),
                               "plain_keys": list(plain.state_dict()),
                               "param_dtypes": [p.dtype for p in model.parameters()]}
    res["buckets"] = strategy.extended.gradient_reducer.bucket_sizes
    return from_every_replica(res)


def reference_grads(name, init, n, steps):
    """Single process: the gradients of every replica's losses on micro-batches `steps`,
    summed (in fp32 for bf16)."""
    total = {}
    for rank in range(n):
        x = replica_input(name, rank, steps=2)
        for s in steps:
            model = MODELS[name][0]()
            model.load_state_dict(init)
            model_loss(model, x[s]).backward()
            for key, p in model.named_parameters():
                g = p.grad.float() if p.dtype == torch.bfloat16 else p.grad
                total[key] = g if key not in total else total[key] + g
    return total


@pytest.mark.parametrize("num_replicas,bucket_cap_mb,cross_device_ops",
                         [(2, 25, "default"), (4, 0.0001, "default"), (2, 0.0001, "one_device"),
                          (4, 25, "packs")])
def test_reducer_matches_reference_for_shared_mixed_and_low_precision(
        num_replicas, bucket_cap_mb, cross_device_ops):
    per_replica = launch(_reducer_models, list(MODELS), bucket_cap_mb, cross_device_ops,
                         n=num_replicas)
    buckets = per_replica[0]["buckets"]
    if bucket_cap_mb < 1:
        # 104-byte buckets, filled as DDP fills them (a bucket closes with the parameter that
        # crosses its cap: tests/collectives/test_bucket_layout.py checks the rule against
        # torch's): small tensors share one, most get a bucket of their own.
        assert len(buckets) >= 10, buckets
    else:
        assert len(buckets) == 3, buckets  # one per dtype: fp32, fp64, bf16
    for rank, res in enumerate(per_replica):
        assert res["buckets"] == buckets
        for name, got in res["models"].items():
            what = f"{name} replica {rank}/{num_replicas}"
            # Nothing is wrapped: the same state_dict keys as a model built without strategy.
            assert got["keys"] == got["plain_keys"], what
            assert got["param_dtypes"] == [p.dtype for p in MODELS[name][0]().parameters()]
            assert_same_tensors(got["init"], per_replica[0]["models"][name]["init"],
                                what=what + " init")
            for key, steps in (("one", [0]), ("two", [0, 1]), ("no_sync", [0, 1])):
                expected = reference_grads(name, got["init"], num_replicas, steps)
                grads = got[key]
                label = f"{what} {key}"
                if name == "bf16":
                    assert all(g.dtype == torch.bfloat16 for g in grads.values())
                    grads = {k: g.float() for k, g in grads.items()}
                    assert_same_tensors(grads, expected, atol=0.1, rtol=0.03, what=label)
                elif name == "shared_fp64":
                    assert_same_tensors(grads, expected, atol=1e-12, rtol=1e-12, what=label)
                else:
                    assert_same_tensors(grads, expected, atol=1e-5, rtol=1e-5, what=label)
                # Bit-identical gradients on every replica.
                assert_same_tensors(got[key], per_replica[0]["models"][name][key],
                                    what=label + " vs replica 0")
    tied = per_replica[0]["models"]["shared"]
    assert "second.weight" in tied["keys"] and "first.weight" in tied["keys"]


# -- BatchNorm buffers ----------------------------------------------------------------------
def make_bn_model():
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))


def bn_input(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4 + rank, 4, generator=g) * (rank + 1) + rank


def _batchnorm_replicas():
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    torch.manual_seed(rank)
    with strategy.scope():
        model = make_bn_model()
    init = detached_state(model)
    history = []

    def step(x):
        model(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None

    for s in range(3):
        strategy.run(step, args=(bn_input(rank, s),))
        history.append({k: v.clone() for k, v in model.named_buffers()})
    return from_every_replica({"init": init, "history": history,
                               "params": detached_state(model), "keys": list(model.state_dict()),
                               "plain_keys": list(make_bn_model().state_dict())})


def test_batchnorm_buffers_are_identical_after_every_step():
    n = 2
    per_replica = launch(_batchnorm_replicas, n=n)
    zero = per_replica[0]
    for rank, res in enumerate(per_replica):
        assert res["keys"] == res["plain_keys"]
        assert "1.running_mean" in res["keys"] and "1.num_batches_tracked" in res["keys"]
        for s in range(3):
            assert_same_tensors(res["history"][s], zero["history"][s], what=f"step {s} r{rank}")
        assert_same_tensors(res["params"], zero["params"])
    # After the first step the statistics are the mean over replicas of each replica's
    # update from the common initial state.
    expected = {}
    for rank in range(n):
        model = make_bn_model()
        model.load_state_dict(zero["init"])
        model(bn_input(rank, 0))
        for key, value in model.named_buffers():
            if value.is_floating_point():
                expected[key] = expected.get(key, 0) + value / n
    for key, value in expected.items():
        torch.testing.assert_close(zero["history"][0][key], value)
    assert zero["history"][2]["1.num_batches_tracked"].item() == 3
    # The statistics really moved away from their initial values.
    assert not torch.allclose(zero["history"][2]["1.running_mean"], torch.zeros(5))
