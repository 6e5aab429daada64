"""What a strategy owns: the strategy whose scope was entered last, modules adopted after
they were built, and a one-time check that ``run`` trains only what the strategy mirrors.

- `live_strategy()`: the strategy whose ``scope()`` was entered last in this process. Loss
  scaling outside ``strategy.run`` (a DDP-style loop) asks it how many replicas the next
  ``backward()`` sums over, instead of assuming the default strategy's one.
- `replay_scope(strategy, module, optimizer)`: ``strategy.adopt`` of a strategy whose
  parameters are mirrored. A module built outside the scope gets what creating it inside
  would have given: its parameters and buffers are
  recorded by the strategy (placed on its device, broadcast from replica 0 after the
  replicas compared their layouts, handed to the gradient reducer), the optimizer's state
  is broadcast too, and Parameters, buffers and submodules registered on it later
  (nanoGPT's ``crop_block_size``) are recorded as they appear.
- `warn_if_unmirrored(...)`: during a strategy's first multi-replica ``run``, warns once
  when the step calls a module whose trainable parameters the strategy does not mirror
  (a model created outside the scope and not adopted: its gradients are not summed and
  replicas drift apart). Later runs pay nothing.

The live strategy is runtime state (`runtime.current().state`), never at module level; an
adopted module carries its adoption itself (`torchstrategy.module_state`: a state in the
module's ``__dict__`` naming the strategy's extended, weakly).
"""
import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from torchstrategy import context, mirroring, module_state, runtime


class _Ownership:
    def __init__(self) -> None:
        self.last_scoped: weakref.ReferenceType[Any] | None = None   # weakref to a Strategy


def _state() -> _Ownership:
    return runtime.current().state("ownership", _Ownership)


def note_scope_entered(strategy: context.AnyStrategy) -> None:
    """Called by ``Strategy.scope()``: `strategy` becomes the live strategy."""
    _state().last_scoped = weakref.ref(strategy)


def live_strategy() -> context.AnyStrategy | None:
    """The strategy whose ``scope()`` was entered last in this process (or that adopted a
    module last), or None when no scope was ever entered (or that strategy is gone)."""
    ref = _state().last_scoped
    return None if ref is None else ref()


# -- adoption --------------------------------------------------------------------------------
def check_adopt_arguments(module: torch.nn.Module,
                          optimizer: torch.optim.Optimizer | None) -> None:
    """What every strategy's ``adopt`` refuses, before anything is moved or sent.

    Raises:
      TypeError: `module` not an ``nn.Module``, `optimizer` not a ``torch.optim.Optimizer``.
      RuntimeError: called inside ``strategy.run``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"strategy.adopt(module, ...) takes an nn.Module, got "
                        f"{type(module).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"strategy.adopt(..., optimizer=...) takes a torch.optim.Optimizer "
                        f"(or None), got {type(optimizer).__name__}.")
    if context.in_run():
        raise RuntimeError("strategy.adopt must be called outside strategy.run (in the "
                           "program's set-up, where the model is built).")


def replay_scope(strategy: context.AnyStrategy, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
    """Replays for `module` (built outside ``strategy.scope()``) what the scope would have
    recorded, and brings `optimizer`'s state along: the guarantees of creating them inside
    the scope; returns `module` itself (nothing is wrapped: ``state_dict()`` keys are
    unchanged).

    Every replica must call it at the same point with the same module layout: it is a
    collective (a layout check, then a broadcast from replica 0).

    Raises:
      TypeError: `module` not an ``nn.Module``, `optimizer` not a ``torch.optim.Optimizer``.
      RuntimeError: called inside ``strategy.run``.
      ValueError: replicas whose modules or optimizer states differ (the first difference
        and the replicas are named).
    """
    check_adopt_arguments(module, optimizer)
    ext = strategy.extended
    runtime.current().install_once("adopted-module-hooks", _install_hooks)
    with strategy.scope():
        moved = _place(module, ext.torch_device)
        if moved and optimizer is not None:
            _move_optimizer_state(optimizer)
        _record_tree(ext, module)
    # The scope's exit broadcast the module's tensors; the optimizer's state (loaded from a
    # checkpoint, or from steps taken before) must start identical too.
    if optimizer is not None:
        labelled = _optimizer_state_tensors(optimizer)
        comm = ext.communicator
        if labelled and comm.world_size > 1:
            mirroring.check_replicas_agree(comm, labelled)
            comm.broadcast_([t for _, t in labelled], src=0)
    return module


def _place(module: torch.nn.Module, device: torch.device | None) -> bool:
    """Moves `module` to `device` (None: leaves it); True when something moved. ``.to``
    keeps the Parameter objects, so an optimizer made before still holds them."""
    if device is None:
        return False
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.device == device for t in tensors):
        return False
    module.to(device)
    return True


def _move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """State tensors follow their parameter's device, as ``load_state_dict`` places them;
    a scalar ``step`` stays where the optimizer keeps it."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(param.device)


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer
                             ) -> list[tuple[str, torch.Tensor]]:
    """(label, tensor) of the optimizer's state, in parameter order, keys sorted."""
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            state = optimizer.state.get(param, {})
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    out.append((f"optimizer state group {g} param {i} {key!r}", state[key]))
    return out


def _record_tree(ext: Any, module: torch.nn.Module) -> None:
    """Records every parameter and buffer of `module` and its submodules with the strategy
    whose extended is `ext` (the calls the scope's registration hooks make), and marks the
    modules as adopted by it (their `module_state`)."""
    for sub in module.modules():
        module_state.attach(sub, ext).adopted = True
        for name, param in sub.named_parameters(recurse=False):
            ext.record_parameter(sub, name, param)
        for name, _ in sub.named_buffers(recurse=False):
            ext.record_buffer(sub, name)


def _adopter(module: torch.nn.Module) -> Any:
    """The extended of the strategy that adopted `module` (alive), or None. One dict lookup
    for a module that was never adopted: these hooks see every registration in the
    process."""
    state = module_state.state_of(module)
    return state.owner if state is not None and state.adopted else None


def _capturing(ext: Any) -> bool:
    """True where the scope's own hooks already record for the strategy of `ext`."""
    strategy = context.active_non_default_strategy()
    return strategy is not None and strategy.extended is ext and \
        context.get_strategy() is strategy


def _after_registration(ext: Any) -> None:
    # Outside the scope and outside run, nothing else would synchronise what was just
    # recorded before the next backward of a DDP-style loop: do it now (every replica
    # registers the same tensors at the same point). Inside the scope, its exit does it;
    # inside run, the next run's start.
    if not context.in_run() and context.active_non_default_strategy() is None:
        ext.settle_recorded_state()


def _on_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
                  ) -> None:
    ext = _adopter(module)
    if ext is not None and param is not None and not _capturing(ext):
        ext.record_parameter(module, name, param)
        _after_registration(ext)
    return None


def _on_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    ext = _adopter(module)
    if ext is not None and buffer is not None and not _capturing(ext):
        ext.record_buffer(module, name)
        _after_registration(ext)
    return None


def _on_submodule(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None
                  ) -> None:
    ext = _adopter(module)
    if ext is not None and submodule is not None:
        _record_tree(ext, submodule)
        if not _capturing(ext):
            _after_registration(ext)
    return None


def _install_hooks() -> None:
    nn_module.register_module_parameter_registration_hook(_on_parameter)
    nn_module.register_module_buffer_registration_hook(_on_buffer)
    nn_module.register_module_module_registration_hook(_on_submodule)


# -- the first run's check -------------------------------------------------------------------
@contextlib.contextmanager
def warn_if_unmirrored(strategy: context.AnyStrategy,
                       is_mirrored: Callable[[torch.Tensor], bool]) -> Iterator[None]:
    """Active around a strategy's first multi-replica ``run``: the first module called
    there that has trainable parameters is checked, with its submodules, and a
    RuntimeWarning names the parameters `is_mirrored` rejects. The global forward hook is
    removed as soon as that module is checked (before ``torch.compile`` traces a compiled
    module's code, so that code carries no trace of it) or when the run ends. A step
    function compiled as a whole traces the hook in this run and is compiled again in the
    next (once)."""
    handle: RemovableHandle | None = None


    def check(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return None
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not params:
            return None
        if handle is not None:  # set before the hook can run
            handle.remove()
        foreign = [n for n, p in params if not is_mirrored(p)]
        if foreign:
            shown = ", ".join(repr(n) for n in foreign[:3]) + \
                (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            warnings.warn(
                f"strategy.run calls {type(module).__name__}, whose parameters {shown} "
                f"({len(foreign)} of {len(params)}) {type(strategy).__name__} does not "
                "mirror: the model was created outside strategy.scope(). Their gradients are "
                "not summed across replicas, so the replicas train apart. Create the model "
                "inside `with strategy.scope():`, or adopt it after building it: "
                "strategy.adopt(model, optimizer).", RuntimeWarning, stacklevel=2)
        return None

    with warnings.catch_warnings():
        # torch warns that a compiled module called while a global hook exists fires the
        # hook twice; this hook removes itself at the first call, so that says nothing.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there "
                                "are global hooks", category=UserWarning)
        handle = nn_module.register_module_forward_pre_hook(check)
        try:
            yield
        finally:
            handle.remove()
