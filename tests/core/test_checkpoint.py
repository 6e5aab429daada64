"""Checkpoints: replica 0 writes atomically, every replica loads, and state_dicts move
between a strategy and plain PyTorch unchanged (nothing is wrapped)."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import assert_same_tensors, detached_state, from_every_replica, launch


def make_model():
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def batch(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randint(0, 2, (6,), generator=g)


def _checkpoint_replicas(directory, plain_path):
    strategy = ts.MirroredStrategy()
    r = strategy.extended.replica_id
    n = strategy.num_replicas_in_sync
    torch.manual_seed(r)
    with strategy.scope():
        model = make_model()

    def step(x, y):
        loss = ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                       global_batch_size=6 * n)
        loss.backward()
        with torch.no_grad():  # plain SGD (torch.optim's first use costs a second to import)
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None

    for s in range(3):
        strategy.run(step, args=batch(r, s))

    # Count the writes of this replica.
    writes = []
    original_save = torch.save

    def counting_save(obj, f, *args, **kwargs):
        writes.append(1)
        return original_save(obj, f, *args, **kwargs)

    torch.save = counting_save
    path = os.path.join(directory, "nested", "model.pt")
    try:
        with strategy.scope():
            ts.checkpoint.save({"in_scope": torch.ones(1)}, path)
        ts.checkpoint.save(model.state_dict(), path)  # outside the scope (the usual place)
    finally:
        torch.save = original_save
    # save ends with a barrier: the file is complete on every replica when it returns.
    listing = sorted(os.listdir(os.path.dirname(path)))
    loaded = ts.checkpoint.load(path)
    res = {"writes": len(writes), "listing": listing, "trained": detached_state(model),
           "loaded": {k: v.clone() for k, v in loaded.items()},
           "loaded_device": {str(v.device) for v in loaded.values()}}

    # A plain (no-strategy) checkpoint loads into the strategy's model on every replica,
    # and training goes on in sync.
    model.load_state_dict(ts.checkpoint.load(plain_path))
    res["after_plain_load"] = detached_state(model)
    strategy.run(step, args=batch(r, 9))
    res["after_step"] = detached_state(model)
    return from_every_replica(res)


def test_checkpoints_move_between_strategy_and_plain_pytorch(tmp_path):
    torch.manual_seed(123)
    plain = make_model()
    with torch.no_grad():
        plain[1].running_mean.fill_(0.5)
        plain[1].num_batches_tracked.fill_(7)
    plain_path = tmp_path / "plain.pt"
    torch.save(plain.state_dict(), plain_path)
    plain_state = detached_state(plain)

    per_replica = launch(_checkpoint_replicas, str(tmp_path), str(plain_path), n=2)

    assert [res["writes"] for res in per_replica] == [2, 0]  # replica 0 writes, alone
    for res in per_replica:
        assert res["listing"] == ["model.pt"]  # no temporary file left behind
        assert res["loaded_device"] == {"cpu"}
        assert_same_tensors(res["loaded"], per_replica[0]["trained"])
        assert_same_tensors(res["trained"], per_replica[0]["trained"])
        assert_same_tensors(res["after_plain_load"], plain_state)
        assert_same_tensors(res["after_step"], per_replica[0]["after_step"])
    assert not torch.equal(per_replica[0]["after_step"]["0.weight"], plain_state["0.weight"])

    # The checkpoint written under MirroredStrategy loads into a model built without one:
    # same keys, same values.
    state = torch.load(tmp_path / "nested" / "model.pt", weights_only=True)
    fresh = make_model()
    assert list(state) == list(fresh.state_dict())
    fresh.load_state_dict(state, strict=True)
    assert_same_tensors(detached_state(fresh), per_replica[0]["trained"])
    assert fresh[1].num_batches_tracked.item() == 3


def test_save_and_load_without_strategy(tmp_path):
    model = make_model()
    path = tmp_path / "a" / "b.pt"
    ts.checkpoint.save({"model": model.state_dict(), "step": 5}, path)
    assert sorted(os.listdir(tmp_path / "a")) == ["b.pt"]
    loaded = ts.checkpoint.load(path)
    assert loaded["step"] == 5
    assert_same_tensors(loaded["model"], detached_state(model))
    with ts.OneDeviceStrategy("cpu").scope():
        again = ts.checkpoint.load(str(path), map_location="cpu")
    assert_same_tensors(again["model"], detached_state(model))


def test_load_of_a_missing_checkpoint(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="No checkpoint at .*nope.pt"):
        ts.checkpoint.load(missing)


def _checkpoints_of_a_model_built_in_a_mirrored_scope(directory):
    from torchstrategy import checkpoint

    strategy = ts.MirroredStrategy()
    with strategy.scope():
        model = make_model()
    other = ts.OneDeviceStrategy("cpu")
    with other.scope():      # the scope entered last is now another strategy's
        in_other_scope = checkpoint.owning_extended(model) is strategy.extended
        backup = ts.BackupAndRestore(directory).track(model=model)
        backup.save()
    outside = checkpoint.owning_extended(model) is strategy.extended
    saved = torch.load(backup.path, weights_only=False)
    return from_every_replica({"in_other_scope": in_other_scope, "outside": outside,
                               "replicas": saved["num_replicas"]})


def test_a_model_built_in_a_mirrored_scope_is_checkpointed_through_its_strategy(tmp_path):
    # The module carries its owner (as an adopted one does): inside another strategy's
    # scope, and outside every scope after that one, its backup is taken by the two
    # replicas of the MirroredStrategy that built it (chief writes, world of 2), not by the
    # one-replica strategy entered last (each replica its own chief, a world of 1).
    per_replica = launch(_checkpoints_of_a_model_built_in_a_mirrored_scope,
                         str(tmp_path / "backup"), n=2)
    for res in per_replica:
        assert res == {"in_other_scope": True, "outside": True, "replicas": 2}
