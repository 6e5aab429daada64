"""Issue 36, item 2: a model built on meta whose initialisation leaves a buffer unset (a
Linear subclass with a rotary table computed in __init__, which Linear's
reset_parameters() does not recompute) is refused on every replica, naming the buffer;
before, the buffer held uninitialised memory, different on each replica, silently."""
import pytest
import torch
import torch.nn as nn

import torchstrategy as ts
from tests.helpers.replicas import from_every_replica, launch

pytestmark = pytest.mark.timeout(240)


class RotaryLinear(nn.Linear):
    """A Linear with a rotary table computed in __init__ only."""

    def __init__(self, width):
        super().__init__(width, width)
        angles = torch.arange(width // 2, dtype=torch.float32) / width
        self.register_buffer("cos_table", torch.cos(angles), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.cos_table.repeat(2)


class RotaryLinearReset(RotaryLinear):
    """The fix: reset_parameters() computes the table too."""

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "cos_table"):
            width = self.in_features
            self.cos_table.copy_(torch.cos(torch.arange(width // 2) / width))


def _built_on_meta(cls):
    strategy = ts.ShardedStrategy()
    try:
        with strategy.scope():
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(8, 8), cls(8))
    except ValueError as error:
        return from_every_replica(str(error))
    return from_every_replica(model[1].cos_table.tolist())


def test_a_buffer_the_initialisation_leaves_unset_is_refused_naming_it():
    messages = launch(_built_on_meta, RotaryLinear, n=2)
    assert messages[0] == messages[1]  # refused on every replica, the same words
    assert "RotaryLinear.reset_parameters(), which left '1.cos_table' of '1' " \
           "(RotaryLinear) unset" in messages[0], messages[0]
    assert "different on each replica" in messages[0]
    assert "computed there too" in messages[0]


def test_a_buffer_that_reset_parameters_sets_is_accepted():
    tables = launch(_built_on_meta, RotaryLinearReset, n=2)
    expected = torch.cos(torch.arange(4) / 8).tolist()
    assert tables == [expected, expected]
