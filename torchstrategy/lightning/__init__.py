"""The Lightning adapter: any torchstrategy strategy as a Lightning ``Trainer`` strategy.

    import lightning.pytorch as pl            # or: import pytorch_lightning as pl
    import torchstrategy as ts
    import torchstrategy.lightning                  # registers the names below

    trainer = pl.Trainer(strategy=ts.LightningStrategy(ts.MirroredStrategy(["cpu:0", "cpu:1"])))
    trainer = pl.Trainer(strategy="mirrored", accelerator="cpu", devices=2)   # the same

Lightning's semantics hold, so a LightningModule trains exactly as under
``strategy="ddp"``: ``training_step`` returns the per-replica mean loss and gradients are
*averaged* over replicas (the adapter scales the loss by 1/N before the reducer sums).
The model is not wrapped: checkpoints have the module's own keys.

Importing this module imports Lightning (``import torchstrategy`` alone never does) and
registers torchstrategy's names ("mirrored", "mirrored_notebook", "one_device",
"multi_worker_mirrored", ...) in Lightning's ``StrategyRegistry``. The Lightning package
in use is the one already imported (``lightning.pytorch`` first if both are: names are
registered in every one already imported), else the one installed (``lightning.pytorch``
first). ``LightningStrategy(...)`` and ``BackupAndRestoreCallback(...)`` build that
package's classes (``package=`` picks the other), published at module level in
`torchstrategy.lightning.lightning_pytorch` and `.pytorch_lightning`, which subclass the
Lightning-free bases of `torchstrategy.lightning_base`:
``isinstance(s, LightningStrategy)`` holds for either package. Importing one of those two
modules registers the names in its package explicitly.
"""
from torchstrategy.lightning_base.adapter import (LightningStrategy, packages_in_use,
                                                  strategy_class)
from torchstrategy.lightning_base.backup import BackupAndRestoreCallback, callback_class
from torchstrategy.lightning_base.registration import registered_names

# Defining a package's classes registers our names in its StrategyRegistry.
for _package in packages_in_use():
    callback_class(_package)
del _package

__all__ = ["BackupAndRestoreCallback", "LightningStrategy", "callback_class",
           "registered_names", "strategy_class"]
