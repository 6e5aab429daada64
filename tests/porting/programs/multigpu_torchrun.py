"""The shape of PyTorch's DDP tutorial program (``multigpu_torchrun.py``), small, on CPU or GPU.

A fixture for tests/porting/test_guide_diffs.py: multigpu_torchrun_ported.py is its port, with
the changes docs/porting_from_ddp.md makes to the tutorial itself. Kept from the tutorial: the Trainer with its snapshot (saved by rank 0, resumed from
when present, mapped to this process's device on load), the DistributedSampler, the
``[GPU..]`` progress line and torchrun's launch. Changed so that it runs on CPUs: gloo
without a GPU, and the device follows from LOCAL_RANK only where there are GPUs. The
dataset and the model's initial weights are seeded (per rank, as the tutorial's unseeded
ones differ per rank) so that two runs can be compared, and each epoch prints its loss.

    torchrun --standalone --nproc-per-node=2 multigpu_torchrun.py TOTAL_EPOCHS SAVE_EVERY
"""
import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group


class MyTrainDataset(Dataset):
    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.size = size
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator))
                     for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.gpu_id) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.gpu_id] if torch.cuda.is_available() else None)

    def _load_snapshot(self, snapshot_path):
        loc = str(self.device)
        snapshot = torch.load(snapshot_path, map_location=loc)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        losses = []
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            losses.append(self._run_batch(source, targets))
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Losses: {losses!r}")

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    rank = int(os.environ["RANK"])
    train_set = MyTrainDataset(64, seed=rank)
    torch.manual_seed(100 + rank)   # the replicas' initial weights differ; DDP keeps rank 0's
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available(),
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=8, type=int, help="Input batch size on each device")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
