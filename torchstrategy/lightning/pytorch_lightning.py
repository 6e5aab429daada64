"""The Lightning adapter for ``pytorch_lightning``: its `LightningStrategy` and
`BackupAndRestoreCallback` classes (subclasses of ``pytorch_lightning``'s ``ParallelStrategy`` /
``Callback`` and of torchstrategy's Lightning-free bases), published here. Importing this
module imports ``pytorch_lightning`` and registers our names in its ``StrategyRegistry``.

The classes are made by `torchstrategy.lightning_base` (`adapter.strategy_class`,
`backup.callback_class`), once per process, so that ``ts.LightningStrategy(...)`` can make
them without importing this module; this module gives them their public place.
"""
from torchstrategy.lightning_base import adapter, backup

LightningStrategy = adapter.strategy_class("pytorch_lightning")
BackupAndRestoreCallback = backup.callback_class("pytorch_lightning")
PACKAGE = LightningStrategy.lightning

__all__ = ["BackupAndRestoreCallback", "LightningStrategy"]
