"""Time gradient accumulation: ``ts.accumulate`` vs. a hand-written ``no_sync`` loop.

Both configurations train the same small GPT-style model (nanoGPT's block: attention, MLP,
dropout 0.1) with AdamW on 2 CPU replicas (gloo) under one ts.MirroredStrategy, each
iteration being `--accumulate` micro-batches and one optimizer step:

  accumulate  for micro in ts.accumulate(strategy, batches, steps=k):
                  with micro: micro.scale_mean_loss(loss).backward()
  no-sync     for m in range(k):
                  with (no_sync() unless the last): ts.scale_mean_loss(loss / k).backward()

The difference is what ts.accumulate costs per iteration: its generator, a MicroBatch per
micro-batch, entering and leaving ``no_sync`` through it, and any collective it would add
(none for a mean loss). Machine noise moves an iteration's time far more than that, so the
two configurations alternate in short chunks (the order swapping every chunk) inside the
same 2 processes; a chunk's time is the slower replica's, and the figure reported is the
median of the paired ratios (each accumulate chunk over the no-sync chunk next to it), with
the quartiles of those ratios as the spread, beside the ratio of the CPU times (the
process's, gloo's threads included), which other jobs on the same cores barely move.
Target: <= 1.01. Last, the loop machinery alone is timed (both loops with an empty body:
micro-seconds per iteration), which sets what ts.accumulate can cost whatever the model.

    .venv/bin/python scripts/bench_accumulate.py            # default: about a minute
    .venv/bin/python scripts/bench_accumulate.py --quick    # smoke test: a few seconds
"""
import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts

CONFIGS = ("accumulate", "no-sync")
NUM_REPLICAS = 2


class Block(nn.Module):
    """nanoGPT's transformer block, with its dropout."""

    def __init__(self, embd, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(embd), nn.LayerNorm(embd)
        self.attn, self.proj = nn.Linear(embd, 3 * embd), nn.Linear(embd, embd)
        self.mlp = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(),
                                 nn.Linear(4 * embd, embd), nn.Dropout(dropout))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, embd, dropout=0.1):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, embd), nn.Embedding(block, embd)
        self.h = nn.Sequential(*(Block(embd, heads, dropout) for _ in range(layers)))
        self.ln_f, self.lm_head = nn.LayerNorm(embd), nn.Linear(embd, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        logits = self.lm_head(self.ln_f(self.h(x)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build_iterations(args):
    """Returns the strategy and {configuration: function running one iteration (k
    micro-batches, a step)}."""
    strategy = ts.MirroredStrategy()          # the process group ts.launch prepared
    gen = torch.Generator().manual_seed(1 + strategy.extended.replica_id)
    data = torch.randint(0, args.vocab, (args.accumulate, args.batch, args.block + 1),
                         generator=gen)
    # Fixed micro-batches: data loading is not what is measured.
    micro_batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]

    def make():
        torch.manual_seed(0)
        model = strategy.adopt(GPT(args.vocab, args.block, args.layers, args.heads,
                                   args.embd))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def with_accumulate(model, optimizer):
        def iteration():
            batches = (batch for batch in micro_batches)
            for micro in ts.accumulate(strategy, batches, steps=args.accumulate):
                with micro:
                    micro.scale_mean_loss(model(*micro.batch)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return iteration

    def hand_written(model, optimizer):
        k = args.accumulate

        def iteration():
            for m, batch in enumerate(micro_batches):
                with contextlib.nullcontext() if m == k - 1 else strategy.extended.no_sync():
                    ts.scale_mean_loss(model(*batch) / k).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return iteration

    return strategy, {"accumulate": with_accumulate(*make()),
                      "no-sync": hand_written(*make())}


def machinery_seconds(strategy, k, repeats):
    """Seconds per iteration of each loop with an empty body (no model: only the loop, the
    MicroBatch objects and entering no_sync), the median of 5 runs of `repeats`."""
    def accumulate_loop():
        for micro in ts.accumulate(strategy, range(k), k):
            with micro:
                pass

    def hand_written_loop():
        for m in range(k):
            with contextlib.nullcontext() if m == k - 1 else strategy.extended.no_sync():
                pass

    result = {}
    for config, loop in (("accumulate", accumulate_loop), ("no-sync", hand_written_loop)):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                loop()
            runs.append((time.perf_counter() - start) / repeats)
        result[config] = statistics.median(runs)
    return result


def replica_main(args, chunks):
    """One replica; returns {configuration: {"wall"|"cpu": [seconds per iteration of each
    chunk]}} (the slower replica's) and the loop machinery's seconds per iteration."""
    torch.set_num_threads(1)   # two replicas on a shared machine: one core each
    strategy, iterations = build_iterations(args)
    for iteration in iterations.values():
        for _ in range(args.warmup):
            iteration()
    wall = {c: [] for c in CONFIGS}
    cpu = {c: [] for c in CONFIGS}
    for i in range(chunks):
        for config in (CONFIGS if i % 2 == 0 else CONFIGS[::-1]):
            iteration = iterations[config]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.chunk):
                iteration()
            wall[config].append((time.perf_counter() - start) / args.chunk)
            cpu[config].append((time.process_time() - start_cpu) / args.chunk)
    table = torch.tensor([wall[c] for c in CONFIGS] + [cpu[c] for c in CONFIGS],
                         dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    n = len(CONFIGS)
    times = {c: {"wall": table[k].tolist(), "cpu": table[n + k].tolist()}
             for k, c in enumerate(CONFIGS)}
    return times, machinery_seconds(strategy, args.accumulate, 200 if args.quick else 2000)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=120,
                        help="timed iterations per configuration")
    parser.add_argument("--chunk", type=int, default=3,
                        help="consecutive iterations of one configuration before switching")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations each")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=8, help="per-replica micro-batch")
    parser.add_argument("--block", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a few iterations of a tiny model")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.chunk, args.warmup = 4, 1, 1
        args.block, args.embd, args.layers = 16, 32, 1
    chunks = max(1, args.iterations // args.chunk)
    print(f"model: GPT {args.layers} layers x {args.embd}, block {args.block}, dropout 0.1; "
          f"{NUM_REPLICAS} CPU replicas on gloo, {args.accumulate} micro-batches of "
          f"{args.batch} per step, AdamW")
    print(f"{chunks} chunks x {args.chunk} iterations per configuration, interleaved",
          flush=True)
    times, machinery = ts.launch(replica_main, args, chunks, num_replicas=NUM_REPLICAS)
    wall = {c: times[c]["wall"] for c in CONFIGS}

    print()
    print(f"{'configuration':<14}{'median ms/iteration':>21}{'p25':>9}{'p75':>9}"
          f"{'CPU ms/iteration':>18}")
    for c in CONFIGS:
        q = statistics.quantiles(wall[c], n=4) if len(wall[c]) > 1 else [wall[c][0]] * 3
        print(f"{c:<14}{statistics.median(wall[c]) * 1e3:>21.2f}{q[0] * 1e3:>9.2f}"
              f"{q[2] * 1e3:>9.2f}{statistics.median(times[c]['cpu']) * 1e3:>18.2f}")
    ratios = [a / b for a, b in zip(wall["accumulate"], wall["no-sync"])]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    cpu_ratio = statistics.median(times["accumulate"]["cpu"]) / \
        statistics.median(times["no-sync"]["cpu"])
    print()
    print(f"accumulate / no-sync, median of {len(ratios)} paired ratios: "
          f"{statistics.median(ratios):.3f} (p25 {q[0]:.3f}, p75 {q[2]:.3f}); CPU time "
          f"{cpu_ratio:.3f}; target <= 1.01")
    extra = machinery["accumulate"] - machinery["no-sync"]
    print(f"loop machinery alone: accumulate {machinery['accumulate'] * 1e6:.1f} us, "
          f"no-sync {machinery['no-sync'] * 1e6:.1f} us per iteration of "
          f"{args.accumulate}; the difference, {extra * 1e6:.1f} us, is "
          f"{extra / statistics.median(wall['no-sync']):.3%} of a no-sync iteration here")

if __name__ == "__main__":
    main()
