"""A plain `python reexec_train.py MODE OUTDIR` training script for the launcher tests.

MODE: ok | child_exit | parent_raise | hang_until_signal | torchrun
"""
import logging
import os
import sys
import time

import torch

import torchstrategy as ts

# The library configures no logging; a program that wants its messages says so.
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
mode, outdir = sys.argv[1], sys.argv[2]
devices = None if mode == "torchrun" else ["cpu:0", "cpu:1"]
strategy = ts.MirroredStrategy(devices=devices)
rid = strategy.extended.replica_id
with open(os.path.join(outdir, f"pid{rid}"), "w") as f:
    f.write(str(os.getpid()))

with strategy.scope():
    torch.manual_seed(rid)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x):
    loss = ts.compute_average_loss(model(x).squeeze(1) ** 2, global_batch_size=8)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


data = [torch.ones(8, 4) * (i + 1) for i in range(3)]
for batch in strategy.experimental_distribute_dataset(data):
    loss = strategy.reduce("SUM", strategy.run(step, args=(batch,)))

if mode == "child_exit" and rid == 1:
    sys.exit(3)
if mode == "parent_raise" and rid == 0:
    raise ValueError("replica 0 fails on purpose")
if mode == "hang_until_signal":
    with open(os.path.join(outdir, f"ready{rid}"), "w"):
        pass
    time.sleep(300)
if mode in ("child_exit", "parent_raise"):
    # The surviving replica blocks in a collective with the failed one.
    strategy.reduce("SUM", torch.ones(1))
    time.sleep(300)

weights = torch.cat([p.detach().flatten() for p in model.parameters()])
# Each replica writes its own file: lines printed by two processes into one pipe can interleave.
with open(os.path.join(outdir, f"weights{rid}"), "w") as f:
    f.write(f"{strategy.num_replicas_in_sync} {weights.tolist()}")
