"""Trains a small LightningModule on one device and saves its final state_dict, for
tests/gpu/test_lightning_cuda.py:

    python tests/gpu/lightning_run.py --strategy mirrored|ddp --accelerator gpu|cpu --out F

Deterministic (``Trainer(deterministic=True)``, seeded shuffling), so two strategies that
train the same way save the same values. ``use_distributed_sampler=False``: the
comparison is of the training, with the loader's own shuffling on both sides (at devices=1
Lightning would give both strategies a DistributedSampler, since both report
``is_distributed``; leaving it out keeps the data order independent of that).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy.lightning  # noqa: F401  (registers strategy="mirrored" with Lightning)
import lightning.pytorch as pl

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--accelerator", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        # Recorded while training: Strategy.teardown moves the module to the CPU after fit.
        self.training_device = str(next(self.parameters()).device)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main():
    pl.seed_everything(3)
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,),
                                                                        generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(5))
    model = Model()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, strategy=args.strategy,
                         max_steps=10, deterministic=True, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, loader)
    torch.save({"strategy": type(trainer.strategy).__name__,
                "device": model.training_device,
                "global_step": trainer.global_step,
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}},
               args.out)


if __name__ == "__main__":
    main()
