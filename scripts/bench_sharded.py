"""ShardedStrategy against a hand-written FSDP2 loop on the same model: step time (wall and
CPU) as paired ratios over alternating rounds, and the memory each replica holds; with
``--offload``, where CPU offload puts parameters, gradients and optimizer state.

    python scripts/bench_sharded.py                      # 2 CPU replicas (gloo)
    python scripts/bench_sharded.py --replicas 4 --width 512 --layers 8
    python scripts/bench_sharded.py --offload            # cpu_offload=False vs True
    python scripts/bench_sharded.py --split              # + our step without run, theirs in run
    torchrun --nproc-per-node=8 scripts/bench_sharded.py # GPUs (NCCL)

Both sides run in the same processes, on the same process group, with the same units
(each transformer layer, then the model), the same options (FSDP2's defaults), the same
reduction (a plain SUM of gradients) and the same data. "ours" is ``strategy.run(step)``
with the model and optimizer built in ``ShardedStrategy.scope()``; "by hand" is
``fully_shard`` on each layer and the model, and the step called directly.

Timing: each round times ``--steps`` steps of one side, then of the other (the order
alternates from round to round), so a machine busy with something else slows both sides
of a round alike. A round's time is the slowest replica's; its ratio is ours / by hand.
Printed: the median of those paired ratios, their quartiles (the spread of one round's
ratio) and a 95% confidence interval of the median (what to compare a difference from 1
with: it narrows as rounds are added), for wall time and for CPU time
(``time.process_time``: every thread of every replica, gloo's included, summed over the
replicas), and the machine's load average before and after.

Memory: on GPUs, each side's peak allocated memory during its steps
(``torch.cuda.max_memory_allocated``); on CPUs, the bytes of parameters, gradients and
Adam state a replica holds (its local shards; the process's peak RSS covers both sides
and is printed once).
"""
import argparse
import datetime
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torchstrategy as ts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--replicas", type=int, default=2, help="CPU replicas (no GPU)")
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--batch", type=int, default=8, help="per replica")
parser.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
parser.add_argument("--rounds", type=int, default=20, help="alternating rounds")
parser.add_argument("--split", action="store_true",
                    help="also time our model's step called without strategy.run and the "
                    "hand-written step inside strategy.run (what run costs, what the "
                    "model built in scope costs)")
parser.add_argument("--same-parameters", action="store_true",
                    help="build ours with same_parameters_every_step=True (FSDP2's own "
                    "reduction, without the mask of parameters each replica used)")
parser.add_argument("--offload", action="store_true",
                    help="report where cpu_offload=False / True keep the training state")

VOCAB = 1000


class Transformer(nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width,
                                       dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_step(model, optimizer, global_batch):
    def step(tokens, targets):
        per_example = F.cross_entropy(model(tokens).transpose(1, 2), targets,
                                      reduction="none").mean(1)
        loss = per_example.sum() / global_batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients to count them
        return loss.detach()
    return step


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model, optimizer):
    """Bytes of parameters + gradients + Adam state this replica holds (local shards)."""
    total = 0
    for p in model.parameters():
        total += 2 * local(p).numel() * local(p).element_size()  # the parameter, its gradient
        for value in optimizer.state[p].values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += local(value).numel() * local(value).element_size()
    return total


def bytes_by_device(model, optimizer):
    """{"parameters" / "gradients" / "optimizer state": {device type: bytes}} of this
    replica's local shards."""
    where = {"parameters": {}, "gradients": {}, "optimizer state": {}}

    def add(kind, tensor):
        tensor = local(tensor)
        where[kind][tensor.device.type] = where[kind].get(tensor.device.type, 0) + \
            tensor.numel() * tensor.element_size()
    for p in model.parameters():
        add("parameters", p)
        if p.grad is not None:
            add("gradients", p.grad)
        for value in optimizer.state[p].values():
            if torch.is_tensor(value) and value.dim() > 0:
                add("optimizer state", value)
    return where


def timed(call, steps, device):
    """(wall seconds, CPU seconds of this process, peak CUDA bytes or None) for `steps`
    calls."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return wall, cpu, peak


def quartiles(values):
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def median_interval(values):
    """A distribution-free 95% confidence interval of the median: the order statistics
    whose ranks a Binomial(n, 1/2) count stays between with 95% probability (normal
    approximation; wider than the data's range below 6 values)."""
    ordered, n = sorted(values), len(values)
    half = 1.96 * math.sqrt(n) / 2
    low, high = math.floor(n / 2 - half), math.ceil(n / 2 + half)
    return ordered[max(low, 0)], ordered[min(high, n - 1)]


def make_strategy(args, **options):
    if args.same_parameters:
        options.setdefault("same_parameters_every_step", True)
    return ts.ShardedStrategy(devices=None if ts.runtime.world_from_environment()
                              else [f"cpu:{i}" for i in range(args.replicas)], **options)


def batch(ext, args):
    generator = torch.Generator().manual_seed(ext.replica_id)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq), generator=generator)
    tokens = tokens.to(ext.torch_device)
    return tokens, tokens.flip(1)


def bench(args):
    load_before = os.getloadavg()
    strategy = make_strategy(args)
    ext = strategy.extended
    device = ext.torch_device
    n = strategy.num_replicas_in_sync
    global_batch = args.batch * n
    tokens, targets = batch(ext, args)

    torch.manual_seed(0)
    with strategy.scope():
        ours = Transformer(args.width, args.layers)
        ours_optimizer = torch.optim.Adam(ours.parameters(), lr=1e-4)
    ours_step = make_step(ours, ours_optimizer, global_batch)

    torch.manual_seed(0)
    by_hand = Transformer(args.width, args.layers).to(device)
    for module in list(by_hand.layers) + [by_hand]:
        fully_shard(module, mesh=ext.mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    hand_optimizer = torch.optim.Adam(by_hand.parameters(), lr=1e-4)
    hand_step = make_step(by_hand, hand_optimizer, global_batch)

    calls = {"ours": lambda: strategy.run(ours_step, args=(tokens, targets)),
             "by hand": lambda: hand_step(tokens, targets)}
    models = {"ours": (ours, ours_optimizer), "by hand": (by_hand, hand_optimizer)}
    if args.split:
        calls["ours, no run"] = lambda: ours_step(tokens, targets)
        calls["hand in run"] = lambda: strategy.run(hand_step, args=(tokens, targets))
        models["ours, no run"], models["hand in run"] = models["ours"], models["by hand"]
    for call in calls.values():  # warm-up: lazy init, optimizer state, allocator
        call()
        call()
    walls = {name: [] for name in calls}
    cpus = {name: [] for name in calls}
    peaks = {name: 0 for name in calls}
    for round_index in range(args.rounds):
        order = list(calls.items())
        for name, call in order if round_index % 2 == 0 else reversed(order):
            ext.communicator.barrier()
            wall, cpu, peak = timed(call, args.steps, device)
            walls[name].append(wall / args.steps)
            cpus[name].append(cpu / args.steps)
            peaks[name] = max(peaks[name], peak or 0)
    held = {name: held_bytes(*models[name]) for name in calls}
    report = ext.communicator.gather_objects(
        {"walls": walls, "cpus": cpus, "peaks": peaks, "held": held})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not ext.is_chief:
        return
    # Per round: the slowest replica's wall time, the replicas' CPU time summed.
    wall = {name: [max(r["walls"][name][i] for r in report) for i in range(args.rounds)]
            for name in calls}
    cpu = {name: [sum(r["cpus"][name][i] for r in report) for i in range(args.rounds)]
           for name in calls}
    parameters = sum(p.numel() for p in ours.parameters())
    load_after = os.getloadavg()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{os.cpu_count()} cores, load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; command: python {' '.join(sys.argv)}")
    print(f"{n} replica(s) on {device.type}, transformer {args.layers}x{args.width} "
          f"({parameters / 1e6:.1f}M parameters), batch {args.batch}x{args.seq} per "
          f"replica, {args.rounds} alternating rounds of {args.steps} steps per side")
    print(f"{'':14s}{'step ms (median)':>18s}{'CPU ms / step':>15s}{'held MiB':>10s}"
          + (f"{'peak MiB':>10s}" if device.type == "cuda" else ""))
    for name in calls:
        print(f"{name:14s}{statistics.median(wall[name]) * 1e3:18.1f}"
              f"{statistics.median(cpu[name]) * 1e3:15.1f}"
              f"{max(r['held'][name] for r in report) / 2**20:10.2f}"
              + (f"{max(r['peaks'][name] for r in report) / 2**20:10.1f}"
                 if device.type == "cuda" else ""))
    for name in (name for name in calls if name != "by hand"):
        for what, series in (("wall", wall), ("CPU", cpu)):
            ratios = [a / b for a, b in zip(series[name], series["by hand"])]
            q1, median, q3 = quartiles(ratios)
            low, high = median_interval(ratios)
            print(f"{what:4s} time {name} / by hand, paired per round: median {median:.3f}, "
                  f"quartiles {q1:.3f} .. {q3:.3f}, median's 95% interval {low:.3f} .. "
                  f"{high:.3f}" + (" (target <= 1.05)" if name == "ours" else ""))
    print(f"held per replica / MirroredStrategy's (16 B per parameter with Adam): "
          f"{max(r['held']['ours'] for r in report) / (16 * parameters):.3f}")
    if device.type != "cuda":
        print(f"peak RSS of replica 0's process (both sides): {rss:.0f} MiB")


def offload(args):
    """Where the training state lives with cpu_offload=False and True, after two steps."""
    rows = {}
    for cpu_offload in (False, True):
        strategy = make_strategy(args, cpu_offload=cpu_offload)
        ext = strategy.extended
        device = ext.torch_device
        tokens, targets = batch(ext, args)
        torch.manual_seed(0)
        with strategy.scope():
            model = Transformer(args.width, args.layers)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        step = make_step(model, optimizer, args.batch * strategy.num_replicas_in_sync)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            strategy.run(step, args=(tokens, targets))
        where = bytes_by_device(model, optimizer)
        if device.type == "cuda":
            where["device memory"] = {"allocated": torch.cuda.memory_allocated(),
                                      "peak": torch.cuda.max_memory_allocated()}
        rows[cpu_offload] = (ext.communicator.gather_objects(where), ext.is_chief, device)
        del model, optimizer, step
    for cpu_offload, (report, chief, device) in rows.items():
        if not chief:
            continue
        mine = report[0]
        print(f"cpu_offload={cpu_offload}: replica 0 ({device}) holds, in MiB:")
        for kind, places in mine.items():
            shown = ", ".join(f"{place} {size / 2**20:.2f}" for place, size in places.items())
            print(f"  {kind:16s} {shown}")
    if rows[False][2].type != "cuda" and rows[False][1]:
        print("On CPU replicas both settings keep everything in host memory: offload moves "
              "nothing there (FSDP2 copies each gathered unit to the compute device, here "
              "the same CPU). On GPUs the parameters, gradients and optimizer state move to "
              "host memory and the device keeps only gathered units and activations.")


if __name__ == "__main__":
    parsed = parser.parse_args()
    offload(parsed) if parsed.offload else bench(parsed)
