"""The Lightning adapter for ``lightning.pytorch`` (importing this module imports it and
registers our names in its ``StrategyRegistry``). Its classes subclass
`torchstrategy.lightning.LightningStrategy` / `BackupAndRestoreCallback`, which build them
when this is the Lightning package in use (or when given ``package="lightning.pytorch"``)."""
import lightning.pytorch as pl
from lightning.pytorch.accelerators import (CPUAccelerator, CUDAAccelerator, MPSAccelerator,
                                            XLAAccelerator)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

from torchstrategy.lightning_base import adapter, backup

PACKAGE = adapter.LightningPackage(
    name="lightning.pytorch", trainer=pl.Trainer, fitting=TrainerFn.FITTING,
    rank_zero_only=(rank_zero_only, utilities_rank_zero_only),
    accelerators=((CPUAccelerator, "cpu"), (CUDAAccelerator, "cuda"),
                  (MPSAccelerator, "mps"), (XLAAccelerator, "xla")))


class LightningStrategy(adapter.LightningStrategy, ParallelStrategy):
    __doc__ = adapter.CLASS_DOC
    lightning = PACKAGE


class BackupAndRestoreCallback(backup.BackupAndRestoreCallback, Callback):
    __doc__ = backup.CLASS_DOC
    package = PACKAGE.name


LightningStrategy.register_strategies(StrategyRegistry)
