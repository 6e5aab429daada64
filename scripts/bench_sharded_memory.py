"""The memory proof of ShardedStrategy: a transformer whose full training state (float32
parameters + gradients + Adam's two moments: 16 bytes per parameter) is about 6 GB,
built on the meta device inside the scope, trained for a few steps on 4 CPU replicas
(gloo); each replica's peak resident memory above a bare interpreter's is compared with
that full state.

    python scripts/bench_sharded_memory.py            # 380M parameters, 4 replicas (~9 GB)
    python scripts/bench_sharded_memory.py --quick    # a tiny model, 2 replicas (a test)

Measured:
- the baseline: the peak resident memory (VmHWM) of a process that imports torch and
  torchstrategy and does nothing else, started by replica 0 while the replicas wait (the
  median of three such processes, with their range);
- per replica, VmHWM (its peak resident set since it started, from /proc/self/status)
  after the strategy started, after the model was materialised, and after training; and
  the bytes of the training state it holds (its shards of parameters and Adam's moments,
  gradients counted as large as the parameter shards);
- the ratio (peak - baseline) / full training state, which must be <= 0.35 at full size
  (the script exits with status 1 otherwise; ``--quick`` checks nothing: a tiny model's
  state is far smaller than the interpreter's own memory).

What adds to the 1/N of the state that each replica holds: the full parameters of a unit
gathered during its forward and backward (one transformer layer at a time, plus FSDP2's
prefetch of the next; the model's own parameters, embedding and head, stay gathered from
forward to backward), the unsharded gradients of a unit before they are reduce-scattered,
gloo's buffers, the modules imported (FSDP2, DTensor) and the process group. On CPUs
there is no caching allocator: freed blocks go back to the C allocator (glibc), which
returns large ones to the system at once.

MirroredStrategy is not run: each of its replicas would hold the whole training state,
4 x that state plus 4 interpreters, more than this machine's memory (the script prints
the comparison with MemTotal).
"""
import argparse
import ctypes
import ctypes.util
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import torchstrategy as ts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--replicas", type=int, default=4, help="CPU replicas (gloo)")
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--layers", type=int, default=30)
parser.add_argument("--vocab", type=int, default=1024)
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--batch", type=int, default=1, help="per replica")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--limit", type=float, default=0.35,
                    help="the largest (peak - baseline) / full training state accepted")
parser.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="glibc's M_MMAP_THRESHOLD in bytes, set in every replica before "
                    "the model exists (0: glibc's default, a threshold that rises up to 32 "
                    "MiB; see the module docstring)")
parser.add_argument("--quick", action="store_true",
                    help="a tiny model on 2 replicas: checks the script runs (no limit)")

BASELINE_CODE = ("import torch, torchstrategy\n"
                 "print([int(line.split()[1]) for line in open('/proc/self/status') "
                 "if line.startswith('VmHWM:')][0])")


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (part.view(b, t, self.heads, -1).transpose(1, 2)
                   for part in self.qkv(self.attention_norm(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Transformer(nn.Module):
    """Every module with parameters of its own has reset_parameters() (torch's modules)."""

    def __init__(self, vocab, width, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, max(1, width // 64)) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).flatten(0, 1))  # 2-D: not a view (FSDP2 warns)


def peak_kib():
    """This process's peak resident set size (VmHWM), in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def mem_total_bytes():
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo
                    if line.startswith("MemTotal:"))


def baseline_kib(repeats=3):
    """VmHWM of fresh processes that import torch and torchstrategy and stop."""
    return [int(subprocess.run([sys.executable, "-c", BASELINE_CODE], capture_output=True,
                               text=True, check=True).stdout) for _ in range(repeats)]


def local_bytes(tensor):
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def set_mmap_threshold(size):
    """Makes glibc serve every allocation of `size` bytes or more with its own mmap, given
    back to the system when freed (``mallopt(M_MMAP_THRESHOLD, size)``, which also turns
    off the threshold's rise). Returns False where the C library has no mallopt."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    m_mmap_threshold = -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, size))


def main(args):
    if args.quick:
        args.replicas, args.width, args.layers, args.vocab = 2, 64, 2, 64
        args.seq, args.batch, args.steps = 8, 2, 2
    # Before the strategy: every replica (re-executed from this script) runs this first.
    args.mmap_set = bool(args.mmap_threshold) and set_mmap_threshold(args.mmap_threshold)
    strategy = ts.ShardedStrategy(devices=[f"cpu:{i}" for i in range(args.replicas)])
    ext = strategy.extended
    figures = {"started": peak_kib()}
    # The baseline, measured while the replicas wait (in the same run, on the same
    # machine state); only replica 0 starts the processes.
    baseline = baseline_kib(1 if args.quick else 3) if ext.is_chief else []
    ext.communicator.barrier()

    start = time.perf_counter()
    torch.manual_seed(0)
    with strategy.scope():
        with torch.device("meta"):
            model = Transformer(args.vocab, args.width, args.layers)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    figures["materialised"] = peak_kib()
    figures["materialise_s"] = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    global_batch = args.batch * args.replicas

    def step(tokens, targets):
        per_token = F.cross_entropy(model(tokens), targets.flatten(), reduction="none")
        loss = ts.compute_average_loss(per_token.view(targets.shape).mean(1),
                                       global_batch_size=global_batch)
        loss.backward()
        state_bytes = sum(2 * local_bytes(p) for p in model.parameters())  # + gradients
        optimizer.step()
        state_bytes += sum(local_bytes(v) for p in model.parameters()
                           for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)
                           and v.dim() > 0)
        optimizer.zero_grad()
        figures["state_bytes"] = state_bytes
        return loss.detach()

    generator = torch.Generator().manual_seed(0)
    batches = [(t, t.roll(1, dims=1)) for t in (
        torch.randint(0, args.vocab, (global_batch, args.seq), generator=generator)
        for _ in range(args.steps))]
    step_seconds, losses = [], []
    for tokens, targets in strategy.experimental_distribute_dataset(batches):
        began = time.perf_counter()
        loss = strategy.run(step, args=(tokens, targets))
        losses.append(strategy.reduce("SUM", loss, axis=None).item())
        step_seconds.append(time.perf_counter() - began)
    figures["trained"] = peak_kib()
    every = ext.communicator.gather_objects(figures)
    if not ext.is_chief:
        return 0
    return report(args, parameters, baseline, every, step_seconds, losses)


def report(args, parameters, baseline, every, step_seconds, losses):
    full = 16 * parameters
    base = statistics.median(baseline) * 1024
    gb = 1e9
    print(f"model: {parameters / 1e6:.1f}M parameters ({args.layers} layers of width "
          f"{args.width}, vocabulary {args.vocab}); full training state (float32 parameters "
          f"+ gradients + Adam's 2 moments, 16 B/parameter): {full / gb:.2f} GB")
    print(f"{args.replicas} CPU replicas (gloo), built on meta, {args.steps} Adam steps of "
          f"{args.batch}x{args.seq} tokens per replica; losses "
          + ", ".join(f"{loss:.3f}" for loss in losses))
    print(f"materialised in {every[0]['materialise_s']:.1f} s; step times "
          + ", ".join(f"{s:.1f}" for s in step_seconds) + " s")
    print("glibc allocator: " + (f"M_MMAP_THRESHOLD = {args.mmap_threshold} B (mallopt)"
                                 if args.mmap_set else "default (dynamic mmap threshold)"))
    print(f"baseline (import torch, torchstrategy): VmHWM {base / gb:.3f} GB (median of "
          f"{len(baseline)}: {min(baseline) * 1024 / gb:.3f} .. "
          f"{max(baseline) * 1024 / gb:.3f})")
    print("replica  state held  started  materialised  trained (VmHWM, GB)  "
          "above baseline  / full state")
    worst = 0.0
    for rank, figures in enumerate(every):
        above = figures["trained"] * 1024 - base
        ratio = above / full
        worst = max(worst, ratio)
        print(f"{rank:7d}  {figures['state_bytes'] / gb:9.3f}  "
              f"{figures['started'] * 1024 / gb:7.3f}  "
              f"{figures['materialised'] * 1024 / gb:12.3f}  "
              f"{figures['trained'] * 1024 / gb:7.3f}              "
              f"{above / gb:14.3f}  {ratio:12.3f}")
    print(f"largest (peak - baseline) / full training state: {worst:.3f} "
          f"(1/{args.replicas} = {1 / args.replicas:.3f} is the state alone)")
    total = mem_total_bytes()
    mirrored = args.replicas * (full + base)
    print(f"MirroredStrategy (not run): {args.replicas} x ({full / gb:.2f} GB state + "
          f"{base / gb:.2f} GB interpreter) = {mirrored / gb:.1f} GB before any activation, "
          f"{'more' if mirrored > total else 'less'} than this machine's MemTotal "
          f"{total / gb:.1f} GB")
    if args.quick:
        return 0
    if worst > args.limit:
        print(f"FAILED: {worst:.3f} > {args.limit}")
        return 1
    print(f"OK: {worst:.3f} <= {args.limit}")
    return 0


if __name__ == "__main__":
    sys.exit(main(parser.parse_args()))
