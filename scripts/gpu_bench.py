"""The GPU benchmarks of scripts/gpu_check.sh, each side by side in one process, written as
JSON (the figures with their targets) and printed.

    python scripts/gpu_bench.py kernels  --device cuda --json out.json
    python scripts/gpu_bench.py mirrored --device cuda --json out.json
    python scripts/gpu_bench.py sharded  --device cuda --json out.json
    python scripts/gpu_bench.py all --device cpu --tiny --json out.json   # code paths only

- kernels: the fused pack+unpack of a GPT-2-sized bucket (many tensors, scale 1/N) as a
  fraction of the device's copy bandwidth (target >= 0.80) and against torch's
  flatten+scale+split (cat, mul_, split, copy_; target >= 2x); the compression kernels
  (narrowing to bf16, int8 quantisation with error feedback, its dequantising sum,
  PowerSGD's last pass) as their bytes moved per second over the copy bandwidth.
- mirrored: a ResNet-50-shaped and a GPT-2-small-shaped model (the shapes of
  scripts/bench_network.py, without torchvision): the step time of MirroredStrategy at
  world 1 over DDP's (target <= 1.02) and over a plain loop's (<= 1.02); the peak memory of
  a step, ours over DDP's (<= 1.0).
- sharded: the GPT-2-small-shaped model, ShardedStrategy over a hand-written FSDP2 loop
  (``fully_shard`` per block, then the model): step time (<= 1.02) and peak memory (<= 1.0).

Timing: the sides alternate within each round (the order reversed every other round), each
timed over --reps calls with CUDA events (perf_counter on the CPU) after warm-up; a figure
is the median over rounds of the paired per-round ratio, with its quartiles as the spread.
Peak memory: each side alone (the others deleted, the cache emptied), the peak of
``torch.cuda.max_memory_allocated`` over its steps above what was allocated before it was
built (model, optimizer state, buckets and activations included).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torchstrategy as ts  # noqa: E402
from torchstrategy import _ops  # noqa: E402

KINDS = ("kernels", "mirrored", "sharded")
MODELS = ("resnet50", "gpt2")


# -- measuring -----------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(call: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Seconds per call of `call`, over `reps` calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    begin = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - begin) / reps


def alternate(calls: dict[str, Callable[[], Any]], rounds: int, reps: int,
              device: torch.device, warmup: int = 2) -> dict[str, list[float]]:
    """{side: seconds per call, one value per round}; the sides take turns in each round,
    in reversed order every other round."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for index in range(rounds):
        for name in (order if index % 2 == 0 else order[::-1]):
            times[name].append(time_calls(calls[name], reps, device))
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, statistics.median(values), q3


def figure(name: str, values: list[float] | None, target: tuple[str, float] | None = None,
           unit: str = "", better: str = "") -> dict[str, Any]:
    """A figure: the median of `values` (per-round ratios), their quartiles, and whether
    the median meets `target` (("<=", 1.02) / (">=", 0.8)); value None (a CPU run's
    memory) leaves `met` None."""
    out: dict[str, Any] = {"name": name, "unit": unit, "value": None, "spread": "",
                           "target": None, "met": None, "rounds": 0}
    if target is not None:
        out["target"] = f"{target[0]} {target[1]:g}"
    if values:
        q1, median, q3 = quartiles(values)
        out.update(value=median, spread=f"quartiles {q1:.3f} .. {q3:.3f}", rounds=len(values))
        if target is not None:
            out["met"] = median <= target[1] if target[0] == "<=" else median >= target[1]
    if better:
        out["note"] = better
    return out


def paired(numerator: list[float], denominator: list[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator)]


def peak_memory(build: Callable[[], Callable[[], Any]], steps: int,
                device: torch.device) -> int | None:
    """Bytes: the peak allocated while `build()` makes a side and its step runs `steps`
    times, above what was allocated before; None on the CPU."""
    if device.type != "cuda":
        step = build()
        for _ in range(steps):
            step()
        return None
    gc.collect()
    torch.cuda.empty_cache()
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step = build()
    for _ in range(steps):
        step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del step
    gc.collect()
    return peak


# -- the models (bench_network.py's shapes; positions made on the input's device) -----------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 small with the defaults (124M parameters, output tied to the embedding)."""

    def __init__(self, vocab: int = 50257, context: int = 1024, d: int = 768, heads: int = 12,
                 layers: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50's layout with the defaults (161 parameter tensors, 25.6M parameters)."""

    def __init__(self, base: int = 64, classes: int = 1000,
                 blocks: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base)
        layers, cin = [], base
        for stage, count in enumerate(blocks):
            width = base * 2**stage
            for k in range(count):
                layers.append(Bottleneck(cin, width, 2 if stage > 0 and k == 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(x).mean(dim=(2, 3)))


def model_specs(tiny: bool) -> dict[str, tuple[Callable[[], nn.Module], Callable[..., Any],
                                                str]]:
    """{name: (make the model, make a batch on a device, description)}."""
    gpt: dict[str, Any]
    resnet: dict[str, Any]
    if tiny:
        gpt = dict(vocab=512, context=64, d=64, heads=4, layers=1)
        resnet = dict(base=8, classes=10, blocks=(1, 1, 1, 1))
        gpt_bt, res_bs = (2, 16), (2, 32)
    else:
        gpt, resnet = {}, {}
        gpt_bt, res_bs = (8, 512), (64, 224)
    vocab, classes = gpt.get("vocab", 50257), resnet.get("classes", 1000)

    def gpt_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (gpt_bt[0], gpt_bt[1] + 1), generator=g).to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def resnet_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        b, s = res_bs
        return (torch.randn(b, 3, s, s, generator=g).to(device),
                torch.randint(0, classes, (b,), generator=g).to(device))

    return {"resnet50": (lambda: ResNet(**resnet), resnet_batch,
                         f"ResNet-50-shaped, batch {res_bs[0]} of {res_bs[1]}x{res_bs[1]}"),
            "gpt2": (lambda: GPT(**gpt), gpt_batch,
                     f"GPT-2-small-shaped, batch {gpt_bt[0]}x{gpt_bt[1]} tokens")}


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
              targets: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = loss_of(model, inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


# -- kernels -------------------------------------------------------------------------------
def bucket_sizes(tiny: bool) -> list[int]:
    """The tensors of a GPT-2-small bucket of about 25 MiB (two blocks' parameters)."""
    d = 64 if tiny else 768
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return block * 2


def bench_kernels(device: torch.device, tiny: bool, rounds: int, reps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    sizes = bucket_sizes(tiny)
    tensors = [torch.randn(n, generator=g).to(device) for n in sizes]
    offsets, total = [], 0
    for n in sizes:                       # 16-byte aligned slots: the kernels' aligned case
        offsets.append(total)
        total += -(-n // 4) * 4
    flat = torch.empty(total, device=device)
    outs = [torch.empty_like(t) for t in tensors]
    copy_src, copy_dst = torch.randn(total, generator=g).to(device), torch.empty(total,
                                                                                  device=device)
    scale = 0.5

    def ours() -> None:
        _ops.pack(flat, tensors, offsets, sizes, scale)
        _ops.unpack(flat, outs, offsets, 1.0)

    def torch_way() -> None:
        joined = torch.cat([t.reshape(-1) for t in tensors])
        joined.mul_(scale)
        for out, piece in zip(outs, joined.split(sizes)):
            out.copy_(piece.view_as(out))

    wire = torch.empty(total, dtype=torch.bfloat16, device=device)
    chunk = 1024 if not tiny else 64
    n = sum(sizes)
    grad = torch.randn(n, generator=g).to(device)
    residual = torch.zeros(n, device=device)
    q = torch.empty(n, dtype=torch.int8, device=device)
    scales = torch.empty(-(-n // chunk), device=device)
    summed = torch.empty(n, device=device)
    rows, cols, rank = (256, 64, 4) if tiny else (4 * 768 * 2, 768, 4)
    m = torch.randn(rows, cols, generator=g).to(device)
    basis = torch.linalg.qr(torch.randn(rows, rank, generator=g)).Q.contiguous().to(device)
    q_local_t = (basis.t() @ m).contiguous()
    q_sum_t = (q_local_t * 2).contiguous()
    ps_residual, ps_out = m.clone(), torch.empty_like(m)

    calls: dict[str, Callable[[], Any]] = {
        "copy": lambda: copy_dst.copy_(copy_src),
        "pack+unpack": ours,
        "flatten+scale+split": torch_way,
        "narrow to bf16": lambda: _ops.pack(wire, tensors, offsets, sizes, scale),
        "int8 quantise": lambda: _ops.ef_quantize_int8(grad, residual, q, scales, chunk),
        "int8 dequantise-sum": lambda: _ops.dequantize_sum(q.view(1, n), scales.view(1, -1),
                                                           summed, chunk),
        "powersgd finish": lambda: _ops.powersgd_finish(ps_residual, basis, q_local_t, q_sum_t,
                                                        ps_out),
    }
    times = alternate(calls, rounds, reps, device)
    copy_bytes = 2 * total * 4                      # read + write
    moved = {"pack+unpack": 4 * n * 4,              # pack reads and writes, unpack too
             "narrow to bf16": n * 4 + n * 2,
             "int8 quantise": n * (4 + 4 + 4 + 1),  # grad, residual in/out, q
             "int8 dequantise-sum": n * (1 + 4),
             "powersgd finish": rows * cols * 4 * 3}
    figures = [
        figure("pack+unpack bandwidth / copy bandwidth",
               [moved["pack+unpack"] / t / (copy_bytes / c)
                for t, c in zip(times["pack+unpack"], times["copy"])], (">=", 0.80),
               "fraction"),
        figure("pack+unpack speed-up over torch's flatten+scale+split",
               paired(times["flatten+scale+split"], times["pack+unpack"]), (">=", 2.0), "x"),
    ]
    for name in ("narrow to bf16", "int8 quantise", "int8 dequantise-sum", "powersgd finish"):
        figures.append(figure(f"{name}: bytes moved per second / copy bandwidth",
                              [moved[name] / t / (copy_bytes / c)
                               for t, c in zip(times[name], times["copy"])], None, "fraction"))
    details = {name: {"median_ms": statistics.median(v) * 1e3} for name, v in times.items()}
    details["copy"]["bandwidth_GBps"] = copy_bytes / statistics.median(times["copy"]) / 1e9
    details["bucket"] = {"tensors": len(sizes), "elements": n, "bytes": n * 4}
    return {"figures": figures, "details": details}


# -- MirroredStrategy against DDP and a plain loop ----------------------------------------
def bench_mirrored(device: torch.device, tiny: bool, rounds: int, reps: int,
                   models: list[str]) -> dict[str, Any]:
    """`models` in this process, one after the other (several models in one strategy share
    its gradient reducer: run_separately gives each model a process of its own)."""
    strategy = ts.MirroredStrategy() if device.type == "cuda" else \
        ts.MirroredStrategy(devices=["cpu:0"])
    here = strategy.extended.torch_device
    assert here is not None and here.type == device.type, \
        f"MirroredStrategy() picked {here}, not {device}"
    figures: list[dict[str, Any]] = []
    details: dict[str, Any] = {"strategy": repr(strategy)}
    for name, (make, batch, description) in model_specs(tiny).items():
        if name not in models:
            continue
        inputs, targets = batch(here)

        def plain() -> Callable[[], Any]:
            torch.manual_seed(0)
            model = make().to(here)
            return make_step(model, optimizer_for(model), inputs, targets)

        def ddp() -> Callable[[], Any]:
            torch.manual_seed(0)
            model = make().to(here)
            wrapped = nn.parallel.DistributedDataParallel(
                model, device_ids=[here.index] if here.type == "cuda" else None,
                gradient_as_bucket_view=True, broadcast_buffers=False)
            return make_step(wrapped, optimizer_for(model), inputs, targets)

        def ours() -> Callable[[], Any]:
            torch.manual_seed(0)
            with strategy.scope():
                model = make()
                optimizer = optimizer_for(model)
            step = make_step(model, optimizer, inputs, targets)
            return lambda: strategy.run(step)

        steps = 2 if tiny else 5
        memory = {"plain": peak_memory(plain, steps, here), "ddp": peak_memory(ddp, steps, here)}
        # Ours last, measured as peak_memory does, and kept: it is also timed below.
        if here.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(here)
            torch.cuda.reset_peak_memory_stats(here)
        our_step = ours()
        for _ in range(steps):
            our_step()
        memory["ours"] = None
        if here.type == "cuda":
            synchronize(here)
            memory["ours"] = torch.cuda.max_memory_allocated(here) - base
        calls = {"ours": our_step, "ddp": ddp(), "plain": plain()}
        times = alternate(calls, rounds, reps, here)
        figures += [figure(f"{name}: step time ours / DDP (world 1)",
                           paired(times["ours"], times["ddp"]), ("<=", 1.02), "x"),
                    figure(f"{name}: step time ours / plain loop",
                           paired(times["ours"], times["plain"]), ("<=", 1.02), "x")]
        ratio = None if memory["ours"] is None or not memory["ddp"] else \
            [memory["ours"] / memory["ddp"]]
        figures.append(figure(f"{name}: peak memory ours / DDP", ratio, ("<=", 1.0), "x"))
        details[name] = {"description": description,
                         "median_step_ms": {k: statistics.median(v) * 1e3
                                            for k, v in times.items()},
                         "peak_MiB": {k: None if v is None else v / 2**20
                                      for k, v in memory.items()}}
        del calls, our_step
        gc.collect()
    return {"figures": figures, "details": details}


def bench_sharded(device: torch.device, tiny: bool, rounds: int, reps: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard   # FSDP2 imported only for this kind

    # FSDP2's own reduction on both sides (the hand-written loop below has no mask of the
    # parameters each replica used): like for like, and it runs on torch 2.11 too.
    strategy = ts.ShardedStrategy(same_parameters_every_step=True) if device.type == "cuda" \
        else ts.ShardedStrategy(devices=["cpu:0"], same_parameters_every_step=True)
    ext = strategy.extended
    here = ext.torch_device
    assert here is not None and here.type == device.type, \
        f"ShardedStrategy() picked {here}, not {device}"
    make, batch, description = model_specs(tiny)["gpt2"]
    inputs, targets = batch(here)

    def by_hand() -> Callable[[], Any]:
        torch.manual_seed(0)
        model = make().to(here)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=ext.mesh)
        fully_shard(model, mesh=ext.mesh)
        return make_step(model, optimizer_for(model), inputs, targets)

    steps = 2 if tiny else 5
    memory = {"fsdp2": peak_memory(by_hand, steps, here)}
    if here.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(here)
        torch.cuda.reset_peak_memory_stats(here)
    torch.manual_seed(0)
    with strategy.scope():
        model = make()
        optimizer = optimizer_for(model)
    step = make_step(model, optimizer, inputs, targets)

    def ours() -> Any:
        return strategy.run(step)

    for _ in range(steps):
        ours()
    memory["ours"] = None
    if here.type == "cuda":
        synchronize(here)
        memory["ours"] = torch.cuda.max_memory_allocated(here) - base
    times = alternate({"ours": ours, "fsdp2": by_hand()}, rounds, reps, here)
    ratio = None if memory["ours"] is None or not memory["fsdp2"] else \
        [memory["ours"] / memory["fsdp2"]]
    return {"figures": [figure("gpt2: step time ShardedStrategy / hand-written FSDP2",
                               paired(times["ours"], times["fsdp2"]), ("<=", 1.02), "x"),
                        figure("gpt2: peak memory ShardedStrategy / hand-written FSDP2", ratio,
                               ("<=", 1.0), "x")],
            "details": {"description": description, "strategy": repr(strategy),
                        "median_step_ms": {k: statistics.median(v) * 1e3
                                           for k, v in times.items()},
                        "peak_MiB": {k: None if v is None else v / 2**20
                                     for k, v in memory.items()}}}


# -- the command ---------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda:{device.index or 0})"
    return f"CPU ({os.cpu_count()} cores)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS + ("all",))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes, 2 rounds of 1 call: the code paths only")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (8)")
    parser.add_argument("--reps", type=int, default=None, help="calls per side per round (3)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model", choices=MODELS,
                        help="with mirrored: this model only, in this process (default: each "
                        "model in a process of its own)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="with all: the kinds to run (comma-separated)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False here: use "
                     "--device cpu --tiny for the code paths")
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or set(args.kinds) - set(KINDS):
        parser.error(f"--kinds: give some of {','.join(KINDS)}")
    args.rounds = args.rounds or (2 if args.tiny else 8)
    args.reps = args.reps or (1 if args.tiny else 3)
    if args.rounds < 1 or args.reps < 1:
        parser.error("--rounds and --reps must be at least 1")
    return args


def run_in_process(command: list[str], out: str) -> dict[str, Any] | None:
    """Runs this script with `command` (its --json is `out`) and returns what it wrote, or
    None if it failed."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *command, "--json", out],
                          cwd=ROOT)
    if done.returncode != 0 or not os.path.exists(out):
        return None
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    os.remove(out)
    return result


def mirrored_separately(args: argparse.Namespace) -> dict[str, Any]:
    """Each model of the mirrored benchmark in a process (and a strategy) of its own."""
    merged: dict[str, Any] = {"figures": [], "details": {}, "failed": []}
    for model in MODELS:
        out = f"{args.json or os.path.join(ROOT, 'build', 'gpu_bench')}.{model}.json"
        result = run_in_process(
            ["mirrored", "--model", model, "--device", args.device, "--rounds",
             str(args.rounds), "--reps", str(args.reps)] + (["--tiny"] if args.tiny else []),
            out)
        if result is None:
            merged["failed"].append(model)
            continue
        merged["figures"] += result["figures"]
        merged["details"].update(result["details"])
    return merged


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Each kind with a strategy in its own process (one strategy per process), the kernels
    in this one; the results merged."""
    merged: dict[str, Any] = {"figures": [], "details": {}, "failed": []}
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else \
        torch.device("cpu")
    for kind in args.kinds:
        if kind == "kernels":   # no strategy: in this process
            result = bench_kernels(device, args.tiny, args.rounds, args.reps)
            merged["figures"] += [dict(f, name=f"{kind}: {f['name']}")
                                  for f in result["figures"]]
            merged["details"][kind] = result["details"]
            continue
        out = f"{args.json or os.path.join(ROOT, 'build', 'gpu_bench')}.{kind}.json"
        ran = run_in_process([kind, "--device", args.device, "--rounds", str(args.rounds),
                              "--reps", str(args.reps)] + (["--tiny"] if args.tiny else []),
                             out)
        if ran is None or ran.get("failed"):
            merged["failed"].append(kind)
        if ran is None:
            continue
        result = ran
        merged["figures"] += [dict(f, name=f"{kind}: {f['name']}") for f in result["figures"]]
        merged["details"][kind] = result["details"]
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else \
        torch.device("cpu")
    started = time.monotonic()
    if args.kind == "all":
        result = run_all(args)
    elif args.kind == "mirrored" and args.model is None:
        result = mirrored_separately(args)
    elif args.kind == "mirrored":
        result = bench_mirrored(device, args.tiny, args.rounds, args.reps, [args.model])
    else:
        bench = {"kernels": bench_kernels, "sharded": bench_sharded}[args.kind]
        result = bench(device, args.tiny, args.rounds, args.reps)
    result.update(kind=args.kind, device=device_name(device), torch=torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).strftime(
                      "%Y-%m-%d %H:%M:%S UTC"),
                  scale="tiny" if args.tiny else "full", rounds=args.rounds, reps=args.reps,
                  seconds=round(time.monotonic() - started, 1))
    if args.tiny or device.type != "cuda":
        for f in result["figures"]:   # the targets are GPU targets at full sizes
            if f["target"]:
                f["met"] = None
                f["note"] = "not judged: a tiny or CPU run exercises the code paths only"
    print(f"{args.kind} on {result['device']}, torch {result['torch']}, {result['date']}, "
          f"{args.rounds} alternating rounds of {args.reps} call(s) per side")
    for f in result["figures"]:
        value = "n/a" if f["value"] is None else f"{f['value']:.3f}"
        met = "" if f["met"] is None else ("  met" if f["met"] else "  MISSED")
        target = f"  (target {f['target']})" if f["target"] else ""
        print(f"  {f['name']}: {value} {f['unit']} {f['spread']}{target}{met}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=1)
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
