"""Sharded checkpoints: permissions, and a clear error on every replica for each way a
checkpoint directory can be broken; a MirroredStrategy checkpoint loads into a sharded model
with ``load_state_dict``.

One launch of 2 replicas:
- save_checkpoint's directory is 0700 and every file in it 0600 (os.stat);
- a directory without .metadata, with a data file missing, truncated, or with a flipped
  bit (found by the replica that checks that file only: the other agrees and raises too),
  and unreadable bytes in a checkpoint without recorded checksums: the same error on both
  replicas, naming the file and what to do, never DCP's raw CheckpointException; after
  them a good checkpoint loads (no replica was left inside a collective);
- ts.checkpoint.load of a sharded directory names the call that loads it;
- a MirroredStrategy checkpoint (ts.checkpoint.save of the state_dict) loads into a sharded
  model with model.load_state_dict, bit for bit; a wrong shape is torch's error, and
  assign=True (which would put full tensors in FSDP2's place) is refused, naming the key.
"""
import os
import shutil
import stat

import pytest
import torch
import torch.nn as nn

import torchstrategy as ts
from tests.helpers.replicas import from_every_replica, launch

pytestmark = pytest.mark.timeout(240)


def build(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 17), nn.ReLU(), nn.Linear(17, 17), nn.ReLU(),
                         nn.Linear(17, 3))


def error_of(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test checks the type and message
        return type(error).__name__, str(error)
    return None


def modes(directory):
    out = {".": stat.S_IMODE(os.stat(directory).st_mode)}
    for name in os.listdir(directory):
        out[name] = stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode)
    return out


def flip_bit(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def broken_copies(good, root):
    """Copies of the checkpoint directory `good`, each broken one way (made by the chief)."""
    copies = {}

    def copy(name):
        copies[name] = os.path.join(root, name)
        shutil.copytree(good, copies[name])
        return copies[name]
    os.remove(os.path.join(copy("no metadata"), ".metadata"))
    os.remove(os.path.join(copy("missing file"), "__1_0.distcp"))
    truncated = os.path.join(copy("truncated"), "__0_0.distcp")
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    flipped = os.path.join(copy("flipped"), "__1_0.distcp")  # replica 1 checks this one
    flip_bit(flipped, os.path.getsize(flipped) // 2)
    # No checksums recorded (a checkpoint written by DCP directly), its first item's zip
    # header damaged: DCP's own read fails.
    raw = copy("flipped, no checksums")
    os.remove(os.path.join(raw, ".torchstrategy-checksums.json"))
    flip_bit(os.path.join(raw, "__0_0.distcp"), 0)
    return copies


def replica(root):
    strategy = ts.ShardedStrategy()
    ext = strategy.extended
    chief = ext.should_checkpoint
    with strategy.scope():
        model = build(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    good = os.path.join(root, "good")
    ext.save_checkpoint(good, model, optimizer)
    saved = ext.export_state_dict(model)
    found_modes = from_every_replica(modes(good))

    copies = broken_copies(good, root) if chief else None
    copies = from_every_replica(copies)[0]
    with strategy.scope():
        fresh = build(1)
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    errors = {name: from_every_replica(
                  error_of(lambda: ext.load_checkpoint(path, fresh, fresh_optimizer)))
              for name, path in copies.items()}
    errors["pretrained, no metadata"] = from_every_replica(
        error_of(lambda: ts.load_pretrained(fresh, copies["no metadata"])))
    # Nobody is stuck: the good checkpoint loads.
    ext.load_checkpoint(good, fresh, fresh_optimizer)
    loaded = ext.export_state_dict(fresh)
    if chief:
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    errors["ts.checkpoint.load"] = [error_of(lambda: ts.checkpoint.load(good))]

    # A MirroredStrategy checkpoint: ts.checkpoint.save of the plain state_dict.
    mirrored = ts.MirroredStrategy()
    with mirrored.scope():
        plain = build(2)
    plain_file = os.path.join(root, "mirrored.pt")
    ts.checkpoint.save(plain.state_dict(), plain_file)
    with strategy.scope():
        sharded = build(3)
    full = ts.checkpoint.load(plain_file)
    result = sharded.load_state_dict(full)
    assert not result.missing_keys and not result.unexpected_keys
    exported = ext.export_state_dict(sharded)
    if chief:
        reference = plain.state_dict()
        assert list(exported) == list(reference)
        for key in reference:
            assert torch.equal(exported[key], reference[key]), key
    wrong = dict(full, **{"2.weight": torch.zeros(3, 16)})
    errors["wrong shape"] = [error_of(lambda: sharded.load_state_dict(wrong))]
    errors["assign"] = [error_of(lambda: sharded.load_state_dict(full, assign=True))]
    return found_modes, errors


def test_sharded_checkpoint_permissions_and_errors(tmp_path):
    found_modes, errors = launch(replica, str(tmp_path), n=2)

    for per_replica in found_modes:
        assert per_replica.pop(".") == 0o700
        assert {".metadata", "__0_0.distcp", "__1_0.distcp",
                ".torchstrategy-checksums.json"} <= set(per_replica), per_replica
        assert set(per_replica.values()) == {0o600}, per_replica

    expected = {
        "no metadata": ("FileNotFoundError", ["no .metadata file", "incomplete"]),
        "missing file": ("FileNotFoundError", ["lacks its data file '__1_0.distcp'"]),
        "truncated": ("RuntimeError", ["__0_0.distcp", "is truncated"]),
        "flipped": ("RuntimeError", ["__1_0.distcp", "is corrupt: its CRC-32",
                                     "(found by replica 1)"]),
        "flipped, no checksums": ("RuntimeError", ["Reading the sharded checkpoint",
                                                   "failed on replica(s)",
                                                   "present and long enough"]),
        "pretrained, no metadata": ("FileNotFoundError", ["no .metadata file"]),
    }
    for name, (kind, parts) in expected.items():
        first, second = errors[name]
        assert first is not None and first == second, (name, errors[name])
        assert first[0] == kind, (name, first)
        for part in parts:
            assert part in first[1], (name, part, first[1])
        assert "CheckpointException" not in first[1] or name == "flipped, no checksums"
        if name != "pretrained, no metadata":
            assert "Load an earlier checkpoint, or copy the directory again" in first[1]
    assert errors["no metadata"][0][1].startswith(
        f"The sharded checkpoint {str(tmp_path / 'no metadata')!r}")

    kind, message = errors["ts.checkpoint.load"][0]
    assert kind == "IsADirectoryError"
    assert "strategy.extended.load_checkpoint(path, model, optimizer)" in message
    assert "ts.load_pretrained(model, path)" in message

    kind, message = errors["assign"][0]
    assert kind == "RuntimeError" and "0.weight: load_state_dict(assign=True) cannot" in \
        message, message
    kind, message = errors["wrong shape"][0]
    assert kind == "RuntimeError" and "size mismatch for 2.weight" in message, message
