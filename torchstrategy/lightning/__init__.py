"""The Lightning adapter: any torchstrategy strategy as a Lightning ``Trainer`` strategy.

    import lightning.pytorch as pl            # or: import pytorch_lightning as pl
    import torchstrategy as ts
    from torchstrategy.lightning import LightningStrategy

    trainer = pl.Trainer(strategy=LightningStrategy(ts.MirroredStrategy(["cpu:0", "cpu:1"])))
    trainer = pl.Trainer(strategy="mirrored", accelerator="cpu", devices=2)   # the same

Lightning's semantics hold, so a LightningModule trains exactly as under
``strategy="ddp"``: ``training_step`` returns the per-replica mean loss and gradients are
*averaged* over replicas (the adapter scales the loss by 1/N before the reducer sums).
The model is not wrapped: checkpoints have the module's own keys.

Importing this module (or ``torchstrategy``) never imports Lightning; Lightning's classes
are built the first time an adapter is made, for the Lightning package in use.
"""
import sys

from torchstrategy.lightning.registration import registered_names

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _default_package():
    """The Lightning package this program uses: the one already imported (``lightning.
    pytorch`` if both are), else whichever is installed."""
    for package in _PACKAGES:
        if package in sys.modules:
            return package
    for package in _PACKAGES:
        try:
            __import__(package)
            return package
        except ImportError:
            continue
    raise ImportError("torchstrategy.lightning needs Lightning: pip install lightning "
                      "(or pytorch-lightning).")


def strategy_class(package=None):
    """The adapter class for `package` ("lightning.pytorch" or "pytorch_lightning"; None:
    the one in use), a subclass of that package's ``ParallelStrategy``."""
    from torchstrategy.lightning.adapter import adapter_class

    package = package or _default_package()
    if package not in _PACKAGES:
        raise ValueError(f"package must be one of {_PACKAGES}, got {package!r}.")
    return adapter_class(package)


class _DispatchingType(type):
    def __instancecheck__(cls, obj):
        return any(isinstance(obj, adapter) for adapter in _built_adapters())

    def __subclasscheck__(cls, sub):
        return any(issubclass(sub, adapter) for adapter in _built_adapters())


def _built_adapters():
    from torchstrategy.lightning import adapter

    return tuple(adapter._classes.values())


class LightningStrategy(metaclass=_DispatchingType):
    """A Lightning strategy that runs the Trainer on a torchstrategy strategy.

    ``LightningStrategy(strategy)`` returns an instance of the adapter class of the
    Lightning package in use (``lightning.pytorch`` or ``pytorch_lightning``; pass
    ``package=`` when a program imports both), so it is accepted by that package's
    ``Trainer(strategy=...)``; ``isinstance(s, LightningStrategy)`` holds for either.

    Args:
      strategy: a torchstrategy strategy that runs one replica per process: the default
        strategy, ``OneDeviceStrategy``, ``MirroredStrategy`` (and the multi-worker one).
        Creating it is what launches the replicas (re-execution of ``python train.py``,
        or joining torchrun's world), so the Trainer's ``devices``, ``num_nodes`` and
        ``accelerator`` must agree with it or be left at "auto" (a clear error otherwise).
      kind: instead of `strategy`, the name of a strategy to build from the Trainer's
        ``accelerator``/``devices``/``num_nodes`` ("mirrored", "one_device",
        "multi_worker_mirrored"): what the registered names ``Trainer(strategy="mirrored")``
        do.
      start_method: with `kind`: "popen" (default) builds the strategy when the Trainer is
        built (re-executing ``python train.py`` for the other replicas, or joining
        torchrun); "fork" (notebooks: ``Trainer(strategy="mirrored_notebook")``) forks the
        replicas at ``fit``/``validate``/... and brings the trained weights back into the
        calling process, as Lightning's ``ddp_notebook`` does.
      package: "lightning.pytorch" or "pytorch_lightning" (default: the one imported).
      accelerator / checkpoint_io / precision_plugin: as for any Lightning strategy.
    """

    def __new__(cls, strategy=None, *, kind=None, start_method="popen", package=None,
                **kwargs):
        return strategy_class(package)(strategy, kind=kind, start_method=start_method,
                                       **kwargs)


__all__ = ["LightningStrategy", "registered_names", "strategy_class"]
