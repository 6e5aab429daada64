"""Train a small transformer with ShardedStrategy (FSDP2): parameters, gradients and Adam
state sharded over the replicas, the model built on the meta device so that no replica
ever holds it whole.

    python examples/sharded_transformer.py                 # every GPU, or 2 CPU replicas
    python examples/sharded_transformer.py --replicas 4
    torchrun --nproc-per-node=2 examples/sharded_transformer.py

The task is synthetic (predict each token of a random sequence reversed), so it needs no
download and the loss visibly falls within a few dozen steps on a CPU. Comments starting
with "distributed:" mark what differs from single-device training; apart from the
strategy's name the script is the one MirroredStrategy would run.
"""
import argparse
import logging
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts

# torchstrategy logs through the standard logging module and configures nothing itself.
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

parser = argparse.ArgumentParser(description="ShardedStrategy on a small transformer")
parser.add_argument("--replicas", type=int, default=None,
                    help="number of replicas (default: every GPU, or 2 CPU replicas)")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=16, help="per replica")
parser.add_argument("--bf16", action="store_true", help="compute in bfloat16")

VOCAB, LENGTH, WIDTH, LAYERS = 32, 12, 64, 4


class Block(nn.Module):
    """A pre-norm transformer layer (self-attention, then an MLP)."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp_norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (part.view(b, t, self.heads, -1).transpose(1, 2)
                   for part in self.qkv(self.attention_norm(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.out(y)
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.empty(LENGTH, WIDTH))
        # distributed: each of these repeated layers becomes one FSDP unit (gathered whole
        # only while it runs); the embedding, positions and head stay with the model.
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.reset_parameters()

    def reset_parameters(self):
        # Initialises this module's own parameters only (its children have their own
        # reset_parameters): the contract of torch's modules, which ShardedStrategy relies
        # on for a model built on the meta device.
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position
        for layer in self.layers:
            x = layer(x)
        # Logits as (batch * length, vocabulary), the matrix product's own result: a Linear
        # over a 3-D input returns a view of it, and FSDP2 (torch 2.13) warns when a sharded
        # model returns a view, since an in-place op on a view would skip its backward hook.
        return self.head(self.norm(x).flatten(0, 1))


def batches(steps, global_batch, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (global_batch, LENGTH), generator=generator)
        yield tokens, tokens.flip(1)


def replica_devices(n):
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(n or torch.cuda.device_count())]
    return [f"cpu:{i}" for i in range(n or 2)]


def main():
    args = parser.parse_args()
    torch.manual_seed(0)
    devices = None if "TORCHELASTIC_RUN_ID" in os.environ else replica_devices(args.replicas)
    # distributed: the only line that differs from a MirroredStrategy script.
    strategy = ts.ShardedStrategy(devices=devices,
                                  mixed_precision="bf16" if args.bf16 else None)
    chief = strategy.extended.is_chief
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    # distributed: built on the meta device (shapes, no memory), the model is sharded when
    # the scope exits; then each replica allocates only its shards and fills them by each
    # module's reset_parameters(), the same values for any number of replicas. The
    # optimizer made here is switched to the sharded parameters before its first step.
    with strategy.scope():
        with torch.device("meta"):
            model = Transformer()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train_step(tokens, targets):
        logits = model(tokens)
        per_example = F.cross_entropy(logits, targets.flatten(), reduction="none")
        per_example = per_example.view(targets.shape).mean(1)
        # distributed: divide by the GLOBAL batch; backward() sums over replicas.
        loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = strategy.experimental_distribute_dataset(batches(args.steps, global_batch))
    for step, (tokens, targets) in enumerate(data):
        loss = strategy.reduce("SUM", strategy.run(train_step, args=(tokens, targets)),
                               axis=None)
        if chief and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}")

    # What one replica holds: its shard of every parameter (a DTensor).
    mine = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    if chief:
        print(f"replica 0 holds {mine} of {total} parameters "
              f"({mine / total:.0%}; Adam state likewise)")

    # distributed: a sharded checkpoint (every replica writes its shards; loads on any
    # number of replicas) and a plain single-device state_dict, gathered on the chief.
    with tempfile.TemporaryDirectory() as directory:
        directory = strategy.extended.communicator.broadcast_object(directory)
        strategy.extended.save_checkpoint(os.path.join(directory, "sharded"), model,
                                          optimizer)
        state = strategy.extended.export_state_dict(model)
        if chief:
            plain = Transformer()
            plain.load_state_dict(state)
            tokens, targets = (strategy.experimental_local_results(t)[0]
                               for t in (tokens, targets))  # replica 0's slice
            accuracy = (plain(tokens).argmax(-1) == targets.flatten()).float().mean()
            print(f"exported a plain state_dict ({len(state)} tensors); the unsharded copy "
                  f"predicts replica 0's last batch with accuracy {accuracy:.2f}")
        strategy.extended.communicator.barrier()


if __name__ == "__main__":
    main()
