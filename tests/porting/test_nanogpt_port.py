"""A nanoGPT-style loop, ported: gradient accumulation and ``torch.compile`` under two
replicas equal the same loop under ``DistributedDataParallel`` with ``no_sync`` (gloo).

The port is the one docs/porting_from_ddp.md shows: the model is built outside the scope
with a different seed on each replica, adopted (``strategy.adopt``), then cropped
(``crop_block_size`` registers a new Parameter after adoption), the optimizer is made, and
the loop runs outside ``strategy.run`` as nanoGPT's does, with ``ts.accumulate`` in place of
``require_backward_grad_sync`` and ``micro.scale_mean_loss`` in place of
``loss / gradient_accumulation_steps``. As in nanoGPT, the model has dropout and
``get_batch`` draws from the global random generator, and the DDP loop prefetches its next
batch after the forward: ``ts.accumulate`` reads each batch when the loop asks for it, so
the random draws come in the same order and the weights agree. One launch runs the eager
and the compiled port and the DDP reference.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import detached_state, from_every_replica, launch

N = 2
# One block: the equality does not depend on depth, and each block adds to what
# torch.compile generates and compiles (most of this file's time, on a cold cache).
VOCAB, BLOCK, CROPPED, LAYERS, HEADS, EMBD = 32, 16, 8, 1, 2, 16
MICRO_B, ACCUMULATION, ITERS = 2, 3, 3
SEED = 1337
DROPOUT = 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = nn.Linear(EMBD, 3 * EMBD)
        self.proj = nn.Linear(EMBD, EMBD)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(),
                                 nn.Linear(4 * EMBD, EMBD), nn.Dropout(DROPOUT))
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.block_size = BLOCK
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)

    def crop_block_size(self, block_size):
        """nanoGPT's: a new, smaller position-embedding Parameter."""
        self.block_size = block_size
        self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_batch():
    """This replica's micro-batch, drawn from the global generator as nanoGPT's
    ``get_batch`` draws its offsets (each rank seeds it with ``1337 + seed_offset``)."""
    data = torch.randint(0, VOCAB, (MICRO_B, CROPPED + 1))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def train_port(strategy, rank, compiled):
    torch.manual_seed(SEED + rank)            # replica 0's model wins at adoption
    model = GPT()
    strategy.adopt(model)
    model.crop_block_size(CROPPED)            # after adoption: recorded and broadcast too
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    run = torch.compile(model) if compiled else model
    torch.manual_seed(SEED + 1 + rank)        # nanoGPT's 1337 + seed_offset: data, dropout
    for it in range(ITERS):
        micro_batches = (get_batch() for _ in range(ACCUMULATION))
        for micro in ts.accumulate(strategy, micro_batches, steps=ACCUMULATION):
            with micro:
                _, loss = run(*micro.batch)
                micro.scale_mean_loss(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return detached_state(model)


def train_ddp(rank, compiled):
    """nanoGPT's own loop: compile, then wrap in DDP; ``require_backward_grad_sync``; the
    next batch prefetched after the forward."""
    torch.manual_seed(SEED)
    model = GPT()
    model.crop_block_size(CROPPED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    ddp = nn.parallel.DistributedDataParallel(torch.compile(model) if compiled else model)
    torch.manual_seed(SEED + 1 + rank)
    X, Y = get_batch()
    for it in range(ITERS):
        for m in range(ACCUMULATION):
            ddp.require_backward_grad_sync = m == ACCUMULATION - 1
            _, loss = ddp(X, Y)
            loss = loss / ACCUMULATION
            X, Y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return detached_state(model)


def _replica():
    # One compile worker per replica: the two replicas already take the machine's cores.
    torch._inductor.config.compile_threads = 1
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    out = {}
    for compiled in (False, True):   # the compiled DDP run reuses the port's compiled code
        out[compiled] = {"port": train_port(strategy, rank, compiled),
                         "ddp": train_ddp(rank, compiled)}
    return from_every_replica(out)


@pytest.fixture(scope="module")
def runs():
    return launch(_replica, n=N)


# Bit-identical: the same draws in the same order, and with two replicas the 1/2 of DDP's
# averaging is exact whether it scales the loss or the summed gradient.
@pytest.mark.parametrize("compiled,atol", [(False, 0.0), (True, 0.0)],
                         ids=["eager", "compiled"])
def test_nanogpt_port_equals_ddp(runs, compiled, atol):
    for rank, r in enumerate(runs):
        got, want = r[compiled]["port"], runs[0][compiled]["ddp"]
        assert list(got) == list(want)
        assert got["wpe.weight"].shape == (CROPPED, EMBD)
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0,
                                       msg=lambda m: f"replica {rank} {key}: {m}")
