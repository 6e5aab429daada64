"""How replica threads read central parameters, sum their gradients and step once.

CentralStorageStrategy keeps one copy of every parameter and buffer (the *central*
tensors, on the parameter device). During ``strategy.run`` each replica thread sees its own
*replica copies*, substituted for the central tensors in every torch operation by a
thread-local `TorchFunctionMode` (nothing is wrapped: the user's module still holds the
central tensors):

- a parameter's replica copy is a new autograd leaf: on the parameter device it shares the
  central storage (no copy), on another compute device it is a copy made when ``run``
  starts (TensorFlow reads the central variable onto the compute device the same way);
- a buffer's replica copy is a clone; when ``run`` ends the central buffer becomes the mean
  of the replicas' copies (floating buffers, e.g. BatchNorm statistics) or replica 0's;
- ``param.grad`` read inside a replica is that replica's view of the summed gradient.

`RunSession` synchronises the threads at two points, as TensorFlow's merge_call does:

- when ``backward()`` ends in a replica (an autograd final callback), every replica waits
  for the others; then the gradients of all replicas are summed, in replica order, on the
  parameter device, and every replica's ``param.grad`` becomes that SUM (added to what it
  held before, so gradient accumulation works);
- ``optimizer.step()`` called in the replicas applies the update ONCE to the central
  parameters: every replica waits for the others, replica 0's call updates the central
  parameters with the summed gradients, the other replicas' calls update nothing (to them
  every ``.grad`` reads None for the duration of their call), and all replicas continue
  once the update is done.

When ``run`` returns, the central ``param.grad`` is replica 0's view (the SUM), exactly what
a single device would hold after ``backward()`` on the global batch.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterable, TypeVar

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.overrides import TorchFunctionMode

from torchstrategy import _compat, context, runtime
from torchstrategy.strategies.replica_threads import ReplicaGroup

# The functions torch passes to a mode for ``t.grad`` and ``t.grad = g`` (method-wrappers:
# a new object at every access, so they are compared with ==).
# torch's stubs declare `grad` as an attribute of type Tensor | None; it is a descriptor.
_GRAD_GET = torch.Tensor.grad.__get__  # type: ignore[union-attr]
_GRAD_SET = torch.Tensor.grad.__set__  # type: ignore[union-attr]

# Key of the process-wide optimizer hooks in `torchstrategy.runtime`.
_OPTIMIZER_HOOKS = "central_storage/optimizer-step-hooks"

_Result = TypeVar("_Result")


def current_replica() -> ReplicaCopies | None:
    """The `ReplicaCopies` of the replica context this thread is in, or None: outside
    replica threads, and in cross-replica context inside one (``merge_call``'s merge_fn,
    a ``scope()``), where operations are local to the process.

    Which replica a thread runs is `torchstrategy.context`'s record, nowhere else: the
    replica context of a run carries its copies (``copies``)."""
    return getattr(context.get_replica_context(), "copies", None)


def central_view() -> ContextManager[Any]:
    """In a replica thread: operations inside see the central tensors themselves (for the
    code that maintains them: rendezvous actions, the optimizer's update, merge_call)."""
    replica = current_replica()
    return contextlib.nullcontext() if replica is None else replica.suspended()


class ReplicaCopies(TorchFunctionMode):
    """One replica's view of the central tensors (see the module docstring)."""

    def __init__(self, session: RunSession, replica_id: int, device: torch.device) -> None:
        super().__init__()
        self.session = session
        self.replica_id = replica_id
        self.device = device
        # Keyed by id(), on the hot path of every torch call in a replica: these tables
        # live for one run, whose `RunSession` holds every central tensor, so no id can
        # change hands while they exist (not a side table that outlives its keys).
        # id(central tensor) -> this replica's copy
        self.copies: dict[int, torch.Tensor] = {}
        # id(central parameter) -> this replica's view of .grad
        self.grads: dict[int, torch.Tensor | None] = {}
        self._suspended = 0      # >0: operations see the central tensors themselves
        self._hide_grads = 0     # >0: every .grad reads None (a non-chief optimizer.step)
        # guards of the optimizer.step() calls in progress
        self.step_guards: list[ContextManager[Any]] = []

    def suspended(self) -> _Counter:
        """Inside, operations see the central tensors themselves (nestable)."""
        return _Counter(self, "_suspended")

    def hiding_grads(self) -> _Counter:
        """Inside, every ``.grad`` reads None (nestable)."""
        return _Counter(self, "_hide_grads")

    def _read(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.copies.get(id(tensor), tensor)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._suspended:
            return func(*args, **kwargs)
        if func == _GRAD_GET:
            if self._hide_grads:
                return None
            key = id(args[0])
            return self.grads[key] if key in self.grads else func(*args)
        if func == _GRAD_SET:
            key = id(args[0])
            if key in self.grads:
                self.grads[key] = args[1]
                return None
            return func(*args)
        args, kwargs = _compat.tree_map_only(torch.Tensor, self._read, (args, kwargs))
        return func(*args, **kwargs)


class _Counter:
    def __init__(self, owner: object, attribute: str) -> None:
        self._owner, self._attribute = owner, attribute

    def __enter__(self) -> None:
        setattr(self._owner, self._attribute, getattr(self._owner, self._attribute) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self._owner, self._attribute, getattr(self._owner, self._attribute) - 1)


def central_view_decorator(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """`method` run inside `central_view()`."""
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> _Result:
        with central_view():
            return method(*args, **kwargs)
    return wrapper


class RunSession:
    """The state of one ``strategy.run``: the replica copies, the gradient views, the
    rendezvous group.

    Class attribute `share_parameter_storage`: on the parameter device a replica's copy
    of a parameter shares the central storage (True, the default). False makes a real copy
    there too, which is what every compute device other than the parameter device does;
    the tests use it to check that path on machines without GPUs.

    Args:
      group: the `ReplicaGroup` of the run's threads.
      params: the central parameters (their order fixes the order of reduction).
      buffers: the central buffers.
      devices: one compute `torch.device` per replica.
      parameter_device: where the central tensors live.
    """

    share_parameter_storage = True

    def __init__(self, group: ReplicaGroup, params: Iterable[torch.Tensor],
                 buffers: Iterable[torch.Tensor], devices: Iterable[torch.device],
                 parameter_device: torch.device) -> None:
        self.group = group
        self.strategy: Any = None      # set by the strategy that runs the session
        self.params = list(params)
        self.buffers = list(buffers)
        self.devices = list(devices)
        self.parameter_device = parameter_device
        self.replicas = [ReplicaCopies(self, r, d) for r, d in enumerate(self.devices)]
        self._leaves: list[list[Any]] = [[None] * len(self.params) for _ in self.devices]
        self._queued = [False] * len(self.devices)
        self._hooks: list[Any] = []
        with torch.no_grad():
            for r, replica in enumerate(self.replicas):
                self._make_copies(r, replica)

    def _make_copies(self, r: int, replica: ReplicaCopies) -> None:
        device = replica.device
        for i, p in enumerate(self.params):
            if device == p.device and self.share_parameter_storage:
                leaf = p.detach()
            else:
                leaf = p.detach().to(device, copy=True)
            if p.requires_grad:
                leaf.requires_grad_(True)
                self._hooks.append(leaf.register_post_accumulate_grad_hook(
                    lambda _leaf, r=r: self._on_gradient(r)))
            replica.copies[id(p)] = leaf
            self._leaves[r][i] = leaf
            grad = p.grad
            if grad is not None and (r > 0 or device != grad.device):
                grad = grad.to(device, copy=True)
            replica.grads[id(p)] = grad
        for b in self.buffers:
            replica.copies[id(b)] = b.detach().to(device, copy=True)

    # -- the end of backward -------------------------------------------------------------
    def _on_gradient(self, replica_id: int) -> None:
        # The first gradient of a backward pass queues the synchronisation for the moment
        # the whole backward pass has finished in this replica.
        if not self._queued[replica_id]:
            self._queued[replica_id] = True
            _compat.queue_autograd_callback(lambda: self._end_of_backward(replica_id))

    def _end_of_backward(self, replica_id: int) -> None:
        self._queued[replica_id] = False
        self.group.rendezvous(replica_id, "the gradient sum at the end of backward()",
                              action=lambda _: self._sum_gradients())

    @torch.no_grad()
    @central_view_decorator
    def _sum_gradients(self) -> None:
        """Adds the SUM over replicas of the gradients computed since the last sum to every
        replica's view of ``.grad``, and clears the per-replica leaves' gradients."""
        for i, p in enumerate(self.params):
            total = None
            for leaves in self._leaves:   # replica order: the result is deterministic
                part = leaves[i].grad
                leaves[i].grad = None
                if part is None:
                    continue
                if total is None:         # the first replica's gradient is ours to reuse
                    total = part if part.device == self.parameter_device \
                        else part.to(self.parameter_device)
                else:
                    total.add_(part.to(self.parameter_device))
            if total is None:
                continue
            for r, replica in enumerate(self.replicas):
                previous = replica.grads[id(p)]
                # Replica 0 keeps `total` itself; the others get their own copy, so that a
                # replica changing its .grad in place (clipping) changes only its view.
                mine = total if r == 0 and replica.device == total.device \
                    else total.to(replica.device, copy=True)
                replica.grads[id(p)] = mine if previous is None else previous + mine

    # -- optimizer.step ------------------------------------------------------------------
    def before_step(self, replica: ReplicaCopies) -> _Counter:
        """Every replica's ``optimizer.step()`` waits for the others; returns what its call
        runs under: replica 0 updates the central tensors, the others update nothing."""
        self.group.rendezvous(replica.replica_id, "optimizer.step()",
                              action=lambda _: self._publish_gradients())
        if replica.replica_id == 0:
            return replica.suspended()     # the update is applied to the central tensors
        return replica.hiding_grads()      # the other replicas' calls update nothing

    def after_step(self, replica: ReplicaCopies) -> None:
        """The end of ``optimizer.step()``: every replica waits for the update, and copies
        on other devices read its result."""
        self.group.rendezvous(replica.replica_id, "the end of optimizer.step()",
                              action=lambda _: self._refresh_copies())

    @torch.no_grad()
    @central_view_decorator
    def _publish_gradients(self) -> None:
        for p in self.params:
            grad = self.replicas[0].grads[id(p)]
            p.grad = None if grad is None else grad.to(p.device)

    @torch.no_grad()
    @central_view_decorator
    def _refresh_copies(self) -> None:
        # Copies on another device than the parameters' read the updated values, as a read
        # of the central variable after the update would.
        for replica in self.replicas:
            for p in self.params:
                leaf = replica.copies[id(p)]
                if leaf.data_ptr() != p.data_ptr():
                    leaf.copy_(p)

    # -- the end of run ------------------------------------------------------------------
    def close(self) -> None:
        """Removes the run's autograd hooks (whether or not the run succeeded)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @torch.no_grad()
    def write_back(self) -> None:
        """After a successful run, writes the replicas' results to the central tensors:
        ``.grad`` from replica 0's view, buffers as the mean (floating) or replica 0's value
        (others)."""
        for p in self.params:
            grad = self.replicas[0].grads[id(p)]
            p.grad = None if grad is None else grad.to(p.device)
        for b in self.buffers:
            copies = [replica.copies[id(b)].to(b.device) for replica in self.replicas]
            if b.is_floating_point() and len(copies) > 1:
                total = copies[0].clone()
                for c in copies[1:]:
                    total.add_(c)
                b.copy_(total / len(copies))
            else:
                b.copy_(copies[0])


def install_optimizer_hooks() -> None:
    """Makes ``optimizer.step()`` inside a replica thread apply its update once (see the
    module docstring); everywhere else the hooks do nothing. Installed once per process."""
    runtime.current().install_once(_OPTIMIZER_HOOKS, _register_optimizer_hooks)


def _register_optimizer_hooks() -> None:
    register_optimizer_step_pre_hook(_optimizer_step_begins)
    register_optimizer_step_post_hook(_optimizer_step_ends)


def _optimizer_step_begins(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = current_replica()
    if replica is None:
        return None
    if args[1:] or kwargs:
        raise ValueError("optimizer.step(closure) is not supported inside "
                         "CentralStorageStrategy.run: compute the loss and call backward() "
                         "in the step function, then optimizer.step() without a closure.")
    guard = replica.session.before_step(replica)
    guard.__enter__()
    replica.step_guards.append(guard)
    return None


def _optimizer_step_ends(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = current_replica()
    if replica is None:
        return
    replica.step_guards.pop().__exit__(None, None, None)
    replica.session.after_step(replica)
