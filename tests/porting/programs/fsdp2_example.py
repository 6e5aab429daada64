"""The shape of pytorch/examples' ``distributed/FSDP2/example.py``, small, on CPU or GPU.

A fixture for tests/porting/test_real_programs.py (fsdp2_example_ported.py is its port).
Kept from the example: a Transformer built on the meta device, ``fully_shard`` on each
layer and then on the model, ``to_empty`` + ``reset_parameters`` for a fresh start or the
last checkpoint loaded (full state dicts through ``torch.distributed.checkpoint.state_dict``,
broadcast from rank 0) with Adam's state, the same random batch on every rank, ``loss =
model(x).sum()`` with FSDP2's averaged gradients, and a checkpoint saved at the end.
Changed: tiny sizes, gloo and the CPU without GPUs, a step count argument, the checkpoint
in ``checkpoints/last`` (the example names it by time), so it is
loaded without ``mmap`` (the save overwrites it), and the loss printed per step.

    torchrun --standalone --nproc-per-node=2 fsdp2_example.py [--steps N]
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import init_process_group, destroy_process_group
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 32, 16, 2, 2, 8, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, DIM))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 4 * DIM)
        self.w2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))

    def reset_parameters(self):
        for module in (self.attention_norm, self.attention, self.ffn_norm, self.w1, self.w2):
            module.reset_parameters()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self):
        for module in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm,
                       self.output):
            module.reset_parameters()


class Checkpointer:
    def __init__(self, folder):
        self.folder = folder
        last = os.path.join(folder, "last")
        self.last_training_time = "last" if os.path.exists(last) else None

    def _path(self, name):
        return os.path.join(self.folder, "last", name)

    def load_model(self, model):
        full_sd = torch.load(self._path("model_state_dict.pt"), weights_only=True,
                             map_location="cpu")
        set_model_state_dict(model, full_sd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def load_optim(self, model, opt):
        full_sd = torch.load(self._path("optim_state_dict.pt"), weights_only=True,
                             map_location="cpu")
        set_optimizer_state_dict(model, opt, full_sd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def save(self, model, optim):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, optim, options=options)
        if torch.distributed.get_rank() == 0:
            os.makedirs(os.path.join(self.folder, "last"), exist_ok=True)
            torch.save(model_sd, self._path("model_state_dict.pt"))
            torch.save(optim_sd, self._path("optim_state_dict.pt"))


def main(args):
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

    checkpointer = Checkpointer("checkpoints")
    if checkpointer.last_training_time is None:
        model.to_empty(device=device)
        model.reset_parameters()
    else:
        checkpointer.load_model(model)

    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if checkpointer.last_training_time is not None:
        checkpointer.load_optim(model, optim)

    for step in range(args.steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        print(f"[rank {torch.distributed.get_rank()}] step {step} loss {loss.item()!r}")

    checkpointer.save(model, optim)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example")
    parser.add_argument("--steps", type=int, default=3)
    main(parser.parse_args())
