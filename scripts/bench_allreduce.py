"""Time the gradient all-reduce of a ResNet-like gradient set: the fused bucketed reducer
vs. one all-reduce per tensor vs. DDP's reducer vs. one contiguous all-reduce.

The gradient set: 160 fp32 tensors, 42 MiB in all (a third large, convolution-like
tensors; the rest small, BatchNorm-like vectors), on 2 CPU replicas (gloo).

  contiguous       dist.all_reduce of one 42 MiB buffer: the physical limit
  per-tensor       one dist.all_reduce per gradient, one after the other
  per-tensor-async one asynchronous dist.all_reduce per gradient, then wait for all
  naive-buckets    flatten into 25 MiB buckets, all-reduce, unflatten (copy back)
  ddp              torch DistributedDataParallel's reducer, driven by a backward pass
  ours-backward    ts.MirroredStrategy's reducer, driven by the same backward pass
  ours-ready       the reducer's C++ hot path with gradients already in their buckets,
                   marked ready in bucket order (what the post-accumulate hook does), then
                   finalised: the cost of the reducer itself

The two "backward" configurations run the same autograd graph: one node whose backward
returns the precomputed gradients, so the step is autograd's accumulation into .grad plus
the reducer, with no model compute. Then the same 42 MiB split into 16 / 160 / 1600
tensors (ours-ready and contiguous).

Configurations alternate round-robin in the same 2 processes, each timed on the slower
replica; tables give medians over all repetitions, ratios of medians and paired ratios
(the median of per-round ratios, both measured back to back), and CPU-time ratios, which
depend less on other jobs sharing the cores.

    .venv/bin/python scripts/bench_allreduce.py            # about a minute
    .venv/bin/python scripts/bench_allreduce.py --quick    # smoke test
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from given_gradients import GivenGradients  # scripts/given_gradients.py
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import torchstrategy as ts
from torchstrategy.collectives.reducer import GradientReducer

NUM_REPLICAS = 2
TOTAL_BYTES = 42 * 2**20


def resnet_like_sizes(count, total_elements):
    """`count` tensor sizes summing to `total_elements`: every third tensor large (weights
    growing geometrically, as convolutions do from stage to stage), the others small
    vectors of 64..2048 elements (BatchNorm weights and biases)."""
    sizes = []
    for i in range(count):
        stage = min(3, 4 * i // count)
        if i % 3 == 0:
            sizes.append(None)                       # large: filled below
        else:
            sizes.append(64 * 2 ** (stage + i % 2 * 2) // (2 if i % 5 == 0 else 1))
    large = [i for i, s in enumerate(sizes) if s is None]
    remaining = total_elements - sum(s for s in sizes if s is not None)
    weights = [1.04 ** k for k in range(len(large))]
    for k, i in enumerate(large):
        sizes[i] = int(remaining * weights[k] / sum(weights)) // 4 * 4
    sizes[large[-1]] += total_elements - sum(sizes)
    return sizes


def make_module(sizes):
    module = nn.Module()
    module.ps = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in sizes])
    return module


def init_process_group():
    timeout = datetime.timedelta(seconds=float(os.environ.get(
        "TORCHSTRATEGY_TIMEOUT_SECONDS", 300)))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def build(sizes, strategy, with_ddp):
    """Returns {configuration: one step} for the gradient set `sizes`."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    total = sum(sizes)
    configs = {}

    flat = torch.randn(total, generator=gen)
    configs["contiguous"] = lambda: dist.all_reduce(flat)

    if with_ddp:
        tensors = [g.clone() for g in grads]

        def per_tensor():
            for t in tensors:
                dist.all_reduce(t)
        configs["per-tensor"] = per_tensor

        def per_tensor_async():
            for w in [dist.all_reduce(t, async_op=True) for t in tensors]:
                w.wait()
        configs["per-tensor-async"] = per_tensor_async

        cap = 25 * 2**20 // 4

        def naive_buckets():
            start = 0
            while start < len(tensors):
                end, size = start, 0
                while end < len(tensors) and (size == 0 or size + tensors[end].numel() <= cap):
                    size += tensors[end].numel()
                    end += 1
                bucket = _flatten_dense_tensors(tensors[start:end])
                dist.all_reduce(bucket)
                for t, r in zip(tensors[start:end],
                                _unflatten_dense_tensors(bucket, tensors[start:end])):
                    t.copy_(r)
                start = end
        configs["naive-buckets"] = naive_buckets

        ddp_module = make_module(sizes)
        ddp = nn.parallel.DistributedDataParallel(ddp_module)
        ddp_params = list(ddp_module.parameters())

        def ddp_step():
            for p in ddp_params:
                p.grad = None
            # DDP's reducer is armed by forward; the loss is the same given-gradients node.
            ddp(torch.zeros(()))
            GivenGradients.apply(grads, *ddp_params).backward()
        ddp_module.forward = lambda x: x
        configs["ddp"] = ddp_step

    if with_ddp:   # the strategy's own reducer, exactly as a training step uses it
        with strategy.scope():
            ours = make_module(sizes)
        ours_params = list(ours.parameters())
        reducer = strategy.extended.gradient_reducer

        def ours_backward():
            for p in ours_params:
                p.grad = None
            strategy.run(lambda: GivenGradients.apply(grads, *ours_params).backward())
        configs["ours-backward"] = ours_backward
    else:          # one process, several gradient sets: a reducer of their own
        ours_params = list(make_module(sizes).parameters())
        reducer = GradientReducer(strategy.extended.communicator)
        reducer.add_parameters(ours_params)
    for _ in range(2):   # buckets rebuilt in arrival order, then gradients become views
        GivenGradients.apply(grads, *ours_params).backward()
    assert all(reducer.is_bucket_view(p) for p in ours_params)
    configs["ours-ready"] = reducer.reduce_all_now
    return configs


def time_configs(configs, repeats, warmup):
    """{name: ([wall seconds], [cpu seconds])}, the slower replica's, interleaved."""
    names = list(configs)
    for name in names:
        for _ in range(warmup):
            configs[name]()
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            configs[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    table = torch.tensor([wall[n] for n in names] + [cpu[n] for n in names],
                         dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    k = len(names)
    return {n: (table[i].tolist(), table[k + i].tolist()) for i, n in enumerate(names)}


def replica_main(repeats, warmup, counts):
    init_process_group()
    strategy = ts.MirroredStrategy()
    elements = TOTAL_BYTES // 4
    results = {"main": time_configs(build(resnet_like_sizes(160, elements), strategy, True),
                                    repeats, warmup)}
    for count in counts:
        sizes = resnet_like_sizes(count, elements) if count >= 10 else [elements // count] * count
        configs = build(sizes, strategy, False)
        results[count] = time_configs(configs, repeats, warmup)
    return results


def summary(results, names, reference):
    med = {n: statistics.median(results[n][0]) for n in names}
    med_cpu = {n: statistics.median(results[n][1]) for n in names}
    print(f"{'configuration':<18}{'median ms':>11}{'p25':>9}{'p75':>9}{'CPU ms':>9}")
    for n in names:
        q = statistics.quantiles(results[n][0], n=4)
        print(f"{n:<18}{med[n] * 1e3:>11.2f}{q[0] * 1e3:>9.2f}{q[2] * 1e3:>9.2f}"
              f"{med_cpu[n] * 1e3:>9.2f}")
    return med, med_cpu


def ratio_line(results, a, b, med, med_cpu, target=""):
    paired = statistics.median(x / y for x, y in zip(results[a][0], results[b][0]))
    print(f"{a + ' / ' + b:<32}{med[a] / med[b]:>9.3f}{paired:>9.3f}"
          f"{med_cpu[a] / med_cpu[b]:>9.3f}   {target}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 repeats")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup = 4, 1
    counts = (16, 160, 1600)
    sizes = resnet_like_sizes(160, TOTAL_BYTES // 4)
    print(f"gradient set: {len(sizes)} fp32 tensors, {sum(sizes) * 4 / 2**20:.1f} MiB "
          f"(largest {max(sizes) * 4 / 2**20:.2f} MiB, {sum(s < 4096 for s in sizes)} under "
          f"16 KiB); {NUM_REPLICAS} CPU replicas on gloo; {args.repeats} interleaved repeats; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    res = ts.launch(replica_main, args.repeats, args.warmup, counts,
                    num_replicas=NUM_REPLICAS, timeout_seconds=1800)

    print()
    main_res = res["main"]
    names = list(main_res)
    med, med_cpu = summary(main_res, names, "contiguous")
    print()
    print(f"{'ratio':<32}{'medians':>9}{'paired':>9}{'CPU':>9}")
    ratio_line(main_res, "ours-ready", "contiguous", med, med_cpu, "target <= 1.15")
    ratio_line(main_res, "ours-backward", "ddp", med, med_cpu, "target <= 0.9")
    ratio_line(main_res, "per-tensor", "ours-ready", med, med_cpu, "target >= 3")
    ratio_line(main_res, "per-tensor-async", "ours-ready", med, med_cpu)
    ratio_line(main_res, "naive-buckets", "ours-ready", med, med_cpu)
    ratio_line(main_res, "ours-backward", "contiguous", med, med_cpu)
    print()
    print("same 42 MiB in N tensors (ours-ready; contiguous of the same bytes alongside)")
    print(f"{'tensors':>8}{'ours ms':>10}{'contig ms':>11}{'ours/contig':>13}")
    ours = {}
    for count in counts:
        r = res[count]
        ours[count] = statistics.median(r["ours-ready"][0])
        contig = statistics.median(r["contiguous"][0])
        print(f"{count:>8}{ours[count] * 1e3:>10.2f}{contig * 1e3:>11.2f}"
              f"{ours[count] / contig:>13.3f}")
    print(f"growth 16 -> 1600 tensors: {ours[1600] / ours[16]:.3f} (target <= 1.2)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
