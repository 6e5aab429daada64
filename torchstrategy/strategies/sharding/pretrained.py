"""Pretrained weights into a model, sharded or not, without a full copy of the model anywhere.

`load_pretrained(model, source)` reads a plain ``torch.save`` state_dict file (memory-mapped),
a safetensors file or a ``torch.distributed.checkpoint`` directory. For a sharded parameter
(a DTensor, as ShardedStrategy makes them) each replica reads only the part of the tensor
its local shard holds (`state.local_region`): from a memory-mapped file only those pages
are touched, from safetensors only that slice is read (``get_slice``), and DCP reads only
the chunks that overlap the shard. Unsharded tensors (buffers, a MirroredStrategy or
single-device model) are read whole, as ``load_state_dict`` would.

Every key and shape is checked before any tensor is copied, and with sharded parameters
the replicas agree on the outcome (`dcp_io.agree`): all raise the same error, naming the
key, or all load.
"""
from __future__ import annotations

import os
import pwd
import stat
import zipfile
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from torchstrategy.strategies.sharding import dcp_io, state

# The keys a training checkpoint nests the model's state_dict under, tried in this order
# when the file's top level is not a state_dict itself ({"model": ..., "optimizer": ...},
# as written with ts.checkpoint.save, or Lightning's {"state_dict": ...}).
_NESTED_KEYS = ("model", "state_dict")
# The prefix ShardedStrategy's save_checkpoint gives the model's keys in a DCP checkpoint.
_DCP_MODEL_PREFIX = "model."
# Prefixes a wrapper puts before a model's own keys when its state_dict is saved through the
# wrapper: DistributedDataParallel's (and DataParallel's) "module.", torch.compile's
# "_orig_mod.". A source whose keys are the model's behind one of them gets the way to strip it.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# The first bytes of a zip archive's first entry: how a torch.save file starts.
_ZIP_MAGIC = b"PK\x03\x04"
# A pickle stream (protocol 2 or later) starts with this byte: how a torch.save file written
# with _use_new_zipfile_serialization=False starts.
_PICKLE_PROTO = b"\x80"


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
      PermissionError: `source`, or a directory on its way, that this user may not read
        (named, with the user), rather than a missing or incomplete one.
      KeyError: with ``strict=True``, keys missing from `source` or unexpected in it (named).
      ValueError: a shape mismatch (named), a truncated or corrupt file, a file of no known
        format.
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
    opened: _Source | None = None
    plan: list[_Target] = []
    result = LoadResult([], [])
    problem: Exception | None = None
    try:
        is_directory = _is_directory(path)
    except PermissionError as error:     # agreed below, with the file's problems
        is_directory, problem = False, error
    if is_directory:
        return _load_dcp(path, targets, sharded, strict)
    try:
        if problem is None:
            _check_not_meta(targets)
            opened = _open(path)
            plan, result = _plan(targets, opened.shapes, strict, path)
    except (OSError, KeyError, ValueError, RuntimeError) as error:
        problem = error
    try:
        dcp_io.agree(problem, collective=sharded)
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
        prefix = _wrapper_prefix(missing, unexpected)
        if prefix is not None:
            raise KeyError(
                f"load_pretrained({path!r}): its keys are the model's behind the prefix "
                f"{prefix!r} (saved from a {_WRAPPER_NAMES[prefix]}: {_names(unexpected, 3)}). "
                f"Strip the prefix and save the file again: state = {{k.removeprefix("
                f"{prefix!r}): v for k, v in state.items()}}; or save the unwrapped model's "
                f"state_dict (model.module.state_dict() under DDP).")
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


_WRAPPER_NAMES = {"module.": "DistributedDataParallel (or DataParallel) wrapper",
                  "_orig_mod.": "torch.compile'd module"}


def _wrapper_prefix(missing: list[str], unexpected: list[str]) -> str | None:
    """The wrapper prefix (`_WRAPPER_PREFIXES`) that every key of the source the model lacks
    starts with, and behind which the source holds every key the model misses, or None: the
    source is then the model's state_dict saved through DDP or torch.compile."""
    if not missing:
        return None
    for prefix in _WRAPPER_PREFIXES:
        if all(key.startswith(prefix) for key in unexpected) and \
                set(missing) <= {key.removeprefix(prefix) for key in unexpected}:
            return prefix
    return None


def _names(keys: list[str], shown: int = 8) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(repr(k) for k in keys[:shown]) + more


def _open(path: str) -> _Source:
    """The file `path` as a `_Source`, by its format (not its name: a safetensors file
    starts with its header's length and ``{``, a torch file is a zip archive)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"load_pretrained: no file or directory at {path!r}.") from error
    except PermissionError as error:
        raise _permission_error(path, "file") from error
    if zipfile.is_zipfile(path):
        return _open_torch(path)
    if len(head) == 9 and head[8:9] == b"{":
        return _open_safetensors(path)
    if head.startswith(_ZIP_MAGIC):
        raise ValueError(
            f"load_pretrained: {path!r} is a torch.save file (a zip archive) that is truncated "
            f"or corrupt: its {os.path.getsize(path)} bytes end before the archive's "
            "directory. Copy or download it again (compare its size with the original's).")
    if not head:
        raise ValueError(f"load_pretrained: {path!r} is empty (0 bytes): a copy or download "
                         "that did not finish. Copy or download it again.")
    if head.startswith(_PICKLE_PROTO):
        raise ValueError(
            f"load_pretrained: {path!r} is a torch.save file in the old format "
            "(_use_new_zipfile_serialization=False), which cannot be memory-mapped: load it "
            "with torch.load and save it again with torch.save.")
    raise ValueError(
        f"load_pretrained: {path!r} is neither a torch.save file (a zip archive), nor a "
        "safetensors file, nor a torch.distributed.checkpoint directory.")


def _is_directory(path: str) -> bool:
    """``os.path.isdir``, except that a path this user may not look up (a directory on its
    way that is not searchable) raises the PermissionError naming it, where ``isdir`` would
    say False and the path would then be reported missing."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        return False
    except PermissionError as error:
        raise _permission_error(path, "path") from error


def _permission_error(path: str, what: str) -> PermissionError:
    """The error for `path` that exists (or may) but that this user may not read: it names
    the first directory on the way that cannot be searched, or the file itself."""
    blocked = _first_unsearchable_directory(path)
    user = _user()
    if blocked is not None:
        return PermissionError(
            f"load_pretrained: cannot reach {path!r}: the directory {blocked!r} on its way "
            f"cannot be searched by {user} (permission denied; whether the {what} exists "
            f"cannot be told). Give this user access (chmod o+x, or the directory's group), "
            f"or copy the weights somewhere it can read.")
    return PermissionError(
        f"load_pretrained: {path!r} exists but {user} may not read it (permission denied). "
        f"Give this user read access (chmod o+r, or the {what}'s group), or copy the weights "
        f"somewhere it can read.")


def _first_unsearchable_directory(path: str) -> str | None:
    """The first directory from the root down to `path`'s parent that this process cannot
    look into (listing a name in it raises PermissionError), or None."""
    directory = os.path.dirname(os.path.abspath(path))
    parts = [directory]
    while os.path.dirname(parts[-1]) != parts[-1]:
        parts.append(os.path.dirname(parts[-1]))
    for candidate in reversed(parts):
        try:
            os.stat(os.path.join(candidate, "."))
        except PermissionError:
            return candidate
        except OSError:
            return None
    return None


def _user() -> str:
    """This process's user, as a message names it: the name and the uid."""
    uid = os.geteuid()
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


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


def _check_dcp_readable(path: str) -> None:
    """A DCP directory this user may not list or read is refused as such: the checks of
    `dcp_io.read_dcp_metadata` would otherwise find no ``.metadata`` and call it
    incomplete."""
    try:
        for name in os.listdir(path):    # .metadata, the data files, the checksums
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file, "rb"):
                    pass
    except PermissionError as error:
        target = error.filename if isinstance(error.filename, str) else path
        if target == path:
            raise PermissionError(
                f"load_pretrained: the checkpoint directory {path!r} cannot be read by "
                f"{_user()} (permission denied): it may well be complete. Give this user "
                f"read and search access (chmod -R o+rX, or the directory's group), or copy "
                f"it somewhere it can read.") from error
        raise PermissionError(
            f"load_pretrained: {target!r} of the checkpoint directory {path!r} cannot be "
            f"read by {_user()} (permission denied). Give this user read access (chmod -R "
            f"o+rX, or the files' group), or copy it somewhere it can read.") from error


def _load_dcp(path: str, targets: Mapping[str, torch.Tensor], sharded: bool, strict: bool
              ) -> LoadResult:
    """From a DCP directory: the keys and shapes are checked against its metadata, then
    DCP reads into the model's own tensors (for a DTensor, only the stored chunks that
    overlap its local shard)."""
    problem: Exception | None = None
    try:
        _check_not_meta(targets)
        _check_dcp_readable(path)
    except (ValueError, PermissionError) as error:
        problem = error
    dcp_io.agree(problem, collective=sharded)
    metadata = dcp_io.read_dcp_metadata(path, collective=sharded)
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
        problem = error
    dcp_io.agree(problem, collective=sharded)
    # DCP copies into the tensors given (a DTensor's local shard in place); detached, as a
    # parameter that requires grad refuses an in-place copy.
    inner = {target.key: target.tensor.detach() for target in plan}
    state_dict: dict[str, Any] = {"model": inner} if prefix else inner
    dcp_io.dcp_load(state_dict, path, no_dist=not sharded)
    return result
