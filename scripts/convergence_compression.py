"""Convergence under gradient compression: a small GPT trained on 2 replicas (gloo, CPU)
with the default reduction, bf16 on the wire, ts.PowerSGD(rank=4) (from the first step, and
after ``--warmup`` uncompressed steps), ts.Int8(), 1-bit Adam (``onebit``: ts.OneBitAdam with
the optimizer ts.OneBitAdamW, ``--onebit-warmup`` uncompressed steps) and, as the reference,
torch's own DDP PowerSGD hook (``ddp-powersgd``): same seed, same data, same number of
steps; prints the final validation losses side by side and writes the loss curves (JSON,
and a PNG when matplotlib is installed).

Corpus: the Python standard library's own source files (``sysconfig.get_paths()["stdlib"]``,
the ``*.py`` files directly in it, sorted by name), as bytes (vocabulary 256); the first
90 % of the bytes train, the last 10 % validate. Model: a decoder-only transformer
(``--layers`` 2, ``--width`` 128, 4 heads, context 64), AdamW (or ``--optimizer sgd``:
SGD with momentum 0.9, as PowerSGD's paper), a constant learning rate (or ``--schedule
cosine``: decaying to 0 over the run), the mean loss averaged over replicas with
``ts.scale_mean_loss``. Validation: the mean loss over a fixed set of windows. A run is
about a minute on an idle 2-core machine (far longer on a loaded one: the replicas wait
for each other at every collective).

    .venv/bin/python scripts/convergence_compression.py \\
        --json docs/images/compression_convergence.json \\
        --plot docs/images/compression_convergence.png

Runs are deterministic, so results of separate invocations (other settings) can be put
together: ``--replot a.json b.json --json all.json --plot all.png``.

Other settings (docs/gradient_reduction.md, "Convergence" has the commands and results):
``--replicas 4`` (the same per-replica batch, on 4 replicas); ``--schedule cosine
--lr-warmup 100`` (a linear warm-up of the learning rate over the first 100 steps, then
cosine decay to 0); ``--model digits``: a second model family, a small MLP (64-128-128-10)
on scikit-learn's bundled handwritten digits (1797 8x8 images; 1497 train, 300 validate,
split once with a fixed seed), usually with ``--optimizer sgd`` (momentum 0.9).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchstrategy as ts  # noqa: E402


def corpus(limit_bytes: int) -> torch.Tensor:
    stdlib = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py") and len(data) < limit_bytes:
            with open(os.path.join(stdlib, name), "rb") as f:
                data += f.read()
    return torch.frombuffer(data[:limit_bytes], dtype=torch.uint8).long()


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, layers: int, width: int, context: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(256, width)
        self.pos = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.Sequential(*[Block(width, 4) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


class DigitsMLP(torch.nn.Module):
    """The second model family: an MLP on 8x8 digit images."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
            torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits (no download): train and validation images (scaled
    to [0, 1]) and labels, split once with a fixed seed."""
    from sklearn.datasets import load_digits   # optional dependency (setup installs it)
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(7))
    x, y = x[order], y[order]
    return x[300:], y[300:], x[:300], y[:300]


def windows(data: torch.Tensor, starts: torch.Tensor, context: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def train(name: str, args: argparse.Namespace) -> dict:
    compression = {"none": None, "bf16": "bf16", "powersgd": ts.PowerSGD(rank=args.rank),
                   "powersgd-warmup": ts.PowerSGD(rank=args.rank, warmup_steps=args.warmup),
                   "int8": ts.Int8(), "ddp-powersgd": None,
                   "onebit": ts.OneBitAdam(warmup_steps=args.onebit_warmup)}[name]
    torch.set_num_threads(1)
    strategy = ts.MirroredStrategy(cross_device_ops=ts.NcclAllReduce(compression=compression))
    replica = strategy.extended.replica_id
    is_gpt = args.model == "gpt"
    if is_gpt:
        data = corpus(args.corpus_bytes)
        split = int(len(data) * 0.9)
        train_data, val_data = data[:split], data[split:]
    else:
        train_x, train_y, val_x, val_y = digits()

    def make_model() -> torch.nn.Module:
        return GPT(args.layers, args.width, args.context) if is_gpt else DigitsMLP()

    def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = net(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    torch.manual_seed(args.seed)
    if name == "ddp-powersgd":
        # The reference: torch's own DDP PowerSGD hook, outside the strategy (which only
        # provides the process group), with the same rank and the same rule for which
        # matrices are compressed (min_compression_rate=1); the hook needs at least 2
        # uncompressed steps before it starts.
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=64)
        hook_state = powerSGD.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank,
            start_powerSGD_iter=max(2, args.warmup), min_compression_rate=1,
            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(hook_state, powerSGD.powerSGD_hook)
    else:
        with strategy.scope():
            model = make_model()
    if name == "onebit":   # the moments live in the reduction; AdamW's defaults otherwise
        if args.optimizer != "adamw":
            raise SystemExit("the onebit run is 1-bit Adam: use it with --optimizer adamw")
        optimizer: torch.optim.Optimizer = ts.OneBitAdamW(model.parameters(), lr=args.lr)
    elif args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:   # PowerSGD's paper trains with SGD and momentum
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # "cosine": the learning rate decays from --lr to 0 over the run (as GPT training
    # usually does), after --lr-warmup steps rising linearly from --lr / warm-up steps;
    # "constant": it stays at --lr.
    schedule = None
    if args.schedule == "cosine":
        warm = args.lr_warmup

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if is_gpt:
        val_gen = torch.Generator().manual_seed(1234)
        val_starts = torch.randint(0, len(val_data) - args.context - 1, (256,),
                                   generator=val_gen)
        vx, vy = windows(val_data, val_starts, args.context)
    else:
        vx, vy = val_x, val_y

    def validate() -> float:
        with torch.no_grad():
            return loss_of(model, vx, vy).item()

    curve = []
    total_sent = 0   # over the run (a warm-up sends more than the last step)
    start = time.process_time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            curve.append((step, validate()))
        if step == args.steps:
            break
        gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 2 + replica)
        if is_gpt:
            starts = torch.randint(0, len(train_data) - args.context - 1, (args.batch,),
                                   generator=gen)
            x, y = windows(train_data, starts, args.context)
        else:
            rows = torch.randint(0, len(train_x), (args.batch,), generator=gen)
            x, y = train_x[rows], train_y[rows]
        optimizer.zero_grad()
        if name == "ddp-powersgd":   # DDP averages the gradients itself
            loss_of(ddp, x, y).backward()
        else:
            ts.scale_mean_loss(loss_of(model, x, y)).backward()
        optimizer.step()
        total_sent += strategy.extended.stats().bytes_reduced
        if schedule is not None:
            schedule.step()
    stats = strategy.extended.stats()
    sent, ratio = stats.bytes_reduced, stats.compression_ratio
    numel = sum(p.numel() for p in model.parameters())
    if name == "ddp-powersgd":   # the hook's P, Q and uncompressed tensors, fp32
        rule = ts.PowerSGD(rank=args.rank)
        sent = 4 * sum(args.rank * (p.shape[0] + p[0].numel()) if rule.compresses(p.shape)
                       else p.numel() for p in model.parameters())
        ratio = 4 * numel / sent
    return {"name": name, "setting": setting(args), "rank": args.rank,
            "warmup": {"powersgd-warmup": args.warmup, "onebit": args.onebit_warmup,
                       "ddp-powersgd": max(2, args.warmup)}.get(name, 0),
            "mean_bytes": total_sent / args.steps if name != "ddp-powersgd" else
            hook_mean_bytes(sent, 4 * numel, max(2, args.warmup), args.steps),
            "seed": args.seed, "curve": curve, "cpu_seconds": time.process_time() - start,
            "bytes": sent, "ratio": ratio,
            "params": numel}


def hook_mean_bytes(compressed: int, uncompressed: int, warmup: int, steps: int) -> float:
    """Bytes a step over a run of DDP's PowerSGD hook: its first `warmup` steps all-reduce
    every gradient whole (start_powerSGD_iter), the rest `compressed` bytes."""
    warm = min(warmup, steps)
    return (warm * uncompressed + (steps - warm) * compressed) / steps


def setting(args: argparse.Namespace | dict) -> str:
    """What the runs compared with each other share: optimizer, learning rate, schedule."""
    a = vars(args) if isinstance(args, argparse.Namespace) else args
    model = "digits MLP, " if a.get("model", "gpt") == "digits" else ""
    schedule = ""
    if a.get("schedule", "constant") == "cosine":
        schedule = ", cosine decay" + (f" after {a['lr_warmup']} warm-up steps"
                                       if a.get("lr_warmup") else "")
    replicas = f", {a['replicas']} replicas" if a.get("replicas", 2) != 2 else ""
    return f"{model}{'AdamW' if a['optimizer'] == 'adamw' else 'SGD+momentum'} " \
        f"lr {a['lr']:g}{schedule}{replicas}"


def label(result: dict) -> str:
    name = result["name"]
    if name == "onebit":
        return f"1-bit Adam, {result['warmup']} warm-up steps"
    if "powersgd" in name:
        name = name.replace("-warmup", "") + f" rank {result.get('rank', 4)}"
        if result.get("warmup"):
            name += f", {result['warmup']} warm-up steps"
    return name


def report(results: list) -> None:
    """Final losses, each against the uncompressed run of its setting and seed."""
    for r in results:
        base = next((b for b in results if b["name"] == "none" and
                     b["setting"] == r["setting"] and b["seed"] == r["seed"]), None)
        final = r["curve"][-1][1]
        against = "" if base is None else \
            f"  vs none: {100 * (final - base['curve'][-1][1]) / base['curve'][-1][1]:+.2f} %"
        print(f"{r['setting']:32s} seed {r['seed']}  {label(r):36s} {final:.4f}{against}")


def merge(paths: list[str]) -> list:
    """The results of several JSON files written by --json (older files: their setting
    from the file's arguments)."""
    results = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data["results"]:
            if "args" in data:   # a merged file's results carry these already
                r.setdefault("setting", setting(data["args"]))
                r.setdefault("rank", data["args"]["rank"])
                r.setdefault("seed", data["args"]["seed"])
                r.setdefault("warmup", data["args"]["warmup"]
                             if r["name"] == "powersgd-warmup" else 0)
            results.append(r)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                        help="the learning rate: constant, or cosine decay to 0")
    parser.add_argument("--lr-warmup", type=int, default=0,
                        help="with --schedule cosine: steps of linear warm-up first")
    parser.add_argument("--model", choices=["gpt", "digits"], default="gpt",
                        help="the byte-level GPT, or an MLP on scikit-learn's digits")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    parser.add_argument("--warmup", type=int, default=100,
                        help="uncompressed steps first, for the powersgd-warmup run (and "
                             "ddp-powersgd: at least 2, the hook's minimum)")
    parser.add_argument("--onebit-warmup", type=int, default=100,
                        help="the onebit run's uncompressed steps (Adam's variance is "
                             "frozen after them)")
    parser.add_argument("--runs", default="none,bf16,powersgd,powersgd-warmup,int8",
                        help="comma-separated: none, bf16, powersgd, powersgd-warmup, "
                             "int8, onebit (ts.OneBitAdam with ts.OneBitAdamW), ddp-powersgd "
                             "(torch's DDP PowerSGD hook, the reference)")
    parser.add_argument("--json", default=None, help="write the curves here")
    parser.add_argument("--plot", default=None, help="write the PNG plot here")
    parser.add_argument("--replot", default=None, nargs="+",
                        help="no training: merge the results of JSON files written by "
                             "--json (into --json) and redraw --plot from them")
    args = parser.parse_args()
    if args.lr_warmup and args.schedule != "cosine":
        parser.error("--lr-warmup is the warm-up of --schedule cosine; add it")
    if args.lr_warmup >= args.steps:
        parser.error(f"--lr-warmup ({args.lr_warmup}) must be shorter than --steps")
    if args.replicas < 1:
        parser.error(f"--replicas must be at least 1, got {args.replicas}")
    if args.model == "digits" and "onebit" in args.runs.split(",") and \
            args.optimizer != "adamw":
        parser.error("the onebit run is 1-bit Adam: it needs --optimizer adamw")
    if args.replot:
        results = merge(args.replot)
        report(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"merged": args.replot, "results": results}, f, indent=1)
        if args.plot:
            plot(results, args.plot)
        return
    results = []
    for name in args.runs.split(","):
        wall = time.perf_counter()
        result = ts.launch(train, name, args, num_replicas=args.replicas,
                           timeout_seconds=1800)
        result["wall_seconds"] = time.perf_counter() - wall
        results.append(result)
        print(f"{name:15s} final val loss {result['curve'][-1][1]:.4f}  "
              f"bytes/step/replica {result['bytes']:>9d}  ratio {result['ratio']:5.1f}  "
              f"wall {result['wall_seconds']:.0f}s", flush=True)
    shape = f"{args.layers} layers, width {args.width}, context {args.context}" \
        if args.model == "gpt" else "digits MLP 64-128-128-10"
    print(f"model: {results[0]['params']} parameters, {shape}, {args.batch} "
          f"{'sequences' if args.model == 'gpt' else 'images'}/replica x {args.replicas} "
          f"replicas, {args.steps} steps")
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if args.plot:
        plot(results, args.plot)


def plot(results: list, path: str) -> None:
    """The validation curves side by side, one panel per setting (optimizer, learning
    rate, schedule) and seed; bytes relative to the uncompressed run's."""
    import matplotlib  # optional dependency (scripts/setup.sh installs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: list[tuple[str, int]] = []
    for r in results:
        if (r["setting"], r["seed"]) not in panels:
            panels.append((r["setting"], r["seed"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (where, seed) in zip(axes[0], panels):
        runs = [r for r in results if r["setting"] == where and r["seed"] == seed]
        plain = next((r["bytes"] for r in runs if r["name"] == "none"), runs[0]["bytes"])
        for r, style in zip(runs, ["-", "--", "-", "-", ":", "-.", "--", ":"]):
            steps, losses = zip(*r["curve"])
            run_mean = r.get("mean_bytes")   # older results: not recorded
            if r["name"] == "ddp-powersgd":
                # Computed here: results written before 2026-11-28 recorded the hook's
                # compressed bytes as its mean, leaving out its uncompressed warm-up.
                run_mean = hook_mean_bytes(r["bytes"], 4 * r["params"], r["warmup"],
                                           steps[-1])
            over_run = f"; {plain / run_mean:.1f}x over the run" \
                if r.get("warmup") and run_mean else ""
            ax.plot(steps, losses, style, label=f"{label(r)} (final {losses[-1]:.3f}, "
                                                f"{plain / r['bytes']:.1f}x fewer bytes"
                                                f"{over_run})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)" if "digits" not in where
                      else "validation loss (nats/image)")
        ax.set_title(f"{where}, seed {seed}", fontsize=10)
        if "digits" in where:   # from 2.3 down to about 0.1: a log scale shows the end
            ax.set_yscale("log")
        else:
            ax.set_ylim(top=min(max(r["curve"][1][1] for r in runs) + 0.2, math.log(256)))
        ax.legend(fontsize=8, loc="upper right")
    family = "MLP on scikit-learn's digits" if "digits" in panels[0][0] else \
        "Byte-level GPT on the stdlib sources"
    replicas = "" if "replicas" in panels[0][0] else ", 2 replicas"
    fig.suptitle(f"{family}{replicas} ({results[0]['params'] / 1e6:.2f}M parameters)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
