"""TPUStrategy's step time against a hand-written torch_xla SPMD loop, side by side.

Same model, data, optimiser and device mesh; the reference is the loop torch_xla's SPMD
guide describes (shard each batch along dim 0 on its way to the devices, step, sync). Rounds
alternate between the two so machine noise hits both alike; the median is reported.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python scripts/bench_tpu.py
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchstrategy as ts  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--batch-per-replica", type=int, default=64)
parser.add_argument("--width", type=int, default=512)
args = parser.parse_args()

strategy = ts.TPUStrategy()      # switches torch_xla to SPMD; the reference shares its mesh
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

N = strategy.num_replicas_in_sync
GLOBAL_BATCH = args.batch_per_replica * N
device = torch_xla.device()
mesh = xs.Mesh(list(range(N)), (N,), ("data",))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                         nn.ReLU(), nn.Linear(args.width, 10))


generator = torch.Generator().manual_seed(0)
batches = [(torch.randn(GLOBAL_BATCH, 256, generator=generator),
            torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator))
           for _ in range(args.steps)]

# --- ours ---------------------------------------------------------------------------------
with strategy.scope():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(batch):
    x, y = batch
    loss = ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                   global_batch_size=GLOBAL_BATCH)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


dataset = strategy.experimental_distribute_dataset(batches)


def ours():
    for batch in dataset:
        loss = strategy.run(train_step, args=(batch,))
    xm.wait_device_ops()
    return loss


# --- the hand-written torch_xla SPMD loop -------------------------------------------------
ref_model = make_model().to(device)
ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.01)
x_spec = xs.ShardingSpec(mesh, ("data", None))
y_spec = xs.ShardingSpec(mesh, ("data",))


def reference():
    for x, y in batches:
        x = xm.send_cpu_data_to_device(x, device, x_spec)[0]
        y = xm.send_cpu_data_to_device(y, device, y_spec)[0]
        loss = F.cross_entropy(ref_model(x), y)
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch_xla.sync()
    xm.wait_device_ops()
    return loss


def timed(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / args.steps


ours(), reference()                       # compile both
ours_times, ref_times = [], []
for _ in range(args.rounds):
    ours_times.append(timed(ours))
    ref_times.append(timed(reference))
ours_ms = statistics.median(ours_times) * 1e3
ref_ms = statistics.median(ref_times) * 1e3
print(f"{N} XLA devices ({os.environ['PJRT_DEVICE']}), MLP width {args.width}, "
      f"global batch {GLOBAL_BATCH}, median of {args.rounds} rounds x {args.steps} steps")
print(f"TPUStrategy          {ours_ms:8.2f} ms/step")
print(f"hand-written SPMD    {ref_ms:8.2f} ms/step")
print(f"ratio ours/reference {ours_ms / ref_ms:8.3f}  (target <= 1.1)")
