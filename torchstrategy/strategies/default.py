"""The default strategy: what ``ts.get_strategy()`` returns outside any scope.

A pass-through with one replica: ``run`` calls the function, ``reduce`` returns the value
(reduced along `axis` if given), nothing is placed, launched or communicated. Code written
for a strategy therefore also runs without one.
"""
import threading

from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import NcclAllReduce
from torchstrategy.strategies.base import Strategy, StrategyExtended

_lock = threading.Lock()
_default = None


class _DefaultStrategy(Strategy):
    def __init__(self):
        import torch

        communicator = Communicator(None, 0, 1, torch.device("cpu"), NcclAllReduce())
        super().__init__(StrategyExtended(self, communicator, None, place_in_scope=False))

    def __repr__(self):
        return "DefaultStrategy()"


def default_strategy():
    """The process-wide default strategy."""
    global _default
    with _lock:
        if _default is None:
            _default = _DefaultStrategy()
    return _default


def is_default(strategy):
    return isinstance(strategy, _DefaultStrategy)
