"""Train torchvision's ResNet-18 with TPUStrategy (torch_xla SPMD over every XLA device).

Runs on TPUs, or on CPU with XLA:CPU devices standing in for TPU cores:

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python examples/tpu.py

The data is generated (small 32x32 images whose class is the brightest colour channel), so
nothing is downloaded.
"""
import argparse
import logging
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts

# torchstrategy logs through the standard logging module and configures nothing itself.
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch-per-replica", type=int, default=8)
parser.add_argument("--steps-per-execution", type=int, default=1)
args = parser.parse_args()

strategy = ts.TPUStrategy(steps_per_execution=args.steps_per_execution)
GLOBAL_BATCH = args.batch_per_replica * strategy.num_replicas_in_sync

# Class c: channel c is brighter. Learnable in a few steps, and no download.
generator = torch.Generator().manual_seed(0)
labels = torch.randint(0, 3, (args.steps * GLOBAL_BATCH,), generator=generator)
images = torch.randn(len(labels), 3, 32, 32, generator=generator) * 0.5
images[torch.arange(len(labels)), labels] += 1.0
loader = DataLoader(TensorDataset(images, labels), batch_size=GLOBAL_BATCH, shuffle=True,
                    generator=generator)

with strategy.scope():       # parameters replicated on every XLA device
    model = torchvision.models.resnet18(weights=None, num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


def train_step(batch):
    x, y = batch             # the global batch, split along dim 0 over the devices
    per_example = F.cross_entropy(model(x), y, reduction="none")
    loss = ts.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    loss.backward()          # .grad = sum over replicas = gradient over the global batch
    optimizer.step()
    optimizer.zero_grad()
    return loss


start = time.time()
losses = []
for step, batch in enumerate(strategy.experimental_distribute_dataset(loader)):
    per_replica_loss = strategy.run(train_step, args=(batch,))
    losses.append(strategy.reduce(ts.ReduceOp.SUM, per_replica_loss, axis=None))
losses = [loss.item() for loss in losses]   # read once at the end: no per-step host sync
for step, loss in enumerate(losses):
    print(f"step {step}: loss {loss:.4f}")
print(f"{strategy.num_replicas_in_sync} replicas, global batch {GLOBAL_BATCH}, "
      f"{len(losses)} steps in {time.time() - start:.1f}s (compilation included)")
assert losses[-1] < losses[0], "the loss should fall"
