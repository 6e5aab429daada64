"""docs/porting_from_ddp.md's first diff applies with ``patch`` to PyTorch's DDP tutorial as
published, and the port runs on CPUs: 2 replicas on gloo under torchrun, then resumed from
its snapshot.

The file is pytorch/examples' ``distributed/ddp-tutorial-series/multigpu_torchrun.py``
(https://github.com/pytorch/examples, BSD-3-Clause; last changed in commit a308b4e, the same
at 77f55b9). Its code is not copied into this repository (the project's rule for other
projects' code): the test reads it, with the ``datautils.py`` beside it, from a checkout of
pytorch/examples named by ``TORCHSTRATEGY_PYTORCH_EXAMPLES`` and checks its SHA-256, so the
diff is tested against exactly the published file. Without a checkout it skips, saying so.

The tutorial's own loss (``F.cross_entropy`` of a one-column output) is zero with a zero
gradient, so the weights a run saves are replica 0's initial ones: the checks are the
tutorial's progress lines on both replicas (the sampler's share of its 2048 examples), the
snapshot (the model's own keys, no ``module.``), and the resume from it.
"""
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.porting.programs.harness import UPSTREAM_TUTORIAL, guide_diffs, torchrun

CHECKOUT_VARIABLE = "TORCHSTRATEGY_PYTORCH_EXAMPLES"
SOURCE = "https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/"
UPSTREAM_SHA256 = "6b0a1568337fe206fa74e971cfeec42317f40b82122475327d50f0a0d37e1ba7"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tutorial_directory():
    """The tutorial's directory in the pytorch/examples checkout, after checking the file."""
    checkout = os.environ.get(CHECKOUT_VARIABLE)
    if not checkout:
        pytest.skip(f"{CHECKOUT_VARIABLE} is not set: the guide's tutorial diff is checked "
                    f"against pytorch/examples' {UPSTREAM_TUTORIAL} ({SOURCE}{UPSTREAM_TUTORIAL}), "
                    "which this repository does not copy; set it to a checkout to run this")
    original = Path(checkout) / UPSTREAM_TUTORIAL
    assert original.is_file(), f"{CHECKOUT_VARIABLE}={checkout}: no {UPSTREAM_TUTORIAL} there"
    digest = hashlib.sha256(original.read_bytes()).hexdigest()
    assert digest == UPSTREAM_SHA256, (
        f"{original} is not the published file the guide's diff is made against (SHA-256 "
        f"{digest}, expected {UPSTREAM_SHA256}: {SOURCE}{UPSTREAM_TUTORIAL})")
    return original.parent


def _guide_diff_text() -> str:
    """The guide's diff block for the tutorial, as a user copies it."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "porting_from_ddp.md").read_text()
    blocks = re.findall(r"^```diff\n(.*?)^```", guide, re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(f"--- a/{UPSTREAM_TUTORIAL}\n")]
    assert [d.name for d in guide_diffs()].count(UPSTREAM_TUTORIAL) == 1
    return block


def test_the_guides_diff_applies_to_the_published_tutorial_and_the_port_runs_on_cpus(
        tutorial_directory, tmp_path):
    checkout = tmp_path / "examples"
    shutil.copytree(tutorial_directory, checkout / Path(UPSTREAM_TUTORIAL).parent)
    patch = shutil.which("patch")
    assert patch, "patch (GNU patch) is needed to apply the guide's diff as a user does"
    done = subprocess.run([patch, "-p1", "--fuzz=0", "--no-backup-if-mismatch"],
                          input=_guide_diff_text(), cwd=checkout, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "offset" not in done.stdout and "fuzz" not in done.stdout, done.stdout
    program = checkout / UPSTREAM_TUTORIAL
    ported = program.read_text()
    assert "DistributedDataParallel" not in ported and "init_process_group" not in ported

    workdir = program.parent
    first = torchrun(program, "2", "1", cwd=workdir)           # epochs 0 and 1, both saved
    for rank in (0, 1):
        for epoch in (0, 1):     # 2048 examples, 1024 per replica, batches of 32
            assert f"[GPU{rank}] Epoch {epoch} | Batchsize: 32 | Steps: 32" in first, first
    assert "Epoch 1 | Training snapshot saved at snapshot.pt" in first, first
    snapshot = torch.load(workdir / "snapshot.pt")
    assert snapshot["EPOCHS_RUN"] == 1
    assert sorted(snapshot["MODEL_STATE"]) == ["bias", "weight"]    # no "module." prefix
    torch.nn.Linear(20, 1).load_state_dict(snapshot["MODEL_STATE"])  # loads without a strategy

    resumed = torchrun(program, "3", "1", cwd=workdir)          # from the snapshot: epochs 1, 2
    assert resumed.count("Loading snapshot") == 2, resumed
    assert resumed.count("Resuming training from snapshot at Epoch 1") == 2, resumed
    for rank in (0, 1):
        assert f"[GPU{rank}] Epoch 0 |" not in resumed, resumed
        assert f"[GPU{rank}] Epoch 2 | Batchsize: 32 | Steps: 32" in resumed, resumed
    final = torch.load(workdir / "snapshot.pt")
    assert final["EPOCHS_RUN"] == 2
    for key, value in snapshot["MODEL_STATE"].items():   # the tutorial's loss has no gradient
        assert torch.equal(final["MODEL_STATE"][key], value), key
