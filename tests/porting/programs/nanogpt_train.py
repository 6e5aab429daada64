"""The shape of nanoGPT's ``train.py``, small, on CPU or GPU.

A fixture for tests/porting: docs/porting_from_ddp.md's diff is applied to this file as it
is. Kept from nanoGPT: configuration globals overridden by ``--key=value`` arguments, DDP
set up from torchrun's RANK, the seed offset per rank (the replicas build different initial
weights, DDP keeps rank 0's), ``get_batch`` drawing its offsets from the global generator,
the model built (from scratch or from ``ckpt.pt``) then cropped with ``crop_block_size``,
AdamW with weight-decay groups, optional ``torch.compile``, the loop with periodic
evaluation and checkpointing on the master process, the first batch fetched before the loop
and the next one prefetched after each forward, ``require_backward_grad_sync`` while
accumulating, gradient clipping through the GradScaler, and the logged
``lossf = loss.item() * gradient_accumulation_steps``. Small: a two-layer GPT with dropout
on synthetic tokens; losses are printed in full rather than to 4 decimals, for comparison.

    torchrun --standalone --nproc-per-node=2 nanogpt_train.py [--key=value ...]
"""
import math
import os
import sys
from ast import literal_eval
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group

# -- configuration ------------------------------------------------------------------------
out_dir = "out"
eval_interval = 2
log_interval = 1
eval_iters = 2
always_save_checkpoint = True
init_from = "scratch"          # or "resume"
gradient_accumulation_steps = 4
batch_size = 2
block_size = 16
crop_to = 8                    # crop_block_size after building, as when fine-tuning
n_layer, n_head, n_embd, dropout, vocab_size = 2, 2, 16, 0.1, 32
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 3e-3, 4, 0.1, 0.9, 0.95, 1.0
decay_lr, warmup_iters, lr_decay_iters, min_lr = True, 2, 4, 3e-4
backend = "nccl" if torch.cuda.is_available() else "gloo"
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "float32"
compile = False
for arg in sys.argv[1:]:       # nanoGPT's configurator, in short
    key, value = arg.removeprefix("--").split("=", 1)
    assert key in globals(), key
    globals()[key] = literal_eval(value) if not isinstance(globals()[key], str) else value
# ------------------------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{ddp_local_rank}"
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1

if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

data = {split: torch.randint(0, vocab_size, (512,), generator=torch.Generator().manual_seed(seed))
        for split, seed in (("train", 0), ("val", 1))}


def get_batch(split):
    tokens = data[split]
    ix = torch.randint(len(tokens) - crop_to, (batch_size,))
    x = torch.stack([tokens[i:i + crop_to] for i in ix])
    y = torch.stack([tokens[i + 1:i + 1 + crop_to] for i in ix])
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=dropout if self.training else 0.0)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, block_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def crop_block_size(self, block_size):
        self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


iter_num = 0
best_val_loss = 1e9
if init_from == "scratch":
    model = GPT(block_size)
elif init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device)
    model = GPT(checkpoint["block_size"])
    state_dict = checkpoint["model"]
    for k in list(state_dict):
        if k.startswith("_orig_mod."):
            state_dict[k.removeprefix("_orig_mod.")] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
if crop_to < block_size:
    model.crop_block_size(crop_to)
    block_size = crop_to
model.to(device)

scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None

if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


X, Y = get_batch("train")
raw_model = model.module if ddp else model
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train'].item()!r}, val loss {losses['val'].item()!r}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "block_size": block_size, "iter_num": iter_num,
                              "best_val_loss": best_val_loss}
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")   # the next batch, fetched while the forward runs
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf!r}")
    iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
