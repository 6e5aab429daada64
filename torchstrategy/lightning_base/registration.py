"""torchstrategy's names in Lightning's strategy registry (``Trainer(strategy="mirrored")``).

Lightning looks a strategy name up in its ``StrategyRegistry`` (one per package:
``lightning.pytorch.strategies.StrategyRegistry``, ``pytorch_lightning.strategies.
StrategyRegistry``) and offers no entry point through which an installed package adds
strategies (its entry points, ``lightning.pytorch.callbacks_factory``, are for callbacks
only). So the names are registered, through Lightning's own ``register_strategies`` hook of
the adapter class, when `torchstrategy.lightning` is imported: into the registry of every
Lightning package already imported, or of the one it imports. ``import torchstrategy``
alone imports no Lightning and registers nothing.

Registration records a name and a factory; the strategy itself is built when a Trainer
asks for the name. This module imports no Lightning.
"""
import threading

# name -> (torchstrategy class it needs, kind, start method, description)
_NAMES = {
    "mirrored": ("MirroredStrategy", "mirrored", "popen",
                 "torchstrategy MirroredStrategy: one replica per device, python train.py "
                 "re-executes itself for the other replicas (or joins torchrun)"),
    "mirrored_notebook": ("MirroredStrategy", "mirrored", "fork",
                          "torchstrategy MirroredStrategy with replicas forked at fit "
                          "(notebooks)"),
    "one_device": ("OneDeviceStrategy", "one_device", "popen",
                   "torchstrategy OneDeviceStrategy: one replica on one device"),
    "multi_worker_mirrored": ("MultiWorkerMirroredStrategy", "multi_worker_mirrored",
                              "popen", "torchstrategy MultiWorkerMirroredStrategy: "
                              "several machines under torchrun"),
    "central_storage": ("CentralStorageStrategy", "central_storage", "popen",
                        "torchstrategy CentralStorageStrategy"),
    "tpu": ("TPUStrategy", "tpu", "popen", "torchstrategy TPUStrategy"),
}
# Prefix for a name Lightning already uses for one of its own strategies.
_COLLISION_PREFIX = "ts_"

_lock = threading.Lock()
_registered = {}  # package -> {our name: name in that registry}


def available_names():
    """Our names (every strategy they name is in this package)."""
    return list(_NAMES)


def registered_names(package=None):
    """{our name: the name registered in `package`'s registry} (a name Lightning already
    uses gets the prefix "ts_"). `package` None: the first package registered into."""
    with _lock:
        if package is None:
            package = next(iter(_registered), None)
        return dict(_registered.get(package, {}))


def _factory(adapter_class, kind, start_method):
    def build(**kwargs):
        return adapter_class(None, kind=kind, start_method=start_method, **kwargs)
    build.__name__ = f"torchstrategy_{kind}_{start_method}"
    return build


def register_into(registry, package, adapter_class):
    """Registers every available name into `registry` (the ``StrategyRegistry`` of
    `package`), each building an `adapter_class`. Idempotent per package."""
    with _lock:
        if package in _registered:
            return _registered[package]
        names = {}
        for name in available_names():
            _cls, kind, start_method, description = _NAMES[name]
            final = name if name not in registry else _COLLISION_PREFIX + name
            registry.register(final, _factory(adapter_class, kind, start_method),
                              description=description, override=True)
            names[name] = final
        _registered[package] = names
        return names
