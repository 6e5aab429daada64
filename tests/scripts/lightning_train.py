"""Trains a small LightningModule with a given strategy and saves what the tests compare.

    python tests/scripts/lightning_train.py --strategy ddp|mirrored|instance|one_device \
        --model boring|regression --out DIR [--package lightning|pytorch_lightning] [--resume]
        [--also NAME ...] [--straight-too] [--import-order ORDER] [--probe-registration]
        [--probe-reexecution]

Run as a plain script (Lightning's ddp and our re-execution launcher both start the other
replica by running this command again). Replica 0 writes DIR/result.pt: the final
state_dict, the logged metrics, and what validate/test/predict returned.

Each launch of Lightning replicas costs seconds of imports, so one launch can train more
than once: ``--also NAME`` then fits the same model from the same seed with strategy NAME
in the world the first fit's launcher made (Lightning's own ``"ddp"`` finds its variables
and process group and starts nothing; so do ours), giving result[NAME];
``--straight-too`` (with ``--resume``) then trains uninterrupted for all the steps
(result["straight"]).

A fresh interpreter is also what the registration tests need (what is registered depends
on what was imported first), so before it trains the run records, in the process the test
started (not in the replicas a launcher started: their result is not saved):
``--probe-registration`` our names in the package's StrategyRegistry and the Trainer built
for ``strategy="one_device"`` (result["registration"]); ``--probe-reexecution`` the error
of ``Trainer(strategy="mirrored", devices=2)`` in a program that cannot be re-executed
(read on stdin; result["reexecution_error"]). With ``--import-order adapter-first`` every
process records what ``import torchstrategy`` and then ``import torchstrategy.lightning``
each did (result["imports"]).
"""
import sys

# Taken before any import: `import torchstrategy` must add no import hook.
META_PATH_AT_START = list(sys.meta_path)

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--model", default="boring")
parser.add_argument("--out", required=True)
parser.add_argument("--package", default="lightning")
parser.add_argument("--import-order", default="torchstrategy-first",
                    choices=["torchstrategy-first", "lightning-first", "adapter-first"],
                    help="adapter-first: torchstrategy, then torchstrategy.lightning (which "
                         "imports Lightning itself), then the package")
parser.add_argument("--max-steps", type=int, default=6)
parser.add_argument("--resume", action="store_true",
                    help="train half the steps, then resume from the checkpoint")
parser.add_argument("--also", action="append", default=[],
                    help="then train again with this strategy in the same world")
parser.add_argument("--straight-too", action="store_true",
                    help="then train again uninterrupted, for all the steps")
parser.add_argument("--probe-registration", action="store_true",
                    help="record our names in the registry and Trainer(strategy='one_device')")
parser.add_argument("--probe-reexecution", action="store_true",
                    help="record the error of Trainer(strategy='mirrored', devices=2)")
args = parser.parse_args()
if args.import_order == "adapter-first" and args.package != "lightning":
    parser.error("--import-order adapter-first imports the installed Lightning: "
                 "--package lightning")
# Started by a launcher (re-execution, torchrun) as one of its replicas.
LAUNCHED_REPLICA = "RANK" in os.environ


def lightning_modules():
    return sorted(m for m in sys.modules
                  if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"))


IMPORTS = {}
if args.import_order == "adapter-first":
    import torchstrategy as ts
    IMPORTS["lightning_after_torchstrategy"] = lightning_modules()
    IMPORTS["hooks_unchanged_after_torchstrategy"] = sys.meta_path == META_PATH_AT_START
    from torchstrategy.lightning import LightningStrategy
    from lightning.pytorch.strategies import StrategyRegistry
    IMPORTS["registered_by_adapter"] = "mirrored" in StrategyRegistry
    IMPORTS["same_class"] = ts.LightningStrategy is LightningStrategy
    IMPORTS["hooks_unchanged_after_adapter"] = sys.meta_path == META_PATH_AT_START
elif args.import_order == "torchstrategy-first":
    import torchstrategy as ts
pl = importlib.import_module("lightning.pytorch" if args.package == "lightning"
                             else "pytorch_lightning")
demos = importlib.import_module(f"{pl.__name__}.demos.boring_classes")
if args.import_order == "lightning-first":
    import torchstrategy as ts
from torchstrategy.lightning import LightningStrategy  # noqa: E402


class Regression(pl.LightningModule):
    """y = 2x + 3 with noise; logs a synced metric, gathers predictions."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if isinstance(self.trainer.strategy, LightningStrategy):
            # Our steps run in the strategy's replica context; its collectives work there.
            replica = ts.get_replica_context()
            assert replica.replica_id_in_sync_group == self.global_rank
            assert replica.num_replicas_in_sync == self.trainer.world_size
            total = replica.all_reduce("SUM", torch.ones(1))
            assert total.item() == self.trainer.world_size, total
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_max", loss, sync_dist=True, reduce_fx="max")

    def test_step(self, batch, batch_idx):
        x, y = batch
        gathered = self.all_gather(x)
        assert gathered.shape == (self.trainer.world_size,) + tuple(x.shape), gathered.shape
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def regression_data():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 1, generator=g) * 4 - 2
    y = 2 * x + 3 + 0.05 * torch.randn(64, 1, generator=g)
    return TensorDataset(x, y)


def make_trainer(strategy_name, max_steps, callbacks=()):
    if strategy_name == "instance":
        strategy = LightningStrategy(ts.MirroredStrategy(devices=["cpu:0", "cpu:1"]))
        devices = "auto"
    elif strategy_name == "one_device":
        strategy, devices = "one_device", 1
    else:  # "ddp", "mirrored", "multi_worker_mirrored", "mirrored_notebook" (stdin)
        strategy, devices = strategy_name, 2
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                      max_steps=max_steps, limit_val_batches=2, enable_progress_bar=False,
                      enable_model_summary=False, logger=False,
                      default_root_dir=args.out, callbacks=list(callbacks),
                      enable_checkpointing=bool(callbacks),
                      # gradient accumulation (no_sync) for the BoringModel runs
                      accumulate_grad_batches=2 if args.model == "boring" else 1)


def new_model():
    return demos.BoringModel() if args.model == "boring" else Regression()


def data():
    """(train, val) loaders."""
    if args.model == "boring":
        return (DataLoader(demos.RandomDataset(32, 64), batch_size=4, shuffle=True),
                DataLoader(demos.RandomDataset(32, 16), batch_size=4))
    return (DataLoader(regression_data(), batch_size=8, shuffle=True),
            DataLoader(regression_data(), batch_size=8))


def fit(strategy_name, resume=False):
    """One training from seed 7; what the tests compare, and whether this is replica 0."""
    pl.seed_everything(7)
    model = new_model()
    train, val = data()
    result = {}
    if resume:
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"),
                                            save_last=True, every_n_train_steps=1)
        trainer = make_trainer(strategy_name, args.max_steps // 2, [ckpt])
        trainer.fit(model, train, val)
        last = os.path.join(args.out, "ckpt", "last.ckpt")
        result["checkpoint_keys"] = sorted(torch.load(last, weights_only=False)["state_dict"])
        pl.seed_everything(7)
        resumed = new_model()
        ckpt2 = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt2"),
                                             save_last=True)
        trainer = make_trainer(strategy_name, args.max_steps, [ckpt2])
        trainer.fit(resumed, train, val, ckpt_path=last)
        model = resumed
    else:
        trainer = make_trainer(strategy_name, args.max_steps)
        trainer.fit(model, train, val)
    result["global_step"] = trainer.global_step
    result["strategy"] = type(trainer.strategy).__name__
    result["world_size"] = trainer.world_size
    result["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.model == "regression":
        result["validate"] = trainer.validate(model, val, verbose=False)
        result["test"] = trainer.test(model, val, verbose=False)
        predictions = trainer.predict(model, DataLoader(regression_data(), batch_size=8))
        result["predictions"] = torch.cat(predictions)
    return result, trainer.is_global_zero


def registration_probe():
    """Our names in the package's registry, and the Trainer that one of them builds."""
    names = [n for n in ("mirrored", "mirrored_notebook", "one_device")
             if n in pl.strategies.StrategyRegistry]
    trainer = pl.Trainer(strategy="one_device", accelerator="cpu", devices=1, logger=False)
    return {"names": names,
            "is_adapter": isinstance(trainer.strategy, LightningStrategy),
            "is_lightning_strategy": isinstance(trainer.strategy, pl.strategies.Strategy),
            "torchstrategy": repr(trainer.strategy.torchstrategy)}


def reexecution_probe():
    """The error of a Trainer whose strategy would re-execute this program (None if none)."""
    try:
        pl.Trainer(strategy="mirrored", accelerator="cpu", devices=2, logger=False)
    except RuntimeError as error:
        return str(error)
    return None


def main():
    probes = {"imports": IMPORTS}
    if not LAUNCHED_REPLICA:
        if args.probe_registration:
            probes["registration"] = registration_probe()
        if args.probe_reexecution:
            probes["reexecution_error"] = reexecution_probe()
    result, chief = fit(args.strategy, resume=args.resume)
    result.update(probes)
    for name in args.also:
        result[name], _ = fit(name)
    if args.straight_too:
        result["straight"], _ = fit(args.strategy)
    result["lightning_modules"] = sorted(m for m in ("lightning", "pytorch_lightning")
                                         if m in sys.modules)
    result["import_order"] = args.import_order
    if chief:
        torch.save(result, os.path.join(args.out, "result.pt"))
    # Python's finalisation would walk every object the imports made (seconds per replica on
    # a loaded machine); frozen, they are left to the process's end.
    gc.freeze()


if __name__ == "__main__":
    main()
