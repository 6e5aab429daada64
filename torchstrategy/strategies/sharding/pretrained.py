"""Pretrained weights into a model, sharded or not, without a full copy of the model anywhere.

`load_pretrained(model, source)` reads a plain ``torch.save`` state_dict file (memory-mapped),
a safetensors file or a ``torch.distributed.checkpoint`` directory. For a sharded parameter
(a DTensor, as ShardedStrategy makes them) each replica reads only the part of the tensor
its local shard holds (`state.local_region`): from a memory-mapped file only those pages
are touched, from safetensors only that slice is read (``get_slice``), and DCP reads only
the chunks that overlap the shard. Unsharded tensors (buffers, a MirroredStrategy or
single-device model) are read whole, as ``load_state_dict`` would.

Every key and shape is checked before any tensor is copied, and with sharded parameters
the replicas agree on the outcome (`state.agree`): all raise the same error, naming the
key, or all load.
"""
from __future__ import annotations

import os
import zipfile
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from torchstrategy.strategies.sharding import state

# The keys a training checkpoint nests the model's state_dict under, tried in this order
# when the file's top level is not a state_dict itself ({"model": ..., "optimizer": ...},
# as written with ts.checkpoint.save, or Lightning's {"state_dict": ...}).
_NESTED_KEYS = ("model", "state_dict")
# The prefix ShardedStrategy's save_checkpoint gives the model's keys in a DCP checkpoint.
_DCP_MODEL_PREFIX = "model."


class LoadResult(NamedTuple):
    """What `load_pretrained` did not load, as ``load_state_dict``'s result: keys of the
    model the source lacks, and keys of the source the model lacks (both empty when
    ``strict=True``, which raises instead)."""
    missing_keys: list[str]
    unexpected_keys: list[str]


class _Target(NamedTuple):
    key: str
    tensor: torch.Tensor             # the parameter / buffer itself
    local: torch.Tensor              # where the values go: the local shard, or the tensor
    region: tuple[slice, ...]        # which part of the full tensor goes there


class _Source:
    """One file's tensors: their shapes, and any part of one read on demand."""

    def __init__(self, shapes: dict[str, tuple[int, ...]],
                 read: Callable[[str, tuple[slice, ...]], torch.Tensor], close: Callable[[], None]
                 ) -> None:
        self.shapes = shapes
        self.read = read
        self.close = close


def load_pretrained(model: torch.nn.Module, source: str | os.PathLike[str], *,
                    strict: bool = True) -> LoadResult:
    """Loads the weights in `source` into `model`, each replica reading only its shards.

    Args:
      model: any module: sharded by ShardedStrategy (its parameters are DTensors; call this
        on every replica, after the scope that built the model), or plain (MirroredStrategy,
        one device, no strategy).
      source: a ``torch.save`` file of a state_dict (or of a dict holding one under
        "model" or "state_dict"), read memory-mapped (``torch.load(mmap=True,
        weights_only=True)``); a ``.safetensors`` file; or a ``torch.distributed.checkpoint``
        directory (its keys plain, or under "model." as ``save_checkpoint`` writes them).
      strict: as ``load_state_dict``'s: every key of the model must be in `source` and
        every tensor of `source` in the model. A shape that differs is an error either way.

    Returns:
      `LoadResult` (missing and unexpected keys; empty with ``strict=True``).

    Raises:
      FileNotFoundError: no `source`; a DCP directory without ``.metadata`` or a data file.
      KeyError: with ``strict=True``, keys missing from `source` or unexpected in it (named).
      ValueError: a shape mismatch (named), an unreadable file, a file of no known format.
      RuntimeError: a truncated or corrupt DCP checkpoint (the file named).
      With sharded parameters every replica raises the same error, before anything is
      copied.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_pretrained(model, ...): model must be an nn.Module, got "
                        f"{type(model).__name__}.")
    if not isinstance(strict, bool):
        raise TypeError(f"load_pretrained(strict={strict!r}): give True or False.")
    path = os.fspath(source)
    targets = model.state_dict(keep_vars=True)
    sharded = any(isinstance(t, DTensor) for t in targets.values())
    if os.path.isdir(path):
        return _load_dcp(path, targets, sharded, strict)
    opened: _Source | None = None
    plan: list[_Target] = []
    result = LoadResult([], [])
    problem = None
    try:
        _check_not_meta(targets)
        opened = _open(path)
        plan, result = _plan(targets, opened.shapes, strict, path)
    except (OSError, KeyError, ValueError, RuntimeError) as error:
        problem = state.problem_of(error)
    try:
        state.agree(problem, collective=sharded)
        with torch.no_grad():
            for target in plan:
                assert opened is not None
                target.local.copy_(opened.read(target.key, target.region))
    finally:
        if opened is not None:
            opened.close()
    return result


def _check_not_meta(targets: Mapping[str, torch.Tensor]) -> None:
    """Copying into a meta tensor does nothing: refuse a model not materialised yet."""
    for key, tensor in targets.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_meta:
            raise ValueError(
                f"load_pretrained: the model's {key!r} is on the meta device (no memory, "
                "nothing to copy into). Call load_pretrained after the strategy.scope() that "
                "built the model: ShardedStrategy allocates the shards when the scope exits "
                "(without a strategy: model.to_empty(device=...) first).")


def _plan(targets: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]],
          strict: bool, path: str) -> tuple[list[_Target], LoadResult]:
    """What to copy where, after checking keys and shapes (nothing read yet)."""
    missing = [key for key in targets if key not in shapes]
    unexpected = [key for key in shapes if key not in targets]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from it: {_names(missing)}")
        if unexpected:
            parts.append(f"in it but not in the model: {_names(unexpected)}")
        raise KeyError(f"load_pretrained({path!r}): the keys differ from the model's; "
                       f"{'; '.join(parts)}. Rename the keys, or pass strict=False to load "
                       "the common ones.")
    plan = []
    for key, tensor in targets.items():
        if key not in shapes:
            continue
        if tuple(shapes[key]) != tuple(tensor.shape):
            raise ValueError(f"load_pretrained({path!r}): {key!r} has shape "
                             f"{list(shapes[key])} there and {list(tensor.shape)} in the model.")
        if isinstance(tensor, DTensor):
            plan.append(_Target(key, tensor, tensor.to_local(), state.local_region(tensor)))
        else:
            plan.append(_Target(key, tensor, tensor,
                                tuple(slice(0, n) for n in tensor.shape)))
    return plan, LoadResult(missing, unexpected)


def _names(keys: list[str], shown: int = 8) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(repr(k) for k in keys[:shown]) + more


def _open(path: str) -> _Source:
    """The file `path` as a `_Source`, by its format (not its name: a safetensors file
    starts with its header's length and ``{``, a torch file is a zip archive)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_pretrained: no file or directory at {path!r}.")
    if zipfile.is_zipfile(path):
        return _open_torch(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        return _open_safetensors(path)
    raise ValueError(
        f"load_pretrained: {path!r} is neither a torch.save file (zip format; files saved "
        "with _use_new_zipfile_serialization=False cannot be memory-mapped: load and save "
        "them again), nor a safetensors file, nor a torch.distributed.checkpoint directory.")


def _open_torch(path: str) -> _Source:
    try:
        # mmap: the tensors stay in the file; reading a slice touches only its pages.
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # unpickling reports anything
        raise ValueError(f"load_pretrained: {path!r} cannot be read as a torch.save file "
                         f"({type(error).__name__}: {error}).") from error
    tensors = _state_dict_in(loaded, path)
    return _Source({k: tuple(v.shape) for k, v in tensors.items()},
                   lambda key, region: tensors[key][region], lambda: None)


def _state_dict_in(loaded: Any, path: str) -> Mapping[str, torch.Tensor]:
    if isinstance(loaded, Mapping):
        if loaded and all(isinstance(v, torch.Tensor) for v in loaded.values()):
            return loaded
        for key in _NESTED_KEYS:
            inner = loaded.get(key)
            if isinstance(inner, Mapping) and inner and \
                    all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
    raise ValueError(f"load_pretrained: {path!r} holds no state_dict (a dict of tensors, or "
                     f"one under {' or '.join(map(repr, _NESTED_KEYS))}).")


def _open_safetensors(path: str) -> _Source:
    # safetensors is an optional dependency (scripts/setup.sh installs it).
    try:
        import safetensors
    except ImportError as error:
        raise ValueError(f"load_pretrained: {path!r} is a safetensors file; install the "
                         "safetensors package (pip install safetensors).") from error
    try:
        handle = safetensors.safe_open(path, framework="pt", device="cpu")
        opened = handle.__enter__()
        shapes = {key: tuple(opened.get_slice(key).get_shape()) for key in opened.keys()}
    except Exception as error:  # safetensors reports a bad header as its own error type
        raise ValueError(f"load_pretrained: {path!r} cannot be read as a safetensors file "
                         f"({type(error).__name__}: {error}).") from error

    def read(key: str, region: tuple[slice, ...]) -> torch.Tensor:
        if not region:  # a 0-dim tensor has no slice to take
            return opened.get_tensor(key)
        return opened.get_slice(key)[region]

    return _Source(shapes, read, lambda: handle.__exit__(None, None, None))


def _load_dcp(path: str, targets: Mapping[str, torch.Tensor], sharded: bool, strict: bool
              ) -> LoadResult:
    """From a DCP directory: the keys and shapes are checked against its metadata, then
    DCP reads into the model's own tensors (for a DTensor, only the stored chunks that
    overlap its local shard)."""
    problem = None
    try:
        _check_not_meta(targets)
    except ValueError as error:
        problem = state.problem_of(error)
    state.agree(problem, collective=sharded)
    metadata = state.read_dcp_metadata(path, collective=sharded)
    stored = {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
              if hasattr(meta, "size")}  # tensors only (optimizer hyper-parameters are bytes)
    prefix = ""
    if targets and not any(key in stored for key in targets) and \
            any(_DCP_MODEL_PREFIX + key in stored for key in targets):
        prefix = _DCP_MODEL_PREFIX
    shapes = {key[len(prefix):]: shape for key, shape in stored.items()
              if key.startswith(prefix)}
    plan: list[_Target] = []
    result = LoadResult([], [])
    problem = None
    try:
        plan, result = _plan(targets, shapes, strict, path)
    except (KeyError, ValueError, RuntimeError) as error:
        problem = state.problem_of(error)
    state.agree(problem, collective=sharded)
    # DCP copies into the tensors given (a DTensor's local shard in place); detached, as a
    # parameter that requires grad refuses an in-place copy.
    inner = {target.key: target.tensor.detach() for target in plan}
    state_dict: dict[str, Any] = {"model": inner} if prefix else inner
    state.dcp_load(state_dict, path, no_dist=not sharded)
    return result
