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
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchstrategy import context

# Every checkpoint the library writes is private to its owner: files 0600 (``mkstemp``'s),
# directories created 0700 (sharded checkpoints: strategies/sharding/state.py).
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
# A sharded (torch.distributed.checkpoint) checkpoint is a directory holding this file.
_SHARDED_MARKER = ".metadata"


class _ProcessGroupFacts:
    """Outside any scope in a multi-replica program (the usual place for checkpointing)
    the default strategy is active, yet this process is still one replica of the launched
    world: take the rank, the barrier and the device from torch.distributed."""

    def __init__(self) -> None:
        self.replica_id = dist.get_rank()
        nccl = dist.get_backend() == "nccl" and torch.cuda.is_available()
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) if nccl \
            else torch.device("cpu")
        self.communicator = self

    def host_copy(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        if self.torch_device.type == "cuda":
            dist.barrier(device_ids=[self.torch_device.index])
        else:
            dist.barrier()


def _strategy_facts() -> tuple[Any, bool]:
    ext: Any
    if not context.has_strategy() and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        ext = _ProcessGroupFacts()
    else:
        ext = context.get_strategy().extended
    return ext, ext.replica_id == 0


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Writes ``torch.save(obj)`` to `path` from replica 0; the other replicas wait.

    The file appears atomically: it is written to a temporary file in the same directory,
    flushed to disk and renamed, so a reader (or a crash) never sees a partial checkpoint.
    Every replica must call this (it ends with a barrier, bounded by the strategy's
    timeout).

    Raises:
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
    ext, writer = _strategy_facts()
    obj = ext.host_copy(obj)  # TPUStrategy: host tensors, loadable without torch_xla
    error = None
    if writer:
        try:
            write_atomically(_current_values(obj), path)
        except BaseException as caught:  # the barrier below must still be reached
            error = caught
    ext.communicator.barrier()
    if error is not None:
        raise error


def _first_sharded(obj: Any, where: str) -> str | None:
    """The path (``obj['model']['0.weight']``) of the first DTensor in `obj`'s dicts, lists
    and tuples, or None."""
    if isinstance(obj, DTensor):
        return where
    items: Any = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found = _first_sharded(value, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


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
        ext, _ = _strategy_facts()
        map_location = ext.torch_device or torch.device("cpu")
    return torch.load(path, map_location=map_location, weights_only=weights_only)
