"""Sharded checkpoint directories: ``torch.distributed.checkpoint`` (DCP) with checksums.

`save` / `load` write and read each replica's shards of a model and its optimizer (a
checkpoint written by N replicas loads on M). `save` makes the directory 0700 and its files
0600 (as every checkpoint of the library) and records each data file's size and CRC-32
beside ``.metadata``; `read_dcp_metadata` checks a directory against them on every replica,
and the replicas agree on what they found (`agree`) before any of them reads a tensor, so a
missing, truncated or corrupt file is one clear error everywhere instead of DCP's raw
``CheckpointException`` on some replicas and a hang on the others.

Every question to the other replicas (who is the chief, agreeing on an outcome, gathering
the checksums) goes through `torchstrategy.collectives.peers`: the strategy's replicas
where it passes them, else those of the default process group; an error found on one
replica is raised, as the same exception, on every replica.
"""
from __future__ import annotations

import json
import os
import tempfile
import zlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from torchstrategy import _compat, checkpoint
from torchstrategy.collectives import peers as peers_lib
from torchstrategy.collectives.peers import Peers
from torchstrategy.strategies.sharding import stale


def _checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        stale.stale_parameters().refresh_optimizer(optimizer)
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


# -- the replicas a checkpoint is read or written with ----------------------------------
def peers_of(collective: bool) -> Peers:
    """The replicas that check and read a directory together: with `collective`, those of
    the default process group (every one calls at the same point), else this one alone."""
    return peers_lib.process_group_peers() if collective else peers_lib.alone()


def agree(error: BaseException | None, collective: bool) -> None:
    """Raises, on every replica, the error of the first replica that found one (its class
    and message, with " (found by replica R)" when there are several replicas); returns on
    every replica when none did. With `collective`, every replica of the default process
    group calls this at the same point (so a replica that found nothing does not go on
    into a collective the others never join); without, only this replica's error counts.
    `Peers.agree` over `peers_of(collective)`."""
    peers_of(collective).agree(error, name_finder=True)


# -- sharded checkpoint directories ------------------------------------------------------
METADATA = ".metadata"
# Beside DCP's `.metadata`: {data file: [size, CRC-32]} as `save` wrote them.
CHECKSUMS = ".torchstrategy-checksums.json"
_CHUNK = 1 << 22


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _what_to_do() -> str:
    return ("Load an earlier checkpoint, or copy the directory again from where it was "
            "written (all of it, .metadata included).")


def _check_dcp_directory(path: str, rank: int, size: int) -> Any:
    """The directory's DCP metadata, after checking that its files are all there, long
    enough, and (where `save` recorded them) that the files this replica checks, every
    `size`-th from the `rank`-th, have their recorded CRC-32.

    Raises: FileNotFoundError / RuntimeError naming the directory or the file."""
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise ValueError(f"{path!r} is a file, not a sharded checkpoint directory "
                             "(torch.distributed.checkpoint). A single-file checkpoint loads "
                             "with ts.checkpoint.load / ts.load_pretrained.")
        raise FileNotFoundError(f"No sharded checkpoint at {path!r}: no such directory.")
    metadata_path = os.path.join(path, METADATA)
    if not os.path.isfile(metadata_path):
        raise FileNotFoundError(
            f"The sharded checkpoint {path!r} has no {METADATA} file: it is incomplete (a save "
            f"that did not finish, or a copy without its hidden files). {_what_to_do()}")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # unpickling garbage raises anything
        raise RuntimeError(
            f"The sharded checkpoint's {metadata_path!r} cannot be read ({type(error).__name__}: "
            f"{error}): it is truncated or corrupt. {_what_to_do()}") from error
    extents = _compat.dcp_file_extents(metadata)
    for name, needed in sorted(extents.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"The sharded checkpoint {path!r} lacks its data file {name!r}, which its "
                f"{METADATA} refers to: it is incomplete. {_what_to_do()}")
        found = os.path.getsize(file)
        if found < needed:
            raise RuntimeError(
                f"The data file {file!r} of the sharded checkpoint is truncated: {found} bytes, "
                f"where its {METADATA} needs at least {needed}. {_what_to_do()}")
    recorded = _recorded_checksums(path)
    for name in sorted(recorded)[rank::size]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"The sharded checkpoint {path!r} lacks its data file {name!r}, which {CHECKSUMS} "
                f"lists: it is incomplete. {_what_to_do()}")
        expected_size, expected_crc = recorded[name]
        found = os.path.getsize(file)
        if found != expected_size:
            raise RuntimeError(
                f"The data file {file!r} of the sharded checkpoint has {found} bytes where the "
                f"save wrote {expected_size}: it was truncated or changed. {_what_to_do()}")
        crc = _crc32(file)
        if crc != expected_crc:
            raise RuntimeError(
                f"The data file {file!r} of the sharded checkpoint is corrupt: its CRC-32 is "
                f"{crc:08x} where the save recorded {expected_crc:08x} (bits flipped on disk or "
                f"in a copy). {_what_to_do()}")
    return metadata


def _recorded_checksums(path: str) -> dict[str, tuple[int, int]]:
    """What `save` recorded for the directory's data files ({} for a checkpoint written by
    DCP directly: its files are then checked for presence and size only)."""
    file = os.path.join(path, CHECKSUMS)
    if not os.path.exists(file):
        return {}
    try:
        with open(file) as f:
            raw = json.load(f)
        return {str(name): (int(size), int(crc)) for name, (size, crc) in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise RuntimeError(
            f"The sharded checkpoint's {file!r} cannot be read ({error}): it is corrupt. "
            f"{_what_to_do()}") from error


def read_dcp_metadata(path: str | os.PathLike[str], collective: bool) -> Any:
    """Checks the sharded checkpoint directory `path` (every data file present, as long as
    its ``.metadata`` needs, with the CRC-32 `save` recorded) and returns its DCP metadata.

    With `collective` (every replica calls it), the replicas split the checksum work and
    agree on the outcome: all of them raise, or none does.

    Raises:
      FileNotFoundError: no directory, no ``.metadata``, a data file missing.
      RuntimeError: unreadable ``.metadata``, a truncated or corrupt data file (named).
      ValueError: `path` is a file.
    """
    return _checked_metadata(path, peers_of(collective))


def _checked_metadata(path: str | os.PathLike[str], peers: Peers) -> Any:
    """`read_dcp_metadata` among `peers`."""
    metadata, problem = None, None
    try:
        metadata = _check_dcp_directory(os.fspath(path), peers.rank, peers.world_size)
    except (OSError, ValueError, RuntimeError) as error:
        problem = error
    peers.agree(problem, name_finder=True)
    return metadata


def dcp_load(state: dict[str, Any], path: str | os.PathLike[str], no_dist: bool) -> None:
    """``dcp.load(state, path)``, its raw ``CheckpointException`` (raised on every replica
    by DCP itself) replaced by one naming the directory and what to do."""
    try:
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=no_dist)
    except CheckpointException as error:
        failures = getattr(error, "failures", {}) or {}
        first = next(iter(failures.values()), error)
        checked = "present, long enough and with the checksums the save recorded" \
            if _recorded_checksums(os.fspath(path)) else "present and long enough"
        raise RuntimeError(
            f"Reading the sharded checkpoint {os.fspath(path)!r} failed on replica(s) "
            f"{sorted(failures) or '?'}: {type(first).__name__}: {first}. Its data files are "
            f"{checked}, so one of them holds bytes torch cannot read (corrupt where nothing "
            f"recorded a checksum, or written by another torch version). {_what_to_do()}"
        ) from error


def _write_checksums(path: str, metadata: Any, peers: Peers) -> None:
    """After ``dcp.save``: makes the data files 0600 and records their sizes and CRC-32s in
    `CHECKSUMS` (each replica sums its share of the files, the chief writes the record,
    atomically); every replica returns once the record exists, or raises what failed."""
    sums: dict[str, tuple[int, int]] = {}
    problem: BaseException | None = None
    try:
        for name in sorted(_compat.dcp_file_extents(metadata))[peers.rank::peers.world_size]:
            file = os.path.join(path, name)
            os.chmod(file, checkpoint.FILE_MODE)
            sums[name] = (os.path.getsize(file), _crc32(file))
    except OSError as error:
        problem = error
    peers.agree(problem)
    parts = peers.gather_to_chief(sums)
    problem = None
    if parts is not None:
        try:
            _write_record(path, {name: list(value) for part in parts
                                 for name, value in part.items()})
        except OSError as error:
            problem = error
    peers.agree(problem, name_finder=True)


def _write_record(path: str, merged: dict[str, list[int]]) -> None:
    """The chief's part of `_write_checksums`: `merged` written as `CHECKSUMS`, atomically."""
    os.chmod(os.path.join(path, METADATA), checkpoint.FILE_MODE)
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", dir=path)  # 0600
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(merged, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, os.path.join(path, CHECKSUMS))
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def save(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None, peers: Peers | None = None) -> None:
    """Writes a sharded checkpoint with ``torch.distributed.checkpoint``: every replica
    writes its own shards of `model` (and `optimizer`) into the directory `path`. A
    collective; `path` must be shared by the replicas (one file system). The directory is
    0700 and its files 0600; the data files' sizes and CRC-32s are recorded for `load`.
    `peers`: the replicas writing it (default: the default process group's)."""
    path = os.fspath(path)
    peers = peers if peers is not None else peers_of(True)
    os.makedirs(path, mode=checkpoint.DIRECTORY_MODE, exist_ok=True)
    if peers.is_chief:
        os.chmod(path, checkpoint.DIRECTORY_MODE)  # also when it existed
        # A save over an earlier one: its record would not match the new files, and a
        # save that stops before recording must leave none (sizes are still checked).
        if os.path.exists(os.path.join(path, CHECKSUMS)):
            os.unlink(os.path.join(path, CHECKSUMS))
    metadata = dcp.save(_checkpoint_state(model, optimizer), checkpoint_id=path)
    _write_checksums(path, metadata, peers)


def load(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None, peers: Peers | None = None) -> None:
    """Reads a checkpoint written by `save` into `model` (and `optimizer`), whatever the
    number of replicas that wrote it: each replica reads the parts of the tensors its shards
    cover. A collective. The directory is checked first (`read_dcp_metadata`): every
    replica raises the same error, naming the file, before any tensor is read. `peers`: the
    replicas reading it (default: the default process group's)."""
    _checked_metadata(path, peers if peers is not None else peers_of(True))
    state = _checkpoint_state(model, optimizer)
    dcp_load(state, path, no_dist=False)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
