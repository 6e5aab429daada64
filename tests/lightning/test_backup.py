"""BackupAndRestoreCallback: a Lightning fit that fails, run again, ends where an
uninterrupted fit ends.

Each fit is tests/scripts/lightning_backup.py's on 2 CPU replicas
(Trainer(strategy="mirrored")), in a subprocess with a timeout. Its training step draws
random numbers and an LR scheduler steps, so equality needs model, optimizer, scheduler,
loop position and every replica's generators restored. 4 steps per epoch, 3 epochs.

The fits run in two jobs (each process start imports Lightning: seconds of CPU): the first
runs the uninterrupted fit, the two fits that fail and the one that meets a planted backup;
the second, fresh processes as a user's second attempt is, runs the failed fits' commands
again. Each fit runs under its own try/except and every replica writes its outcome ("ok" or
the exception it raised) beside the fit's files, so each test checks its own fit, and one
fit failing does not hide the others.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.lightning_runs import ROOT, SUBPROCESS_TIMEOUT_SECONDS, clean_env

pytestmark = [pytest.mark.lightning, pytest.mark.usefixtures("real_exit")]  # exits as users' do

SCRIPT = os.path.join(ROOT, "tests", "scripts", "lightning_backup.py")
# save_freq: the step at which its first attempt fails, the step of the backup it leaves.
FAILING = {"epoch": (6, 4), "4": (11, 8)}


def _run_plan(fits, timeout):
    """One job running `fits` (dicts: out, save_freq, fail_at_step, keep) in turn."""
    plan = json.dumps([{**fit, "out": str(fit["out"])} for fit in fits])
    return subprocess.run([sys.executable, SCRIPT, "--plan", plan], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def _job_log(job):
    return (f"the job exited with {job.returncode}\n--- stdout ---\n{job.stdout[-3000:]}\n"
            f"--- stderr ---\n{job.stderr[-5000:]}")


def _read_outcomes(out_dir):
    """Each replica's outcome of the fit into `out_dir` (None where it left none)."""
    paths = [os.path.join(out_dir, f"outcome-rank{r}.txt") for r in range(2)]
    return [open(p).read() if os.path.exists(p) else None for p in paths]


def _outcomes(out_dir, job, outcomes=None):
    """`outcomes` (default: those in `out_dir`), failing with the job's log where a replica
    left none."""
    outcomes = _read_outcomes(out_dir) if outcomes is None else outcomes
    assert None not in outcomes, f"{outcomes}\n{_job_log(job)}"
    return outcomes


def _ok(out_dir, job):
    outcomes = _outcomes(out_dir, job)
    assert outcomes == ["ok", "ok"], f"{outcomes}\n{_job_log(job)}"
    assert job.returncode == 0, _job_log(job)


def _result(out_dir):
    return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)


class _Planted:
    """Unpickling this creates a file: what an attacker's backup.ckpt would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def first_attempts(tmp_path_factory):
    """The first job: {name: out_dir}, the job, and what each failed fit left behind (its
    replicas' outcomes, its backup's global step and the backup directory's listing), read
    before the second job resumes from it."""
    dirs = {name: tmp_path_factory.mktemp(name)
            for name in ("uninterrupted", "fails_epoch", "fails_4", "planted")}
    # The uninterrupted fit backs up every 4 steps and keeps its backup.
    fits = [{"out": dirs["uninterrupted"], "save_freq": "4", "keep": True}]
    fits += [{"out": dirs[f"fails_{freq}"], "save_freq": freq, "fail_at_step": fail_at}
             for freq, (fail_at, _) in FAILING.items()]
    # A backup planted by an attacker; the fit resumes through Lightning's loader.
    (dirs["planted"] / "backup").mkdir()
    torch.save({"global_step": 4, "planted": _Planted(str(dirs["planted"] / "pwned"))},
               dirs["planted"] / "backup" / "backup.ckpt")
    fits.append({"out": dirs["planted"], "save_freq": "4"})
    job = _run_plan(fits, timeout=2 * SUBPROCESS_TIMEOUT_SECONDS)
    left = {}
    for freq in FAILING:
        backup_dir = dirs[f"fails_{freq}"] / "backup"
        left[freq] = (_read_outcomes(dirs[f"fails_{freq}"]),
                      torch.load(backup_dir / "backup.ckpt", weights_only=False)["global_step"]
                      if (backup_dir / "backup.ckpt").exists() else None,
                      sorted(os.listdir(backup_dir)) if backup_dir.exists() else None)
    return dirs, job, left


@pytest.fixture(scope="module")
def second_attempts(first_attempts):
    """The second job: each failed fit's command again, which resumes from its backup."""
    dirs, _, _ = first_attempts
    fits = [{"out": dirs[f"fails_{freq}"], "save_freq": freq, "fail_at_step": fail_at}
            for freq, (fail_at, _) in FAILING.items()]
    return _run_plan(fits, timeout=SUBPROCESS_TIMEOUT_SECONDS)


@pytest.fixture(scope="module")
def uninterrupted(first_attempts):
    dirs, job, _ = first_attempts
    _ok(dirs["uninterrupted"], job)
    return dirs["uninterrupted"]


def test_kept_backup_is_the_end_of_training(uninterrupted):
    result = _result(uninterrupted)
    assert result["global_step"] == 12 and not result["restored"]
    backup = torch.load(os.path.join(uninterrupted, "backup", "backup.ckpt"),
                        weights_only=False)
    assert backup["global_step"] == 12
    assert os.listdir(os.path.join(uninterrupted, "backup")) == ["backup.ckpt"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("save_freq, fail_at, backup_step", [("epoch", 6, 4), ("4", 11, 8)])
def test_failed_fit_run_again_matches_uninterrupted(first_attempts, second_attempts,
                                                    uninterrupted, save_freq, fail_at,
                                                    backup_step):
    dirs, first, left = first_attempts
    out = dirs[f"fails_{save_freq}"]
    # The first attempt: every replica failed at the step, leaving only the last backup.
    outcomes, step, listing = left[save_freq]
    for outcome in _outcomes(out, first, outcomes):
        assert f"injected failure at step {fail_at}" in outcome, outcome
    assert (step, listing) == (backup_step, ["backup.ckpt"]), (step, listing)

    _ok(out, second_attempts)   # the same command again: resumes from the backup
    resumed, reference = _result(out), _result(uninterrupted)
    assert resumed["restored"] and resumed["global_step"] == 12
    assert resumed["lr"] == reference["lr"]
    assert list(resumed["state_dict"]) == list(reference["state_dict"])
    for key, value in resumed["state_dict"].items():
        torch.testing.assert_close(value, reference["state_dict"][key], atol=1e-6, rtol=0,
                                   msg=lambda m: f"{key}: {m}")
    assert not os.path.exists(out / "backup")  # delete_checkpoint=True: removed


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


def test_planted_backup_runs_nothing(first_attempts):
    """The callback resumes through Lightning's loader with weights_only=True (issue 19)."""
    dirs, job, _ = first_attempts
    for outcome in _outcomes(dirs["planted"], job):   # every replica refused to load it
        assert "weights_only" in outcome or "Unpickling" in outcome, outcome
    assert not (dirs["planted"] / "pwned").exists(), \
        "resuming from the backup ran the planted code"


def test_a_backup_loads_as_plain_tensors_and_values(uninterrupted):
    backup = torch.load(os.path.join(uninterrupted, "backup", "backup.ckpt"),
                        weights_only=True)
    assert backup["global_step"] == 12


def test_several_fits_in_one_program_leave_no_process_group_behind(first_attempts,
                                                                  second_attempts):
    # Each job runs several fits (some raising); the checkpoints saved under the default
    # strategy between them once kept the world's process group referenced past its
    # destruction at exit, which the runtime reports (and gloo's threads can abort on).
    for job in (first_attempts[1], second_attempts):
        assert "a process group is still referenced" not in job.stderr, job.stderr[-3000:]
