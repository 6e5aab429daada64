"""Models built on the meta device: sharded while they hold no memory, then given values
shard by shard (`ShardedStrategy`'s deferred initialisation).

A model created under ``torch.device("meta")`` has parameters with shapes and no storage.
`ShardedStrategy` shards it as it is (``fully_shard`` accepts meta modules), then
`materialize` allocates each replica's shards only (``to_empty`` on the sharded DTensors)
and initialises them: for each module with parameters or buffers of its own, in
``model.modules()`` order, those parameters are temporarily replaced by full, plain tensors
on the replica's device, the module is initialised (its ``reset_parameters()``, or the
strategy's ``init_fn(module)``), and each replica copies its slice of every full value into
its shard. At most one module's own parameters exist whole at a time, never the model.

Why the initial values do not depend on the number of replicas: every replica draws the
same full values (the random generator of the device the shards live on is first set
to replica 0's state) and
keeps the slice its shard covers, so N replicas hold exactly the shards of what one replica
(one device) computes with the same procedure.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchstrategy.collectives.communicator import Communicator

# What ShardedStrategy(init_fn=...) takes: initialises one module's own parameters and
# buffers in place.
InitFn = Callable[[nn.Module], None]


def check_init_fn(init_fn: Any) -> InitFn | None:
    """Returns `init_fn` if it is None or callable.

    Raises:
      TypeError: anything else.
    """
    if init_fn is None or callable(init_fn):
        return init_fn
    raise TypeError(f"ShardedStrategy(init_fn={init_fn!r}): give a function taking one "
                    "module and initialising its own parameters and buffers in place, or "
                    "None (each module's reset_parameters()).")


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def on_meta(root: nn.Module) -> bool:
    """True if any parameter or buffer of `root` is on the meta device."""
    return any(t.is_meta for t in (*root.parameters(), *root.buffers()))


def _module_name(name: str, module: nn.Module) -> str:
    return f"'{name}' ({type(module).__name__})" if name else \
        f"the model itself ({type(module).__name__})"


def check_materializable(root: nn.Module, init_fn: InitFn | None) -> None:
    """Checks, before any collective, that a model built on meta can be given values:
    every parameter and buffer is on meta (a partly built model would lose the values of
    the rest), and without `init_fn` every module with parameters or buffers of its own has
    a ``reset_parameters()``.

    Raises:
      ValueError: naming the modules (qualified names as in ``model.named_modules()``)
        and the fix.
    """
    real = [f"{name} ({t.device})" for name, t in
            (*root.named_parameters(), *root.named_buffers()) if not t.is_meta]
    if real:
        raise ValueError(
            f"ShardedStrategy: {type(root).__name__} has parameters or buffers on the meta "
            f"device and others that hold values ({', '.join(real[:3])}"
            f"{', ...' if len(real) > 3 else ''}); materialising it would overwrite those. "
            "Build the whole model under `with torch.device('meta'):` inside "
            "strategy.scope(), or none of it.")
    if init_fn is not None:
        return
    missing = [_module_name(name, module) for name, module in root.named_modules()
               if _own_tensors(module) and not callable(getattr(module, "reset_parameters",
                                                                None))]
    if missing:
        raise ValueError(
            f"ShardedStrategy: {type(root).__name__} was built on the meta device, so its "
            "values are created after sharding by each module's reset_parameters(), but "
            f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''} "
            f"{'has' if len(missing) == 1 else 'have'} parameters or buffers of "
            f"{'its' if len(missing) == 1 else 'their'} own and no reset_parameters(). Give "
            "ShardedStrategy(init_fn=fn), where fn(module) initialises that one module's own "
            "parameters and buffers in place (it is called for every such module, in "
            "model.modules() order), or add reset_parameters() to those classes.")


def meta_labels(labelled: Iterable[tuple[str, torch.Tensor]]
                ) -> list[tuple[str, torch.Tensor]]:
    """`labelled` with " (meta)" added to the labels of meta tensors: the replicas compare
    labels, so a model built on meta on one replica and with values on another is
    refused before anything is broadcast."""
    return [(f"{label} (meta)" if t.is_meta else label, t) for label, t in labelled]


def _same_random_state(communicator: Communicator, device: torch.device) -> None:
    """Sets this replica's random generator for `device` (the CPU's, or the CUDA
    device's) to replica 0's state (a collective)."""
    if device.type == "cuda":
        state = communicator.broadcast_object(torch.cuda.get_rng_state(device))
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(communicator.broadcast_object(torch.get_rng_state()))


def _initialise(module: nn.Module, init_fn: InitFn | None) -> None:
    if init_fn is not None:
        init_fn(module)
    else:
        module.reset_parameters()  # type: ignore[operator]


def _local_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This replica's part of `full` as `like` places it (no communication:
    ``src_data_rank=None`` makes every replica cut its own slice)."""
    return distribute_tensor(full, like.device_mesh, like.placements,
                             src_data_rank=None).to_local()


def materialize(roots: Sequence[nn.Module], device: torch.device,
                communicator: Communicator, init_fn: InitFn | None) -> None:
    """Allocates the shards of the sharded meta models `roots` on `device` and initialises
    them (see the module's docstring). A collective (the random state), called by every
    replica with the same models; `check_materializable` passed before they were
    sharded."""
    if not roots:
        return
    _same_random_state(communicator, device)
    with torch.no_grad():
        for root in roots:
            root.to_empty(device=device)
            for name, module in root.named_modules():
                if _own_tensors(module):
                    _initialise_sharded(name, module, device, init_fn)


def _mark_unset(tensor: torch.Tensor) -> None:
    """Fills `tensor` with a value no initialisation leaves everywhere (NaN; an integer
    type's largest value), so that `_left_unset` can tell what was not written."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool or tensor.is_complex():
        return
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max)


def _left_unset(tensor: torch.Tensor) -> bool:
    """Whether `tensor`, marked by `_mark_unset` before the initialisation, was left
    (wholly or partly, for floating point) as marked."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool or tensor.is_complex():
        return False
    if tensor.is_floating_point():
        return bool(torch.isnan(tensor).any())
    return bool((tensor == torch.iinfo(tensor.dtype).max).all())


def _refuse_unset(module_name: str, module: nn.Module, unset: list[str],
                  init_fn: InitFn | None) -> None:
    what = "init_fn" if init_fn is not None else \
        f"{type(module).__name__}.reset_parameters()"
    names = ", ".join(f"'{module_name}.{n}'" if module_name else f"'{n}'" for n in unset)
    raise ValueError(
        f"ShardedStrategy: the model was built on the meta device, so its values are "
        f"created after sharding by {what}, which left {names} of "
        f"{_module_name(module_name, module)} unset: on meta, __init__ computed nothing, "
        f"and {'it' if len(unset) == 1 else 'they'} would hold uninitialised memory, "
        "different on each replica. Set every parameter and buffer of the module in "
        f"{'init_fn' if init_fn is not None else 'reset_parameters()'} (a buffer computed "
        "in __init__, such as a rotary table, computed there too), or build the model "
        "without torch.device('meta').")


def _initialise_sharded(module_name: str, module: nn.Module, device: torch.device,
                        init_fn: InitFn | None) -> None:
    """Initialises `module`'s own parameters as full tensors, then keeps each replica's
    slice; its buffers (never sharded) are initialised in place.

    Raises:
      ValueError: the initialisation left a parameter or buffer (some of its elements,
        for floating point) unwritten, naming it (the same on every replica: each runs
        the same initialisation on the same values).
    """
    sharded = [(name, p) for name, p in module.named_parameters(recurse=False)
               if isinstance(p, DTensor)]
    full = {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                               requires_grad=p.requires_grad) for name, p in sharded}
    # setattr registers a parameter through nn.Module's public path (the registration
    # hooks run; ShardedStrategy ignores them while it shards); the sharded parameter,
    # the very object FSDP2 holds, is put back right after.
    for name, tensor in full.items():
        setattr(module, name, tensor)
    try:
        before = dict(_own_tensors(module))
        for own in before.values():
            _mark_unset(own)
        _initialise(module, init_fn)
        # A tensor the initialisation replaced (``self.table = ...``) was set.
        unset = [name for name, own in _own_tensors(module)
                 if before.get(name) is own and _left_unset(own)]
        if unset:
            _refuse_unset(module_name, module, unset, init_fn)
        for name, p in sharded:
            p.to_local().copy_(_local_slice(full[name].detach(), p))
    finally:
        for name, p in sharded:
            setattr(module, name, p)
