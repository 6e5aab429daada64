"""What a step changes, kept in memory so that a step that did not commit can be undone.

Live recovery commits a step on every replica or on none, and undoes on the survivors a
step that did not commit before they redo it. Two copies serve it:

- `StepStart`, the copy taken before every step by default: live recovery votes in the
  first optimizer's step pre-hook, after the gradients were summed and *before* any
  optimizer changes anything, so the parameters and the optimizer state never need a
  copy. What a step changes before that point is small and copied here: the modules'
  buffers (BatchNorm's running statistics and counters), the gradients present when the
  step starts (gradient accumulation across steps; none in a loop that clears them after
  the optimizer step), the optimizers' hyper-parameters, and the random generators.
- `StepSnapshot`, the full copy (parameters, buffers, gradients, optimizer state and
  hyper-parameters, random generators), for the steps that cannot vote before their
  optimizers step: ``commit_every=k`` (several steps under one vote), a step function that
  changes parameters without a given optimizer, or that steps an optimizer again after new
  gradients once it voted; and for the first step of each step function (where that is
  found out). Horovod elastic keeps the same kind of copy (its ``state.commit()``).

Both copy into buffers allocated once and overwritten in place (`Tensor.copy_`): no
allocation per step.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

from torchstrategy import module_state


def _modules_and_optimizers(objects: Mapping[str, Any]
                            ) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """The modules and the optimizers of `objects`, each in the order given.

    Raises:
      TypeError: an object that is neither, naming it.
    """
    modules: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            optimizers.append(obj)
        else:
            raise TypeError(
                f"live recovery keeps the state of modules and optimizers; {name!r} is "
                f"a {type(obj).__name__}. Pass the model(s) and optimizer(s) the step "
                "changes (state the step does not change needs no copy).")
    return modules, optimizers


class _RandomState:
    """torch's CPU random generator and, once CUDA is initialised, the current device's:
    `take` copies them, `restore` puts the copies back."""

    def __init__(self) -> None:
        self._cpu: torch.Tensor | None = None
        self._cuda: torch.Tensor | None = None

    def take(self) -> None:
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and \
            torch.cuda.is_initialized() else None

    def restore(self) -> None:
        if self._cpu is not None:
            torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state(self._cuda)


class StepSnapshot:
    """Copies of the state of `objects` (modules and optimizers, by name), taken by `take`
    and put back by `restore`.

    Guarantees: after ``restore()`` every parameter, buffer, gradient (a gradient that was
    None is None again), optimizer state entry and hyper-parameter, and torch's CPU (and
    current CUDA device's) random generator, holds exactly what it held at the last
    ``take()``; optimizer state created since (the first step of Adam) is removed.

    Raises:
      TypeError: an object that is neither a `torch.nn.Module` nor a
        `torch.optim.Optimizer`.
    """

    def __init__(self, objects: Mapping[str, Any]) -> None:
        self._modules, self._optimizers = _modules_and_optimizers(objects)
        # tensor -> its copy, by identity; buffers reused from step to step.
        self._copies: module_state.IdentityMap[torch.Tensor, torch.Tensor] = \
            module_state.IdentityMap()
        self._grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._optimizer_state: list[dict[Any, dict[str, Any]]] = []
        self._hyper: list[list[dict[str, Any]]] = []
        self._random = _RandomState()

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        saved = self._copies.get(tensor)
        if saved is None or saved.shape != tensor.shape or saved.dtype != tensor.dtype:
            saved = torch.empty_like(tensor, memory_format=torch.preserve_format)
            self._copies[tensor] = saved
        saved.copy_(tensor.detach())
        return saved

    def take(self) -> None:
        """Copies the state as it is now (the start of a step)."""
        with torch.no_grad():
            self._grads = []
            for module in self._modules:
                for tensor in list(module.parameters()) + list(module.buffers()):
                    self._keep(tensor)
                for param in module.parameters():
                    grad = param.grad
                    # A gradient is a view into the reducer's bucket, rewritten by the
                    # next backward: its values are copied, not the tensor kept.
                    self._grads.append((param, None if grad is None
                                        else grad.detach().clone()))
            self._optimizer_state = []
            self._hyper = []
            for optimizer in self._optimizers:
                state: dict[Any, dict[str, Any]] = {}
                for owner, entries in optimizer.state.items():
                    state[owner] = {key: (self._keep(value)
                                          if isinstance(value, torch.Tensor)
                                          else copy.deepcopy(value))
                                    for key, value in entries.items()}
                self._optimizer_state.append(state)
                self._hyper.append([{key: copy.deepcopy(value)
                                     for key, value in group.items() if key != "params"}
                                    for group in optimizer.param_groups])
        self._random.take()

    def parameters_changed(self) -> bool:
        """Whether a parameter of the modules differs from its copy taken by `take`."""
        with torch.no_grad():
            for module in self._modules:
                for param in module.parameters():
                    saved = self._copies.get(param)
                    if saved is None or not torch.equal(saved, param.detach()):
                        return True
        return False

    def restore(self) -> None:
        """Puts back what `take` copied (see the class docstring)."""
        with torch.no_grad():
            for module in self._modules:
                tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
                for tensor in tensors:
                    saved = self._copies.get(tensor)
                    if saved is not None:
                        tensor.copy_(saved)
            for param, grad in self._grads:
                param.grad = None if grad is None else grad.clone()
            for optimizer, state, hyper in zip(self._optimizers, self._optimizer_state,
                                               self._hyper):
                for param in list(optimizer.state):
                    if param not in state:
                        del optimizer.state[param]
                for param, entries in state.items():
                    live = optimizer.state[param]
                    for key in list(live):
                        if key not in entries:
                            del live[key]
                    for key, value in entries.items():
                        current = live.get(key)
                        if isinstance(value, torch.Tensor):
                            if isinstance(current, torch.Tensor) and \
                                    current.shape == value.shape:
                                current.copy_(value)
                            else:
                                live[key] = value.clone()
                        else:
                            live[key] = copy.deepcopy(value)
                for group, saved_group in zip(optimizer.param_groups, hyper):
                    group.update(copy.deepcopy(saved_group))
        self._random.restore()


class StepStart:
    """What a step changes before its first optimizer step, for the modules and optimizers
    of `objects` (by name): copied by `take` at the start of each step, put back by
    `restore` when the step did not commit.

    Guarantees: after ``restore()`` every module buffer holds what it held at the last
    ``take()``, every gradient of the modules' and optimizers' parameters is what it was
    then (None if it was None: the gradients a step computed are discarded), every
    optimizer hyper-parameter is back, and so are torch's CPU (and current CUDA device's)
    random generator. Parameters and optimizer state are *not* copied: the caller
    guarantees that no optimizer stepped (live recovery votes in the optimizers' step
    pre-hook, and a vote that does not commit stops the step there).

    Cost: one copy of the buffers and of the gradients present at the start (none after
    ``optimizer.zero_grad()``, which sets them to None), a few small dictionaries, and the
    random generators' states.

    Raises:
      TypeError: an object that is neither a `torch.nn.Module` nor a
        `torch.optim.Optimizer`.
    """

    def __init__(self, objects: Mapping[str, Any]) -> None:
        self._kept_buffers: list[torch.Tensor] = []
        self._params: list[torch.Tensor] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        seen: module_state.IdentityMap[torch.Tensor, bool] = module_state.IdentityMap()
        for name, obj in objects.items():
            modules, optimizers = _modules_and_optimizers({name: obj})
            self._optimizers.extend(optimizers)
            params = [p for module in modules for p in module.parameters()] + \
                [p for optimizer in optimizers for group in optimizer.param_groups
                 for p in group["params"]]
            for module in modules:
                self._kept_buffers.extend(module.buffers())
            for param in params:
                if seen.get(param) is None:
                    seen[param] = True
                    self._params.append(param)
        self._buffer_copies: list[torch.Tensor] = [
            torch.empty_like(b, memory_format=torch.preserve_format) for b in self._kept_buffers]
        self._grad_copies: module_state.IdentityMap[torch.Tensor, torch.Tensor] = \
            module_state.IdentityMap()
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hyper: list[list[dict[str, Any]]] = []
        self._random = _RandomState()

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The parameters of the modules and optimizers (each once)."""
        return self._params

    def take(self) -> None:
        """Copies the state a step changes before its optimizers step, as it is now."""
        with torch.no_grad():
            for buffer, saved in zip(self._kept_buffers, self._buffer_copies):
                saved.copy_(buffer)
            self._grads = []
            for param in self._params:
                grad = param.grad
                if grad is None:
                    continue
                saved = self._grad_copies.get(param)
                if saved is None or saved.shape != grad.shape or saved.dtype != grad.dtype:
                    saved = torch.empty_like(grad)
                    self._grad_copies[param] = saved
                # A gradient is a view into the reducer's bucket, rewritten by the next
                # backward: its values are copied, not the tensor kept.
                saved.copy_(grad)
                self._grads.append((param, saved))
        self._hyper = [[{key: value.clone() if isinstance(value, torch.Tensor) else value
                         for key, value in group.items() if key != "params"}
                        for group in optimizer.param_groups]
                       for optimizer in self._optimizers]
        self._random.take()

    def restore(self) -> None:
        """Puts back what `take` copied (see the class docstring)."""
        with torch.no_grad():
            for buffer, saved in zip(self._kept_buffers, self._buffer_copies):
                buffer.copy_(saved)
            for param in self._params:
                param.grad = None
            for param, grad in self._grads:
                param.grad = grad.clone()
        for optimizer, hyper in zip(self._optimizers, self._hyper):
            for group, saved_group in zip(optimizer.param_groups, hyper):
                group.update({key: value.clone() if isinstance(value, torch.Tensor)
                              else value for key, value in saved_group.items()})
        self._random.restore()
