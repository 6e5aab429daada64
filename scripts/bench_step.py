"""Time one training step: torchstrategy's MirroredStrategy vs. torch DDP vs. no sync.

Three configurations of the same model, per-replica batch and optimizer, on 2 CPU
replicas (gloo):

  ours     ts.MirroredStrategy(); strategy.run(train_step); gradients summed by the
           fused bucketed reducer
  ddp      plain torch: DistributedDataParallel
  no-sync  each replica trains on its own (no gradient communication): the floor both
           synchronous configurations are measured against

Machine noise (other jobs on the same cores) easily moves a step time by 2x between two
runs a minute apart, so the configurations are measured side by side: each round starts 2
fresh processes with ``ts.launch``; in them the script initialises torch.distributed
itself (``dist.init_process_group("gloo", ...)``, as any DDP program does), the
MirroredStrategy adopts that process group, and the three configurations then alternate
in short chunks of steps (the order rotating every chunk). A chunk's time is the slower
replica's; the table gives the median over all chunks of all rounds.

    .venv/bin/python scripts/bench_step.py               # default: 1-2 minutes
    .venv/bin/python scripts/bench_step.py --quick       # smoke test: a few seconds
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts

CONFIGS = ("ours", "ddp", "no-sync")
NUM_REPLICAS = 2


def make_model(width, depth):
    """An MLP on digits-sized input (8x8 -> 10 classes): 4 * depth + 4 parameter tensors."""
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    layers += [nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def init_process_group():
    """Plain torch: a gloo group on the rendezvous store ts.launch hosts."""
    timeout = datetime.timedelta(seconds=float(os.environ.get(
        "TORCHSTRATEGY_TIMEOUT_SECONDS", 300)))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def build_steps(batch, width, depth):
    """Returns {configuration: function running one training step}."""
    rank = dist.get_rank()
    # Each replica trains on its own fixed batch: data loading is not what is measured.
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(batch, 64, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    # ours: the user code of DESIGN.md.
    strategy = ts.MirroredStrategy()          # adopts the process group made above
    global_batch = batch * strategy.num_replicas_in_sync
    torch.manual_seed(0)
    with strategy.scope():
        ours = make_model(width, depth)
        ours_opt = make_optimizer(ours)

    def train_step(x, y):
        per_example = F.cross_entropy(ours(x), y, reduction="none")
        loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()
        ours_opt.step()
        ours_opt.zero_grad()
        return loss

    def ours_step():
        strategy.run(train_step, args=(x, y))

    # ddp and no-sync: plain torch, the same model and optimizer.
    def plain_step(model, optimizer):
        def step():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(make_model(width, depth))
    torch.manual_seed(0)
    alone = make_model(width, depth)
    return {"ours": ours_step,
            "ddp": plain_step(ddp, make_optimizer(ddp)),
            "no-sync": plain_step(alone, make_optimizer(alone))}


def replica_main(chunks, chunk_steps, warmup, batch, width, depth):
    """One replica; returns {configuration: {"wall"|"cpu": [seconds per step of each
    chunk]}}, the slower replica's."""
    init_process_group()
    steps = build_steps(batch, width, depth)
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall = {c: [] for c in CONFIGS}
    cpu = {c: [] for c in CONFIGS}
    for i in range(chunks):
        order = CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]
        for config in order:
            step = steps[config]
            step()                      # untimed: brings this model back into cache
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(chunk_steps):
                step()
            wall[config].append((time.perf_counter() - start) / chunk_steps)
            cpu[config].append((time.process_time() - start_cpu) / chunk_steps)
    # The slower replica's time for each chunk.
    table = torch.tensor([wall[c] for c in CONFIGS] + [cpu[c] for c in CONFIGS],
                         dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    n = len(CONFIGS)
    return {c: {"wall": table[k].tolist(), "cpu": table[n + k].tolist()}
            for k, c in enumerate(CONFIGS)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300,
                        help="timed steps per configuration per round")
    parser.add_argument("--chunk", type=int, default=10,
                        help="consecutive steps of one configuration before switching")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each in 2 fresh processes")
    parser.add_argument("--batch", type=int, default=64, help="per-replica batch size")
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 round of 20 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.chunk, args.warmup, args.rounds = 20, 5, 3, 1
    chunks = max(1, args.steps // args.chunk)

    model = make_model(args.width, args.depth)
    tensors = list(model.parameters())
    megabytes = sum(p.numel() * p.element_size() for p in tensors) / 2**20
    print(f"model: MLP {args.depth}x{args.width}, {len(tensors)} parameter tensors, "
          f"{megabytes:.1f} MiB; {NUM_REPLICAS} CPU replicas on gloo, per-replica batch "
          f"{args.batch}, SGD")
    print(f"{args.rounds} round(s) x {chunks} chunks x {args.chunk} steps per "
          f"configuration, interleaved", flush=True)

    times = {c: [] for c in CONFIGS}
    cpu = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        result = ts.launch(replica_main, chunks, args.chunk, args.warmup, args.batch,
                           args.width, args.depth, num_replicas=NUM_REPLICAS)
        for c in CONFIGS:
            times[c] += result[c]["wall"]
            cpu[c] += result[c]["cpu"]
        print(f"round {r + 1}/{args.rounds} (median ms/step): " + ", ".join(
            f"{c} {statistics.median(result[c]['wall']) * 1e3:.2f}" for c in CONFIGS),
            flush=True)

    med = {c: statistics.median(times[c]) for c in CONFIGS}
    med_cpu = {c: statistics.median(cpu[c]) for c in CONFIGS}
    q = {c: statistics.quantiles(times[c], n=4) if len(times[c]) > 1 else [times[c][0]] * 3
         for c in CONFIGS}
    print()
    print(f"{'configuration':<14}{'median ms/step':>16}{'p25':>9}{'p75':>9}"
          f"{'CPU ms/step':>13}{'chunks':>8}")
    for c in CONFIGS:
        print(f"{c:<14}{med[c] * 1e3:>16.2f}{q[c][0] * 1e3:>9.2f}{q[c][2] * 1e3:>9.2f}"
              f"{med_cpu[c] * 1e3:>13.2f}{len(times[c]):>8}")
    print()
    # Wall time: ratio of the medians, and the median of the ratios of chunks run back to
    # back (paired: both chunks of a pair saw nearly the same machine load). CPU time (the
    # process's, gloo's threads included) barely depends on other jobs sharing the cores;
    # it leaves out time spent waiting for the other replica.
    print(f"{'ratio':<16}{'of medians':>12}{'paired':>10}{'CPU time':>10}")
    for a, b in (("ours", "ddp"), ("ours", "no-sync"), ("ddp", "no-sync")):
        paired = statistics.median(x / y for x, y in zip(times[a], times[b]))
        print(f"{a + ' / ' + b:<16}{med[a] / med[b]:>12.3f}{paired:>10.3f}"
              f"{med_cpu[a] / med_cpu[b]:>10.3f}")


if __name__ == "__main__":
    main()
