"""Sharded state outside the modules: optimizers, checkpoints, the plain export.

Optimizers. ``fully_shard`` replaces every parameter of a module by a new DTensor
parameter. An optimizer built from ``model.parameters()`` before the model was sharded
(the usual ``with strategy.scope(): model = ...; optimizer = ...``: the scope shards when it
exits) holds the replaced tensors. `StaleParameters` remembers which tensor replaced which,
and a global optimizer step pre-hook swaps them in the optimizer's parameter groups (in
place, so optimizers that keep a reference to a group's list see it) before its first step.

Checkpoints go through ``torch.distributed.checkpoint``: `save` / `load` write and read each
replica's shards (a checkpoint written by N replicas loads on M), `export_state_dict` gives
the plain single-device ``state_dict``.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as optim_lib
from torch.utils.weak import WeakIdKeyDictionary

from torchstrategy import runtime

_STATE_KEY = "torchstrategy.sharded.stale_parameters"


class StaleParameters:
    """Which sharded parameter replaced which unsharded one (weakly: neither is kept
    alive), and which optimizers were already brought up to date.

    The sharded parameter is found through its module and name, not a weak reference to
    it: ``torch.utils.swap_tensors`` (``module.to()`` / ``.cpu()`` on an FSDP2 module)
    refuses tensors that have weak references."""

    def __init__(self) -> None:
        # old (unsharded) parameter -> (weakref to its model's root, its name there). Weak
        # in the old parameters (no longer any module's, so a weak reference to them stops
        # nothing): an entry goes with its parameter, and a new tensor is never taken for
        # a dead one.
        self._replaced = WeakIdKeyDictionary()
        self._version = 0
        self._adopted = WeakIdKeyDictionary()        # optimizer -> the version it saw

    def add(self, root: torch.nn.Module, before: Mapping[str, torch.Tensor]) -> None:
        """Records that `root`'s parameters `before` (name -> unsharded parameter) were
        replaced by its parameters of the same names."""
        root_ref = weakref.ref(root)
        for name, old in before.items():
            self._replaced[old] = (root_ref, name)
        self._version += 1

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces, in `optimizer`'s parameter groups, every parameter that sharding
        replaced by its sharded parameter. Cheap when there is nothing to do.

        Raises:
          RuntimeError: optimizer state already held for an unsharded parameter (a
            ``load_state_dict`` of an unsharded optimizer checkpoint before the first step),
            or a replaced parameter whose sharded module no longer exists.
        """
        if not self._replaced or self._adopted.get(optimizer) == self._version:
            return
        for group in optimizer.param_groups:
            params = group["params"]
            for index, param in enumerate(params):
                replaced = self._replaced.get(param)
                if replaced is None:
                    continue
                root_ref, name = replaced
                new = _parameter(root_ref(), name)
                if new is param:
                    continue
                if new is None:
                    raise RuntimeError(
                        "An optimizer holds a parameter of a module that ShardedStrategy "
                        "sharded and that no longer exists; build the optimizer from the "
                        "live model's parameters.")
                if optimizer.state.get(param):
                    raise RuntimeError(
                        "This optimizer holds state for a parameter as it was before "
                        "ShardedStrategy sharded it (an unsharded optimizer state_dict "
                        "loaded before the first step?). Load optimizer checkpoints with "
                        "strategy.extended.load_checkpoint(path, model, optimizer) or "
                        "load_state_dict_from_checkpoint(optimizer, state).")
                params[index] = new
        self._adopted[optimizer] = self._version


def _parameter(root: torch.nn.Module | None, name: str) -> torch.nn.Parameter | None:
    """`root`'s parameter `name`, or None when `root` is gone or no longer has it."""
    if root is None:
        return None
    try:
        return root.get_parameter(name)
    except AttributeError:
        return None


def stale_parameters() -> StaleParameters:
    """This process's `StaleParameters`, with the optimizer step pre-hook installed."""
    stale = runtime.current().state(_STATE_KEY, StaleParameters)
    runtime.current().install_once(
        _STATE_KEY, lambda: optim_lib.register_optimizer_step_pre_hook(_before_step))
    return stale


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    runtime.current().state(_STATE_KEY, StaleParameters).adopt(optimizer)
    return None


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
    stale_parameters().adopt(optimizer)
    return get_optimizer_state_dict(model, optimizer, options=_full())


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Loads a plain (full, unsharded) ``state_dict`` into a sharded `model`: every
    replica passes the same dict and keeps its shard. Missing or unexpected keys raise."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Loads what `export_optimizer_state_dict` returned (on every replica)."""
    stale_parameters().adopt(optimizer)
    set_optimizer_state_dict(model, optimizer, state_dict,
                             options=StateDictOptions(full_state_dict=True))


def _checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        stale_parameters().adopt(optimizer)
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Writes a sharded checkpoint with ``torch.distributed.checkpoint``: every replica
    writes its own shards of `model` (and `optimizer`) into the directory `path`. A
    collective; `path` must be shared by the replicas (one file system)."""
    dcp.save(_checkpoint_state(model, optimizer), checkpoint_id=str(path))


def load(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Reads a checkpoint written by `save` into `model` (and `optimizer`), whatever the
    number of replicas that wrote it: each replica reads the parts of the tensors its shards
    cover. A collective."""
    state = _checkpoint_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
