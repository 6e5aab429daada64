"""Keras's Model.fit tutorial, with the Lightning Trainer on torchstrategy.

    python examples/lightning_fit.py                 # 2 CPU replicas (every GPU with GPUs)
    python examples/lightning_fit.py --devices 4
    torchrun --nproc-per-node=2 examples/lightning_fit.py --devices 2

First a one-neuron regression learns y = 2x + 3, then a small convnet classifies the
scikit-learn digits. `Trainer(strategy="mirrored")` is torchstrategy's MirroredStrategy:
building the Trainer in `python ...` re-executes this script for the other replicas, so
everything below runs in every replica, each on its own shard of the data (Lightning adds
the DistributedSampler). Losses are per-replica means and gradients are averaged, as with
`strategy="ddp"`.
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy.lightning  # noqa: F401  registers strategy="mirrored" and friends

parser = argparse.ArgumentParser(description="Model.fit with Lightning on torchstrategy")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--epochs", type=int, default=5)


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.dense(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DigitClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 32 x 4 x 4
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
        # torchmetrics accumulates per replica and combines all replicas at the end.
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10,
                                                                       average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.accuracy(self.net(x), y)
        self.log("accuracy", self.accuracy)   # over the whole test set, all replicas

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def trainer(args, epochs):
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    return pl.Trainer(strategy="mirrored", accelerator=accelerator, devices=args.devices,
                      max_epochs=epochs, logger=False, enable_checkpointing=False,
                      enable_model_summary=False)


def main():
    args = parser.parse_args()
    pl.seed_everything(0)

    # 1. Regression: y = 2x + 3.
    x = torch.linspace(-1, 1, 512).unsqueeze(1)
    data = DataLoader(TensorDataset(x, 2 * x + 3), batch_size=16, shuffle=True)
    model = Regression()
    fit = trainer(args, epochs=args.epochs)
    fit.fit(model, data)
    w, b = model.dense.weight.item(), model.dense.bias.item()
    if fit.is_global_zero:
        print(f"regression: y = {w:.2f} x + {b:.2f} ({fit.world_size} replicas)")

    # 2. Classifier on the bundled digits (8x8 images, scaled to [0, 1]).
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=0, stratify=labels)
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=32, shuffle=True)
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=64)
    classifier = DigitClassifier()
    fit = trainer(args, epochs=args.epochs)
    fit.fit(classifier, train)
    (result,) = fit.test(classifier, test, verbose=False)
    if fit.is_global_zero:
        print(f"test accuracy: {result['accuracy']:.4f}")


if __name__ == "__main__":
    main()
