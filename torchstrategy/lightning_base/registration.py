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
asks for the name. The names are `torchstrategy.strategies.registry`'s. This module
imports no Lightning.
"""
import importlib
import sys
from typing import Any, Callable

from torchstrategy.strategies import registry as strategy_registry

# name -> (torchstrategy class it builds, kind, start method, description): a view of
# `torchstrategy.strategies.registry`, which holds the names.
_NAMES = {entry.name: (entry.strategy.class_name, entry.strategy.kind, entry.start_method,
                       entry.description)
          for entry in strategy_registry.NAMES}
# Prefix for a name Lightning already uses for one of its own strategies.
_COLLISION_PREFIX = "ts_"
# The Lightning packages, in the order `registered_names()` looks at them.
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def available_names() -> list[str]:
    """Our names (every strategy they name is in this package)."""
    return list(_NAMES)


def _ours(registry: Any, final: str, name: str) -> bool:
    """True when `final` in `registry` is our registration of `name` (recognised by its
    description: Lightning's registry records it with the factory)."""
    return final in registry and registry[final]["description"] == _NAMES[name][3]


def _names_in(registry: Any) -> dict[str, str]:
    """{our name: the name it is registered under in `registry`}, read from the registry."""
    return {name: final for name in _NAMES
            for final in (name, _COLLISION_PREFIX + name) if _ours(registry, final, name)}


def registered_names(package: str | None = None) -> dict[str, str]:
    """{our name: the name registered in `package`'s registry} (a name Lightning already
    uses gets the prefix "ts_"). `package` None: the first Lightning package imported
    (``lightning.pytorch`` before ``pytorch_lightning``); {} when none is."""
    if package is None:
        package = next((p for p in _PACKAGES if p in sys.modules), None)
        if package is None:
            return {}
    # Lightning is optional: its registry is read only when asked for (never at import).
    return _names_in(importlib.import_module(f"{package}.strategies").StrategyRegistry)


def _factory(adapter_class: type, kind: str, start_method: str) -> Callable[..., Any]:
    def build(**kwargs: Any) -> Any:
        return adapter_class(None, kind=kind, start_method=start_method, **kwargs)
    build.__name__ = f"torchstrategy_{kind}_{start_method}"
    return build


def register_into(registry: Any, adapter_class: type) -> dict[str, str]:
    """Registers every available name into `registry` (a Lightning ``StrategyRegistry``),
    each building an `adapter_class`; returns {our name: registered name}. Idempotent: what
    is already there is recognised in the registry itself."""
    names = _names_in(registry)
    for name in available_names():
        if name in names:
            continue
        _cls, kind, start_method, description = _NAMES[name]
        final = name if name not in registry else _COLLISION_PREFIX + name
        registry.register(final, _factory(adapter_class, kind, start_method),
                          description=description, override=True)
        names[name] = final
    return names
