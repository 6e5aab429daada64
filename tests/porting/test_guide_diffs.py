"""docs/porting_from_ddp.md's diffs against programs of this repository, applied as written,
give programs that train to DDP's weights and log DDP's losses.

The nanoGPT-style and Lightning diffs are against tests/porting/programs/nanogpt_train.py and
lightning_ddp.py; the DDP tutorial's diff is against pytorch/examples' file as published
(applied and run in test_upstream_tutorial.py), and here the tutorial's structure made
deterministic and CPU-capable (multigpu_torchrun.py) is compared with its port
(multigpu_torchrun_ported.py, the same changes).

Each port and its original run under ``torchrun --standalone --nproc-per-node=2`` on gloo
(as a user launches them), from the same start, and are compared bit for bit: what they
print (losses, progress, resume messages) and the weights they save. The DDP tutorial
resumes from a snapshot (its ``loc`` mapping on load, a snapshot without ``module.``
keys saved after), nanoGPT trains with dropout 0.1, accumulation over a prefetched batch
and periodic evaluation, and checkpoints; the Lightning program accumulates over 2 batches
with dropout and saves a checkpoint.
"""
import re

import pytest
import torch

from tests.porting.programs import harness as harness_lib
from tests.porting.programs.harness import (
    PROGRAMS, REPOSITORY, UPSTREAM_TUTORIAL, apply_diff, assert_identical, guide_diffs,
    parse_diff, ported_program, torchrun)

NANOGPT = "tests/porting/programs/nanogpt_train.py"
LIGHTNING = "tests/porting/programs/lightning_ddp.py"


def test_every_diff_of_the_guide_applies_to_a_tested_program():
    diffs = guide_diffs()
    assert sorted(d.name for d in diffs) == sorted([UPSTREAM_TUTORIAL, NANOGPT, LIGHTNING])
    for diff in diffs:
        if diff.name == UPSTREAM_TUTORIAL:      # pytorch/examples' file: test_upstream_tutorial
            continue
        original = (REPOSITORY / diff.name).read_text()
        ported = apply_diff(original, diff)
        assert ported != original
        assert "DistributedDataParallel" not in ported, diff.name
        assert "init_process_group" not in ported, diff.name
        assert 'strategy="ddp"' not in ported, diff.name
        assert "import torchstrategy" in ported, diff.name


def test_the_diff_applier_refuses_a_diff_that_does_not_match():
    original = "a\nb\nc\n"
    good = parse_diff("--- a/x.py\n+++ b/x.py\n@@ -2,1 +2,1 @@\n-b\n+B\n")
    assert apply_diff(original, good) == "a\nB\nc\n"
    with pytest.raises(ValueError, match=r"x.py:2: the diff expects 'q'"):
        apply_diff(original, parse_diff("--- a/x.py\n+++ b/x.py\n@@ -2,1 +2,1 @@\n-q\n+B\n"))
    with pytest.raises(ValueError, match="header says"):
        parse_diff("--- a/x.py\n+++ b/x.py\n@@ -2,2 +2,1 @@\n-b\n+B\n")
    with pytest.raises(ValueError, match="must start with"):
        parse_diff("-b\n+B\n")


def test_ddp_tutorial_port_resumes_and_equals_ddp(tmp_path):
    torch.manual_seed(7)
    snapshot = {"MODEL_STATE": torch.nn.Linear(20, 1).state_dict(), "EPOCHS_RUN": 1}
    runs = {}
    for kind in ("ddp", "port"):
        directory = tmp_path / kind
        directory.mkdir()
        torch.save(snapshot, directory / "snapshot.pt")
        program = PROGRAMS / ("multigpu_torchrun.py" if kind == "ddp" else
                              "multigpu_torchrun_ported.py")
        output = torchrun(program, "3", "1", cwd=directory, reference=kind == "ddp")
        runs[kind] = (output, torch.load(directory / "snapshot.pt"))
    (ddp_out, ddp_snap), (port_out, port_snap) = runs["ddp"], runs["port"]
    losses = re.findall(r"\[GPU(\d)\] Epoch (\d) \| Losses: (\[[^\]]*\])", ddp_out)
    assert len(losses) == 4          # epochs 1 and 2 on both replicas
    assert sorted(losses) == sorted(re.findall(r"\[GPU(\d)\] Epoch (\d) \| Losses: (\[[^\]]*\])",
                                               port_out))
    for output in (ddp_out, port_out):
        assert output.count("Resuming training from snapshot at Epoch 1") == 2
    assert port_snap["EPOCHS_RUN"] == ddp_snap["EPOCHS_RUN"] == 2
    assert_identical(port_snap["MODEL_STATE"], ddp_snap["MODEL_STATE"], "tutorial snapshot")


def test_nanogpt_port_logs_and_trains_as_ddp(tmp_path):
    runs = {}
    for kind in ("ddp", "port"):
        directory = tmp_path / kind
        directory.mkdir()
        program = PROGRAMS / "nanogpt_train.py" if kind == "ddp" else \
            ported_program(NANOGPT, directory)
        output = torchrun(program, cwd=directory, reference=kind == "ddp")
        runs[kind] = (output, torch.load(directory / "out" / "ckpt.pt"))
    (ddp_out, ddp_ckpt), (port_out, port_ckpt) = runs["ddp"], runs["port"]
    assert re.findall(r"^iter \d+: loss .*$", ddp_out, re.MULTILINE)
    assert port_out.splitlines() == ddp_out.splitlines()   # losses, evaluations, saves
    assert port_ckpt["iter_num"] == ddp_ckpt["iter_num"] == 4
    assert_identical(port_ckpt["model"], ddp_ckpt["model"], "nanoGPT checkpoint")
    want_state = ddp_ckpt["optimizer"]["state"]
    assert sorted(port_ckpt["optimizer"]["state"]) == sorted(want_state)
    for index, state in want_state.items():     # AdamW's moments and steps
        assert_identical(port_ckpt["optimizer"]["state"][index], state, f"AdamW state {index}")


def test_lightning_port_logs_and_trains_as_ddp(tmp_path, monkeypatch):
    # As after a script's seed_everything: Lightning's "ddp" re-seeds every replica from
    # PL_GLOBAL_SEED when it sets up; the port must draw the same dropout masks.
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    runs = {}
    for kind in ("ddp", "port"):
        directory = tmp_path / kind
        directory.mkdir()
        program = PROGRAMS / "lightning_ddp.py" if kind == "ddp" else \
            ported_program(LIGHTNING, directory)
        output = torchrun(program, cwd=directory, reference=kind == "ddp")
        losses = re.findall(r"^\[rank (\d)\] batch (\d+) loss (\S+)$", output,
                            re.MULTILINE)
        checkpoint = torch.load(directory / "final.ckpt", weights_only=False)
        runs[kind] = (sorted(losses), checkpoint)
    (ddp_losses, ddp_ckpt), (port_losses, port_ckpt) = runs["ddp"], runs["port"]
    assert len(ddp_losses) == 2 * 2 * 6     # 2 replicas, 2 epochs, 6 batches each
    assert port_losses == ddp_losses
    assert port_ckpt["global_step"] == ddp_ckpt["global_step"] == 6
    assert_identical(port_ckpt["state_dict"], ddp_ckpt["state_dict"], "Lightning weights")


def test_only_torchs_abort_at_exit_is_tolerated_and_only_in_a_reference_run(tmp_path):
    for rank, stderr in ((0, f"...\n{harness_lib.TORCH_EXIT_ABORT}\n"), (1, "")):
        (tmp_path / str(rank)).mkdir()
        (tmp_path / str(rank) / "stderr.log").write_text(stderr)
    per_rank = {0: tmp_path / "0", 1: tmp_path / "1"}
    assert harness_lib._aborted_at_exit_only(-6, per_rank)
    assert not harness_lib._aborted_at_exit_only(0, per_rank)        # nothing failed
    (tmp_path / "0" / "stderr.log").write_text("Traceback ...\nRuntimeError: boom\n")
    assert not harness_lib._aborted_at_exit_only(1, per_rank)        # a real failure
