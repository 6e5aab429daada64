"""Issue 36, item 4: PowerSGD with a rank that compresses no gradient of the model says so,
once; before, PowerSGD(rank=10**9) silently sent everything uncompressed."""
import warnings

import torch

import torchstrategy as ts
from tests.helpers.replicas import launch


def _train(rank):
    strategy = ts.MirroredStrategy(
        cross_device_ops=ts.NcclAllReduce(compression=ts.PowerSGD(rank=rank)))
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            strategy.run(lambda: model(torch.ones(4, 16)).sum().backward())
    return [str(w.message) for w in caught if "compresses none" in str(w.message)]


def test_a_rank_that_compresses_nothing_is_said_once():
    said = launch(_train, 10**9, n=2)
    assert len(said) == 1, said
    assert "PowerSGD(rank=1000000000" in said[0] and "every gradient went uncompressed" \
        in said[0] and "smaller rank" in said[0]
    assert launch(_train, 2, n=2) == []   # rank 2 compresses both matrices: nothing said
