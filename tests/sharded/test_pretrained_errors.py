"""ts.load_pretrained names what is wrong with a source a user points it at:

- a torch.save file cut short (a download that stopped) is truncated or corrupt, not an old
  serialization format; an empty file is empty; an old-format file is still named as such;
- a file in a directory this user may not search, a file this user may not read, and a DCP
  directory this user may not read are permission problems naming the user and the
  directory, not "no file" or "incomplete, copy again";
- a DDP (``module.``) or torch.compile (``_orig_mod.``) checkpoint says to strip the
  prefix, with the expression that does it, and that expression makes it load.

The permission cases run in a child process that cannot override file permissions: as
root, with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from its bounding set
(``setpriv``), so root is refused as any user is; as another user, as it is.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchstrategy as ts

REPOSITORY = Path(__file__).resolve().parents[2]


def small_state(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3).state_dict()


def test_a_truncated_torch_file_is_reported_truncated(tmp_path):
    whole = tmp_path / "whole.pt"
    torch.save(small_state(), whole)
    data = whole.read_bytes()
    for cut in (len(data) // 2, len(data) - 30, 40):
        truncated = tmp_path / f"cut{cut}.pt"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt") as raised:
            ts.load_pretrained(torch.nn.Linear(4, 3), truncated)
        message = str(raised.value)
        assert f"{cut} bytes" in message and "again" in message
        assert "_use_new_zipfile_serialization" not in message


def test_an_empty_file_and_an_old_format_file_are_named_as_such(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        ts.load_pretrained(torch.nn.Linear(4, 3), empty)
    old = tmp_path / "old.pt"
    torch.save(small_state(), old, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="old format") as raised:
        ts.load_pretrained(torch.nn.Linear(4, 3), old)
    assert "truncated" not in str(raised.value)
    garbage = tmp_path / "notes.txt"
    garbage.write_text("hello, these are not weights\n")
    with pytest.raises(ValueError, match="neither a torch.save file"):
        ts.load_pretrained(torch.nn.Linear(4, 3), garbage)


@pytest.mark.parametrize("prefix, wrapper", [("module.", "DistributedDataParallel"),
                                             ("_orig_mod.", "torch.compile")])
def test_a_wrapped_models_checkpoint_says_to_strip_the_prefix(tmp_path, prefix, wrapper):
    want = small_state(seed=3)
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + key: value for key, value in want.items()}, path)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(KeyError, match="Strip the prefix") as raised:
        ts.load_pretrained(model, path)
    message = raised.value.args[0]
    assert wrapper in message and repr(prefix) in message
    expression = f"{{k.removeprefix({prefix!r}): v for k, v in state.items()}}"
    assert expression in message
    # The expression the message gives, applied as it says, makes the file load.
    state = torch.load(path)
    torch.save(eval(expression, {"state": state}), path)
    assert ts.load_pretrained(model, path) == ([], [])
    for key, value in want.items():
        assert torch.equal(model.state_dict()[key], value)


def test_keys_that_differ_otherwise_are_not_called_a_prefix(tmp_path):
    path = tmp_path / "other.pt"
    state = small_state()
    torch.save({"module.weight": state["weight"], "bias": state["bias"], "extra": state["bias"]},
               path)
    with pytest.raises(KeyError, match="the keys differ from the model's") as raised:
        ts.load_pretrained(torch.nn.Linear(4, 3), path)
    assert "Strip the prefix" not in raised.value.args[0]


_PERMISSION_CHILD = textwrap.dedent("""
    import json, sys, torch, torchstrategy as ts
    results = {}
    for case, path in json.loads(sys.argv[1]).items():
        try:
            ts.load_pretrained(torch.nn.Linear(4, 3), path)
            results[case] = ["loaded", ""]
        except Exception as error:
            results[case] = [type(error).__name__, str(error)]
    print(json.dumps(results))
""")


def _without_permission_override() -> list[str]:
    """The command prefix that runs a child unable to bypass file permissions."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): no way to run a child that "
                    "file permissions apply to")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def test_unreadable_sources_are_permission_problems_not_missing_ones(tmp_path):
    state = small_state()
    locked_dir = tmp_path / "locked"
    locked_dir.mkdir()
    torch.save(state, locked_dir / "weights.pt")
    unreadable_file = tmp_path / "unreadable.pt"
    torch.save(state, unreadable_file)
    closed_dcp = tmp_path / "closed_dcp"
    dcp.save(state, checkpoint_id=str(closed_dcp), no_dist=True)
    unreadable_data = tmp_path / "unreadable_data_dcp"
    dcp.save(state, checkpoint_id=str(unreadable_data), no_dist=True)
    readable = tmp_path / "readable.pt"
    torch.save(state, readable)
    cases = {"dir": str(locked_dir / "weights.pt"), "file": str(unreadable_file),
             "dcp": str(closed_dcp), "dcp_data": str(unreadable_data),
             "missing": str(tmp_path / "absent.pt"), "readable": str(readable)}
    os.chmod(locked_dir, 0o600)          # listable by the owner, not searchable
    os.chmod(unreadable_file, 0o200)
    os.chmod(closed_dcp, 0o300)          # searchable, not listable
    for data_file in unreadable_data.glob("*.distcp"):
        os.chmod(data_file, 0o200)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([*_without_permission_override(), sys.executable, "-c",
                               _PERMISSION_CHILD, json.dumps(cases)],
                              capture_output=True, text=True, env=env, timeout=120)
    finally:
        os.chmod(locked_dir, 0o700)
        os.chmod(unreadable_file, 0o600)
        os.chmod(closed_dcp, 0o700)
        for data_file in unreadable_data.glob("*.distcp"):
            os.chmod(data_file, 0o600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["readable"][0] == "loaded"                      # the child can read at all
    assert results["missing"][0] == "FileNotFoundError"            # and missing stays missing
    for case in ("dir", "file", "dcp", "dcp_data"):
        kind, message = results[case]
        assert kind == "PermissionError", (case, kind, message)
        assert "permission denied" in message, (case, message)
        assert f"uid {os.geteuid()}" in message, (case, message)
        assert "no file" not in message and "incomplete" not in message, (case, message)
    assert repr(str(locked_dir)) in results["dir"][1]
    assert "cannot be searched" in results["dir"][1]
    assert "may not read it" in results["file"][1]
    assert repr(str(closed_dcp)) in results["dcp"][1]
    assert ".distcp" in results["dcp_data"][1]
