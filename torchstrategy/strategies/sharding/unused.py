"""Replicas that use different parameters in one step (a branch chosen by each replica's
own batch): ShardedStrategy's gradients stay those of one device, as MirroredStrategy's.

FSDP2 reduce-scatters, for each unit, one flat buffer of the gradients its replica holds:
a parameter that got no gradient on this replica is left out, so two replicas that used
different parameters lay out different buffers and sum mismatched slices (silently wrong
gradients). Two things make it right:

- every unit reduce-scatters every parameter that requires a gradient, a zero one where
  this replica used none (FSDP2's public ``set_reduce_scatter_unused_params``): the same
  layout on every replica, so a parameter used on some replicas gets the sum of theirs;
- a parameter that *no* replica used then has a zero gradient where one device has none
  (``.grad is None``, which optimizers skip: AdamW would otherwise decay it, momentum move
  it). `UnusedParameters` records which parameters this replica used (a hook on each
  gathered parameter's gradient accumulation) in the backward passes since the last one
  that reduced (those under ``no_sync`` accumulate), and at the end of a backward that
  reduced the replicas sum that mask (one all-reduce of 4 bytes per parameter); a parameter
  no replica used, whose gradient was None when those backward passes began, gets None
  back before ``backward()`` returns.

``ShardedStrategy(same_parameters_every_step=True)`` declares that every replica uses the
same parameters in every step and skips both (FSDP2's own behaviour).
"""
from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule

from torchstrategy import _compat, nest
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.reduce_op import ReduceOp


class UnusedParameters:
    """The parameters one sharded model's replica used since its gradients were last
    reduced, and the exchange that gives a gradient of None back to those no replica used.
    It lives as long as the model's hooks that hold it.

    Args:
      root: the sharded model (its units already ``fully_shard``-ed).
      communicator: the replicas' communicator (the mask is summed over all of them).
    """

    def __init__(self, root: torch.nn.Module, communicator: Communicator) -> None:
        self._root = weakref.ref(root)
        self._communicator = communicator
        self._names = [name for name, _ in root.named_parameters()]
        index = {name: i for i, name in enumerate(self._names)}
        self._used = torch.zeros(len(self._names), dtype=torch.int32)
        self._none_before: list[bool] = []
        self._open = False
        self._queued = False
        # The gathered (unsharded) parameter objects hooked so far: FSDP2 keeps one per
        # parameter for the model's life and refills its storage at each gather.
        self._hooked: dict[int, torch.Tensor] = {}
        for unit_name, unit in root.named_modules():
            if _is_unit(unit):
                cast(FSDPModule, unit).set_reduce_scatter_unused_params(True, recurse=False)
                owned = _owned_parameters(unit, unit_name, index)
                # After FSDP2's own pre-forward (registered first): the unit's parameters
                # are the gathered ones while this runs.
                unit.register_forward_pre_hook(
                    lambda module, inputs, owned=owned: self._hook_gathered(owned))
        root.register_forward_hook(lambda module, inputs, output: self._watch(output))

    def _parameters(self) -> list[torch.nn.Parameter]:
        root = self._root()
        return [] if root is None else list(root.parameters())

    def _watch(self, output: Any) -> None:
        """After the model's forward: the first gradient to reach its output starts the
        backward, before any unit reduce-scatters."""
        for leaf in nest.flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        """At the start of a backward: opens the window if none is (which gradients are None
        now, after any ``zero_grad``; nothing used yet), and queues `_backward_ends` after
        FSDP2's own end-of-backward callback (its hook on this output was registered, and
        so runs and queues, first)."""
        if not self._open:
            self._none_before = [p.grad is None for p in self._parameters()]
            self._used.zero_()
            self._open = True
        if not self._queued:
            self._queued = True
            _compat.queue_autograd_callback(self._backward_ends)
        return None

    def _backward_ends(self) -> None:
        self._queued = False
        root = self._root()
        if root is not None and _compat.fsdp_reduces_gradients(root):
            self.settle()

    def _hook_gathered(self, owned: list[tuple[torch.nn.Module, str, int]]) -> None:
        for module, attribute, position in owned:
            tensor = getattr(module, attribute)
            if id(tensor) in self._hooked or not tensor.requires_grad:
                continue
            self._hooked[id(tensor)] = tensor
            tensor.register_post_accumulate_grad_hook(
                lambda _, position=position: self._mark_used(position))

    def _mark_used(self, position: int) -> None:
        self._used[position] = 1

    def settle(self) -> None:
        """At the end of a backward that reduced, on every replica: a parameter that no
        replica used in the window, and had no gradient when it opened, gets ``.grad =
        None`` back. A collective (every replica runs that backward)."""
        if not self._open:
            return
        self._open = False
        params = self._parameters()
        if not params:
            return
        used = self._used.clone()  # how many replicas used each parameter
        if self._communicator.world_size > 1:
            self._communicator.all_reduce([used], ReduceOp.SUM, inplace=True,
                                          check_layout=False)
        for position in torch.nonzero(used == 0).flatten().tolist():
            param = params[position]
            if self._none_before[position] and param.grad is not None:
                param.grad = None


def _is_unit(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _owned_parameters(unit: torch.nn.Module, unit_name: str, index: dict[str, int]
                      ) -> list[tuple[torch.nn.Module, str, int]]:
    """(module, attribute, position in the model's ``named_parameters()``) of each parameter
    that `unit` itself gathers: those of its modules that are not inside another unit."""
    owned = []
    stack: list[tuple[str, torch.nn.Module]] = [(unit_name, unit)]
    while stack:
        name, module = stack.pop()
        for attribute, param in module.named_parameters(recurse=False):
            full = f"{name}.{attribute}" if name else attribute
            if param is not None and full in index:
                owned.append((module, attribute, index[full]))
        for child_name, child in module.named_children():
            if not _is_unit(child):
                stack.append((f"{name}.{child_name}" if name else child_name, child))
    return owned


def track(root: torch.nn.Module, communicator: Communicator) -> None:
    """Makes `root` (sharded) reduce every parameter on every replica, and gives a
    gradient of None back to those no replica used (its hooks hold the tracker)."""
    UnusedParameters(root, communicator)
