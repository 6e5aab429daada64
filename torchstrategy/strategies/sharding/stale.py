"""Optimizers built before their model was sharded: `StaleParameters`.

``fully_shard`` replaces every parameter of a module by a new DTensor parameter. An
optimizer built from ``model.parameters()`` before the model was sharded (the usual ``with
strategy.scope(): model = ...; optimizer = ...``: the scope shards when it exits) holds the
replaced tensors. `StaleParameters` remembers which tensor replaced which, and a global
optimizer step pre-hook swaps them in the optimizer's parameter groups (in place, so
optimizers that keep a reference to a group's list see it) before its first step
(`StaleParameters.refresh_optimizer`).
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch
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
        self._refreshed = WeakIdKeyDictionary()      # optimizer -> the version it saw

    def add(self, root: torch.nn.Module, before: Mapping[str, torch.Tensor]) -> None:
        """Records that `root`'s parameters `before` (name -> unsharded parameter) were
        replaced by its parameters of the same names."""
        root_ref = weakref.ref(root)
        for name, old in before.items():
            self._replaced[old] = (root_ref, name)
        self._version += 1

    def refresh_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces, in `optimizer`'s parameter groups, every parameter that sharding
        replaced by its sharded parameter. Cheap when there is nothing to do.

        Raises:
          RuntimeError: optimizer state already held for an unsharded parameter (a
            ``load_state_dict`` of an unsharded optimizer checkpoint before the first step),
            or a replaced parameter whose sharded module no longer exists.
        """
        if not self._replaced or self._refreshed.get(optimizer) == self._version:
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
        self._refreshed[optimizer] = self._version


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
    runtime.current().state(_STATE_KEY, StaleParameters).refresh_optimizer(optimizer)
    return None
