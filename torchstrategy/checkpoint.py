"""Saving and loading under a strategy: one writer, atomic files, loads onto the replica.

Because the scope never wraps modules, ``model.state_dict()`` has the same keys with or
without a strategy: a checkpoint written under any strategy loads into a plain model, and
a plain model's checkpoint loads under any strategy. Variables held by parameter servers
(``PSVariable``, ``ShardedVariable``) are saved as their whole current value, so they load
into any number of shards (``variable.assign(value)``) or into a plain tensor. Under
`ParameterServerStrategy`, ``optimizer.state_dict()`` gathers the optimizer state held by
the parameter servers, so ``{"model": model.state_dict(), "optimizer":
optimizer.state_dict()}`` is the checkpoint one process would write.
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile
from typing import Any, Callable

import torch

from torchstrategy import context, module_state, ownership
from torchstrategy.collectives import peers as peers_lib

# Every checkpoint the library writes is private to its owner: files 0600 (``mkstemp``'s),
# directories created 0700 (sharded checkpoints: strategies/sharding/state.py).
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
# A sharded (torch.distributed.checkpoint) checkpoint is a directory holding this file.
_SHARDED_MARKER = ".metadata"


def owning_extended(*objects: Any) -> Any:
    """The extended of the strategy the checkpointed `objects` belong to, whose
    ``state_dict_for_checkpoint`` / ``load_state_dict_from_checkpoint`` save and load them.

    A module carries its owner (`torchstrategy.module_state`: a module adopted with
    ``strategy.adopt``, built in a strategy's scope, or handed to it by a Trainer), so a
    program holding several strategies checkpoints each model through its own, whichever
    scope was entered last. For objects that carry none (an optimizer alone, a scheduler),
    the strategy active here (inside a ``scope()``) owns them, else the strategy whose
    scope was entered last (`ownership.live_strategy`), else the default strategy.

    Raises:
      ValueError: `objects` owned by different strategies (save them separately, each
        through its own).
    """
    owners: list[Any] = []
    for obj in objects:
        owner = _owner_of(obj)
        if owner is not None and all(owner is not known for known in owners):
            owners.append(owner)
    if len(owners) > 1:
        raise ValueError(
            "These objects belong to different strategies (" + ", ".join(
                type(owner).__name__ for owner in owners) + "), and a checkpoint goes "
            "through the strategy that owns what it saves: checkpoint each strategy's "
            "objects separately.")
    if owners:
        return owners[0]
    strategy = context.active_non_default_strategy() or ownership.live_strategy() \
        or context.get_strategy()
    return strategy.extended


def _owner_of(obj: Any) -> Any:
    """The extended recorded on `obj` (a module) or on one of its submodules, or None."""
    if not isinstance(obj, torch.nn.Module):
        return None
    for module in obj.modules():
        state = module_state.state_of(module)
        if state is not None:
            return state.owner
    return None


def peers_of(extended: Any) -> peers_lib.Peers:
    """The replicas that checkpoint together under `extended`: its communicator's when it
    spans several; for the default strategy (outside every scope, the usual place for
    checkpointing) in a process that is one replica of a launched world, that world's
    (torch.distributed's default process group); else this process alone."""
    communicator = extended.communicator
    if communicator.world_size > 1:
        return peers_lib.Peers(communicator)
    if not context.has_strategy() and extended is context.get_strategy().extended:
        # The default strategy: the launched world's replicas still checkpoint together.
        live = ownership.live_strategy()
        diagnose = None if live is None else live.extended.communicator.diagnose
        return peers_lib.process_group_peers(diagnose)
    return peers_lib.Peers(communicator)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Writes ``torch.save(obj)`` to `path` from replica 0; the other replicas wait.

    The file appears atomically: it is written to a temporary file in the same directory,
    flushed to disk and renamed, so a reader (or a crash) never sees a partial checkpoint.
    Every replica must call this: the other replicas wait for the chief's write (bounded by
    the strategy's timeout), and raise the chief's error if the write failed.

    Raises:
      OSError (or what else the write raised): on every replica, when the chief could not
        write `path`.
      TypeError: on every replica, for an `obj` holding a sharded tensor (ShardedStrategy's
        ``model.state_dict()``), naming it and the call that saves it whole.
    """
    sharded = _first_sharded(obj, "obj")
    if sharded is not None:
        # Every replica holds the same structure, so every replica refuses (no barrier is
        # left waiting); the chief alone would otherwise write only its own shards.
        raise TypeError(
            f"ts.checkpoint.save: {sharded} is a sharded tensor (DTensor; ShardedStrategy's "
            "model.state_dict() / optimizer.state_dict()), of which this replica holds only "
            "its shard. Save strategy.extended.state_dict_for_checkpoint(model) and "
            "...(optimizer) instead (full tensors, gathered by every replica; load them with "
            "load_state_dict_from_checkpoint), or use strategy.extended.save_checkpoint(path, "
            "model, optimizer) for a sharded directory.")
    ext = owning_extended()
    obj = ext.host_copy(obj)  # TPUStrategy: host tensors, loadable without torch_xla
    peers = peers_of(ext)
    with peers.explained("ts.checkpoint.save"):
        peers.run_on_chief(lambda: write_atomically(_current_values(obj), path))


def _first_sharded(obj: Any, where: str) -> str | None:
    """The path (``obj['model']['0.weight']``) of the first DTensor in `obj`'s dicts, lists
    and tuples, or None."""
    if _is_dtensor(obj):
        return where
    items: Any = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found = _first_sharded(value, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def _is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor, without importing DTensor's module: until something
    (ShardedStrategy, the user's code) has imported it, nothing can be a DTensor, and importing
    it here would add about a second to every replica's start (tests/core/test_architecture:
    test_import_has_no_side_effects)."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    return dtensor_module is not None and isinstance(value, dtensor_module.DTensor)


def write_atomically(obj: Any, path: str | os.PathLike[str],
                     directory_mode: int | None = None) -> None:
    """``torch.save(obj)`` to `path` from this process alone, atomically.

    The bytes go to a temporary file ``.tmp-*.pt`` in the same directory, are flushed to
    disk, and the file is renamed over `path` (``os.replace``, atomic on POSIX): a reader
    sees the previous file or the new one, never a partial one, and a process killed midway
    leaves the previous file intact (and a temporary that `remove_stale_temporaries` clears).
    The directory is created (with `directory_mode`, if given) when missing.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if directory_mode is None:
        os.makedirs(directory, exist_ok=True)
    else:
        os.makedirs(directory, mode=directory_mode, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(handle, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> None:
    """Deletes the temporaries that writes killed midway left in `directory` (call it only
    where no other process is writing there)."""
    for stale in glob.glob(os.path.join(glob.escape(os.fspath(directory)), ".tmp-*.pt")):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass


def _current_values(obj: Any) -> Any:
    """`obj` with every variable held elsewhere (a parameter server's ``PSVariable`` or
    ``ShardedVariable``) replaced by its current value as one plain tensor, so checkpoints
    are plain tensors whatever the sharding. Containers are rebuilt only when they hold such
    a variable; everything else is kept as is."""
    if hasattr(obj, "_ts_checkpoint_value"):
        return obj._ts_checkpoint_value()
    if isinstance(obj, dict):
        items = {k: _current_values(v) for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj
        out = type(obj)() if type(obj) is not dict else {}
        out.update(items)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        elements = [_current_values(v) for v in obj]
        if all(a is b for a, b in zip(elements, obj)):
            return obj
        return type(obj)(elements)
    return obj


def load(path: str | os.PathLike[str],
         map_location: str | torch.device | Callable[..., Any] | dict[str, str] | None = None,
         weights_only: bool = True) -> Any:
    """Loads a checkpoint onto this replica's device (or `map_location`).

    By default only tensors and plain containers are unpickled (``weights_only=True``);
    pass ``weights_only=False`` for checkpoints holding other objects, from sources you
    trust.

    Raises:
      FileNotFoundError: naming the path.
      IsADirectoryError: a directory (a sharded checkpoint: the error names the call that
        loads it).
      pickle.UnpicklingError: for a checkpoint that needs ``weights_only=False``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}.")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, _SHARDED_MARKER)):
            raise IsADirectoryError(
                f"{path!r} is a sharded checkpoint (a torch.distributed.checkpoint directory, "
                "as ShardedStrategy's save_checkpoint writes), not a file: load it on every "
                "replica with strategy.extended.load_checkpoint(path, model, optimizer), or "
                "its weights alone into any model with ts.load_pretrained(model, path).")
        raise IsADirectoryError(f"{path!r} is a directory, not a checkpoint file.")
    if map_location is None:
        ext = owning_extended()
        peers = peers_of(ext)
        # Outside every scope in a launched world: the device of this process's replica.
        map_location = peers.device if peers.world_size > 1 and \
            peers.communicator is not ext.communicator \
            else ext.torch_device or torch.device("cpu")
        if torch.device(map_location).type == "xla":
            # torch.load cannot place storages on an XLA device (TPUStrategy): host tensors,
            # which load_state_dict copies into the XLA parameters.
            map_location = torch.device("cpu")
    return torch.load(path, map_location=map_location, weights_only=weights_only)
