"""Issue 19, items 2 and 10: a planted backup runs no code; a backup directory others can
write is refused; temporaries of a killed write are removed when the directory is opened."""
import os
import random

import numpy
import pytest
import torch

import torchstrategy as ts


class _Planted:
    """Unpickling this creates a file: what an attacker's backup.pt would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_planted_pickle_is_refused_and_runs_nothing(tmp_path):
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir(mode=0o700)
    marker = tmp_path / "pwned"
    torch.save({"epoch": 1, "step": 0, "global_step": 1, "objects": {"model": {}},
                "datasets": [], "rng": [], "x": _Planted(str(marker))},
               backup_dir / "backup.pt")
    backup = ts.BackupAndRestore(str(backup_dir))
    with pytest.raises(Exception, match="backup.pt") as caught:
        backup.track(model=_model())
    assert "delete it" in str(caught.value)
    assert not marker.exists(), "loading the backup ran the planted code"


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777], ids=["777", "775", "sticky-1777"])
def test_backup_directory_writable_by_others_is_refused(tmp_path, mode):
    backup_dir = tmp_path / "shared"
    backup_dir.mkdir()
    os.chmod(backup_dir, mode)
    with pytest.raises(PermissionError) as caught:
        ts.BackupAndRestore(str(backup_dir))
    message = str(caught.value)
    assert str(backup_dir) in message and "chmod go-w" in message


def test_backup_round_trip_with_numpy_state_loads_with_weights_only(tmp_path):
    model = _model()
    backup = ts.BackupAndRestore(str(tmp_path / "b"), save_freq=1)
    backup.track(model=model)
    numpy.random.seed(7)
    random.seed(7)
    backup.save()
    assert oct(os.stat(tmp_path / "b").st_mode & 0o777) == "0o700"
    expected = (numpy.random.rand(), random.random())
    numpy.random.seed(1)
    random.seed(1)
    restored = ts.BackupAndRestore(str(tmp_path / "b")).track(model=_model())
    assert restored.restored
    # The random state restored from the backup (loaded with weights_only=True).
    assert (numpy.random.rand(), random.random()) == expected
    torch.load(tmp_path / "b" / "backup.pt", weights_only=True)


def test_stale_temporaries_are_removed_when_the_directory_is_opened(tmp_path):
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir(mode=0o700)
    stale = backup_dir / ".tmp-abc123.pt"
    stale.write_bytes(b"half a backup")  # what a write killed midway leaves
    mine = backup_dir / "notes.txt"
    mine.write_text("the user's file")
    ts.BackupAndRestore(str(backup_dir))
    assert not stale.exists()
    assert mine.exists()
