"""Compression's local cost across matrix shapes, in memory copies of the gradient bytes
(issue 38, item 4).

Between machines a compressed step is the local step, plus the wire time of the compressed
bytes, plus what compressing and decompressing cost on the replica's own core. This script
measures the last term alone, per compression mode, on one core (one intra-op thread), for a
bucket of gradients laid out as the reducer lays them out, across a sweep of parameter shapes:
``BLOCKSxWIDTH`` is BLOCKS square matrices of WIDTH x WIDTH (from one large matrix to many
small ones at the same total bytes), and ``gpt:BLOCKSxWIDTH`` the matrices of BLOCKS
transformer blocks of that width (QKV 3W x W, projection W x W, MLP 4W x W and W x 4W).

PowerSGD runs the real stage of the reducer's pipeline (``ErrorFeedbackStage``) on a process
group of one replica (its all-reduces carry only P and Q); Int8 runs the two kernels its
stage runs (the quantiser with error feedback, and the sum of ``--replicas`` replicas'
levels), without the all-gathers between them; bf16 is the fused pack into a bf16 buffer
and back. Every repetition first refills
the bucket from the same gradients (a plain copy, ``copy`` below), so a mode's cost is its
time minus the refill's, and is reported in copies: that cost divided by the time of one
copy of the same bytes, the physical limit of a pass over memory on a CPU. Issue 38 asks
for at most 6 copies for the mode it recommends. The sides alternate in every round
(reversed every other round); figures are medians with quartiles over rounds.

    .venv/bin/python scripts/bench_compression_kernels.py            # about 2-4 minutes
    .venv/bin/python scripts/bench_compression_kernels.py --quick    # small shapes, seconds
    .venv/bin/python scripts/bench_compression_kernels.py --shapes 16x1024,gpt:8x512 --json F
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import torchstrategy as ts  # noqa: E402
from torchstrategy import _ops  # noqa: E402
from torchstrategy.collectives.compression import GradBucket  # noqa: E402
from torchstrategy.collectives.error_feedback import ErrorFeedbackStage  # noqa: E402
from gpu_bench import alternate, quartiles  # noqa: E402

DEFAULT_SHAPES = "1x4096,4x2048,16x1024,64x512,256x256,1024x128,gpt:8x512"
QUICK_SHAPES = "1x512,16x128,gpt:1x128"
MODES = ("bf16", "int8", "powersgd4", "powersgd8")


def parse_shape(text: str) -> list[tuple[int, int]]:
    """The matrix shapes of one sweep entry (see the module docstring)."""
    gpt = text.startswith("gpt:")
    blocks_text, _, width_text = text.removeprefix("gpt:").partition("x")
    try:
        blocks, width = int(blocks_text), int(width_text)
    except ValueError:
        raise SystemExit(f"bad shape {text!r}: expected BLOCKSxWIDTH or gpt:BLOCKSxWIDTH, "
                         f"e.g. 16x1024 or gpt:8x512") from None
    if blocks < 1 or width < 8:
        raise SystemExit(f"bad shape {text!r}: at least 1 block of width 8")
    if gpt:
        block = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
        return block * blocks
    return [(width, width)] * blocks


def make_bucket(shapes: list[tuple[int, int]], seed: int) -> tuple[GradBucket, torch.Tensor]:
    """A bucket holding gradients of `shapes` back to back, and the gradients it is refilled
    from before every call."""
    parameters = tuple(torch.empty(rows, cols) for rows, cols in shapes)
    numels = tuple(p.numel() for p in parameters)
    offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
    gradients = torch.randn(sum(numels), generator=torch.Generator().manual_seed(seed))
    bucket = GradBucket(index=0, buffer=torch.empty_like(gradients), parameters=parameters,
                        indices=tuple(range(len(parameters))), offsets=offsets, numels=numels,
                        flags=torch.ones(len(parameters)))
    return bucket, gradients


def mode_calls(bucket: GradBucket, gradients: torch.Tensor,
               replicas: int) -> dict[str, Callable[[], Any]]:
    """{side: one refill of the bucket, then that mode's local work on it}."""
    flat = bucket.buffer
    n = flat.numel()
    wire = torch.empty(n, dtype=torch.bfloat16)
    int8 = ts.Int8()
    chunks = -(-n // int8.chunk_size)
    residual = torch.zeros(n)
    levels = torch.empty(replicas, n, dtype=torch.int8)
    scales = torch.empty(replicas, chunks)

    def refill() -> None:
        flat.copy_(gradients)

    def bf16() -> None:
        refill()
        _ops.pack(wire, [flat], [0], [n])      # narrowed for the wire ...
        _ops.unpack(wire, [flat], [0])         # ... and widened back after the all-reduce

    def int8_kernels() -> None:
        # What Int8's stage computes on its core: the quantiser with error feedback, then
        # the sum of every replica's levels (`replicas` of them; here the same levels). Its
        # two all-gathers between them are the wire's part and are left out: on a process
        # group of one replica gloo still copies the levels through its own buffers, which
        # says nothing about a step between machines.
        refill()
        _ops.ef_quantize_int8(flat, residual, levels[0], scales[0], int8.chunk_size)
        levels[1:].copy_(levels[:1].expand(replicas - 1, n))
        scales[1:].copy_(scales[:1].expand(replicas - 1, chunks))
        _ops.dequantize_sum(levels, scales, flat, int8.chunk_size)

    def stage(compression: ts.PowerSGD) -> Callable[[], None]:
        run = ErrorFeedbackStage(compression)

        def call() -> None:
            refill()
            run.launch(bucket).wait()   # its all-reduces carry P and Q: a few rows each
        return call

    return {"copy": refill, "bf16": bf16, "int8": int8_kernels,
            "powersgd4": stage(ts.PowerSGD(rank=4)), "powersgd8": stage(ts.PowerSGD(rank=8))}


def measure(shape: str, rounds: int, reps: int, replicas: int) -> dict[str, Any]:
    shapes = parse_shape(shape)
    bucket, gradients = make_bucket(shapes, seed=len(shapes))
    calls = mode_calls(bucket, gradients, replicas)
    times = alternate(calls, rounds, reps, torch.device("cpu"))
    copy = times["copy"]
    result: dict[str, Any] = {
        "shape": shape, "matrices": len(shapes), "bytes": gradients.numel() * 4,
        "copy_ms": statistics.median(copy) * 1e3,
        "copy_GBps": 2 * gradients.numel() * 4 / statistics.median(copy) / 1e9,
        "modes": {}}
    for mode in MODES:
        copies = [(t - c) / c for t, c in zip(times[mode], copy)]
        q1, median, q3 = quartiles(copies)
        result["modes"][mode] = {"copies": median, "quartiles": [q1, q3],
                                 "ms": statistics.median(times[mode]) * 1e3 -
                                 result["copy_ms"]}
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'shape':<12} {'matrices':>8} {'MiB':>6} {'copy ms':>8}  " +
          "  ".join(f"{mode + ' (copies)':>22}" for mode in MODES))
    for r in results:
        cells = []
        for mode in MODES:
            m = r["modes"][mode]
            cells.append(f"{m['copies']:6.1f} ({m['quartiles'][0]:.1f}..{m['quartiles'][1]:.1f})"
                         .rjust(22))
        print(f"{r['shape']:<12} {r['matrices']:>8} {r['bytes'] / 2**20:>6.0f} "
              f"{r['copy_ms']:>8.2f}  " + "  ".join(cells))
    print("\ncopies: (time of the mode - time of one copy of the bucket) / time of one copy, "
          "one core; median (quartiles) over rounds. Issue 38's bound: 6.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated BLOCKSxWIDTH or gpt:BLOCKSxWIDTH "
                             f"(default {DEFAULT_SHAPES})")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2, help="calls per side and round")
    parser.add_argument("--replicas", type=int, default=2,
                        help="replicas whose Int8 levels are summed (default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: per core)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: shapes {QUICK_SHAPES}, 3 rounds of 1 call")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.rounds, args.reps = QUICK_SHAPES, 3, 1
    if args.rounds < 1 or args.reps < 1 or args.threads < 1:
        parser.error("--rounds, --reps and --threads must be at least 1")
    if args.replicas < 2:
        parser.error("--replicas must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # One replica: the stages' collectives run, and move nothing between machines.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        print(f"compression kernels, {args.threads} thread(s), torch {torch.__version__}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"{args.rounds} rounds of {args.reps} call(s) per side")
        results = []
        for shape in args.shapes.split(","):
            results.append(measure(shape.strip(), args.rounds, args.reps, args.replicas))
            r = results[-1]
            print(f"  {r['shape']}: {r['matrices']} matrices, {r['bytes'] / 2**20:.0f} MiB, "
                  f"copy {r['copy_ms']:.2f} ms ({r['copy_GBps']:.1f} GB/s)", flush=True)
        print_table(results)
    finally:
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "replicas": args.replicas,
                       "torch": torch.__version__,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
