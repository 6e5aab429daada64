"""Which strategy is active, and whether code runs in replica or cross-replica context.

The rules are TensorFlow's:

- Outside any ``strategy.scope()`` the *default strategy* is active and the code runs in
  its default replica context: ``get_strategy()`` returns the default strategy,
  ``has_strategy()`` is False, ``in_cross_replica_context()`` is False and
  ``get_replica_context()`` returns the default `ReplicaContext` (replica 0 of 1).
- Inside ``strategy.scope()`` (and inside ``merge_call``) the code runs in cross-replica
  context: ``get_replica_context()`` is None and ``in_cross_replica_context()`` is True.
- Inside ``strategy.run(fn)`` the code runs in a replica context of that strategy.

The state is per thread, so strategies that run replicas in threads see their own context.

This module knows no strategy class: the default strategy registers a factory for itself
(`register_default_strategy`) when its module is imported, and ``import torchstrategy``
imports it. The stacks below are the only state here; they are bookkeeping of which object
is active, not distributed state (that belongs to `torchstrategy.runtime`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Iterator

# A `Strategy` and a `ReplicaContext`, as the layers below the strategies name them: their
# classes live in higher layers (strategies/base.py, replica_context.py), which this module
# must not import.
AnyStrategy = Any
AnyReplicaContext = Any

# .stack: this thread's list of _Entry, bottom = the default; .set_scope: the scope that
# `experimental_set_strategy` entered in this thread and the stack's depth inside it.
_state = threading.local()


class _DefaultStrategyRegistry:
    """Where the default strategy's module leaves the factory that makes it (once)."""

    def __init__(self) -> None:
        self.factory: Callable[[], AnyStrategy] | None = None
        self.is_default: Callable[[AnyStrategy], bool] = lambda strategy: False


_registry = _DefaultStrategyRegistry()


def register_default_strategy(factory: Callable[[], AnyStrategy],
                              is_default: Callable[[AnyStrategy], bool]) -> None:
    """Called by `torchstrategy.strategies.default` at import: `factory()` returns the
    process-wide default strategy, `is_default(strategy)` tells it apart."""
    _registry.factory = factory
    _registry.is_default = is_default


def _default_strategy() -> AnyStrategy:
    if _registry.factory is None:
        raise RuntimeError("torchstrategy's default strategy is not registered: import "
                           "torchstrategy (not only torchstrategy.context).")
    return _registry.factory()


class _Entry:
    __slots__ = ("strategy", "replica_context")

    def __init__(self, strategy: AnyStrategy, replica_context: AnyReplicaContext | None
                 ) -> None:
        self.strategy = strategy
        self.replica_context = replica_context


def _stack() -> list[_Entry]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        strategy = _default_strategy()
        stack = [_Entry(strategy, strategy.extended.default_replica_context())]
        _state.stack = stack
    return stack


def _top() -> _Entry:
    return _stack()[-1]


@contextlib.contextmanager
def enter(strategy: AnyStrategy, replica_context: AnyReplicaContext | None
          ) -> Iterator[None]:
    """Pushes (strategy, replica_context or None for cross-replica) for this thread."""
    stack = _stack()
    stack.append(_Entry(strategy, replica_context))
    try:
        yield
    finally:
        stack.pop()


def get_strategy() -> AnyStrategy:
    """The strategy active in this thread: the innermost ``scope()`` or ``run``, else the
    default strategy. Never None."""
    return _top().strategy


def has_strategy() -> bool:
    """True when a strategy other than the default one is active."""
    return not _registry.is_default(_top().strategy)


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (or ``merge_call``) and outside ``strategy.run``."""
    return _top().replica_context is None


def get_replica_context() -> AnyReplicaContext | None:
    """The current `ReplicaContext`, or None in cross-replica context.

    Outside any strategy this is the default strategy's replica context (replica 0 of 1),
    so code written for replica context also runs without a strategy.
    """
    return _top().replica_context


def get_cross_replica_context() -> AnyStrategy | None:
    """The active strategy when in cross-replica context, else None."""
    top = _top()
    return top.strategy if top.replica_context is None else None


def in_run() -> bool:
    """True when some ``strategy.run`` (not the default replica context) is executing."""
    for entry in _stack()[1:]:
        if entry.replica_context is not None:
            return True
    return False


def active_non_default_strategy() -> AnyStrategy | None:
    """The innermost non-default strategy active in this thread, or None."""
    for entry in reversed(_stack()):
        if not _registry.is_default(entry.strategy):
            return entry.strategy
    return None


def experimental_set_strategy(strategy: AnyStrategy | None) -> None:
    """Makes `strategy` this thread's current strategy as if its ``scope()`` were entered
    and never exited (tf.distribute.experimental_set_strategy); None leaves the scope it
    entered, back to the default strategy. Setting another strategy first leaves the
    previous one's scope. As TensorFlow's, the state is per thread (a replica thread or a
    new thread starts with the default strategy).

    Raises:
      RuntimeError: called inside a ``strategy.scope()`` or ``strategy.run`` (other than
        the scope this function entered), as TensorFlow refuses it.
    """
    if strategy is not None and not callable(getattr(strategy, "scope", None)):
        raise TypeError(f"experimental_set_strategy needs a ts.Strategy or None, got "
                        f"{strategy!r:.80}.")
    held: tuple[ContextManager[Any], int] | None = getattr(_state, "set_scope", None)
    if held is not None and len(_stack()) != held[1]:
        raise RuntimeError("experimental_set_strategy must not be called inside a strategy's "
                           "scope() or run (as in TensorFlow): leave the `with` block first.")
    if held is not None:
        _state.set_scope = None
        held[0].__exit__(None, None, None)
    if has_strategy() or in_run():
        raise RuntimeError("experimental_set_strategy must not be called inside a strategy's "
                           "scope() or run (as in TensorFlow): leave the `with` block first.")
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _state.set_scope = (scope, len(_stack()))
