"""Gradient sync and training steps on a shaped network: torchstrategy vs. DDP, 2 replicas.

Between machines, gradient sync is bound by the network. This benchmark makes one on a
single machine: it re-executes itself in a private user and network namespace
(``unshare -rn``: no root needed), brings the namespace's loopback up and limits it to
``--rate`` Gbit/s with a token-bucket filter (``tc qdisc add dev lo root tbf ...``). Both
replicas (gloo, CPU) talk over that loopback, so both directions of the ring share the
rate: a link of R Gbit/s here carries what a full-duplex R/2 Gbit/s link between two
machines would. It refuses with the reason where ``unshare``, ``tc`` or ``ip`` is missing
or user namespaces are disabled.

Two models, built from plain layers with the parameter tensors (shapes, order) of:

- GPT-2 small: token embedding 50257 x 768 (tied with the output layer), positions
  1024 x 768, then blocks of 12 tensors (LayerNorm, QKV 2304 x 768, projection, LayerNorm,
  MLP 3072 x 768 and back) and a final LayerNorm. GPT-2 small has 12 blocks (124M
  parameters, 475 MiB of gradients); ``--gpt-layers`` defaults to 2 (53.5M parameters,
  204 MiB): on 2 CPU cores 12 blocks take minutes per round and all of the machine's memory
  with 8 copies of the model. Inputs: random tokens, ``--gpt-batch`` x ``--gpt-tokens``.
- ResNet-50: 161 tensors, 25.6M parameters (97.5 MiB), bottleneck blocks [3, 4, 6, 3];
  inputs ``--resnet-batch`` random images of ``--resnet-size`` pixels square (2 of 32: compute
  scales with the pixels, the parameters do not).

And, for the sweep of shapes of issue 38 item 4, ``matrices:SHAPE`` with SHAPE as in
scripts/bench_compression_kernels.py (``16x1024``: 16 matrices of 1024 x 1024;
``gpt:8x512``: the QKV, projection and MLP matrices of 8 transformer blocks of width 512):
those weight matrices alone, no biases, their forward a chain of products on 4 rows (so the
link, not the compute, is the limit), e.g. ``--models matrices:1x4096,matrices:gpt:8x512``.

The inputs are small on purpose: between machines with accelerators, compute is fast and
the network is what limits; 2 shared CPU cores computing a large batch would measure the
CPU instead.

Per model, two phases in the same 2 processes, each alternating its configurations in
rotating order, every repetition timed on the slower replica:

sync (no model compute: one autograd node hands out fixed gradients, as in
scripts/bench_allreduce.py, so the time is accumulation into ``.grad`` plus the reduction)
and step (forward, backward, SGD step; ``zero_grad(set_to_none=False)``):

  contiguous      dist.all_reduce of one buffer of all gradients' bytes: the network limit
  local           (step only) the same step without communication: the compute limit
  local-adamw     (step only, with a 1-bit Adam configuration) the same with AdamW: the
                  local step 1-bit Adam's time is counted against
  copy            (step only) one memory copy of the gradients' bytes (tensor.copy_): the
                  unit in which compression's overhead is counted (issue 38)
  serial          (step only) its forward and optimizer step alone: what a synchronous
                  step cannot overlap with its own all-reduce (contiguous + serial is the
                  fastest any data-parallel step on this link can be)
  ddp-best        DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True,
                  broadcast_buffers=False)
  ddp-fp16        the same with DDP's fp16_compress_hook
  ours            ts.MirroredStrategy(): the default, exact reduction
  ours-bf16       ts.NcclAllReduce(compression="bf16")
  ours-powersgd4  ts.NcclAllReduce(compression=ts.PowerSGD(rank=4))
  ours-int8       ts.NcclAllReduce(compression=ts.Int8()): compressed during backward
                  (overlap=True, Int8's default)
  ours-onebit     ts.NcclAllReduce(compression=ts.OneBitAdam(warmup_steps=1)): 1-bit Adam;
                  its step phase uses ts.OneBitAdamW (Adam's moments are updated in the
                  reduction), where every other configuration steps with SGD
  ours-autotuned  (step only) the default with ts.BucketAutotuner, searched during warm-up
  ours-powersgd4-overlap, ours-onebit-overlap, ours-int8-after
                  (only when named in --configs) the other setting of ``overlap``: PowerSGD
                  and 1-bit Adam compressing each bucket while backward goes on, Int8 after
                  backward (ts.Int8(overlap=False))

``--configs`` picks which of ours (besides ``ours``) and ``ours-autotuned`` run (default:
all but the three other settings of ``overlap``). DDP's own PowerSGD hook is left out: it
times out on gloo. Then (unless
``--sweep-repeats 0``) every candidate bucket cap of the autotuner is timed again in a sweep
on one model, to show the cap it chose against the best fixed cap.

Tables give medians with quartiles over repetitions, and ratios as the median (quartiles)
of per-repetition ratios of configurations measured back to back. The targets of issue 25
(2 Gbit/s) are checked on the step phase.

    scripts/bench_network.sh 2                         # or:
    .venv/bin/python scripts/bench_network.py --rate 2 # 10-15 minutes on 2 cores
    .venv/bin/python scripts/bench_network.py --rate 2 --quick   # small shapes, seconds
"""
import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from given_gradients import GivenGradients  # scripts/given_gradients.py
from bench_compression_kernels import parse_shape  # the sweep's shapes
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import torchstrategy as ts

NUM_REPLICAS = 2
INSIDE = "BENCH_NETWORK_SHAPED"          # set in the re-executed process
OURS = {"ours": None, "ours-bf16": "bf16", "ours-powersgd4": "powersgd", "ours-int8": "int8",
        "ours-onebit": "onebit", "ours-powersgd4-overlap": "powersgd-overlap",
        "ours-int8-after": "int8-after", "ours-onebit-overlap": "onebit-overlap"}
SYNC_CONFIGS = ("contiguous", "ddp-best", "ddp-fp16", *OURS)
STEP_CONFIGS = ("local", "serial", "contiguous", "copy", "ddp-best", "ddp-fp16", *OURS,
                "ours-autotuned")
CHOSEN = tuple(n for n in STEP_CONFIGS if n.startswith("ours-"))   # --configs may pick
# Run only when named: each compressor's other setting of `overlap`.
OTHER_OVERLAP = ("ours-powersgd4-overlap", "ours-onebit-overlap", "ours-int8-after")
MIB = 2**20


# -- the shaped namespace ------------------------------------------------------------------
def refuse(message):
    print(f"bench_network.py: {message}", file=sys.stderr)
    sys.exit(3)


def tbf_burst(rate_gbit):
    """tbf's bucket must hold at least one timer tick (4 ms at HZ=250) of traffic."""
    return max(MIB, int(rate_gbit * 1e9 / 8 * 0.004))


def reexec_in_shaped_namespace(rate_gbit):
    """Replaces this process with itself inside ``unshare -rn``; refuses clearly where the
    tools or user namespaces are missing."""
    for tool, package in (("unshare", "util-linux"), ("tc", "iproute2"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            refuse(f"'{tool}' is not installed; it is needed to shape a private network "
                   f"(apt-get install {package}). Nothing was run.")
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        refuse(f"'unshare -rn' failed ({probe.stderr.strip()}): unprivileged user "
               "namespaces are disabled on this machine (sysctl "
               "kernel.unprivileged_userns_clone=1, or a container that allows them). "
               "Nothing was run.")
    env = dict(os.environ, **{INSIDE: str(rate_gbit)})
    os.execvpe("unshare", ["unshare", "-rn", sys.executable, os.path.abspath(__file__),
                           *sys.argv[1:]], env)


def shape_loopback(rate_gbit):
    """Inside the namespace: loopback up, limited to `rate_gbit`. Returns tc's description."""
    commands = (["ip", "link", "set", "lo", "up"],
                ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_gbit}gbit",
                 "burst", str(tbf_burst(rate_gbit)), "latency", "50ms"])
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            refuse(f"'{' '.join(command)}' failed in the private namespace: "
                   f"{done.stderr.strip()} (the kernel lacks the tbf qdisc, sch_tbf?).")
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                          text=True).stdout.strip()


# -- the models ----------------------------------------------------------------------------
class Block(nn.Module):
    """A GPT-2 block: pre-LayerNorm attention and MLP, 12 parameter tensors."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, d, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()   # output layer tied to the embedding


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
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

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50's layout: with base=64 and classes=1000, its 161 parameter tensors."""

    def __init__(self, base=64, classes=1000, blocks=(3, 4, 6, 3)):
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

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(x).mean(dim=(2, 3)))


class Matrices(nn.Module):
    """Weight matrices of the given (rows, cols) shapes, no biases. The forward carries a few
    rows through every matrix in turn (tanh between them): where a matrix takes more
    columns than the activations have, they are repeated; fewer, they are averaged in
    groups. Every matrix gets a gradient; the compute is small against the link."""

    def __init__(self, shapes):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(rows, cols) / cols**0.5)
                                        for rows, cols in shapes)

    def forward(self, x):
        for weight in self.weights:
            width = weight.shape[1]
            if x.shape[-1] < width:
                x = x.repeat(1, width // x.shape[-1])
            elif x.shape[-1] > width:
                x = x.view(x.shape[0], -1, width).mean(dim=1)
            x = torch.tanh(F.linear(x, weight))
        return x


def matrices_spec(name, rows_per_batch=4):
    """(make model, make batch, description) of a ``matrices:SHAPE`` model."""
    shapes = parse_shape(name.removeprefix("matrices:"))
    widths_in = [shapes[0][1]] + [rows for rows, _ in shapes[:-1]]   # each one's input
    if any(max(cols, width) % min(cols, width)
           for (_, cols), width in zip(shapes, widths_in)):
        raise SystemExit(f"{name}: each matrix's columns must divide or be divided by the "
                         "rows before them")
    params = sum(r * c for r, c in shapes)

    def batch(g):
        return (torch.randn(rows_per_batch, shapes[0][1], generator=g),
                torch.randint(0, shapes[-1][0], (rows_per_batch,), generator=g))

    return (lambda: Matrices(shapes), batch,
            f"{len(shapes)} matrices ({name.removeprefix('matrices:')}), {params / 1e6:.1f}M "
            f"parameters, batch {rows_per_batch} rows")


def model_specs(args):
    """{name: (make model, make a batch (inputs, targets) from a generator, description)}."""
    if args.quick:   # small shapes of the same structure: seconds, for the test
        gpt = dict(vocab=512, context=64, d=64, heads=4, layers=1)
        resnet = dict(base=8, classes=10, blocks=(1, 1, 1, 1))
        gpt_bt, res_bs = (2, 16), (2, 32)
    else:
        gpt = dict(vocab=50257, context=1024, d=768, heads=12, layers=args.gpt_layers)
        resnet = dict(base=64, classes=1000)
        gpt_bt, res_bs = (args.gpt_batch, args.gpt_tokens), (args.resnet_batch, args.resnet_size)

    def gpt_batch(g):
        b, t = gpt_bt
        tokens = torch.randint(0, gpt["vocab"], (b, t + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def resnet_batch(g):
        b, s = res_bs
        return (torch.randn(b, 3, s, s, generator=g),
                torch.randint(0, resnet["classes"], (b,), generator=g))

    specs = {"gpt2": (lambda: GPT(**gpt), gpt_batch,
                      f"GPT-2-small-shaped, {gpt['layers']} of 12 blocks, batch "
                      f"{gpt_bt[0]}x{gpt_bt[1]} tokens"),
             "resnet50": (lambda: ResNet(**resnet), resnet_batch,
                          f"ResNet-50-shaped, batch {res_bs[0]} of {res_bs[1]}x{res_bs[1]}")}
    return {m: specs[m] if m in specs else matrices_spec(m) for m in args.models}


def loss_of(model, inputs, targets):
    out = model(inputs)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


# -- one replica ---------------------------------------------------------------------------
def init_process_group():
    timeout = datetime.timedelta(seconds=float(os.environ.get(
        "TORCHSTRATEGY_TIMEOUT_SECONDS", 600)))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def our_strategy(kind):
    compression = {None: None, "bf16": "bf16", "powersgd": ts.PowerSGD(rank=4),
                   "powersgd-overlap": ts.PowerSGD(rank=4, overlap=True),
                   "int8": ts.Int8(), "int8-after": ts.Int8(overlap=False),
                   "onebit": ts.OneBitAdam(warmup_steps=1),
                   "onebit-overlap": ts.OneBitAdam(warmup_steps=1, overlap=True)}[kind]
    if compression is None:
        return ts.MirroredStrategy()   # adopts the process group made above
    return ts.MirroredStrategy(cross_device_ops=ts.NcclAllReduce(compression=compression))


def ddp(module, fp16, static_graph=True):
    # torch 2.13 deprecates broadcast_buffers in favour of forward_sync_buffers, which still
    # syncs at init; False here only means "no broadcast before every forward", as ours.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    wrapped = nn.parallel.DistributedDataParallel(
        module, gradient_as_bucket_view=True, static_graph=static_graph,
        broadcast_buffers=False)
    if fp16:
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return wrapped


class Identity(nn.Module):
    """DDP's reducer is armed by forward: a forward that uses no parameter."""

    def __init__(self, params):
        super().__init__()
        self.ps = nn.ParameterList(params)

    def forward(self, x):
        return x


def build_sync(make_model, rank, ours):
    """{configuration: one sync} on copies of the model's parameters; extras."""
    shapes = [p.shape for p in make_model().parameters()]
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    total = sum(g.numel() for g in grads)
    flat = torch.randn(total, generator=gen)
    configs = {"contiguous": lambda: dist.all_reduce(flat)}

    def params():
        return [nn.Parameter(torch.zeros(s)) for s in shapes]

    for name, fp16 in (("ddp-best", False), ("ddp-fp16", True)):
        plist = params()
        # No static_graph here: its first iteration sees a forward that uses no parameter
        # and then skips reducing them.
        wrapped = ddp(Identity(plist), fp16, static_graph=False)

        def run(wrapped=wrapped, plist=plist):
            for p in plist:
                if p.grad is not None:
                    p.grad.zero_()
            wrapped(torch.zeros(()))
            GivenGradients.apply(grads, *plist).backward()
        configs[name] = run
    strategies = {}
    for name, kind in ours.items():
        strategy = strategies[name] = our_strategy(kind)
        with strategy.scope():
            plist = list(Identity(params()).parameters())
        assert len(strategy.extended.gradient_reducer.parameters) == len(plist)

        def run(strategy=strategy, plist=plist):
            for p in plist:
                if p.grad is not None:
                    p.grad.zero_()
            strategy.run(lambda: GivenGradients.apply(grads, *plist).backward())
        configs[name] = run
    return configs, strategies


def build_step(make_model, make_batch, rank, quick, ours, autotuned):
    """{configuration: one training step}; the strategies; the autotuner."""
    gen = torch.Generator().manual_seed(1 + rank)
    inputs, targets = make_batch(gen)
    configs = {}

    def plain(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            loss_of(model, inputs, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return step

    torch.manual_seed(0)
    local_model = make_model()
    configs["local"] = plain(local_model)
    if any(kind is not None and kind.startswith("onebit") for kind in ours.values()):
        # 1-bit Adam's step does AdamW's work (the moments in the reduction, the decay and
        # the step in ts.OneBitAdamW) where the others step with SGD: its own reference.
        torch.manual_seed(0)
        adamw_model = make_model()
        adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-3)

        def adamw_step():
            loss_of(adamw_model, inputs, targets).backward()
            adamw.step()
            adamw.zero_grad(set_to_none=False)
        configs["local-adamw"] = adamw_step
    local_optimizer = torch.optim.SGD(local_model.parameters(), lr=1e-3)

    def serial():
        # What a synchronous step cannot overlap with its own all-reduce: the forward (the
        # gradients do not exist yet) and the optimizer step (it needs all of them summed).
        # The forward records its graph, as in a step; the graph is dropped unused.
        loss_of(local_model, inputs, targets)
        local_optimizer.step()
    configs["serial"] = serial
    numel = sum(p.numel() for p in make_model().parameters())
    flat = torch.randn(numel, generator=gen)
    configs["contiguous"] = lambda: dist.all_reduce(flat)
    # One memory copy of the gradient bytes: the unit of compression's overhead.
    copy_of_flat = torch.empty_like(flat)
    configs["copy"] = lambda: copy_of_flat.copy_(flat)
    for name, fp16 in (("ddp-best", False), ("ddp-fp16", True)):
        torch.manual_seed(0)
        configs[name] = plain(ddp(make_model(), fp16))
    strategies, tuner = {}, None
    for name, kind in (*ours.items(), *([("ours-autotuned", None)] if autotuned else [])):
        strategy = strategies[name] = our_strategy(kind)
        torch.manual_seed(0)
        with strategy.scope():
            model = make_model()
            onebit = kind is not None and kind.startswith("onebit")
            optimizer = ts.OneBitAdamW(model.parameters(), lr=1e-3, strategy=strategy) \
                if onebit else torch.optim.SGD(model.parameters(), lr=1e-3)
        if name == "ours-autotuned":
            tuner = ts.BucketAutotuner(
                strategy.extended.gradient_reducer,
                **(dict(steps_per_candidate=1, settle_steps=1) if quick else {}))

        def train_step(model=model, optimizer=optimizer):
            ts.scale_mean_loss(loss_of(model, inputs, targets)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        configs[name] = lambda strategy=strategy, f=train_step: strategy.run(f)
    return configs, strategies, tuner


def time_alternating(configs, repeats, warmup, extra_warmup=None):
    """{name: [seconds per repetition]} on the slower replica, configurations alternating
    in rotating order."""
    names = list(configs)
    for name in names:
        for _ in range(warmup + (extra_warmup or {}).get(name, 0)):
            configs[name]()
    times = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            configs[name]()
            times[name].append(time.perf_counter() - start)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {n: table[k].tolist() for k, n in enumerate(names)}


def one_bucket_cap(reducer):
    return sum(p.numel() * p.element_size() + 16 for p in reducer.parameters)


def sweep(step, reducer, candidates, repeats):
    """Each candidate cap timed (one settling step, then one timed), alternating."""
    caps = [(c, one_bucket_cap(reducer)) if c is None else (c, None) for c in candidates]
    times = {c: [] for c in candidates}
    for r in range(repeats):
        for c, first in caps[r % len(caps):] + caps[:r % len(caps)]:
            reducer.rebucket(first if c is None else c, first)
            step()
            dist.barrier()
            start = time.perf_counter()
            step()
            times[c].append(time.perf_counter() - start)
    table = torch.tensor([times[c] for c in candidates], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return [table[k].tolist() for k in range(len(candidates))]


def replica_main(args):
    init_process_group()
    rank = dist.get_rank()
    results = {}
    for model_name, (make_model, make_batch, _) in model_specs(args).items():
        started = time.perf_counter()
        ours = {n: k for n, k in OURS.items() if n == "ours" or n in args.configs}
        autotuned = "ours-autotuned" in args.configs
        configs, strategies = build_sync(make_model, rank, ours)
        sync = time_alternating(configs, args.repeats, args.warmup)
        if rank == 0:
            print(f"{model_name}: sync phase done in {time.perf_counter() - started:.0f} s",
                  flush=True)
        sync_bytes = {n: s.extended.stats().bytes_reduced for n, s in strategies.items()}
        del configs, strategies
        gc.collect()

        configs, strategies, tuner = build_step(make_model, make_batch, rank, args.quick,
                                                ours, autotuned)
        step = time_alternating(configs, args.repeats, args.warmup,
                                {"ours-autotuned": tuner.total_steps} if tuner else {})
        assert tuner is None or tuner.done, \
            "the autotuner's search did not finish during warm-up"
        if rank == 0:
            print(f"{model_name}: step phase done in {time.perf_counter() - started:.0f} s",
                  flush=True)
        out = {"sync": sync, "step": step, "sync_bytes": sync_bytes,
               "step_bytes": {n: s.extended.stats().bytes_reduced
                              for n, s in strategies.items()},
               "ratio": {n: s.extended.stats().compression_ratio
                         for n, s in strategies.items()},
               "autotune": tuner.result._asdict() if tuner else None,
               "candidates": list(tuner.candidates) if tuner else [],
               "num_tensors": len(strategies["ours"].extended.gradient_reducer.parameters),
               "bytes": sum(p.numel() * p.element_size() for p in
                            strategies["ours"].extended.gradient_reducer.parameters)}
        if args.sweep_repeats and model_name == args.sweep_model and tuner is not None:
            reducer = strategies["ours-autotuned"].extended.gradient_reducer
            out["sweep"] = sweep(configs["ours-autotuned"], reducer, tuner.candidates,
                                 args.sweep_repeats)
        results[model_name] = out
        del configs, strategies, tuner
        gc.collect()
    return results


# -- the report ----------------------------------------------------------------------------
def quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def paired(a, b):
    return quartiles([x / y for x, y in zip(a, b)])


def fmt_q(q, scale=1.0, digits=3):
    lo, med, hi = (v * scale for v in q)
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def report(results, args, shaped):
    summary = {"rate_gbit": args.rate, "date": datetime.date.today().isoformat(),
               "qdisc": shaped, "repeats": args.repeats, "models": {}}
    for model_name, res in results.items():
        desc = model_specs(args)[model_name][2]
        print(f"\n=== {model_name}: {desc}; {res['num_tensors']} gradient tensors, "
              f"{res['bytes'] / MIB:.1f} MiB ===")
        entry = summary["models"][model_name] = {"description": desc,
                                                 "tensors": res["num_tensors"],
                                                 "mib": res["bytes"] / MIB}
        for phase in ("sync", "step"):
            times = res[phase]
            limit = times["contiguous"] if phase == "sync" else \
                [max(a, b) for a, b in zip(times["local"], times["contiguous"])]
            print(f"\n{phase}: ms, median [quartiles] over {len(times['contiguous'])} "
                  f"repetitions; paired ratios vs ddp-best, vs ddp-fp16, vs the limit ("
                  f"{'contiguous' if phase == 'sync' else 'max(local, contiguous)'})")
            print(f"{'configuration':<16}{'ms':>24}{'/ ddp-best':>24}{'/ ddp-fp16':>24}"
                  f"{'/ limit':>24}{'MiB sent':>10}")
            entry[phase] = {}
            for name, t in times.items():
                sent = res[f"{phase}_bytes"].get(name)
                row = {"ms": [v * 1e3 for v in quartiles(t)],
                       "vs_ddp_best": list(paired(t, times["ddp-best"])),
                       "vs_ddp_fp16": list(paired(t, times["ddp-fp16"])),
                       "vs_limit": list(paired(t, limit)),
                       "mib_sent": None if sent is None else sent / MIB}
                entry[phase][name] = row
                print(f"{name:<16}{fmt_q(quartiles(t), 1e3, 1):>24}"
                      f"{fmt_q(row['vs_ddp_best']):>24}{fmt_q(row['vs_ddp_fp16']):>24}"
                      f"{fmt_q(row['vs_limit']):>24}"
                      f"{'' if sent is None else f'{sent / MIB:.2f}':>10}")
        auto = res["autotune"]
        if auto is None:
            continue
        cands = res["candidates"]
        entry["autotune"] = {"kept": auto["candidate"], "cap_bytes": auto["bucket_cap_bytes"],
                             "search_step_ms": [s * 1e3 for s in auto["step_seconds"]]}
        print(f"\nautotuner: kept {label(auto['candidate'])} (cap {auto['bucket_cap_bytes']} "
              f"bytes); its search, median step ms per candidate: "
              + ", ".join(f"{label(c)} {s * 1e3:.1f}" for c, s in
                          zip(cands, auto["step_seconds"])))
        if "sweep" in res:
            sw = res["sweep"]
            meds = [statistics.median(t) for t in sw]
            best = min(range(len(meds)), key=meds.__getitem__)
            chosen = cands.index(auto["candidate"])
            ratio = paired(sw[chosen], sw[best])
            print(f"sweep ({len(sw[0])} repetitions, alternating, step ms median "
                  f"[quartiles]): " + ", ".join(
                      f"{label(c)} {fmt_q(quartiles(t), 1e3, 1)}" for c, t in zip(cands, sw)))
            print(f"  best fixed cap: {label(cands[best])}; the autotuner's choice "
                  f"{label(auto['candidate'])}: {fmt_q(ratio)} x the best fixed (paired)")
            entry["sweep"] = {"ms": {label(c): [v * 1e3 for v in quartiles(t)]
                                     for c, t in zip(cands, sw)},
                              "best_fixed": label(cands[best]),
                              "chosen_vs_best": list(ratio)}
    targets(results, summary)
    return summary


def label(candidate):
    return "one bucket" if candidate is None else f"{candidate / MIB:g} MiB"


def targets(results, summary):
    """Issue 25's targets, on the step phase of each model."""
    print("\ntargets (step phase, paired ratios: median [quartiles]):")
    summary["targets"] = {}
    for model_name, res in results.items():
        t = res["step"]
        limit = [max(a, b) for a, b in zip(t["local"], t["contiguous"])]
        reachable = [a + b for a, b in zip(t["contiguous"], t["serial"])]
        checks = [("ours / max(local, contiguous)", t["ours"], limit, 1.05),
                  ("ours / (contiguous + serial)", t["ours"], reachable, 1.05)]
        for name, against, target in (("ours-powersgd4", "ddp-best", 0.35),
                                      ("ours-powersgd4", "ddp-fp16", 0.6),
                                      ("ours-bf16", "ddp-fp16", 1.0),
                                      ("ours-onebit", "ddp-best", 0.30),
                                      ("ours-powersgd4-overlap", "ddp-best", 0.35),
                                      ("ours-onebit-overlap", "ddp-best", 0.30)):
            if name in t:
                checks.append((f"{name} / {against}", t[name], t[against], target))
        # Issue 38: what compression adds to a step, in memory copies of the gradient bytes:
        # (compressed step - local step - the wire time of the bytes it sent) / one copy. The
        # wire time is the contiguous all-reduce's, scaled by the bytes sent over the
        # gradient bytes (at 2 replicas each sends about its buffer's bytes either way).
        for name in ("ours-powersgd4", "ours-int8", "ours-onebit", "ours-powersgd4-overlap",
                     "ours-int8-after", "ours-onebit-overlap"):
            if name in t:
                share = res["step_bytes"][name] / res["bytes"]
                # 1-bit Adam against the local step with AdamW, which it replaces.
                local = t["local-adamw"] if name.startswith("ours-onebit") else t["local"]
                over = [(c - lo - w * share) for c, lo, w in
                        zip(t[name], local, t["contiguous"])]
                checks.append((f"{name} overhead / one copy", over, t["copy"], 6.0))
        rows = summary["targets"][model_name] = {}
        for name, a, b, target in checks:
            q = paired(a, b)
            rows[name] = {"ratio": list(q), "target": target, "met": q[1] <= target}
            print(f"  {model_name:<9}{name:<36}{fmt_q(q):>24}  target <= {target}: "
                  f"{'met' if q[1] <= target else 'MISSED'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=2.0,
                        help="link rate in Gbit/s (1, 2, 10; shared by both directions)")
    parser.add_argument("--models", default="gpt2,resnet50",
                        help="comma-separated: gpt2, resnet50, matrices:SHAPE (e.g. "
                             "matrices:64x512, matrices:gpt:8x512)")
    parser.add_argument("--repeats", type=int, default=8,
                        help="timed repetitions of every configuration per phase")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--gpt-layers", type=int, default=2,
                        help="GPT-2 blocks (GPT-2 small has 12)")
    parser.add_argument("--gpt-batch", type=int, default=1)
    parser.add_argument("--gpt-tokens", type=int, default=32)
    parser.add_argument("--resnet-batch", type=int, default=2)
    parser.add_argument("--resnet-size", type=int, default=32)
    parser.add_argument("--sweep-repeats", type=int, default=3,
                        help="repetitions of the bucket-cap sweep (0: none)")
    parser.add_argument("--sweep-model",
                        help="the model the sweep runs on (default: the last of --models)")
    parser.add_argument("--configs",
                        default=",".join(n for n in CHOSEN if n not in OTHER_OVERLAP),
                        help="comma-separated: which of " + ", ".join(CHOSEN) + " to run "
                             "(the references and ours always run)")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: small shapes, 2 repetitions")
    args = parser.parse_args()
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in ("gpt2", "resnet50")
           and not m.startswith("matrices:")]
    if bad or not args.models:
        parser.error(f"--models: unknown {bad or 'empty list'}; choose from gpt2, resnet50, "
                     f"matrices:SHAPE")
    for name in args.models:
        if name.startswith("matrices:"):
            matrices_spec(name)   # a bad shape is refused here, before any process starts
    if not args.rate > 0:
        parser.error(f"--rate must be a positive number of Gbit/s, got {args.rate}")
    if args.repeats < 1 or args.warmup < 0 or args.sweep_repeats < 0:
        parser.error("--repeats must be >= 1, --warmup and --sweep-repeats >= 0")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(args.configs) - set(CHOSEN):
        parser.error(f"--configs: unknown {sorted(set(args.configs) - set(CHOSEN))}; choose "
                     f"from {', '.join(CHOSEN)}")
    if args.sweep_model is None:
        args.sweep_model = args.models[-1]
    if args.sweep_model not in args.models:
        parser.error(f"--sweep-model {args.sweep_model} is not among --models {args.models}")
    if args.quick:
        args.repeats, args.warmup, args.sweep_repeats = 2, 1, min(args.sweep_repeats, 1)

    if os.environ.get(INSIDE) is None:
        reexec_in_shaped_namespace(args.rate)
    shaped = shape_loopback(args.rate)
    print(f"shaped loopback: {shaped}")
    print(f"{NUM_REPLICAS} replicas on gloo, CPU; {args.repeats} repetitions per phase; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)
    results = ts.launch(replica_main, args, num_replicas=NUM_REPLICAS, timeout_seconds=3600)
    summary = report(results, args, shaped)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
