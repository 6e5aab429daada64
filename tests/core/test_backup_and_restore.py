"""ts.BackupAndRestore: a training loop interrupted at any step and run again from the top
ends with exactly the parameters of an uninterrupted run (model, optimizer, data position,
shuffling and dropout randomness restored), alone and over two replicas."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import assert_same_tensors, launch

EPOCHS, BATCH, EXAMPLES = 3, 8, 40   # 5 steps per epoch, 15 in all


class Preempted(Exception):
    """Stands for the machine going away at a given step."""


def _train(backup_dir, save_freq, stop_at=None, seed=0, strategy=None):
    """Trains with a BackupAndRestore; raises Preempted before global step `stop_at`.
    `seed` seeds torch before anything: a resumed run uses another one on purpose."""
    torch.manual_seed(seed)
    strategy = strategy or ts.get_strategy()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Dropout(0.25), nn.Linear(12, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(EXAMPLES, 5, generator=g),
                                          torch.randint(0, 3, (EXAMPLES,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    dist_data = strategy.experimental_distribute_dataset(loader)

    def step(batch):
        x, y = batch
        loss = ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                       global_batch_size=BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    backup = ts.BackupAndRestore(backup_dir, save_freq=save_freq)
    backup.track(model=model, optimizer=optimizer)
    seen = []
    for epoch in backup.epochs(EPOCHS):
        for step_in_epoch, batch in backup.steps(dist_data):
            if backup.global_step == stop_at:
                raise Preempted(f"at step {stop_at}")
            seen.append((epoch, step_in_epoch))
            strategy.run(step, args=(batch,))
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "seen": seen, "restored": backup.restored,
            "backup_left": os.path.exists(backup.path)}


@pytest.mark.parametrize("save_freq,stop_at", [(3, 8), (1, 14), ("epoch", 7), (5, 10)])
def test_an_interrupted_loop_resumes_exactly(tmp_path, save_freq, stop_at):
    reference = _train(tmp_path / "reference", save_freq)
    assert not reference["restored"] and not reference["backup_left"]
    with pytest.raises(Preempted):
        _train(tmp_path / "backup", save_freq, stop_at=stop_at)
    resumed = _train(tmp_path / "backup", save_freq, seed=123)
    assert resumed["restored"]
    # It ran the steps after the last backup, not from the start.
    last_backup = stop_at // save_freq * save_freq if save_freq != "epoch" else \
        stop_at // 5 * 5
    assert len(resumed["seen"]) == EPOCHS * 5 - last_backup
    assert reference["seen"][last_backup:] == resumed["seen"]
    assert_same_tensors(resumed["final"], reference["final"], atol=0, rtol=0)
    assert not resumed["backup_left"]  # delete_checkpoint=True: the next run starts afresh
    assert not os.path.exists(tmp_path / "backup")


def _replicas_train(backup_dir, stop_at, seed):
    strategy = ts.MirroredStrategy()
    try:
        return _train(backup_dir, 4, stop_at=stop_at, seed=seed + strategy.extended.replica_id,
                      strategy=strategy)
    except Preempted:
        return "preempted"


def test_two_replicas_resume_exactly(tmp_path):
    reference = launch(_replicas_train, str(tmp_path / "reference"), None, 0, n=2)
    assert launch(_replicas_train, str(tmp_path / "backup"), 10, 0, n=2) == "preempted"
    assert os.listdir(tmp_path / "backup") == ["backup.pt"]  # only the chief's file
    resumed = launch(_replicas_train, str(tmp_path / "backup"), None, 77, n=2)
    assert resumed["restored"] and len(resumed["seen"]) == 15 - 8
    assert_same_tensors(resumed["final"], reference["final"], atol=1e-6, rtol=0)


def test_a_failed_write_leaves_the_previous_backup_intact(tmp_path, monkeypatch):
    model = nn.Linear(2, 1)
    backup = ts.BackupAndRestore(tmp_path, save_freq=1).track(model=model)
    backup.save()
    before = torch.load(backup.path, weights_only=False)["objects"]["model"]
    with torch.no_grad():
        model.weight.add_(1.0)

    def fail(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        backup.save()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["backup.pt"]  # no temporary file left behind
    after = torch.load(backup.path, weights_only=False)["objects"]["model"]
    assert_same_tensors(after, before)


def test_delete_checkpoint_false_keeps_the_backup(tmp_path):
    model = nn.Linear(2, 1)
    backup = ts.BackupAndRestore(tmp_path / "b", save_freq="epoch", delete_checkpoint=False)
    backup.track(model=model)
    for _ in backup.epochs(2):
        pass
    assert os.path.exists(backup.path)
    again = ts.BackupAndRestore(tmp_path / "b").track(model=nn.Linear(2, 1))
    assert again.restored and again.epoch == 2
    assert list(again.epochs(2)) == []  # nothing left to run


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number of "
                                         "steps, got 0"):
        ts.BackupAndRestore(tmp_path, save_freq=0)
    with pytest.raises(TypeError, match=r"BackupAndRestore.track: rate=0.1 has no "
                                        r"state_dict\(\)/load_state_dict\(\)"):
        ts.BackupAndRestore(tmp_path).track(rate=0.1)
    ts.BackupAndRestore(tmp_path, save_freq=1).track(model=nn.Linear(2, 1)).save()
    with pytest.raises(KeyError, match=r"has no state for \['net'\] \(it holds \['model'\]\)"):
        ts.BackupAndRestore(tmp_path).track(net=nn.Linear(2, 1))
