"""Trains with BackupAndRestoreCallback on 2 CPU replicas ("mirrored"); optionally fails once.

    python tests/scripts/lightning_backup.py --out DIR --save-freq epoch|N [--fail-at-step K]
        [--keep]

With --fail-at-step K, every replica raises in its training step at global step K, unless
DIR/failed exists (the run creates it): so the same command, run twice, fails the first
time and resumes from the backup the second. Replica 0 writes DIR/result.pt.
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from torchstrategy.lightning import BackupAndRestoreCallback

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--fail-at-step", type=int, default=None)
parser.add_argument("--keep", action="store_true")
args = parser.parse_args()


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        marker = os.path.join(args.out, "failed")
        if self.global_step == args.fail_at_step and not os.path.exists(marker):
            self.trainer.strategy.barrier()  # both replicas see no marker before it appears
            if self.global_rank == 0:
                open(marker, "w").close()
            raise RuntimeError(f"injected failure at step {self.global_step}")
        x, y = batch
        # Random numbers in the step: equal results need the generators restored too.
        noise = 0.01 * torch.randn_like(x)
        return F.mse_loss(self.layer(x + noise), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


def main():
    pl.seed_everything(7)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 1, generator=g) * 4 - 2
    train = DataLoader(TensorDataset(x, 2 * x + 3), batch_size=8, shuffle=True)
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    backup = BackupAndRestoreCallback(os.path.join(args.out, "backup"), save_freq=save_freq,
                                      delete_checkpoint=not args.keep)
    trainer = pl.Trainer(strategy="mirrored", accelerator="cpu", devices=2, max_epochs=3,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, default_root_dir=args.out,
                         callbacks=[backup])
    model = Regression()
    trainer.fit(model, train)
    if trainer.is_global_zero:
        torch.save({"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "global_step": trainer.global_step, "restored": backup.restored,
                    "lr": trainer.optimizers[0].param_groups[0]["lr"]},
                   os.path.join(args.out, "result.pt"))


if __name__ == "__main__":
    main()
