"""Real DDP programs and their ports, launched as users launch them, equal bit for bit.

minGPT-ddp (tests/porting/programs/mingpt_ddp.py, pytorch/examples' structure) and its port
(mingpt_ddp_ported.py) run under ``torchrun --standalone --nproc-per-node=2`` on gloo: first
one epoch in fp32 from scratch (the replicas build different weights; DDP and ``adopt``
keep rank 0's) saving a snapshot of model and optimizer, then a second launch that resumes
from that snapshot and trains another epoch with fp16 autocast and a GradScaler. Every
logged train and eval loss and every saved snapshot (weights and AdamW's state) must be
DDP's.

pytorch/examples' FSDP2 example (fsdp2_example.py: a meta-device Transformer, ``fully_shard``
per layer and on the model, full-state-dict checkpoints through
``torch.distributed.checkpoint.state_dict``) runs once from scratch; its checkpoint is then
resumed by the example and by its port on ShardedStrategy (fsdp2_example_ported.py), whose
losses, weights and Adam state must be the example's. (A fresh start is not compared: the
example's ``reset_parameters`` on the sharded meta model draws other numbers than a model
built whole.)

nanoGPT (dropout 0.1, accumulation with its prefetched batch) is checked through the
guide's own diff in test_guide_diffs.py.
"""
import re
import shutil

import pytest
import torch

from tests.porting.programs.harness import PROGRAMS, assert_identical, torchrun

LOSS_LINE = re.compile(r"^\[GPU(\d)\] Epoch (\d+) \| Iter (\d+) \| (Train|Eval) Loss (\S+)$",
                       re.MULTILINE)


def _losses(output):
    """Every logged loss, keyed by replica, epoch, iteration and kind."""
    found = {match[:4]: match[4] for match in LOSS_LINE.findall(output)}
    assert found, output[-2000:]
    return found


@pytest.fixture(scope="module")
def mingpt_runs(tmp_path_factory):
    runs = {}
    for kind, program in (("ddp", "mingpt_ddp.py"), ("port", "mingpt_ddp_ported.py")):
        directory = tmp_path_factory.mktemp(kind)
        first = torchrun(PROGRAMS / program, "--max_epochs=1", cwd=directory,
                        reference=kind == "ddp")
        first_snapshot = torch.load(directory / "snapshot.pt")
        resumed = torchrun(PROGRAMS / program, "--max_epochs=2", "--use_amp=True", cwd=directory,
                           reference=kind == "ddp")
        runs[kind] = {"fp32": (first, first_snapshot),
                      "fp16_resumed": (resumed, torch.load(directory / "snapshot.pt"))}
    return runs


def _assert_same_losses(got, want):
    differing = {key: (got.get(key), want.get(key)) for key in set(got) | set(want)
                 if got.get(key) != want.get(key)}
    assert not differing, f"(replica, epoch, iteration, kind): (port, original): {differing}"


def _assert_snapshots_identical(got, want, what):
    assert got["finished_epoch"] == want["finished_epoch"]
    assert_identical(got["model_state"], want["model_state"], f"{what} weights")
    want_state = want["optimizer_state"]["state"]
    assert sorted(got["optimizer_state"]["state"]) == sorted(want_state)
    for index, state in want_state.items():
        assert_identical(got["optimizer_state"]["state"][index], state, f"{what} AdamW {index}")


def test_mingpt_port_equals_ddp_in_fp32(mingpt_runs):
    (ddp_out, ddp_snapshot), (port_out, port_snapshot) = \
        mingpt_runs["ddp"]["fp32"], mingpt_runs["port"]["fp32"]
    assert "Snapshot not found" in port_out
    _assert_same_losses(_losses(port_out), _losses(ddp_out))
    assert ddp_snapshot["finished_epoch"] == 1
    _assert_snapshots_identical(port_snapshot, ddp_snapshot, "minGPT fp32")


def test_mingpt_port_resumes_and_equals_ddp_with_fp16_autocast_and_grad_scaler(mingpt_runs):
    (ddp_out, ddp_snapshot), (port_out, port_snapshot) = \
        mingpt_runs["ddp"]["fp16_resumed"], mingpt_runs["port"]["fp16_resumed"]
    for output in (ddp_out, port_out):
        assert output.count("Resuming training from snapshot at Epoch 1") == 2
    losses = _losses(ddp_out)
    assert {key[1] for key in losses} == {"2"}         # only the epoch after the snapshot
    _assert_same_losses(_losses(port_out), losses)
    assert ddp_snapshot["finished_epoch"] == 2
    _assert_snapshots_identical(port_snapshot, ddp_snapshot, "minGPT fp16 resumed")


FSDP2_LOSS_LINE = re.compile(r"^\[rank (\d)\] step (\d+) loss (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    fresh = tmp_path_factory.mktemp("fsdp2_fresh")
    torchrun(PROGRAMS / "fsdp2_example.py", cwd=fresh, reference=True)
    runs = {}
    for kind, program in (("fsdp2", "fsdp2_example.py"), ("port", "fsdp2_example_ported.py")):
        directory = tmp_path_factory.mktemp(kind)
        shutil.copytree(fresh / "checkpoints", directory / "checkpoints")
        output = torchrun(PROGRAMS / program, cwd=directory, reference=kind == "fsdp2")
        last = directory / "checkpoints" / "last"
        runs[kind] = (output, torch.load(last / "model_state_dict.pt"),
                      torch.load(last / "optim_state_dict.pt"))
    return runs


def test_fsdp2_example_port_on_sharded_strategy_resumes_as_fsdp2(fsdp2_runs):
    (fsdp2_out, fsdp2_model, fsdp2_optim), (port_out, port_model, port_optim) = \
        fsdp2_runs["fsdp2"], fsdp2_runs["port"]
    losses = {m[:2]: m[2] for m in FSDP2_LOSS_LINE.findall(fsdp2_out)}
    assert len(losses) == 6, fsdp2_out[-2000:]          # 3 steps on 2 replicas
    assert {m[:2]: m[2] for m in FSDP2_LOSS_LINE.findall(port_out)} == losses
    assert_identical(port_model, fsdp2_model, "FSDP2 example weights")
    assert list(port_optim["state"]) == list(fsdp2_optim["state"])
    for name, state in fsdp2_optim["state"].items():
        assert_identical(port_optim["state"][name], state, f"Adam state {name}")
