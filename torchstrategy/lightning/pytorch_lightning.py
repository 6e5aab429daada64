"""The Lightning adapter for ``pytorch_lightning`` (importing this module imports it and
registers our names in its ``StrategyRegistry``). Its classes subclass
`torchstrategy.lightning.LightningStrategy` / `BackupAndRestoreCallback`, which build them
when this is the Lightning package in use (or when given ``package="pytorch_lightning"``)."""
import pytorch_lightning as pl
from pytorch_lightning.accelerators import (CPUAccelerator, CUDAAccelerator, MPSAccelerator,
                                            XLAAccelerator)
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

from torchstrategy.lightning_base import adapter, backup

PACKAGE = adapter.LightningPackage(
    name="pytorch_lightning", trainer=pl.Trainer, fitting=TrainerFn.FITTING,
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
