"""The Lightning adapter's Lightning-free part: `LightningStrategy` and
`BackupAndRestoreCallback` as bases, and the names to register.

Nothing here imports Lightning, so ``import torchstrategy`` can offer ``ts.LightningStrategy``
and ``ts.BackupAndRestoreCallback``. Constructing one builds the class of the Lightning
package in use, defined in `torchstrategy.lightning` (which imports Lightning and registers
``Trainer(strategy="mirrored")`` and the other names when imported).
"""
