"""BackupAndRestoreCallback: a Lightning fit that fails, run again, ends where an
uninterrupted fit ends.

Each run is `python tests/scripts/lightning_backup.py ...` on 2 CPU replicas
(Trainer(strategy="mirrored")), a subprocess with a timeout. Its training step draws random
numbers and an LR scheduler steps, so equality needs model, optimizer, scheduler, loop
position and every replica's generators restored. 4 steps per epoch, 3 epochs.
"""
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.lightning_runs import ROOT, SUBPROCESS_TIMEOUT_SECONDS, clean_env

pytestmark = pytest.mark.lightning

SCRIPT = os.path.join(ROOT, "tests", "scripts", "lightning_backup.py")


def _run(out_dir, *argv):
    return subprocess.run([sys.executable, SCRIPT, "--out", str(out_dir), *argv], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_SECONDS)


def _ok(result):
    assert result.returncode == 0, (f"exited with {result.returncode}\n--- stdout ---\n"
                                    f"{result.stdout[-3000:]}\n--- stderr ---\n"
                                    f"{result.stderr[-5000:]}")


def _result(out_dir):
    return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A fit that never stops, backing up every 4 steps, keeping its backup."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _ok(_run(out, "--save-freq", "4", "--keep"))
    return out


def test_kept_backup_is_the_end_of_training(uninterrupted):
    result = _result(uninterrupted)
    assert result["global_step"] == 12 and not result["restored"]
    backup = torch.load(os.path.join(uninterrupted, "backup", "backup.ckpt"),
                        weights_only=False)
    assert backup["global_step"] == 12
    assert os.listdir(os.path.join(uninterrupted, "backup")) == ["backup.ckpt"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save_freq, fail_at, backup_step", [("epoch", 6, 4), ("4", 11, 8)])
def test_failed_fit_run_again_matches_uninterrupted(uninterrupted, tmp_path, save_freq,
                                                    fail_at, backup_step):
    command = ("--save-freq", save_freq, "--fail-at-step", str(fail_at))
    failed = _run(tmp_path, *command)
    assert failed.returncode != 0
    assert f"injected failure at step {fail_at}" in failed.stderr
    backup = torch.load(os.path.join(tmp_path, "backup", "backup.ckpt"), weights_only=False)
    assert backup["global_step"] == backup_step
    assert not [name for name in os.listdir(tmp_path / "backup") if name != "backup.ckpt"]

    _ok(_run(tmp_path, *command))  # the same command again: resumes from the backup
    resumed, reference = _result(tmp_path), _result(uninterrupted)
    assert resumed["restored"] and resumed["global_step"] == 12
    assert resumed["lr"] == reference["lr"]
    assert list(resumed["state_dict"]) == list(reference["state_dict"])
    for key, value in resumed["state_dict"].items():
        torch.testing.assert_close(value, reference["state_dict"][key], atol=1e-6, rtol=0,
                                   msg=lambda m: f"{key}: {m}")
    assert not os.path.exists(tmp_path / "backup")  # delete_checkpoint=True: removed


def test_bad_save_freq_is_a_clear_error():
    pytest.importorskip("lightning.pytorch")
    from torchstrategy.lightning import BackupAndRestoreCallback

    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number "
                                         "of steps, got 0"):
        BackupAndRestoreCallback("backup", save_freq=0)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_is_a_callback_of_either_package(package):
    import importlib

    from torchstrategy.lightning import BackupAndRestoreCallback

    callback = BackupAndRestoreCallback("backup", save_freq=3, package=package)
    assert isinstance(callback, importlib.import_module(f"{package}.callbacks").Callback)
    assert isinstance(callback, BackupAndRestoreCallback)
    assert callback.path == os.path.abspath(os.path.join("backup", "backup.ckpt"))


class _Planted:
    """Unpickling this creates a file: what an attacker's backup.ckpt would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_backup_runs_nothing(tmp_path):
    """The callback resumes through Lightning's loader with weights_only=True (issue 19)."""
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"global_step": 4, "planted": _Planted(str(marker))}, backup_dir / "backup.ckpt")
    result = _run(tmp_path, "--save-freq", "4")
    assert result.returncode != 0
    assert "weights_only" in result.stderr or "Unpickling" in result.stderr, \
        result.stderr[-3000:]
    assert not marker.exists(), "resuming from the backup ran the planted code"


def test_a_backup_loads_as_plain_tensors_and_values(uninterrupted):
    backup = torch.load(os.path.join(uninterrupted, "backup", "backup.ckpt"),
                        weights_only=True)
    assert backup["global_step"] == 12
