"""Custom training loop with MultiWorkerMirroredStrategy, resumable with BackupAndRestore.

A port of TensorFlow's tutorial "Custom training loop with Keras and
MultiWorkerMirroredStrategy" on scikit-learn's digits (bundled, no download). Every machine
runs this same program; all replicas on all machines train one model synchronously.

    python examples/multi_worker.py --replicas 2      # one machine, 2 CPU replicas

Two machines (10.0.0.1 and 10.0.0.2), TensorFlow style: TF_CONFIG names the cluster and
each machine's task; the first worker (or the chief) hosts the rendezvous on its port.

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:12345", "10.0.0.2:12345"]},
                "task": {"type": "worker", "index": 0}}' python examples/multi_worker.py
    TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:12345", "10.0.0.2:12345"]},
                "task": {"type": "worker", "index": 1}}' python examples/multi_worker.py

Or torchrun on each machine (restarts failed workers; the backup resumes the loop):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc-per-node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=digits \\
        --max-restarts=3 examples/multi_worker.py --backup-dir "$HOME/jobs/digits/backup"
"""
import argparse
import logging
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts

# torchstrategy logs through the standard logging module and configures nothing itself.
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

parser = argparse.ArgumentParser(description="MultiWorkerMirroredStrategy on digits")
parser.add_argument("--replicas", type=int, default=None,
                    help="CPU replicas per machine (default: every GPU, else one CPU)")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--backup-dir", default=None,
                    help="where the chief keeps the backup (default: a temporary directory)")
args = parser.parse_args()

torch.manual_seed(0)
launched = "TORCHELASTIC_RUN_ID" in os.environ
devices = [f"cpu:{i}" for i in range(args.replicas)] if args.replicas and not launched else None
strategy = ts.MultiWorkerMirroredStrategy(devices=devices)
if strategy.is_chief:
    print(f"{strategy.num_workers} worker(s), {strategy.num_replicas_in_sync} replicas "
          f"(this one: task {strategy.task_type}:{strategy.task_id})")

# Data: every machine reads the same global batches; each replica keeps its slice.
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target)
train_x, test_x, train_y, test_y = train_test_split(images, labels, test_size=0.25,
                                                    random_state=0, stratify=labels)
GLOBAL_BATCH_SIZE = 32 * strategy.num_replicas_in_sync
train_data = strategy.experimental_distribute_dataset(
    DataLoader(TensorDataset(train_x, train_y), batch_size=GLOBAL_BATCH_SIZE, shuffle=True))

with strategy.scope():
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)


def train_step(batch):
    x, y = batch
    loss = ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                   global_batch_size=GLOBAL_BATCH_SIZE)
    optimizer.zero_grad()
    loss.backward()              # every .grad is the sum over all replicas of all machines
    optimizer.step()
    return loss


# The backup makes the loop resumable: after a restart it continues where it stopped.
# Every process must agree on the directory: the chief's choice when it is temporary.
backup_dir = args.backup_dir or strategy.extended.communicator.broadcast_object(
    tempfile.mkdtemp(prefix="multi_worker-") if strategy.is_chief else None)
backup = ts.BackupAndRestore(backup_dir, save_freq="epoch")
backup.track(model=model, optimizer=optimizer)
if backup.restored and strategy.is_chief:
    print(f"resumed from the backup at epoch {backup.epoch}, step {backup.step}")

for epoch in backup.epochs(args.epochs):
    total = 0.0
    for step, batch in backup.steps(train_data):
        total += strategy.reduce("SUM", strategy.run(train_step, args=(batch,))).item()
    if strategy.is_chief:
        print(f"epoch {epoch + 1}: loss {total / (step + 1):.4f}")

if strategy.is_chief:
    with torch.no_grad():
        accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
    print(f"test accuracy: {accuracy:.4f}")
