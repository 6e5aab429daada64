"""Distributed input: the split, sampler-level sharding, uneven batches, shuffling."""
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchstrategy as ts
from torchstrategy.input.distributed_dataset import split_bounds

TIMEOUT = 60


class RecordingDataset(Dataset):
    """Map-style dataset that records which indices this process loaded."""

    def __init__(self, n):
        self.n = n
        self.loaded = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return {"x": torch.tensor([float(i), 2.0 * i]), "y": torch.tensor(i)}


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32).reshape(-1, 1))


def local(strategy, value):
    (v,) = strategy.experimental_local_results(value)
    return v


def _split_of_list(num_replicas):
    strategy = ts.MirroredStrategy()
    batches = [torch.arange(4), torch.arange(4, 7)]
    out = [local(strategy, b).tolist() for b in strategy.experimental_distribute_dataset(batches)]
    return strategy.gather(torch.tensor([len(out)]), axis=0).tolist(), out, \
        [strategy.gather(local(strategy, b), axis=0).tolist()
         for b in strategy.experimental_distribute_dataset(batches)]


def test_split_follows_tf_distribute():
    assert split_bounds(4, 2, 0) == (0, 2) and split_bounds(4, 2, 1) == (2, 2)
    assert [split_bounds(3, 4, r)[1] for r in range(4)] == [1, 1, 1, 0]
    assert [split_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    steps, mine, gathered = ts.launch(_split_of_list, 2, num_replicas=2, timeout_seconds=TIMEOUT)
    assert steps == [2, 2]
    assert mine == [[0, 1], [4, 5]]          # replica 0 takes the first slice
    assert gathered == [[0, 1, 2, 3], [4, 5, 6]]  # nothing dropped or repeated


def _sharded_loader_epochs(num_workers):
    strategy = ts.MirroredStrategy()
    torch.manual_seed(1234 + strategy.extended.replica_id)  # seeds differ: the broadcast fixes
    dataset = RecordingDataset(22)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=num_workers)
    dist = strategy.experimental_distribute_dataset(loader)
    epochs = []
    for _ in range(2):
        steps = []
        for batch in dist:
            x, y = local(strategy, batch["x"]), local(strategy, batch["y"])
            assert x.shape[1:] == (2,) and x.dtype == torch.float32
            assert torch.equal(x[:, 0].long(), y)
            steps.append(strategy.gather(y, axis=0).tolist())
        epochs.append(steps)
    counts = strategy.gather(torch.tensor([len(dataset.loaded)]), axis=0).tolist()
    return epochs, counts, len(dist)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_is_sharded_at_the_sampler_and_shuffled_identically(num_workers):
    epochs, counts, steps = ts.launch(_sharded_loader_epochs, num_workers, num_replicas=2,
                                      timeout_seconds=TIMEOUT)
    assert steps == 3
    for steps_of_epoch in epochs:
        assert [len(s) for s in steps_of_epoch] == [8, 8, 6]
        flat = [i for s in steps_of_epoch for i in s]
        assert sorted(flat) == list(range(22))  # every sample exactly once
    assert epochs[0] != epochs[1]               # a new order each epoch
    if num_workers == 0:
        # Each process loaded only its own slices: 11 of the 22 samples per epoch.
        assert counts == [22, 22]


def _uneven_last_batch():
    strategy = ts.MirroredStrategy()
    rid = strategy.extended.replica_id
    loader = DataLoader(TensorDataset(torch.arange(10.0).reshape(10, 1), torch.arange(10)),
                        batch_size=4)
    shapes = []
    for x, y in strategy.experimental_distribute_dataset(loader):
        x, y = local(strategy, x), local(strategy, y)
        shapes.append((tuple(x.shape), x.dtype, tuple(y.shape), y.dtype))
    stream = [tuple(local(strategy, b).shape)
              for b in strategy.experimental_distribute_dataset(
                  DataLoader(Stream(10), batch_size=4))]
    return rid, shapes, stream


def test_uneven_last_batch_gives_every_replica_the_same_number_of_steps():
    # 10 samples in batches of 4 over 4 replicas: the last global batch has 2 rows.
    result = ts.launch(_uneven_all_replicas, num_replicas=4, timeout_seconds=TIMEOUT)
    for rid, shapes, stream in result:
        assert len(shapes) == 3 and len(stream) == 3
        expected_last = 1 if rid < 2 else 0
        assert shapes[0][0] == (1, 1) and shapes[2][0] == (expected_last, 1)
        assert shapes[2][1] == torch.float32 and shapes[2][3] == torch.int64
        assert stream[2] == (expected_last, 1)


def _uneven_all_replicas():
    strategy = ts.MirroredStrategy()
    mine = _uneven_last_batch()
    # Everyone's result travels back through replica 0.
    import pickle
    blob = torch.tensor(list(pickle.dumps(mine)), dtype=torch.uint8)
    gathered = strategy.extended.communicator.all_gather([blob], axis=0)[0]
    sizes = strategy.gather(torch.tensor([blob.numel()]), axis=0).tolist()
    out, start = [], 0
    for size in sizes:
        out.append(pickle.loads(bytes(gathered[start:start + size].tolist())))
        start += size
    return out


def _from_function():
    strategy = ts.MirroredStrategy()

    def dataset_fn(ctx):
        assert ctx.num_replicas_in_sync == 2
        data = TensorDataset(torch.arange(8.0))
        sampler = DistributedSampler(data, num_replicas=ctx.num_input_pipelines,
                                     rank=ctx.input_pipeline_id, shuffle=False)
        return DataLoader(data, batch_size=ctx.get_per_replica_batch_size(4), sampler=sampler)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([ctx.replica_id_in_sync_group * 10.0]))
    return ([local(strategy, b[0]).tolist() for b in dist], len(dist),
            strategy.gather(values, axis=0).tolist())


def test_distribute_datasets_from_function_and_values_from_function():
    batches, steps, values = ts.launch(_from_function, num_replicas=2, timeout_seconds=TIMEOUT)
    assert steps == 2
    assert batches == [[0.0, 2.0], [4.0, 6.0]]  # DistributedSampler's rank-0 share
    assert values == [0.0, 10.0]


def _already_sharded():
    strategy = ts.MirroredStrategy()
    data = TensorDataset(torch.arange(8.0))
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    strategy.experimental_distribute_dataset(loader)


def test_a_loader_already_sharded_is_a_clear_error():
    with pytest.raises(ValueError, match="DistributedSampler"):
        ts.launch(_already_sharded, num_replicas=2, timeout_seconds=TIMEOUT)


def test_input_context_per_replica_batch_size():
    ctx = ts.InputContext(num_input_pipelines=4, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="divisible"):
        ctx.get_per_replica_batch_size(10)


def test_single_replica_strategies_pass_batches_through():
    strategy = ts.OneDeviceStrategy("cpu")
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=4)
    batches = [b[0].tolist() for b in strategy.experimental_distribute_dataset(loader)]
    assert batches == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]


def _train_uneven(num_steps_seen):
    strategy = ts.MirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(13, 3, generator=g), torch.randn(13, 1, generator=g))
    loader = DataLoader(data, batch_size=4)   # batches of 4, 4, 4, 1

    def step(x, y):
        per_example = ((model(x) - y) ** 2).squeeze(1)
        loss = ts.compute_average_loss(per_example)   # global batch size found by all-reduce
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for epoch in range(2):
        for x, y in strategy.experimental_distribute_dataset(loader):
            strategy.run(step, args=(x, y))
    return [p.detach() for p in model.parameters()]


def test_training_on_uneven_batches_matches_single_device():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(13, 3, generator=g), torch.randn(13, 1, generator=g))
    for epoch in range(2):
        for x, y in DataLoader(data, batch_size=4):
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = [p.detach() for p in model.parameters()]
    got = ts.launch(_train_uneven, 0, num_replicas=4, timeout_seconds=TIMEOUT)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
