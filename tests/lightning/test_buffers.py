"""The Lightning adapter's buffers (BatchNorm statistics) against Lightning's "ddp".

Lightning's ``strategy="ddp"`` wraps the module in DistributedDataParallel, which
broadcasts replica 0's buffers before a forward that follows a synchronised training
step (and at set-up); the adapter's default (``buffers="broadcast"``) does the same, so
weights, every replica's running statistics and the logged ``val_loss`` equal DDP's.
``buffers="mean"`` keeps torchstrategy's own rule: the replica mean after each training
step.

This file is also the training program: ``python tests/lightning/test_buffers.py
--strategy CONFIGURATION[,CONFIGURATION...] --out DIR``, each of ddp, mirrored,
mirrored_mean (both launchers start the second replica by running the command again; a
launch costs seconds of imports, so the tests make one: "mirrored" first, whose launcher
makes the world, then "mirrored_mean" and "ddp", which find it and start nothing). For
each configuration it runs, on 2 CPU replicas whose batches differ (Lightning's
DistributedSampler), with every replica writing DIR/result_<configuration>_<rank>.pt:
- ``auto``: a fit with automatic optimisation and gradient accumulation (2 batches) that
  validates after its first epoch and stops in the middle of the second (so the replicas'
  statistics differ at the end under "ddp"), then ``trainer.validate``;
- ``manual``: a fit with manual optimisation, validating in the middle of the epoch.
"""
import argparse
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.lightning_runs import ROOT, SUBPROCESS_TIMEOUT_SECONDS, clean_env
from torchstrategy.lightning import LightningStrategy

pytestmark = pytest.mark.lightning

# Same float32 operations on both sides: equal in practice bit for bit; 1e-6 leaves room
# for a different but equally valid summation order in gloo.
TOLERANCE = dict(atol=1e-6, rtol=0)
CONFIGURATIONS = ("ddp", "mirrored", "mirrored_mean")


# -- the training program (run as a script) ----------------------------------------------
class BatchNormNet(pl.LightningModule):
    """Linear, BatchNorm, ReLU, Linear; logs the synced validation loss."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                       torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.local_stats: list[torch.Tensor] = []   # after this replica's forward
        self.stats_after_step: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.local_stats.append(self.net[1].running_mean.clone())
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.stats_after_step.append(self.net[1].running_mean.clone())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(seed: int, n: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * torch.linspace(0.5, 3.0, n).unsqueeze(1)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=seed == 1)


def _program(configurations: str, out: str) -> None:
    unknown = [c for c in configurations.split(",") if c not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {CONFIGURATIONS}")
    for strategy in configurations.split(","):
        _fit_twice(strategy, out)


def _fit_twice(strategy: str, out: str) -> None:
    def trainer(**kwargs):
        if strategy == "mirrored_mean":
            chosen = LightningStrategy(kind="mirrored", buffers="mean")
        else:
            chosen = strategy
        return pl.Trainer(strategy=chosen, accelerator="cpu", devices=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, limit_val_batches=2,
                          default_root_dir=out, **kwargs)

    def record(model, fitted) -> dict:
        return {"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "metrics": {k: float(v) for k, v in fitted.callback_metrics.items()},
                "local_stats": model.local_stats, "stats_after_step": model.stats_after_step}

    result = {}
    # 48 examples: 6 batches of 4 per replica and epoch, 3 optimizer steps of 2 batches.
    pl.seed_everything(3)
    model = BatchNormNet(manual=False)
    fitted = trainer(max_steps=5, accumulate_grad_batches=2)
    fitted.fit(model, data(1, 48), data(2, 16))
    result["auto"] = record(model, fitted)
    result["validate"] = fitted.validate(model, data(2, 16), verbose=False)[0]
    result["after_validate"] = {k: v.clone() for k, v in model.state_dict().items()}

    pl.seed_everything(4)
    model = BatchNormNet(manual=True)
    fitted = trainer(max_steps=5, val_check_interval=3)
    fitted.fit(model, data(1, 48), data(2, 16))
    result["manual"] = record(model, fitted)
    result["strategy"] = type(fitted.strategy).__name__
    os.makedirs(out, exist_ok=True)
    torch.save(result, os.path.join(out, f"result_{strategy}_{fitted.global_rank}.pt"))


# -- the tests -----------------------------------------------------------------------------
def _run(out_dir, configurations: tuple[str, ...]) -> dict[str, list[dict]]:
    """Runs this file as the program under `configurations`, in that order, in one launch;
    both replicas' results of each."""
    os.makedirs(out_dir, exist_ok=True)
    argv = [sys.executable, os.path.abspath(__file__), "--strategy", ",".join(configurations),
            "--out", str(out_dir)]
    done = subprocess.run(argv, cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_SECONDS)
    assert done.returncode == 0, (f"{configurations} exited with {done.returncode}\n"
                                  f"--- stdout ---\n{done.stdout[-3000:]}\n"
                                  f"--- stderr ---\n{done.stderr[-5000:]}")
    return {name: [torch.load(os.path.join(out_dir, f"result_{name}_{rank}.pt"),
                              weights_only=False) for rank in (0, 1)]
            for name in configurations}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    # "mirrored" first: our launcher makes the world the others join.
    return _run(tmp_path_factory.mktemp("buffers"), ("mirrored", "mirrored_mean", "ddp"))


@pytest.fixture(scope="module")
def ddp(launched):
    return launched["ddp"]


def _assert_same_state(ours: dict, theirs: dict, what: str) -> None:
    assert list(ours) == list(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **TOLERANCE,
                                   msg=lambda m: f"{what}, {key}: {m}")


@pytest.mark.timeout(600)
def test_default_buffers_match_ddp_on_every_replica(ddp, launched):
    """strategy="mirrored" (buffers="broadcast"): on each replica, the weights and the
    BatchNorm statistics after a fit with accumulation that stops mid-epoch (replicas'
    statistics then differ, as under "ddp"), after ``trainer.validate`` (replica 0's
    everywhere) and after a fit with manual optimisation equal DDP's, and so do the
    logged val_loss and validate's loss."""
    ours = launched["mirrored"]
    assert ours[0]["strategy"] == "LightningStrategy" and ddp[0]["strategy"] == "DDPStrategy"
    for rank in (0, 1):
        for fit in ("auto", "manual"):
            _assert_same_state(ours[rank][fit]["state_dict"], ddp[rank][fit]["state_dict"],
                               f"replica {rank}, {fit} fit")
            assert ours[rank][fit]["metrics"]["val_loss"] == pytest.approx(
                ddp[rank][fit]["metrics"]["val_loss"], abs=1e-6, rel=0)
        _assert_same_state(ours[rank]["after_validate"], ddp[rank]["after_validate"],
                           f"replica {rank}, after validate")
        assert ours[rank]["validate"]["val_loss"] == pytest.approx(
            ddp[rank]["validate"]["val_loss"], abs=1e-6, rel=0)
    # The comparison can tell: under "ddp" the replicas end the fit with different
    # statistics, and trainer.validate makes them replica 0's.
    key = "net.1.running_mean"
    assert not torch.equal(ddp[0]["auto"]["state_dict"][key], ddp[1]["auto"]["state_dict"][key])
    assert torch.equal(ddp[0]["after_validate"][key], ddp[1]["after_validate"][key])


@pytest.mark.timeout(600)
def test_mean_buffers_are_the_replica_mean(ddp, launched):
    """LightningStrategy(kind="mirrored", buffers="mean"): after every training step
    each replica holds the mean of the statistics the replicas computed, the weights
    still equal DDP's (buffers do not change gradients of a training forward), and the
    statistics differ from DDP's."""
    ours = launched["mirrored_mean"]
    for fit in ("auto", "manual"):
        local = [ours[rank][fit]["local_stats"] for rank in (0, 1)]
        after = [ours[rank][fit]["stats_after_step"] for rank in (0, 1)]
        assert len(local[0]) == len(after[0]) == len(local[1]) > 0
        for step, (first, second) in enumerate(zip(*local)):
            mean = (first + second) / 2
            for rank in (0, 1):
                torch.testing.assert_close(after[rank][step], mean, **TOLERANCE,
                                           msg=lambda m: f"{fit}, step {step}: {m}")
        for rank in (0, 1):
            weights = {k: v for k, v in ours[rank][fit]["state_dict"].items()
                       if "running" not in k}
            theirs = {k: v for k, v in ddp[rank][fit]["state_dict"].items()
                      if "running" not in k}
            _assert_same_state(weights, theirs, f"replica {rank}, {fit} fit")
    key = "net.1.running_mean"
    assert not torch.allclose(ours[0]["auto"]["state_dict"][key],
                              ddp[0]["auto"]["state_dict"][key], atol=1e-4)


def test_unknown_buffers_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"buffers must be 'broadcast' .* or 'mean' .*, "
                       r"got 'sum'"):
        LightningStrategy(kind="mirrored", buffers="sum")
    assert LightningStrategy(kind="mirrored").buffers == "broadcast"
    mean = LightningStrategy(kind="mirrored", buffers="mean")
    assert mean.buffers == "mean"
    assert repr(mean) == "LightningStrategy(kind='mirrored', start_method='popen', " \
                         "buffers='mean')"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True,
                        help=f"comma-separated, each of {', '.join(CONFIGURATIONS)}")
    parser.add_argument("--out", required=True)
    arguments = parser.parse_args()
    _program(arguments.strategy, arguments.out)
