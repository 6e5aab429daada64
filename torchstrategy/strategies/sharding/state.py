"""Sharded state outside the modules: checkpoints, the plain export, full tensors into
shards. (Optimizers built before sharding: `torchstrategy.strategies.sharding.stale`.)

Checkpoints go through ``torch.distributed.checkpoint``: `save` / `load` write and read each
replica's shards (a checkpoint written by N replicas loads on M), `export_state_dict` gives
the plain single-device ``state_dict``. `save` makes the directory 0700 and its files 0600
(as every checkpoint of the library) and records each data file's size and CRC-32 beside
``.metadata``; `read_dcp_metadata` checks a directory against them on every replica, and
the replicas agree on what they found (`agree`) before any of them reads a tensor, so a
missing, truncated or corrupt file is one clear error everywhere instead of DCP's raw
``CheckpointException`` on some replicas and a hang on the others.

Full tensors into shards: `route_full_state_dicts` lets ``model.load_state_dict(full)`` of a
sharded model take a plain (MirroredStrategy, single-device) ``state_dict``: each replica
keeps the part of every tensor its shard covers (`local_region`).
"""
from __future__ import annotations

import json
import os
import tempfile
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchstrategy import _compat, checkpoint
from torchstrategy.strategies.sharding import stale

def is_sharded(module: Any) -> bool:
    """True if `module` holds at least one DTensor parameter."""
    return isinstance(module, torch.nn.Module) and any(
        isinstance(p, DTensor) for p in module.parameters())


def _full(cpu_offload: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def export_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The plain single-device ``state_dict`` of a sharded `model` (a collective: every
    replica calls it): full tensors on the CPU, no DTensors, the keys of the unwrapped
    model. The chief (replica 0) gets it, the other replicas an empty dict."""
    return get_model_state_dict(model, options=_full())


def export_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                                ) -> dict[str, Any]:
    """The full ``state_dict`` of an optimizer over `model`'s sharded parameters, keyed by
    parameter name (a collective; the chief gets it, the others an empty dict)."""
    stale.stale_parameters().refresh_optimizer(optimizer)
    return get_optimizer_state_dict(model, optimizer, options=_full())


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Loads a plain (full, unsharded) ``state_dict`` into a sharded `model`: every
    replica passes the same dict and keeps its shard. Missing or unexpected keys raise."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Loads what `export_optimizer_state_dict` returned (on every replica)."""
    stale.stale_parameters().refresh_optimizer(optimizer)
    set_optimizer_state_dict(model, optimizer, state_dict,
                             options=StateDictOptions(full_state_dict=True))


def _checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        stale.stale_parameters().refresh_optimizer(optimizer)
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


# -- agreeing on a problem ------------------------------------------------------------
# The exceptions a problem found on one replica is raised as on every replica.
_KINDS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError, "ValueError": ValueError,
    "RuntimeError": RuntimeError, "KeyError": KeyError, "PermissionError": PermissionError}


def distributed() -> bool:
    """True when this process is one of several in a process group (the replicas of a
    ShardedStrategy): checks and reads are then collectives."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def agree(problem: tuple[str, str] | None, collective: bool) -> None:
    """Raises, on every replica, the problem the first replica that found one found.

    `problem` is this replica's (exception class name, message) or None. With
    `collective`, every replica of the default process group calls this at the same point
    (a status all-gather, so a replica that found nothing does not go on into a collective
    the others never join); without, only this replica's problem counts."""
    problems: list[Any] = [problem]
    if collective and distributed():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    for rank, found in enumerate(problems):
        if found is not None:
            kind, message = found
            where = f" (found by replica {rank})" if len(problems) > 1 else ""
            raise _KINDS.get(kind, RuntimeError)(message + where)


def problem_of(error: Exception) -> tuple[str, str]:
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return type(error).__name__, str(message)


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
    rank, size = _rank_and_size() if collective else (0, 1)
    metadata, problem = None, None
    try:
        metadata = _check_dcp_directory(os.fspath(path), rank, size)
    except (OSError, ValueError, RuntimeError) as error:
        problem = problem_of(error)
    agree(problem, collective)
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


def _write_checksums(path: str, metadata: Any) -> None:
    """After ``dcp.save``: makes the data files 0600 and records their sizes and CRC-32s in
    `CHECKSUMS` (each replica sums its share of the files, the chief writes the record,
    atomically); every replica returns once the record exists."""
    rank, size = _rank_and_size()
    sums: dict[str, tuple[int, int]] = {}
    problem = None
    try:
        for name in sorted(_compat.dcp_file_extents(metadata))[rank::size]:
            file = os.path.join(path, name)
            os.chmod(file, checkpoint.FILE_MODE)
            sums[name] = (os.path.getsize(file), _crc32(file))
    except OSError as error:
        problem = problem_of(error)
    everyone: list[Any] = [(sums, problem)]
    if size > 1:
        everyone = [None] * size
        dist.all_gather_object(everyone, (sums, problem))
    agree(next((found for _, found in everyone if found is not None), None), False)
    problem = None
    if rank == 0:
        try:
            merged = {name: list(value) for part, _ in everyone for name, value in part.items()}
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
        except OSError as error:
            problem = problem_of(error)
    agree(problem, True)


def save(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Writes a sharded checkpoint with ``torch.distributed.checkpoint``: every replica
    writes its own shards of `model` (and `optimizer`) into the directory `path`. A
    collective; `path` must be shared by the replicas (one file system). The directory is
    0700 and its files 0600; the data files' sizes and CRC-32s are recorded for `load`."""
    path = os.fspath(path)
    os.makedirs(path, mode=checkpoint.DIRECTORY_MODE, exist_ok=True)
    if _rank_and_size()[0] == 0:
        os.chmod(path, checkpoint.DIRECTORY_MODE)  # also when it existed
        # A save over an earlier one: its record would not match the new files, and a
        # save that stops before recording must leave none (sizes are still checked).
        if os.path.exists(os.path.join(path, CHECKSUMS)):
            os.unlink(os.path.join(path, CHECKSUMS))
    metadata = dcp.save(_checkpoint_state(model, optimizer), checkpoint_id=path)
    _write_checksums(path, metadata)


def load(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Reads a checkpoint written by `save` into `model` (and `optimizer`), whatever the
    number of replicas that wrote it: each replica reads the parts of the tensors its shards
    cover. A collective. The directory is checked first (`read_dcp_metadata`): every
    replica raises the same error, naming the file, before any tensor is read."""
    read_dcp_metadata(path, collective=True)
    state = _checkpoint_state(model, optimizer)
    dcp_load(state, path, no_dist=False)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


# -- full tensors into shards ------------------------------------------------------------
def local_region(tensor: DTensor) -> tuple[slice, ...]:
    """The part of the full tensor that `tensor`'s local shard holds, as one slice per
    dimension, computed from its placements and this replica's mesh coordinate with
    DTensor's even split (``torch.chunk``: ceil(n / k) rows per shard, the last ones
    shorter or empty), the placements applied in mesh order.

    Raises:
      ValueError: a placement other than Shard / Replicate (a Partial tensor has no full
        value to slice; strided shards of nested parallelism are not supported).
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("This process is not part of the tensor's device mesh.")
    starts = [0] * tensor.dim()
    sizes = list(tensor.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise ValueError(f"Cannot load full tensors into a DTensor placed as "
                             f"{list(tensor.placements)}: only Shard(dim) and Replicate are "
                             "supported.")
        dim = placement.dim % tensor.dim()
        parts = mesh.size(mesh_dim)
        chunk = -(-sizes[dim] // parts)
        start = min(coordinate[mesh_dim] * chunk, sizes[dim])
        starts[dim] += start
        sizes[dim] = max(0, min(chunk, sizes[dim] - start))
    local_shape = list(tensor.to_local().shape)
    if sizes != local_shape:  # DTensor changed its split: refuse rather than misplace data
        raise RuntimeError(f"The local shard of a {list(tensor.shape)} DTensor placed as "
                           f"{list(tensor.placements)} is {local_shape}, not the {sizes} of an "
                           "even split; torchstrategy does not know how it was split.")
    return tuple(slice(start, start + size) for start, size in zip(starts, sizes))


def _shard_full_tensors(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any, strict: bool, missing_keys: list[str],
                        unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """``load_state_dict`` pre-hook of a module holding sharded parameters: a full plain
    tensor given for one of them is replaced by a DTensor holding this replica's part of it,
    which the parameter's own ``copy_`` then takes (no communication). Anything else (a
    DTensor, a tensor of the wrong shape: torch reports it) is left to torch."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and \
                not isinstance(value, DTensor) and value.shape == param.shape:
            if local_metadata.get("assign_to_params_buffers"):
                # The plain tensor would replace FSDP2's sharded parameter: torch must not
                # see it (the parameter stays as it was) and load_state_dict raises.
                del state_dict[prefix + name]
                error_msgs.append(
                    f"{prefix + name}: load_state_dict(assign=True) cannot replace a "
                    "parameter ShardedStrategy sharded by a full tensor; load without "
                    "assign=True (each replica keeps its part), or use ts.load_pretrained.")
                continue
            local = param.to_local()
            part = value.detach()[local_region(param)].to(device=local.device,
                                                           dtype=local.dtype)
            state_dict[prefix + name] = DTensor.from_local(
                part, param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride())
    return None


def route_full_state_dicts(root: torch.nn.Module) -> None:
    """Makes ``load_state_dict`` of `root` (just sharded), or of any of its modules, accept
    full plain tensors for the sharded parameters, as a MirroredStrategy or single-device
    checkpoint holds them; every replica passes the same full ``state_dict``."""
    for module in root.modules():
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            module.register_load_state_dict_pre_hook(_shard_full_tensors)
