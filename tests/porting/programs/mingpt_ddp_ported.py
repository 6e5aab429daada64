"""mingpt_ddp.py ported to torchstrategy as docs/porting_from_ddp.md ports the DDP tutorial:
a MirroredStrategy in place of the process group, ``strategy.adopt`` in place of the DDP
wrapper (after the snapshot is loaded, as DDP wrapped after it), ``ts.scale_mean_loss`` on
what is given to ``backward()`` (the logged loss stays DDP's), ``self.model.state_dict()``
saved as is. Everything else, fp16 autocast with its GradScaler included, is unchanged.

The original's description: the shape of pytorch/examples' ``distributed/minGPT-ddp``, in
one file, on CPU or GPU. Kept
from the example: the Trainer with its config dataclass, a ``Snapshot`` of model, optimizer
and finished epoch saved by local rank 0 every ``save_every`` epochs and resumed from when
present (loaded on the CPU), the DistributedSampler loaders of a random train/test split,
optional fp16 autocast with a GradScaler (``use_amp``), gradient clipping, evaluation
after each epoch, the per-iteration log line, and AdamW with weight-decay groups.
Changed: the configuration comes from ``--key=value`` arguments instead of Hydra, the data
are synthetic characters, gloo and the CPU are used without GPUs, the replicas' initial
weights are seeded per rank (DDP keeps rank 0's) and the loss is printed in full.

    torchrun --standalone --nproc-per-node=2 mingpt_ddp.py [--key=value ...]
"""
import os
import sys
from ast import literal_eval
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler

import torchstrategy as ts


@dataclass
class GPTConfig:
    vocab_size: int = 24
    block_size: int = 8
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.1


@dataclass
class TrainerConfig:
    max_epochs: int = 1
    batch_size: int = 4
    grad_norm_clip: float = 1.0
    snapshot_path: Optional[str] = "snapshot.pt"
    save_every: int = 1
    use_amp: bool = False


@dataclass
class Snapshot:
    model_state: Dict[str, Any]
    optimizer_state: Dict[str, Any]
    finished_epoch: int


class CharDataset(Dataset):
    def __init__(self, config, length=96):
        generator = torch.Generator().manual_seed(0)
        self.block_size = config.block_size
        self.data = torch.randint(0, config.vocab_size, (length + config.block_size,),
                                  generator=generator)

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        chunk = self.data[idx:idx + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, dropout=config.dropout,
                                          batch_first=True)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd),
                                 nn.Dropout(config.dropout))
        self.register_buffer("mask", torch.triu(torch.ones(config.block_size, config.block_size,
                                                           dtype=torch.bool), diagonal=1),
                             persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:, :idx.shape[1]])
        logits = self.head(self.ln_f(self.blocks(x)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def create_optimizer(model, learning_rate=3e-3, weight_decay=0.1):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate)


class Trainer:
    def __init__(self, trainer_config, model, optimizer, train_dataset, test_dataset=None):
        self.config = trainer_config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.train_loader = self._prepare_dataloader(train_dataset)
        self.test_loader = self._prepare_dataloader(test_dataset) if test_dataset else None
        self.epochs_run = 0
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.save_every = self.config.save_every
        if self.config.use_amp:
            self.scaler = torch.amp.GradScaler(self.device.type)
        if self.config.snapshot_path is None:
            self.config.snapshot_path = "snapshot.pt"
        self._load_snapshot()
        self.model = ts.get_strategy().adopt(self.model, self.optimizer)

    def _prepare_dataloader(self, dataset):
        return DataLoader(dataset, batch_size=self.config.batch_size,
                          pin_memory=torch.cuda.is_available(), shuffle=False,
                          sampler=DistributedSampler(dataset))

    def _load_snapshot(self):
        try:
            snapshot_data = torch.load(self.config.snapshot_path, map_location="cpu")
        except FileNotFoundError:
            print("Snapshot not found. Training model from scratch")
            return
        snapshot = Snapshot(**snapshot_data)
        self.model.load_state_dict(snapshot.model_state)
        self.optimizer.load_state_dict(snapshot.optimizer_state)
        self.epochs_run = snapshot.finished_epoch
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets, train=True):
        with torch.set_grad_enabled(train), torch.amp.autocast(
                device_type=self.device.type, dtype=torch.float16, enabled=self.config.use_amp):
            _, loss = self.model(source, targets)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
            if self.config.use_amp:
                self.scaler.scale(ts.scale_mean_loss(loss)).backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                ts.scale_mean_loss(loss).backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
                self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch, dataloader, train=True):
        dataloader.sampler.set_epoch(epoch)
        for iter, (source, targets) in enumerate(dataloader):
            step_type = "Train" if train else "Eval"
            source = source.to(self.device)
            targets = targets.to(self.device)
            batch_loss = self._run_batch(source, targets, train)
            print(f"[GPU{self.global_rank}] Epoch {epoch} | Iter {iter} | {step_type} Loss {batch_loss!r}")

    def _save_snapshot(self, epoch):
        model = self.model
        raw_model = model.module if hasattr(model, "module") else model
        snapshot = Snapshot(model_state=raw_model.state_dict(),
                            optimizer_state=self.optimizer.state_dict(), finished_epoch=epoch)
        torch.save(asdict(snapshot), self.config.snapshot_path)
        print(f"Snapshot saved at epoch {epoch}")

    def train(self):
        for epoch in range(self.epochs_run, self.config.max_epochs):
            epoch += 1
            self._run_epoch(epoch, self.train_loader, train=True)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            if self.test_loader:
                self._run_epoch(epoch, self.test_loader, train=False)


def ddp_setup():
    return ts.MirroredStrategy()   # torchrun's world: NCCL on GPUs, gloo on CPUs


def get_train_objs(gpt_cfg):
    dataset = CharDataset(gpt_cfg)
    train_len = int(len(dataset) * 0.75)
    train_set, test_set = random_split(dataset, [train_len, len(dataset) - train_len],
                                       generator=torch.Generator().manual_seed(1))
    torch.manual_seed(42 + int(os.environ["RANK"]))
    model = GPT(gpt_cfg)
    optimizer = create_optimizer(model)
    return model, optimizer, train_set, test_set


def main(overrides):
    strategy = ddp_setup()
    trainer_cfg = TrainerConfig(**{f.name: overrides[f.name] for f in fields(TrainerConfig)
                                   if f.name in overrides})
    model, optimizer, train_data, test_data = get_train_objs(GPTConfig())
    with strategy.scope():   # the Trainer adopts the model into this strategy
        trainer = Trainer(trainer_cfg, model, optimizer, train_data, test_data)
    trainer.train()


if __name__ == "__main__":
    arguments = dict(arg.removeprefix("--").split("=", 1) for arg in sys.argv[1:])
    main({key: value if key == "snapshot_path" else literal_eval(value)
          for key, value in arguments.items()})
