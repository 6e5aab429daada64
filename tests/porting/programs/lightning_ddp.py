"""A Lightning program trained with DDP (Lightning's "ddp" strategy), small, on CPU or GPU.

A fixture for tests/porting: docs/porting_from_ddp.md's Lightning diff is applied to this
file as it is. A LightningModule with dropout, a mean loss logged per step, gradient
accumulation over 2 batches, a validation loop, a DataLoader that Lightning gives a
DistributedSampler, and a final checkpoint through ``trainer.save_checkpoint``. The
replicas seed their initial weights differently (the strategy keeps rank 0's); each step's
loss is printed in full, for comparison.

    torchrun --standalone --nproc-per-node=2 lightning_ddp.py
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        print(f"[rank {self.global_rank}] batch {batch_idx} loss {loss.item()!r}")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(seed):
    generator = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(48, 8, generator=generator),
                         torch.randint(0, 3, (48,), generator=generator))
    return DataLoader(data, batch_size=4)


def main():
    torch.manual_seed(100 + int(os.environ.get("RANK", 0)))
    model = Classifier()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2,
                         accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(0), loader(1))
    trainer.save_checkpoint("final.ckpt")


if __name__ == "__main__":
    main()
