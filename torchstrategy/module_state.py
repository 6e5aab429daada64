"""torchstrategy's state on the objects it is applied to, instead of tables keyed by ``id()``.

Modules. As torch's composable APIs do (``torch.distributed._composable.contract``,
``fully_shard``), what a strategy keeps about a user's module lives in that module's
``__dict__``, under one private key (`STATE_KEY`): a `ModuleState` naming the strategy's
extended that owns the module (weakly: the state does not keep a strategy alive, though
hooks the strategy registers on the module may) and what that strategy recorded about it. The module stays the user's object: its parameters,
buffers, submodules, ``state_dict()`` keys and ``repr`` are unchanged. A copy of the module
(``copy.deepcopy``, ``pickle``, ``torch.save`` of the whole model) holds new tensors the
strategy never saw, so it is not under the strategy: the copy carries None in place of the
state, made by a builtin, so loading the pickle does not need torchstrategy. A state whose strategy is gone
is removed, with the hooks it registered, the next time it is looked up.

Tensors and optimizers. A table keyed by ``id(obj)`` that outlives `obj` is a bug: a new
object can get the dead one's id and be mistaken for it. Tables here either keep their keys
alive (`IdentityMap`, for tensors a strategy holds anyway, such as the parameters it
mirrors) or hold them weakly (``torch.utils.weak.WeakIdKeyDictionary``). Neither hashes or
compares its keys (a tensor's ``==`` compares elements, and a subclass may redefine
``__hash__``). A weak
reference to a tensor that is still a module's parameter is avoided: ``swap_tensors``
(which ``module.to()`` uses on DTensor parameters, or everywhere once
``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses such tensors.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

#: The key of a module's `ModuleState` in its ``__dict__``.
STATE_KEY = "_torchstrategy_state"

K = TypeVar("K")
V = TypeVar("V")


class ModuleState:
    """What the strategy that owns a module keeps about it.

    Attributes:
      adopted: the module was brought under its owner by ``strategy.adopt`` (Parameters,
        buffers and submodules registered on it later are recorded as they appear).
      parent: a weak reference to the module it was attached to inside the owner's scope
        (ShardedStrategy finds each model's root through it), or None.
      hooks: handles of the hooks the owner registered on the module (removed with the
        state).
    """

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)
        self.adopted = False
        self.parent: weakref.ReferenceType[torch.nn.Module] | None = None
        self.hooks: list[RemovableHandle] = []

    @property
    def owner(self) -> Any:
        """The owning strategy's extended, or None once it is gone."""
        return self._owner()

    def parent_module(self) -> torch.nn.Module | None:
        """The module this one was attached to in scope, if it is still alive."""
        return None if self.parent is None else self.parent()

    def remove_hooks(self) -> None:
        """Removes the hooks the owner registered on the module."""
        hooks, self.hooks = self.hooks, []
        for handle in hooks:
            handle.remove()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A copy of the module is not under the strategy (its tensors are new): it gets None
        # in place of this state, built by a builtin (``dict.get({}, key)``) so that loading
        # a pickled model needs no torchstrategy.
        return (dict.get, ({}, STATE_KEY))

    def __repr__(self) -> str:
        owner = self.owner
        return (f"ModuleState(owner={type(owner).__name__ if owner is not None else None}, "
                f"adopted={self.adopted})")


def state_of(module: torch.nn.Module, owner: object = None) -> ModuleState | None:
    """The live `ModuleState` of `module` (of `owner`'s, when given), or None.

    A state whose owner is gone is removed from the module, with its hooks; one of another
    owner than `owner` is left as it is. Costs one dict lookup for a module without state.
    """
    state = module.__dict__.get(STATE_KEY)
    if state is None:
        return None
    live = state.owner if isinstance(state, ModuleState) else None
    if live is None:
        _drop(module, state)
        return None
    if owner is not None and live is not owner:
        return None
    return state


def attach(module: torch.nn.Module, owner: object) -> ModuleState:
    """`module`'s state owned by `owner`, made and stored on the module if it has none.

    A module belongs to one strategy at a time: a state of another (live) owner is replaced,
    and the hooks that owner registered are removed.
    """
    state = state_of(module)
    if state is not None and state.owner is owner:
        return state
    if state is not None:
        state.remove_hooks()
    state = ModuleState(owner)
    module.__dict__[STATE_KEY] = state
    return state


def detach(module: torch.nn.Module, owner: object) -> None:
    """Removes `owner`'s state from `module` (and the hooks it registered); nothing
    happens when the module has no state of `owner`'s."""
    state = state_of(module, owner)
    if state is not None:
        _drop(module, state)


def _drop(module: torch.nn.Module, state: Any) -> None:
    if isinstance(state, ModuleState):
        state.remove_hooks()
    if module.__dict__.get(STATE_KEY) is state:
        del module.__dict__[STATE_KEY]


class IdentityMap(Generic[K, V]):
    """A mapping keyed by the identity of its keys, which it keeps alive.

    An entry holds its key, so no other object can get the key's id while the entry exists:
    the flaw of a table keyed by ``id()`` that outlives its keys cannot arise. Neither
    ``__hash__`` nor ``__eq__`` of a key is called (a tensor's ``==`` compares elements, and
    a tensor subclass may redefine both). Iteration follows insertion order.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[K, V]] = {}

    def __setitem__(self, key: K, value: V) -> None:
        self._entries[id(key)] = (key, value)

    def __getitem__(self, key: K) -> V:
        entry = self._entries.get(id(key))
        if entry is None:
            raise KeyError(key)
        return entry[1]

    def get(self, key: object, default: Any = None) -> Any:
        """The value of `key`, or `default`."""
        entry = self._entries.get(id(key))
        return default if entry is None else entry[1]

    def __contains__(self, key: object) -> bool:
        return id(key) in self._entries

    def pop(self, key: K, default: Any = None) -> Any:
        """Removes `key`; returns its value, or `default` when it was absent."""
        entry = self._entries.pop(id(key), None)
        return default if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return (key for key, _ in list(self._entries.values()))

    def keys(self) -> list[K]:
        """The keys, in insertion order."""
        return [key for key, _ in self._entries.values()]

    def items(self) -> list[tuple[K, V]]:
        """(key, value) pairs, in insertion order."""
        return list(self._entries.values())
