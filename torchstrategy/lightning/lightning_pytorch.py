"""The Lightning adapter for ``lightning.pytorch``: its `LightningStrategy` and
`BackupAndRestoreCallback` classes (subclasses of ``lightning.pytorch``'s ``ParallelStrategy`` /
``Callback`` and of torchstrategy's Lightning-free bases), published here. Importing this
module imports ``lightning.pytorch`` and registers our names in its ``StrategyRegistry``.

The classes are made by `torchstrategy.lightning_base` (`adapter.strategy_class`,
`backup.callback_class`), once per process, so that ``ts.LightningStrategy(...)`` can make
them without importing this module; this module gives them their public place.
"""
from torchstrategy.lightning_base import adapter, backup

LightningStrategy = adapter.strategy_class("lightning.pytorch")
BackupAndRestoreCallback = backup.callback_class("lightning.pytorch")
PACKAGE = LightningStrategy.lightning

__all__ = ["BackupAndRestoreCallback", "LightningStrategy"]
