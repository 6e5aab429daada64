"""Parameter-server benchmark: what scheduling costs, and how steps scale with workers.

    .venv/bin/python scripts/bench_ps.py [--closures 700] [--steps 200]

Prints, measured side by side in one run on local clusters (127.0.0.1):
1. the round trip of one empty scheduled function (schedule + fetch, one at a time)
   against a bare ``rpc_async(...).wait()`` of the same no-op function to the same worker
   (the physical floor of one rpc): their ratio is the coordinator's overhead;
2. throughput of many empty functions scheduled at once (the queue kept full);
3. training steps per second of a small MLP with 1 and with 2 workers (1 ps), and their ratio,
   with the time ``schedule`` itself takes on the chief for such a step.
The rpc figures are medians over chunks interleaved with each other.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchstrategy as ts  # noqa: E402
# An importable no-op (the worker's pid) for both the bare rpc and the scheduled function.
from torchstrategy.parameter_server.server import ping as noop  # noqa: E402


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


class RandomBatches:
    def __init__(self, seed):
        self.seed = seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)


def dataset_fn(context):
    return RandomBatches(context.input_pipeline_id)


def train_step(model, optimizer, iterator):
    x, y = next(iterator)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def per_call_ms(fn, n):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def interleaved_medians(measures, total, rounds=7):
    """Runs each measure in turn, `rounds` times, `total / rounds` calls a chunk, so slow
    phases of a busy machine hit every measure alike; returns each one's median ms/call."""
    for measure in measures.values():
        measure(10)  # warm-up: connections, first pickling
    chunk = max(1, total // rounds)
    samples = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            samples[name].append(measure(chunk))
    return {name: statistics.median(values) for name, values in samples.items()}


def steps_per_second(num_workers, steps):
    with ts.parameter_server.local_cluster(num_workers=num_workers, num_ps=1) as cluster:
        strategy = ts.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = MLP()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        coordinator = ts.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        for _ in range(10 * num_workers):  # warm-up
            coordinator.schedule(train_step, args=(model, optimizer, iterator))
        coordinator.join()
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(train_step, args=(model, optimizer, iterator))
        scheduling = time.perf_counter() - start
        coordinator.join()
        return steps / (time.perf_counter() - start), scheduling / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--closures", type=int, default=700)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with ts.parameter_server.local_cluster(num_workers=1, num_ps=1) as cluster:
        strategy = ts.ParameterServerStrategy(cluster)
        coordinator = ts.ClusterCoordinator(strategy)
        def bare(n):
            return per_call_ms(lambda: rpc.rpc_async("worker:0", noop).wait(), n)

        def scheduled(n):
            return per_call_ms(lambda: coordinator.schedule(noop).fetch(), n)

        def queued(n):
            start = time.perf_counter()
            for _ in range(n):
                coordinator.schedule(noop)
            coordinator.join()
            return (time.perf_counter() - start) / n * 1e3

        medians = interleaved_medians({"bare": bare, "scheduled": scheduled,
                                       "queued": queued}, args.closures)
    bare, scheduled, pipelined = medians["bare"], medians["scheduled"], medians["queued"]
    print(f"bare rpc_async round trip          {bare:8.3f} ms")
    print(f"schedule + fetch, one at a time    {scheduled:8.3f} ms   "
          f"({scheduled / bare:.2f}x the bare rpc; overhead {scheduled - bare:.3f} ms)")
    print(f"schedule many, then join           {pipelined:8.3f} ms per closure "
          f"({pipelined / bare:.2f}x the bare rpc)")

    one, schedule_ms = steps_per_second(1, args.steps)
    two, _ = steps_per_second(2, args.steps)
    print(f"schedule(train_step, model, ...)   {schedule_ms:8.3f} ms on the chief per call "
          f"(pickling the step and the model's structure)")
    print(f"MLP training, 1 worker / 1 ps      {one:8.1f} steps/s")
    print(f"MLP training, 2 workers / 1 ps     {two:8.1f} steps/s   ({two / one:.2f}x of 1 "
          f"worker; ideal 2.00x, cores on this machine: {os.cpu_count()})")


if __name__ == "__main__":
    main()
