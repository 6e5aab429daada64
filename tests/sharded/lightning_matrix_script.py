"""Run by tests/sharded/test_checkpoint_matrix.py as a plain script: Lightning checkpoints
under every strategy.

    python tests/sharded/lightning_matrix_script.py OUT

For each of Trainer(strategy="mirrored" / "multi_worker_mirrored" / "sharded"): `save`
fits one epoch (3 steps of a global batch of 6, Adam, fp64) on 2 replicas and writes
OUT/<name>.ckpt with ``trainer.save_checkpoint``; `resume` starts from other weights, fits
to 6 steps with ``ckpt_path=`` on N replicas (the per-replica batch 6 / N: the same global
batches) and replica 0 writes the final weights and Adam state to OUT/<name>-N.pt.
`reference` (one process, before any strategy of ours) writes what they are compared with
to OUT/reference.pt: one device's epoch without Lightning (`reference_epoch`) and
Lightning's own save and resume on one device (`reference_resumed`).

This process imports Lightning once and forks every replica from it
(tests/helpers/forked_worlds.py, torchrun's variables: each strategy finds its world): first
the save on 2 replicas, then, side by side, the resume on 2 and one process that runs the
references and then resumes on 1. Every resume is a new process that never saw the save. A
failed or hung replica (killed after --timeout seconds) is named on stderr with its traceback;
the exit status is then 1.
"""
import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
import torchstrategy.lightning  # noqa: F401  (registers the strategy names)
from tests.helpers.forked_worlds import Forked, run_forked, world

STRATEGIES = ("mirrored", "multi_worker_mirrored", "sharded")
GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 3
LR = 0.01


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=torch.float64),
                                         torch.nn.Tanh(),
                                         torch.nn.Linear(8, 3, dtype=torch.float64))

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # The mean over this replica's batch; the replicas' gradients are averaged (DDP's
        # rule): the mean over the global batch.
        return ((self(x) - y) ** 2).sum(1).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * STEPS_PER_EPOCH, 4, generator=generator,
                    dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH * STEPS_PER_EPOCH, 3, generator=generator,
                    dtype=torch.float64)
    return TensorDataset(x, y)


def by_name(optimizer_state):
    """Adam's state_dict()["state"] keyed by parameter name (already so under "sharded")."""
    names = [name for name, _ in Regression().named_parameters()]
    return {(names[k] if isinstance(k, int) else k):
            {key: torch.as_tensor(value, dtype=torch.float64) for key, value in s.items()}
            for k, s in optimizer_state.items()}


def reference_epoch():
    """One device, no Lightning, one epoch: (weights, Adam state by name)."""
    torch.manual_seed(0)
    model = Regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=False):
        model.training_step((x, y), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            by_name(optimizer.state_dict()["state"]))


def reference_resumed(out):
    """Lightning's own save and resume on one device (strategy="auto"): (weights, Adam
    state by name) after resuming OUT/auto.ckpt to two epochs."""
    trainer, _ = fit("auto", 1, STEPS_PER_EPOCH, seed=0)
    path = os.path.join(out, "auto.ckpt")
    trainer.save_checkpoint(path)
    trainer, model = fit("auto", 1, 2 * STEPS_PER_EPOCH, seed=1, ckpt_path=path)
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            by_name(trainer.optimizers[0].state_dict()["state"]))


class Interleaved(torch.utils.data.Sampler):
    """Replica r of N takes samples r, r + N, r + 2N, ... in order (no shuffling, whatever
    N): with a per-replica batch of 6 / N every step trains on the same 6 samples. (With
    its own DistributedSampler, Lightning shuffles the training data on several replicas
    and not on one, so a resize would change the data.)"""

    def __init__(self, size):
        self.size = size

    def _rank_and_size(self):
        if torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __iter__(self):
        rank, size = self._rank_and_size()
        return iter(range(rank, self.size, size))

    def __len__(self):
        return self.size // self._rank_and_size()[1]


def fit(name, replicas, max_steps, seed, ckpt_path=None):
    torch.manual_seed(seed)
    model = Regression()
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=replicas,
                         max_steps=max_steps, enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False,
                         use_distributed_sampler=False)
    loader = DataLoader(data(), batch_size=GLOBAL_BATCH // replicas,
                        sampler=Interleaved(GLOBAL_BATCH * STEPS_PER_EPOCH))
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model


def reference(out):
    """Writes OUT/reference.pt: {"epoch": reference_epoch(), "resumed": reference_resumed()}."""
    directory = os.path.join(out, "reference")
    os.makedirs(directory, exist_ok=True)
    torch.save({"epoch": reference_epoch(), "resumed": reference_resumed(directory)},
               os.path.join(out, "reference.pt"))


def run_phases(out, phases, replicas):
    """One replica's part: `phases` ("+"-joined) in order."""
    for phase in phases.split("+"):
        if phase == "reference":
            reference(out)
        else:
            run_strategies(out, phase, replicas)


def main(out, timeout):
    rounds = [world("save on 2", 2, run_phases, out, "save", 2),
              world("resume on 2", 2, run_phases, out, "resume", 2)
              + [Forked("reference, then resume on 1", run_phases,
                        (out, "reference+resume", 1))]]
    for children in rounds:
        failures = run_forked(children, timeout)
        if failures:
            print("\n".join(failures), file=sys.stderr, flush=True)
            return 1
    return 0


def run_strategies(out, phase, replicas):
    for name in STRATEGIES:
        path = os.path.join(out, f"{name}.ckpt")
        if phase == "save":
            trainer, _ = fit(name, replicas, STEPS_PER_EPOCH, seed=0)
            trainer.save_checkpoint(path)
            continue
        trainer, model = fit(name, replicas, 2 * STEPS_PER_EPOCH, seed=1, ckpt_path=path)
        final = os.path.join(out, f"{name}-{replicas}.ckpt")
        # The checkpoint of the finished run holds the full weights and the optimizer state
        # (keyed by parameter name under "sharded", by index otherwise).
        trainer.save_checkpoint(final)
        if trainer.global_rank == 0:
            checkpoint = torch.load(final, weights_only=False)
            adam = by_name(checkpoint["optimizer_states"][0]["state"])
            torch.save({"weights": checkpoint["state_dict"], "adam": adam,
                        "global_step": checkpoint["global_step"]},
                       os.path.join(out, f"{name}-{replicas}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--timeout", type=float, default=150.0)
    arguments = parser.parse_args()
    sys.exit(main(arguments.out, arguments.timeout))
