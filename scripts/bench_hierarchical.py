"""HierarchicalCopyAllReduce vs a flat all-reduce, side by side, on 4 CPU replicas laid out
as 2 machines x 2 replicas (ts.launch, gloo, loopback).

    python scripts/bench_hierarchical.py [--quick]

Prints the median milliseconds per all-reduce of each size for: `flat` (NcclAllReduce,
gloo's ring over all 4 replicas), `hierarchical` (reduce in each "machine", all-reduce
between the 2 leaders, broadcast back), and `copy` (a local memcpy of the same bytes: the
floor no all-reduce beats). On one host every link is loopback, so the hierarchy's real
advantage (fewer bytes on the slow network between machines) cannot show here: the
ratio measures its overhead (three dependent collectives instead of one).
scripts/bench_cluster.py measures the hierarchy where it matters: two network-namespace
machines, each with its own shaped link (root needed).
"""
import argparse
import statistics
import time

import torch

import torchstrategy as ts


def _bench(sizes, repeats):
    import torch.distributed as dist

    ts.MultiWorkerMirroredStrategy()  # joins ts.launch's world, creates the process group
    hierarchical = ts.HierarchicalCopyAllReduce()
    hierarchical.create_groups([0, 0, 1, 1])
    flat = ts.NcclAllReduce()
    results = {}
    for numel in sizes:
        buffer = torch.randn(numel)
        row = {}
        for name, ops in (("flat", flat), ("hierarchical", hierarchical)):
            times = []
            for _ in range(repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                ops.all_reduce(buffer, None)
                times.append(time.perf_counter() - start)
            row[name] = statistics.median(times[2:]) * 1e3
        copies = []
        target = torch.empty_like(buffer)
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(buffer)
            copies.append(time.perf_counter() - start)
        row["copy"] = statistics.median(copies) * 1e3
        results[numel] = row
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args()
    sizes = [256, 65536, 1 << 20] if args.quick else [256, 4096, 65536, 1 << 20, 1 << 22]
    repeats = 5 if args.quick else 20
    results = ts.launch(_bench, sizes, repeats, num_replicas=4, timeout_seconds=120)
    print(f"{'floats':>10} {'flat ms':>9} {'hier ms':>9} {'copy ms':>9} {'hier/flat':>10}")
    for numel, row in results.items():
        print(f"{numel:>10} {row['flat']:>9.3f} {row['hierarchical']:>9.3f} "
              f"{row['copy']:>9.3f} {row['hierarchical'] / row['flat']:>10.2f}")


if __name__ == "__main__":
    main()
