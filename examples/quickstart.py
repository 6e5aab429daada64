"""Quickstart: train a small convnet on scikit-learn's digits with MirroredStrategy.

    python examples/quickstart.py                  # every GPU, or 2 CPU replicas
    python examples/quickstart.py --replicas 4     # 4 replicas
    torchrun --nproc-per-node=2 examples/quickstart.py

With several replicas, `python examples/quickstart.py` becomes replica 0 and starts the
same command again for each other replica: the code below runs in every replica, each
training on its own slice of every batch. Comments starting with "distributed:" mark what
differs from single-device training.
"""
import argparse
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import torchstrategy as ts

# torchstrategy logs through the standard logging module and configures nothing itself.
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

parser = argparse.ArgumentParser(description="MirroredStrategy on the digits data set")
parser.add_argument("--replicas", type=int, default=None,
                    help="number of replicas (default: every GPU, or 2 CPU replicas)")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32, help="per replica")
parser.add_argument("--lr", type=float, default=3e-3)


def replica_devices(n):
    """n GPUs when there are GPUs (default: all of them), else n CPU replicas (default 2)."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(n or torch.cuda.device_count())]
    return [f"cpu:{i}" for i in range(n or 2)]


def main():
    args = parser.parse_args()
    torch.manual_seed(0)

    # distributed: one replica per device. Under torchrun, torchrun decides how many.
    devices = None if "TORCHELASTIC_RUN_ID" in os.environ else replica_devices(args.replicas)
    strategy = ts.MirroredStrategy(devices=devices)
    chief = strategy.extended.is_chief                    # replica 0 prints and logs
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    # Data: 1797 8x8 images of digits, scaled to [0, 1].
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=0, stratify=labels)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=global_batch,
                              shuffle=True, drop_last=True)
    test_loader = DataLoader(TensorDataset(x_test, y_test), batch_size=global_batch)
    # distributed: the loaders yield global batches; each replica gets its own slice.
    train_data = strategy.experimental_distribute_dataset(train_loader)
    test_data = strategy.experimental_distribute_dataset(test_loader)

    # distributed: parameters created in the scope start identical on every replica.
    with strategy.scope():
        model = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 64 x 4 x 4
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def train_step(x, y):
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        # distributed: divide by the GLOBAL batch size; backward() sums the gradients of
        # all replicas, so each .grad is the gradient of the global-batch mean loss.
        loss = ts.compute_average_loss(per_example_loss, global_batch_size=global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    def test_step(x, y):
        with torch.no_grad():
            return (model(x).argmax(dim=1) == y).sum()

    for epoch in range(1, args.epochs + 1):
        model.train()
        progress = tqdm(train_data, desc=f"epoch {epoch}/{args.epochs}",
                        disable=not chief)                 # one progress bar, on replica 0
        for x, y in progress:
            per_replica_loss = strategy.run(train_step, args=(x, y))
            # distributed: the global-batch loss is the sum of the replicas' losses.
            loss = strategy.reduce("SUM", per_replica_loss, axis=None)
            progress.set_postfix(loss=f"{loss.item():.4f}")

    model.eval()
    correct = 0
    for x, y in test_data:
        # distributed: each replica counts its slice; the sum counts the whole test set.
        correct += strategy.reduce("SUM", strategy.run(test_step, args=(x, y)), axis=None)
    if chief:
        print(f"test accuracy: {correct.item() / len(x_test):.4f} "
              f"({strategy.num_replicas_in_sync} replicas)")


if __name__ == "__main__":
    main()
