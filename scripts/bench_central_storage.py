"""Time one training step: CentralStorageStrategy (2 CPU replicas in threads) vs one device.

Both configurations train the same MLP (the one of bench_step.py) with the same optimizer
on the same global batch, in this process:

  central  ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"]): the global batch
           split over two replica threads reading the central parameters, gradients
           summed onto the parameters, one optimizer update
  single   plain torch on the whole global batch: the same arithmetic with no replicas,
           the floor (both use the same CPU cores)

The ratio central / single is the cost of the replica machinery (threads, the per-replica
parameter reads, the gradient sum, the rendezvous). The configurations alternate in short
chunks of steps (order rotating) so machine noise hits both alike; medians over chunks.

    .venv/bin/python scripts/bench_central_storage.py            # about a minute
    .venv/bin/python scripts/bench_central_storage.py --quick    # a few seconds
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import torchstrategy as ts
from bench_step import make_model


def build_steps(global_batch, width, depth):
    torch.manual_seed(0)
    x = torch.randn(global_batch, 64)
    y = torch.randint(0, 10, (global_batch,))

    strategy = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        central_model = make_model(width, depth)
        central_opt = torch.optim.SGD(central_model.parameters(), lr=0.01, momentum=0.9)
    (xb, yb), = strategy.experimental_distribute_dataset([(x, y)])

    def replica_step(xr, yr):
        per_example = F.cross_entropy(central_model(xr), yr, reduction="none")
        loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()
        central_opt.step()
        central_opt.zero_grad()
        return loss.detach()

    def central():
        strategy.run(replica_step, args=(xb, yb))

    single_model = make_model(width, depth)
    single_opt = torch.optim.SGD(single_model.parameters(), lr=0.01, momentum=0.9)

    def single():
        F.cross_entropy(single_model(x), y).backward()
        single_opt.step()
        single_opt.zero_grad()

    return {"central": central, "single": single}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per config")
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.chunk, args.warmup, args.width, args.depth = 20, 5, 2, 64, 2

    steps = build_steps(args.batch, args.width, args.depth)
    names = list(steps)
    for name in names:
        for _ in range(args.warmup):
            steps[name]()
    times = {name: [] for name in names}
    for chunk in range(args.steps // args.chunk):
        order = names[chunk % len(names):] + names[:chunk % len(names)]
        for name in order:
            start = time.perf_counter()
            for _ in range(args.chunk):
                steps[name]()
            times[name].append((time.perf_counter() - start) / args.chunk * 1e3)
    medians = {name: statistics.median(times[name]) for name in names}
    print(f"MLP {args.depth}x{args.width}, global batch {args.batch}, "
          f"{torch.get_num_threads()} intra-op threads")
    print("| configuration | median ms/step |")
    print("|---|---|")
    for name in names:
        print(f"| {name} | {medians[name]:.2f} |")
    print(f"central / single = {medians['central'] / medians['single']:.3f}")


if __name__ == "__main__":
    main()
