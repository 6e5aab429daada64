"""Recording what a strategy's scope creates: parameters, buffers and variables.

Inside ``strategy.scope()`` every parameter and buffer registered on any ``nn.Module`` is
recorded as mirrored, through torch's global module registration hooks. Nothing is wrapped
or replaced: the user's modules and their ``state_dict()`` keys stay exactly as they are.
"""
import threading
import weakref

import torch
from torch.nn.modules import module as nn_module

from torchstrategy import context

_install_lock = threading.Lock()
_installed = False


def _capturing_strategy():
    strategy = context.active_non_default_strategy()
    if strategy is None or context.get_strategy() is not strategy:
        return None
    return strategy


def _on_parameter(module, name, param):
    strategy = _capturing_strategy()
    if strategy is not None and param is not None:
        strategy.extended._mirrored.add_parameter(param)
    return None


def _on_buffer(module, name, buffer):
    strategy = _capturing_strategy()
    if strategy is not None and buffer is not None:
        strategy.extended._mirrored.add_buffer(module, name)
    return None


def install_capture():
    """Installs the global registration hooks once per process (they are cheap no-ops
    outside a scope)."""
    global _installed
    with _install_lock:
        if not _installed:
            nn_module.register_module_parameter_registration_hook(_on_parameter)
            nn_module.register_module_buffer_registration_hook(_on_buffer)
            _installed = True


class MirroredState:
    """The mirrored parameters, buffers and variable tensors of one strategy.

    Tensors registered since the last synchronisation are *pending*: the strategy broadcasts
    them from replica 0 at scope exit (or before the next ``run``).
    """

    def __init__(self):
        self._params = []
        self._param_ids = set()
        self._buffers = []        # (weakref to module, name)
        self._buffer_keys = set()
        self._pending = []        # callables returning the tensor to broadcast

    def add_parameter(self, param):
        if id(param) in self._param_ids:
            return
        self._param_ids.add(id(param))
        self._params.append(param)
        self._pending.append(lambda p=param: p)

    def add_buffer(self, module, name):
        key = (id(module), name)
        if key in self._buffer_keys:
            return
        self._buffer_keys.add(key)
        ref = weakref.ref(module)
        self._buffers.append((ref, name))
        self._pending.append(lambda r=ref, n=name: None if r() is None else r()._buffers.get(n))

    def add_tensor(self, tensor, trainable):
        """A variable's tensor: broadcast like the rest; trainable ones get gradient sync."""
        if trainable:
            self.add_parameter(tensor)
        else:
            self._pending.append(lambda t=tensor: t)

    @property
    def parameters(self):
        return list(self._params)

    def buffers(self):
        """The live buffer tensors (a module may have replaced a buffer since)."""
        out = []
        for ref, name in self._buffers:
            module = ref()
            if module is not None:
                tensor = module._buffers.get(name)
                if tensor is not None:
                    out.append(tensor)
        return out

    def floating_buffers(self):
        return [b for b in self.buffers() if b.is_floating_point()]

    def take_pending(self):
        """Returns (and forgets) the tensors registered since the last call."""
        pending, self._pending = self._pending, []
        tensors, seen = [], set()
        for get in pending:
            tensor = get()
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        return tensors
