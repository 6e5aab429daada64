"""Registering torchstrategy's strategies under names in Lightning's strategy registry.

``Trainer(strategy="mirrored")`` needs the name in the registry of the Lightning package in
use before the Trainer is built, whichever of ``torchstrategy`` and Lightning the program
imports first, while ``import torchstrategy`` alone must not import Lightning (it is
heavy and optional). So:

- if a Lightning package's strategy registry is already imported, `install` registers
  into it at once;
- otherwise `install` puts a small finder on ``sys.meta_path`` that lets Python import
  ``lightning.pytorch.strategies`` / ``pytorch_lightning.strategies`` as usual and
  registers right after the module has run.

Registration only records names and a factory; the adapter class (and with it the rest of
Lightning) is built when a Trainer asks for one of the names.
"""
import importlib.abc
import importlib.util
import sys
import threading

# registry module -> package whose Trainer reads it
_REGISTRY_MODULES = {
    "lightning.pytorch.strategies": "lightning.pytorch",
    "pytorch_lightning.strategies": "pytorch_lightning",
}

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
    """Our names whose torchstrategy strategy exists in this installation."""
    import torchstrategy

    return [name for name, (cls, *_rest) in _NAMES.items() if hasattr(torchstrategy, cls)]


def registered_names(package=None):
    """{our name: the name registered in `package`'s registry} (a name Lightning already
    uses gets the prefix "ts_"). `package` None: the first package registered into."""
    with _lock:
        if package is None:
            package = next(iter(_registered), None)
        return dict(_registered.get(package, {}))


def _factory(package, kind, start_method):
    def build(**kwargs):
        from torchstrategy.lightning import strategy_class

        return strategy_class(package)(None, kind=kind, start_method=start_method, **kwargs)
    build.__name__ = f"torchstrategy_{kind}_{start_method}"
    return build


def register_into(registry, package):
    """Registers every available name into `registry` (a Lightning ``StrategyRegistry``)."""
    with _lock:
        if package in _registered:
            return _registered[package]
        names = {}
        for name in available_names():
            _cls, kind, start_method, description = _NAMES[name]
            final = name if name not in registry else _COLLISION_PREFIX + name
            registry.register(final, _factory(package, kind, start_method),
                              description=description, override=True)
            names[name] = final
        _registered[package] = names
        return names


def _register_module(module_name):
    module = sys.modules.get(module_name)
    registry = getattr(module, "StrategyRegistry", None)
    if registry is not None:
        register_into(registry, _REGISTRY_MODULES[module_name])


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a Lightning strategy-registry module it asks the other
    finders for the real spec and wraps its loader, so that registration runs right after
    the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _REGISTRY_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader, fullname)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader, fullname):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_module(self._fullname)

    def __getattr__(self, name):  # is_package, get_code, get_source, ...
        return getattr(self._loader, name)


_finder = None


def install():
    """Registers into the Lightning registries already imported and arranges registration
    for those imported later. Idempotent; imports nothing from Lightning."""
    global _finder
    for module_name in _REGISTRY_MODULES:
        if module_name in sys.modules:
            _register_module(module_name)
    if _finder is None:
        _finder = _RegisterAfterImport()
        sys.meta_path.insert(0, _finder)
