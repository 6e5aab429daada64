"""Run by tests/sharded/test_lightning_sharded.py as a plain script (the strategy
re-executes it for replica 1): in the same two processes, fits a LightningModule
for 4 steps with ``LightningStrategy(ShardedStrategy(...))``, saves a checkpoint and
resumes it to 6 steps with ``Trainer(strategy="sharded")``; does the same with
``Trainer(strategy="mirrored")``; and writes what the test compares to OUT/result.pt
(replica 0).

    python tests/sharded/lightning_script.py OUT
"""
import gc
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts
import lightning.pytorch as pl
from torchstrategy.lightning import LightningStrategy


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 1, generator=g) * 4 - 2
    return DataLoader(TensorDataset(x, 2 * x + 3), batch_size=8, shuffle=False)


def fit(strategy, max_steps, ckpt_path=None):
    torch.manual_seed(7)
    model = Regression()
    devices = "auto" if isinstance(strategy, LightningStrategy) else 2
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                         max_steps=max_steps, enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer, model


def fit_and_resume(first, then, out, name):
    """4 steps (one epoch) with `first`, a checkpoint, then resumed to 6 with `then`."""
    trainer, model = fit(first, 4)
    path = os.path.join(out, f"{name}.ckpt")
    trainer.save_checkpoint(path)
    placements = sorted({type(p).__name__ for p in model.parameters()})
    resumed, _ = fit(then, 6, ckpt_path=path)
    return path, placements, resumed.strategy.lightning_module_state_dict()


def main(out):
    sharded = fit_and_resume(LightningStrategy(ts.ShardedStrategy(devices=["cpu:0", "cpu:1"])),
                             "sharded", out, "sharded")
    mirrored = fit_and_resume("mirrored", "mirrored", out, "mirrored")
    if torch.distributed.get_rank() == 0:
        result = {"placements": sharded[1]}
        for name, (path, _, state) in (("sharded", sharded), ("mirrored", mirrored)):
            checkpoint = torch.load(path, weights_only=False)
            plain = Regression()
            plain.load_state_dict(checkpoint["state_dict"])  # strict: plain keys, tensors
            result[name] = {"checkpoint": checkpoint["state_dict"],
                            "optimizer": list(checkpoint["optimizer_states"][0]["state"].items()),
                            "resumed": state}
        torch.save(result, os.path.join(out, "result.pt"))
    # Python's finalisation would walk every object Lightning's import made (seconds per
    # replica on a loaded machine); frozen, they are left to the process's end.
    gc.freeze()


if __name__ == "__main__":
    main(sys.argv[1])
