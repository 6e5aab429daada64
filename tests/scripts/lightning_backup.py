"""Trains with BackupAndRestoreCallback on 2 CPU replicas ("mirrored"); optionally fails once.

    python tests/scripts/lightning_backup.py --out DIR --save-freq epoch|N [--fail-at-step K]
        [--keep]

With --fail-at-step K, every replica raises in its training step at global step K, unless
DIR/failed exists (the run creates it): so the same command, run twice, fails the first
time and resumes from the backup the second. Replica 0 writes DIR/result.pt.

    python tests/scripts/lightning_backup.py --plan JSON

runs several such fits in turn in the same job (one process start for all: the tests'
budget), JSON being a list of {"out", "save_freq", "fail_at_step", "keep"}. Each fit is a
fresh Trainer, model and callback, run under its own try/except: every replica writes
OUT/outcome-rank<R>.txt, "ok" or the exception it raised (its traceback goes to stderr), and
the next fit runs; the job exits 0 once every fit has run.
"""
import argparse
import json
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from torchstrategy.lightning import BackupAndRestoreCallback

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--fail-at-step", type=int, default=None)
parser.add_argument("--keep", action="store_true")
parser.add_argument("--plan", default=None)
args = parser.parse_args()
if (args.out is None) == (args.plan is None):
    parser.error("give either --out or --plan")


class Regression(pl.LightningModule):
    def __init__(self, out, fail_at_step):
        super().__init__()
        self.out, self.fail_at_step = out, fail_at_step
        self.layer = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        marker = os.path.join(self.out, "failed")
        if self.global_step == self.fail_at_step and not os.path.exists(marker):
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


def fit(out, save_freq, fail_at_step, keep):
    """One fit into `out` (replica 0 writes out/result.pt)."""
    pl.seed_everything(7)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 1, generator=g) * 4 - 2
    train = DataLoader(TensorDataset(x, 2 * x + 3), batch_size=8, shuffle=True)
    save_freq = save_freq if save_freq == "epoch" else int(save_freq)
    backup = BackupAndRestoreCallback(os.path.join(out, "backup"), save_freq=save_freq,
                                      delete_checkpoint=not keep)
    trainer = pl.Trainer(strategy="mirrored", accelerator="cpu", devices=2, max_epochs=3,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, default_root_dir=out,
                         callbacks=[backup])
    model = Regression(out, fail_at_step)
    trainer.fit(model, train)
    if trainer.is_global_zero:
        torch.save({"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "global_step": trainer.global_step, "restored": backup.restored,
                    "lr": trainer.optimizers[0].param_groups[0]["lr"]},
                   os.path.join(out, "result.pt"))


def main():
    if args.plan is None:
        fit(args.out, args.save_freq, args.fail_at_step, args.keep)
        return
    for step in json.loads(args.plan):
        os.makedirs(step["out"], exist_ok=True)
        try:
            fit(step["out"], step["save_freq"], step.get("fail_at_step"), step.get("keep", False))
            outcome = "ok"
        except Exception as error:
            traceback.print_exc()
            outcome = f"{type(error).__name__}: {error}"
        rank = dist.get_rank() if dist.is_initialized() else f"-pid{os.getpid()}"
        with open(os.path.join(step["out"], f"outcome-rank{rank}.txt"), "w") as f:
            f.write(outcome)


if __name__ == "__main__":
    main()
