"""The default strategy: what ``ts.get_strategy()`` returns outside any scope.

A pass-through with one replica: ``run`` calls the function, ``reduce`` returns the value
(reduced along `axis` if given), nothing is placed, launched or communicated. Code written
for a strategy therefore also runs without one.

Importing this module registers the default strategy with `torchstrategy.context`, which
itself knows no strategy class.
"""
from __future__ import annotations

import threading

import torch

from torchstrategy import context
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import NcclAllReduce
from torchstrategy.strategies.base import Strategy
from torchstrategy.strategies.data_parallel import DataParallelExtended
from torchstrategy.strategies.parameters import MirroredParameters


class _DefaultStrategy(Strategy):
    def __init__(self) -> None:
        communicator = Communicator(None, 0, 1, torch.device("cpu"), NcclAllReduce())
        super().__init__(DataParallelExtended(self, communicator, None, MirroredParameters(),
                                              place_in_scope=False))

    def __repr__(self) -> str:
        return "DefaultStrategy()"


class _DefaultStrategyHolder:
    """Makes the process-wide default strategy on first use (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._strategy: _DefaultStrategy | None = None

    def get(self) -> _DefaultStrategy:
        with self._lock:
            if self._strategy is None:
                self._strategy = _DefaultStrategy()
            return self._strategy


_holder = _DefaultStrategyHolder()


def default_strategy() -> Strategy:
    """The process-wide default strategy."""
    return _holder.get()


def is_default(strategy: Strategy) -> bool:
    """True for the default strategy (`default_strategy`'s)."""
    return isinstance(strategy, _DefaultStrategy)


context.register_default_strategy(default_strategy, is_default)
