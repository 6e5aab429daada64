"""The reducer's buckets: gradients as views into them (surviving both kinds of
``zero_grad``), buckets per dtype with exact sums for fp32/fp64/fp16/bf16 and mixed models,
the rebuild from the observed gradient order, statistics, and unused parameters.

Gradients here are small integers, so every sum is exact in every dtype and the tests
compare with ``torch.equal``."""
import time

import pytest
import torch
import torch.nn as nn

import torchstrategy as ts
from tests.helpers.replicas import from_every_replica, launch


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(3, 5), (7,), (2, 2, 3), (4,), (1,), (6, 3)]
# How late replica 1 starts its last synchronised backward: replica 0, its computation
# done, waits for replica 1's gradients (exposed communication); replica 1 finds replica
# 0's already there.
LATE_SECONDS = 1.0


class ChainNet(nn.Module):
    """Parameters of every dtype, all ones; the forward multiplies them into a chain in
    `use_order`, so backward delivers their gradients in the reverse of that order, each
    gradient equal to the input (exact in every dtype). `unused` never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.ones(SHAPES[i % len(SHAPES)],
                                                            dtype=DTYPES[i % len(DTYPES)]))
                                    for i in range(8)])
        self.unused = nn.Parameter(torch.ones(3))
        self.use_order = [2, 5, 0, 7, 1, 4, 6, 3]   # not the registration order

    def forward(self, xs):
        total = 0.0
        carry = torch.ones(())
        for i in self.use_order:
            p = self.ps[i]
            # carry (a ones scalar that depends on the previous parameters) chains the
            # parameters so that backward reaches them in reverse use order.
            term = (p * xs[i].to(p.dtype) * carry.to(p.dtype)).sum()
            total = total + term.double()
            carry = carry * (p.sum() - p.sum().detach() + 1).float()
        return total


def inputs(rank, step):
    """Replica- and step-dependent integer inputs, one per parameter of ChainNet."""
    g = torch.Generator().manual_seed(10 * step + rank)
    return [torch.randint(-1, 2, SHAPES[i % len(SHAPES)], generator=g).float()
            for i in range(8)]


def expected_grad(model, i, steps, n):
    """The gradient of parameter i after backward on `steps`, summed over n replicas.

    With all parameters equal to ones, carry is 1 and d carry / d p_i is ones for every
    later term, so d(loss)/d(p_i) = x_i + (the sum of the later terms' inputs)."""
    total = torch.zeros(SHAPES[i % len(SHAPES)], dtype=torch.float64)
    for rank in range(n):
        for s in steps:
            xs = [x.double() for x in inputs(rank, s)]
            order = model.use_order
            k = order.index(i)
            later = sum(xs[j].sum() for j in order[k + 1:])
            total += xs[i] + later
    return total


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.ps]


def _bucket_views_and_rebuild():
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    reducer = strategy.extended.gradient_reducer
    with strategy.scope():
        model = ChainNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)   # lr 0: weights stay ones
    res = {}

    def backward(step):
        model(inputs(rank, step)).backward()

    strategy.run(lambda: None)                      # registers the parameters
    index = {id(p): i for i, p in enumerate(reducer.parameters)}
    res["order_initial"] = [index[id(p)] for p in reducer.bucket_order]
    arrived = []
    watch = [p.register_post_accumulate_grad_hook(lambda p: arrived.append(index[id(p)]))
             for p in model.parameters()]
    strategy.run(backward, args=(0,))
    for handle in watch:
        handle.remove()
    res["arrived"] = arrived
    res["first"] = _grads(model)
    res["unused_after_first"] = model.unused.grad
    res["order_after_first"] = [index[id(p)] for p in reducer.bucket_order]
    res["views_after_first"] = [reducer.is_bucket_view(p) for p in model.ps]
    res["stats_first"] = strategy.extended.stats()
    res["layout"] = reducer.bucket_layout()

    optimizer.zero_grad(set_to_none=False)            # grads stay views, zeroed in place
    res["zeroed_are_views"] = [reducer.is_bucket_view(p) for p in model.ps]
    ptrs = [p.grad.data_ptr() for p in model.ps]
    strategy.run(backward, args=(1,))
    res["after_zero"] = _grads(model)
    res["same_memory"] = [p.grad.data_ptr() for p in model.ps] == ptrs

    optimizer.zero_grad(set_to_none=True)             # grads freed
    strategy.run(backward, args=(2,))
    res["after_none"] = _grads(model)
    res["views_after_none"] = [reducer.is_bucket_view(p) for p in model.ps]

    # The user replaces .grad: the new tensor counts as an already-summed gradient.
    for p in model.ps:
        p.grad = torch.full_like(p, 3.0)
    strategy.run(backward, args=(3,))
    res["after_replace"] = _grads(model)
    res["views_after_replace"] = [reducer.is_bucket_view(p) for p in model.ps]

    # no_sync on top of views, then a synchronised backward.
    optimizer.zero_grad(set_to_none=False)
    with strategy.extended.no_sync():
        strategy.run(backward, args=(4,))
    res["local"] = _grads(model)

    def late_backward(step):
        if rank == 1:
            time.sleep(LATE_SECONDS)
        backward(step)

    strategy.run(late_backward, args=(5,))
    res["no_sync"] = _grads(model)
    res["stats_last"] = strategy.extended.stats()
    # The statistics are those of the last synchronised backward: a local one leaves them.
    with strategy.extended.no_sync():
        strategy.run(backward, args=(6,))
    res["stats_after_local"] = strategy.extended.stats()
    res["on_process_group"] = reducer.launches_on_process_group()
    res["order_final"] = [index[id(p)] for p in reducer.bucket_order]
    return from_every_replica(res)


def test_gradients_are_bucket_views_with_exact_sums_in_every_dtype():
    n = 2
    per_replica = launch(_bucket_views_and_rebuild, n=n)
    model = ChainNet()
    for rank, res in enumerate(per_replica):
        def check(grads, steps, base=None, what=""):
            for i, (g, p) in enumerate(zip(grads, model.ps)):
                want = expected_grad(model, i, steps, n)
                if base is not None:
                    want = want + base
                assert g.dtype == p.dtype, (what, i)
                assert torch.equal(g.double(), want), (what, i, g, want)

        check(res["first"], [0], what="first step")
        assert res["unused_after_first"] is None
        assert all(res["views_after_first"])
        # First DDP's first-iteration layout (one bucket per dtype in registration order,
        # the buckets in the reverse of the order their dtypes first appear), then rebuilt
        # once in replica 0's arrival order, the parameter that got no gradient
        # (registration index 8) last.
        dtypes = [p.dtype for p in list(model.ps) + [model.unused]]   # registration order

        def groups(order):     # one bucket per dtype, opened in order of first appearance
            found = {}
            for i in order:
                found.setdefault(dtypes[i], []).append(i)
            return list(found.values())

        def bucketed(order):
            return [i for group in groups(order) for i in group]

        assert res["order_initial"] == [i for group in reversed(groups(range(9)))
                                        for i in group]
        arrived = per_replica[0]["arrived"]
        assert sorted(arrived) == list(range(8)) and arrived != list(range(7, -1, -1))
        assert res["order_after_first"] == bucketed(arrived + [8])
        assert res["order_after_first"] != res["order_initial"]
        assert res["order_final"] == res["order_after_first"]

        assert all(res["zeroed_are_views"])
        check(res["after_zero"], [1], what="after zero_grad(set_to_none=False)")
        assert res["same_memory"]          # accumulated in place: no new tensors
        check(res["after_none"], [2], what="after zero_grad(set_to_none=True)")
        assert all(res["views_after_none"])
        check(res["after_replace"], [3], base=3.0, what="after replacing .grad")
        assert all(res["views_after_replace"])

        for i, g in enumerate(res["local"]):          # no communication under no_sync
            want = expected_grad(model, i, [4], 1) if rank == 0 else None
            if rank == 0:
                assert torch.equal(g.double(), want)
        check(res["no_sync"], [4, 5], what="no_sync then synchronised")

        # Statistics: one bucket per dtype here (4 dtypes + the fp32 unused parameter
        # shares the fp32 bucket), exact bytes: the slots packed (DDP's layout), and the
        # 9 "contributed" flags in float32 beside the buckets.
        stats = res["stats_last"]
        assert stats.num_buckets == len(res["layout"]) == 4
        expected_bytes = 0
        element_size = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8}
        assert sorted(layout[0] for layout in res["layout"]) == sorted(element_size)
        for dtype, numels, flat_numel, wire in res["layout"]:
            assert wire == ""
            size = element_size[dtype]
            assert flat_numel == sum(numels)
            expected_bytes += flat_numel * size
        assert stats.bytes_reduced == expected_bytes + 9 * 4
        assert stats.num_parameters == 9
        assert stats.steps == 5 and res["stats_first"].steps == 1
        assert stats.compression is None
        assert res["stats_after_local"] == stats
        # The default NcclAllReduce is launched from C++ on the c10d process group.
        assert res["on_process_group"]
    # Every replica has the same buckets.
    assert per_replica[0]["order_final"] == per_replica[1]["order_final"]
    # Replica 0 waited out replica 1's late start after its own backward; replica 1, last
    # to arrive, waited only for the transfer.
    exposed = [res["stats_last"].exposed_communication_seconds for res in per_replica]
    assert exposed[0] > exposed[1], exposed


def _compressed_setup(compression):
    """A strategy with `compression` on the wire, a small fp32 model built in its scope, and
    this replica's generator."""
    strategy = ts.MirroredStrategy(
        cross_device_ops=ts.NcclAllReduce(compression=compression))
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return strategy, model, torch.Generator().manual_seed(strategy.extended.replica_id)


def _local_grads(model, x):
    """This replica's own gradient of the loss the tests use, without the strategy."""
    return torch.func.grad(lambda params: torch.func.functional_call(model, params, (x,))
                           .pow(2).sum())({k: v.detach() for k, v in
                                          model.named_parameters()})


def _compressed(compression):
    strategy, model, g = _compressed_setup(compression)
    with strategy.scope():
        half = nn.Linear(4, 4, dtype=torch.float16)   # already 2 bytes: never compressed
    x = torch.randn(8, 16, generator=g) * (strategy.extended.replica_id + 1)

    def step():
        (model(x).pow(2).sum() + half(torch.ones(1, 4, dtype=torch.float16)).sum()).backward()

    strategy.run(step)
    return from_every_replica({"grads": {k: p.grad.clone() for k, p in
                                         model.named_parameters()},
                               "half": half.weight.grad.clone(),
                               "local": _local_grads(model, x),
                               "stats": strategy.extended.stats()})


def _compressed_mean(compression):
    # Two averaged backward calls without zero_grad: the second adds its mean to the first
    # (the older sum kept aside while the bucket carries the new one).
    strategy, model, g = _compressed_setup(compression)
    xs = [torch.randn(8, 16, generator=g) * (strategy.extended.replica_id + 1)
          for _ in range(2)]
    means = []
    for x in xs:
        strategy.run(lambda x=x: ts.scale_mean_loss(model(x).pow(2).sum()).backward())
        means.append({k: p.grad.clone() for k, p in model.named_parameters()})
    views = all(strategy.extended.gradient_reducer.is_bucket_view(p)
                for p in model.parameters())
    return from_every_replica({"means": means, "local": [_local_grads(model, x) for x in xs],
                               "views": views})


@pytest.mark.parametrize("compression,unit_roundoff", [("bf16", 2.0 ** -8),
                                                       ("fp16", 2.0 ** -11)])
def test_an_averaged_backward_over_a_narrow_wire_gives_the_mean(compression, unit_roundoff):
    # The wire's 1/N scale is the averaging (no pass of its own): 3 replicas, where 1/3 is
    # not exact, still get the mean within the wire's rounding, the same on every replica,
    # and accumulation without zero_grad adds the second mean to the first.
    n = 3
    per_replica = launch(_compressed_mean, compression, n=n)
    for step in range(2):
        for key, got in per_replica[0]["means"][step].items():
            parts = [r["local"][k][key] for r in per_replica for k in range(step + 1)]
            exact = sum(parts) / n
            bound = 3 * unit_roundoff * sum(p.abs() for p in parts) / n + 1e-30
            assert bool(((got - exact).abs() <= bound).all()), (compression, step, key)
            for other in per_replica[1:]:
                assert torch.equal(other["means"][step][key], got)
    assert all(r["views"] for r in per_replica)


def test_compression_error_is_bounded_by_the_wire_precision():
    n = 2
    for compression, unit_roundoff in (("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11)):
        per_replica = launch(_compressed, compression, n=n)
        for res in per_replica:
            stats = res["stats"]
            assert stats.compression == compression
            assert stats.num_buckets == 2
            # fp32 bucket: 4 slots of 512, 32, 128, 4 elements in 2 bytes each; fp16 bucket:
            # 16 + 4 elements (slots packed, as DDP's); the 6 "contributed" flags travel
            # beside the buckets, in float32.
            assert stats.bytes_reduced == (512 + 32 + 128 + 4) * 2 + (16 + 4) * 2 + 6 * 4
            assert torch.equal(res["half"], torch.full((4, 4), float(n), dtype=torch.float16))
            for key, got in res["grads"].items():
                parts = [r["local"][key] for r in per_replica]
                exact = sum(parts)
                bound = 2 * unit_roundoff * sum(p.abs() for p in parts) + 1e-30
                err = (got - exact).abs()
                assert got.dtype == torch.float32
                assert bool((err <= bound).all()), (compression, key, (err / bound).max())
        # The wire really was narrower: the result differs from the fp32 sum somewhere.
        grads = per_replica[0]["grads"]
        exact = {k: sum(r["local"][k] for r in per_replica) for k in grads}
        assert any(not torch.equal(grads[k], exact[k]) for k in grads), compression
        assert per_replica[0]["grads"].keys() == per_replica[1]["grads"].keys()
        for k in grads:
            assert torch.equal(per_replica[0]["grads"][k], per_replica[1]["grads"][k])


def test_compression_option_is_checked():
    with pytest.raises(ValueError, match="compression must be None, 'bf16' or 'fp16'"):
        ts.NcclAllReduce(compression="int8")
    with pytest.raises(ValueError, match="compression must be None, 'bf16' or 'fp16'"):
        ts.CommunicationOptions(compression="fp8")
    assert ts.CommunicationOptions(compression="bf16").compression == "bf16"
    assert "compression='fp16'" in repr(ts.NcclAllReduce(compression="fp16"))


def test_one_replica_stats_are_zero():
    stats = ts.OneDeviceStrategy("cpu").extended.stats()
    assert stats.bytes_reduced == 0 and stats.num_buckets == 0


class CountingAllReduce(ts.CrossDeviceOps):
    """A Python cross-device ops (as HierarchicalCopyAllReduce is): every bucket must come
    through its all_reduce_async."""

    def __init__(self):
        self.sizes = []

    def all_reduce_async(self, flat, group):
        import torch.distributed as dist

        self.sizes.append(flat.numel())
        return dist.all_reduce(flat, group=group, async_op=True)


def _through_python_cross_device_ops():
    ops = CountingAllReduce()
    strategy = ts.MirroredStrategy(cross_device_ops=ops, bucket_cap_mb=0.00005)
    rank = strategy.extended.replica_id
    with strategy.scope():
        model = ChainNet()
    for step in range(2):
        model.zero_grad()
        strategy.run(lambda: model(inputs(rank, step)).backward())
    assert not strategy.extended.gradient_reducer.launches_on_process_group()
    return _grads(model), ops.sizes, strategy.extended.gradient_reducer.bucket_layout(), \
        strategy.extended.stats()


def test_buckets_go_through_a_python_cross_device_ops():
    n = 2
    grads, sizes, layout, stats = launch(_through_python_cross_device_ops, n=n)
    model = ChainNet()
    for i, g in enumerate(grads):
        assert torch.equal(g.double(), expected_grad(model, i, [1], n))
    assert len(layout) > 4                      # 52-byte buckets: several per dtype
    per_step = [flat for _, _, flat, _ in layout]
    # Every bucket, in bucket order, then the step's 9 "contributed" flags.
    assert sizes[-len(per_step) - 1:] == per_step + [9]
    assert stats.num_buckets == len(layout)


def _multi_worker_with_compression_options():
    options = ts.CommunicationOptions(compression="bf16")
    strategy = ts.MultiWorkerMirroredStrategy(
        communication_options=options, cross_device_ops=ts.HierarchicalCopyAllReduce())
    rank = strategy.extended.replica_id
    with strategy.scope():
        w = nn.Parameter(torch.zeros(5))
        holder = nn.Module()
        holder.w = w
    x = torch.tensor([1.0, 3.0, 0.1, 100.0, -2.5]) * (rank + 1)
    strategy.run(lambda: (w * x).sum().backward())
    return (w.grad.clone(), strategy.extended.stats(),
            strategy.extended.gradient_reducer.launches_on_process_group())


def test_communication_options_compression_reaches_a_python_cross_device_ops():
    grad, stats, on_process_group = launch(_multi_worker_with_compression_options, n=2)
    exact = torch.tensor([1.0, 3.0, 0.1, 100.0, -2.5]) * 3
    assert stats.compression == "bf16" and not on_process_group
    assert stats.bytes_reduced == 5 * 2 + 4          # 5 values in bf16, 1 flag in float32
    assert bool(((grad - exact).abs() <= 2 * 2 ** -8 * exact.abs()).all()), grad
    assert not torch.equal(grad, exact)              # 0.1 is not a bf16 number
    with pytest.raises(ValueError, match="disagrees with"):
        from torchstrategy.collectives.compression import with_compression
        with_compression(ts.NcclAllReduce(compression="fp16"), "bf16")
