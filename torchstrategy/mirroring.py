"""Recording what a strategy's scope creates: parameters, buffers and variables.

Inside ``strategy.scope()`` every parameter, buffer and submodule registered on any
``nn.Module`` is recorded by the active strategy, through torch's global module registration
hooks; `MirroredState` is what a strategy that mirrors them keeps. Nothing is wrapped
or replaced: the user's modules and their ``state_dict()`` keys stay exactly as they are.
"""
import weakref
from typing import Callable, Iterable, Sequence

import torch
from torch.nn.modules import module as nn_module
from torch.utils.weak import WeakIdKeyDictionary

from torchstrategy import _compat, context, module_state, runtime
from torchstrategy.collectives.communicator import Communicator


def _capturing_strategy() -> context.AnyStrategy | None:
    strategy = context.active_non_default_strategy()
    if strategy is None or context.get_strategy() is not strategy:
        return None
    return strategy


def _on_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
                  ) -> None:
    strategy = _capturing_strategy()
    if strategy is not None and param is not None:
        strategy.extended.record_parameter(module, name, param)
    return None


def _on_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    strategy = _capturing_strategy()
    if strategy is not None and buffer is not None:
        strategy.extended.record_buffer(module, name)
    return None


def _on_submodule(parent: torch.nn.Module, name: str, submodule: torch.nn.Module | None
                  ) -> None:
    strategy = _capturing_strategy()
    if strategy is not None and submodule is not None:
        strategy.extended.record_submodule(parent, submodule)
    return None


def _install_hooks() -> None:
    nn_module.register_module_parameter_registration_hook(_on_parameter)
    nn_module.register_module_buffer_registration_hook(_on_buffer)
    nn_module.register_module_module_registration_hook(_on_submodule)


def install_capture() -> None:
    """Installs torch's global registration hooks once per process (on the first
    ``scope()``, never at import); outside a scope they are cheap no-ops. Each records into
    the active strategy's ``extended.record_parameter`` / ``record_buffer`` /
    ``record_submodule``."""
    runtime.current().install_once("module-registration-hooks", _install_hooks)


class MirroredState:
    """The mirrored parameters, buffers and variable tensors of one strategy.

    Tensors registered since the last synchronisation are *pending*: the strategy broadcasts
    them from replica 0 at scope exit (or before the next ``run``).
    """

    def __init__(self) -> None:
        # The recorded parameters, in registration order, kept alive (a mirrored parameter
        # stays one for the strategy's life) and keyed by identity, not by id().
        self._params: module_state.IdentityMap[torch.Tensor, None] = \
            module_state.IdentityMap()
        self._buffer_refs: list[tuple[weakref.ReferenceType[torch.nn.Module], str]] = []
        # module -> names of its recorded buffers; an entry goes with its module, so a new
        # module is never mistaken for a dead one (keyed by identity, whatever the module's
        # class defines as equality).
        self._buffer_names = WeakIdKeyDictionary()
        # (label, a function returning the tensor to broadcast, None if it is gone)
        self._pending: list[tuple[str, Callable[..., torch.Tensor | None]]] = []

    def is_parameter(self, tensor: object) -> bool:
        """True for a recorded parameter (or trainable variable tensor)."""
        return tensor in self._params

    def add_parameter(self, param: torch.Tensor, label: str = "parameter") -> None:
        """Records `param`; `label` names it in errors (e.g. "Linear.weight")."""
        if param in self._params:
            return
        self._params[param] = None
        self._pending.append((label, lambda p=param: p))

    def add_buffer(self, module: torch.nn.Module, name: str) -> None:
        """Records `module`'s buffer `name` (read through the module, which may replace the
        tensor later)."""
        names = self._buffer_names.setdefault(module, set())
        if name in names:
            return
        names.add(name)
        ref = weakref.ref(module)
        self._buffer_refs.append((ref, name))
        self._pending.append((f"{type(module).__name__}.{name} (buffer)",
                              lambda r=ref, n=name: None if r() is None
                              else _compat.module_buffer(r(), n)))

    def add_tensor(self, tensor: torch.Tensor, trainable: bool, label: str = "variable") -> None:
        """A variable's tensor: broadcast like the rest; trainable ones get gradient sync."""
        if trainable:
            self.add_parameter(tensor, label)
        else:
            self._pending.append((label, lambda t=tensor: t))

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The recorded parameters, in registration order."""
        return self._params.keys()

    def buffers(self) -> list[torch.Tensor]:
        """The live buffer tensors (a module may have replaced a buffer since)."""
        out = []
        self._buffer_refs = [(ref, name) for ref, name in self._buffer_refs
                             if ref() is not None]
        for ref, name in self._buffer_refs:
            module = ref()
            if module is not None:
                tensor = _compat.module_buffer(module, name)
                if tensor is not None:
                    out.append(tensor)
        return out

    def floating_buffers(self) -> list[torch.Tensor]:
        return [b for b in self.buffers() if b.is_floating_point()]

    def take_pending_labelled(self) -> list[tuple[str, torch.Tensor]]:
        """Returns (and forgets) the (label, tensor) pairs registered since the last call,
        in registration order, each tensor once."""
        pending, self._pending = self._pending, []
        out, seen = [], set()
        for label, get in pending:
            tensor = get()
            # ids of tensors alive for this call only (held by `out`): not a side table.
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((label, tensor))
        return out

    def take_pending(self) -> list[torch.Tensor]:
        """Returns (and forgets) the tensors registered since the last call."""
        return [tensor for _, tensor in self.take_pending_labelled()]


def layout_of(labelled: Iterable[tuple[str, torch.Tensor]]
              ) -> list[tuple[str, tuple[int, ...], str]]:
    """What must agree between replicas about mirrored tensors: (label, shape, dtype) of
    each, in registration order."""
    return [(label, tuple(t.shape), str(t.dtype).replace("torch.", "")) for label, t in labelled]


def check_same_layout(layouts: Sequence[Sequence[tuple[str, tuple[int, ...], str]]]) -> None:
    """Raises if the replicas' mirrored tensors differ (`layouts[r]` is replica r's
    `layout_of`): broadcasting replica 0's values onto different tensors would abort the
    process or, with equal element counts, silently reinterpret them.

    Raises:
      ValueError: naming the first difference, its position, and the replicas.
    """
    reference = layouts[0]
    for rank, layout in enumerate(layouts[1:], 1):
        if layout == reference:
            continue
        for index, (mine, theirs) in enumerate(zip(reference, layout)):
            if mine != theirs:
                raise ValueError(
                    f"Replicas built different mirrored tensors: tensor {index} is "
                    f"{mine[0]} {list(mine[1])} {mine[2]} on replica 0 but {theirs[0]} "
                    f"{list(theirs[1])} {theirs[2]} on replica {rank}. Every replica must "
                    "create the same modules in the same order inside strategy.scope() "
                    "(build the model from arguments that do not depend on the replica).")
        raise ValueError(
            f"Replicas built different numbers of mirrored tensors inside strategy.scope(): "
            f"{len(reference)} on replica 0, {len(layout)} on replica {rank}. Every replica "
            "must create the same modules in the same order.")


def check_replicas_agree(communicator: Communicator,
                         labelled: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Compares the (label, tensor) pairs this replica recorded (`take_pending_labelled`)
    with every other process's through `communicator` (a collective: every process calls
    it at the same point), before anything is broadcast onto them.

    Raises:
      ValueError: see `check_same_layout`.
    """
    check_same_layout(communicator.gather_objects(layout_of(labelled)))
