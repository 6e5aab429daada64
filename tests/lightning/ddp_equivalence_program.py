"""The training program of tests/lightning/test_ddp_equivalence.py:

    python tests/lightning/ddp_equivalence_program.py --replicas 2 3 4 --out DIR

For each N, one world of N replicas fits the same model on the same data four times, each
from the same seed: "mirrored" then "ddp" (Lightning's own strategy), in fp32 and then in
bf16-mixed; its replica 0 writes DIR/N/result.pt: per (precision, strategy) the weights
before and after the fit, the strategy's class, the rank, the world size and the intra-op
threads it trained with. No OMP_NUM_THREADS is set: each strategy chooses them.

The replicas are forked from this process after it imported Lightning and torchstrategy
(tests/helpers/forked_worlds.py), with torchrun's variables: both strategies find that
world and start nothing. Importing Lightning costs seconds of CPU per process; forked, the
three worlds' 9 replicas share one import. A world that fails or does not end in
--world-timeout seconds (its replicas are then killed) leaves no result.pt, its replicas'
tracebacks on stderr and a line naming it; the next world still runs.
"""
import argparse
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy.lightning  # noqa: F401  (registers "mirrored" with Lightning)
from tests.helpers.forked_worlds import run_forked, world

PRECISIONS = ("32-true", "bf16-mixed")
WIDE = 20000
STRATEGIES = ("mirrored", "ddp")
STEPS = 5


class Regression(pl.LightningModule):
    """Linear, Tanh, a wide Linear (16 x 20000: 1.3 MB of gradient, past DDP's 1 MiB first
    bucket), Tanh, Linear on 4 features; AdamW, which turns a last-bit difference in a
    gradient into a visible one in the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, WIDE), torch.nn.Tanh(),
                                       torch.nn.Linear(WIDE, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(96, 1, generator=g)
    # Lightning replaces the sampler with a DistributedSampler (shuffled, seed 0) under
    # both strategies: each replica gets the same batches under both.
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


def _weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(strategy: str, replicas: int, precision: str, out: str) -> dict:
    pl.seed_everything(7)
    model = Regression()
    initial = _weights(model)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=replicas,
                         precision=precision, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    trainer.fit(model, _data())
    return {"initial": initial, "state_dict": _weights(model),
            "strategy": type(trainer.strategy).__name__, "rank": trainer.global_rank,
            "world_size": trainer.world_size, "threads": torch.get_num_threads()}


def run_world(replicas: int, out: str) -> None:
    """One replica's part: the four fits; replica 0 writes OUT/result.pt."""
    result = {(precision, strategy): _fit(strategy, replicas, precision, out)
              for precision in PRECISIONS for strategy in STRATEGIES}
    if result[PRECISIONS[0], STRATEGIES[0]]["rank"] == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(result, os.path.join(out, "result.pt"))


def main(worlds: list[int], out: str, timeout: float) -> int:
    failed = 0
    for replicas in worlds:
        failures = run_forked(world(f"world of {replicas}", replicas, run_world, replicas,
                                    os.path.join(out, str(replicas))), timeout)
        for failure in failures:
            print(failure, file=sys.stderr, flush=True)
        failed += bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-timeout", type=float, default=150.0)
    arguments = parser.parse_args()
    sys.exit(main(arguments.replicas, arguments.out, arguments.world_timeout))
