"""Does compression="auto" choose the fastest mode? Its prediction against the step times
measured, side by side.

Runs 2 replicas on gloo for each fixed mode (none, bf16, Int8) and for "auto", in
alternating order over `--repeats` rounds, on a model of `--width` x `--width` layers
(`--layers` of them), and prints per mode the median step time after the warm-up, its
ratio to the uncompressed step in the same round (median [quartiles] over rounds), the
step "auto" predicted for it (from its first round), and what "auto" chose. Run it on a
shaped link with scripts/bench_network.sh:

    scripts/bench_network.sh 2 -- .venv/bin/python scripts/bench_auto_compression.py
    .venv/bin/python scripts/bench_auto_compression.py          # loopback
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import torchstrategy as ts

MODES = {"none": None, "bf16": "bf16", "Int8": ts.Int8(), "auto": "auto"}


def replica(width: int, layers: int, mode: str, steps: int) -> dict:
    """One replica: `steps` SGD steps; the median step after the first 5 (auto has chosen
    by then: it decides at the end of step 3)."""
    torch.set_num_threads(1)
    strategy = ts.MultiWorkerMirroredStrategy(
        communication_options=ts.CommunicationOptions(compression=MODES[mode]))
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(strategy.extended.replica_id)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        ts.scale_mean_loss(model(torch.randn(8, width, generator=generator)).pow(2).mean()
                           ).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    choice = strategy.extended.gradient_reducer.auto_compression
    return {"step": statistics.median(times[5:]),
            "chose": None if choice is None else
            ("none" if choice.compression is None else
             "Int8" if isinstance(choice.compression, ts.Int8) else choice.compression),
            "predicted": None if choice is None else
            {("Int8" if name.startswith("Int8") else name): seconds
             for name, seconds in choice.predicted_seconds}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {mode: [] for mode in MODES}
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    chosen, predicted = [], None
    order = list(MODES)
    for round_ in range(args.repeats):
        steps = {}
        for mode in order[round_ % len(order):] + order[:round_ % len(order)]:
            result = ts.launch(replica, args.width, args.layers, mode, args.steps,
                               num_replicas=2, timeout_seconds=600)
            steps[mode] = result["step"]
            if mode == "auto":
                chosen.append(result["chose"])
                predicted = predicted or result["predicted"]
        for mode, seconds in steps.items():
            rows[mode].append(seconds)
            ratios[mode].append(seconds / steps["none"])
    mib = args.layers * (args.width * args.width + args.width) * 4 / 2**20
    print(f"{mib:.1f} MiB of gradients, 2 replicas, {args.repeats} rounds; auto chose "
          f"{chosen}")
    print("| mode | median step ms | / none [quartiles] | auto's prediction ms |")
    print("|---|---|---|---|")
    for mode in MODES:
        q = statistics.quantiles(ratios[mode], n=4) if len(ratios[mode]) > 1 else \
            [ratios[mode][0]] * 3
        guess = "" if predicted is None or mode not in predicted else \
            f"{predicted[mode] * 1e3:.0f}"
        print(f"| {mode} | {statistics.median(rows[mode]) * 1e3:.0f} | "
              f"{statistics.median(ratios[mode]):.2f} [{q[0]:.2f}, {q[2]:.2f}] | {guess} |")


if __name__ == "__main__":
    main()
