"""Which modules `ShardedStrategy` shards, and with which FSDP2 options.

A *unit* is a module given to ``fully_shard``: its parameters (those not inside a smaller
unit) are all-gathered together before its forward and reduce-scattered together after
its backward, so a unit is also the granularity of communication and of peak memory.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence, Union

import torch
from torch import nn
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy)

# What names a unit in ``shard_modules``: an ``nn.Module`` subclass, or a module's
# qualified name or class name.
ModuleEntry = Union[type[nn.Module], str]


def fsdp_reduces_unused_parameters() -> bool:
    """Whether this torch's FSDP2 can reduce-scatter a zero gradient for a parameter a
    replica did not use (``FSDPModule.set_reduce_scatter_unused_params``: torch 2.13 has it,
    2.11 does not), which ``same_parameters_every_step=False`` relies on."""
    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def mixed_precision_policy(mixed_precision: torch.dtype | str | MixedPrecisionPolicy | None
                           ) -> MixedPrecisionPolicy:
    """The FSDP2 `MixedPrecisionPolicy` for ShardedStrategy's `mixed_precision` argument.

    None: full precision. A floating dtype (``torch.bfloat16``, ``torch.float16``) or its
    name ("bf16", "bfloat16", "fp16", "float16"): parameters are all-gathered and computed
    in that dtype, gradients are reduced in float32 and the sharded parameters and optimizer
    state stay float32. A `MixedPrecisionPolicy`: used as given.

    Raises:
      ValueError / TypeError: anything else, naming the value.
    """
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16}
    dtype = names.get(mixed_precision) if isinstance(mixed_precision, str) else mixed_precision
    if dtype in (torch.bfloat16, torch.float16):
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    raise ValueError(
        f"ShardedStrategy(mixed_precision={mixed_precision!r}): give torch.bfloat16 (or "
        "'bf16'), torch.float16 (or 'fp16'), a torch.distributed.fsdp.MixedPrecisionPolicy, "
        "or None for full precision.")


def offload_policy(cpu_offload: bool | OffloadPolicy, device_type: str) -> OffloadPolicy:
    """The FSDP2 offload policy for ShardedStrategy's `cpu_offload` argument: False (none),
    True (sharded parameters, gradients and optimizer state in host memory, pinned when the
    replicas are GPUs) or a `CPUOffloadPolicy`.

    Raises:
      TypeError: anything else.
    """
    if isinstance(cpu_offload, OffloadPolicy):
        return cpu_offload
    if cpu_offload is False:
        return OffloadPolicy()
    if cpu_offload is True:
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    raise TypeError(f"ShardedStrategy(cpu_offload={cpu_offload!r}): give True, False or a "
                    "torch.distributed.fsdp.CPUOffloadPolicy.")


def check_reshard_after_forward(value: bool | int | None) -> bool | int | None:
    """Returns `value` if FSDP2 accepts it: None (FSDP2's default: True for every unit but
    the model itself, whose parameters backward needs first), True (free the gathered
    parameters after forward, gather again in backward: least memory), False (keep them
    until backward: one all-gather less per unit) or an int > 1 (reshard to groups of that
    many replicas).

    Raises:
      ValueError: anything else.
    """
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value > 1):
        return value
    raise ValueError(f"ShardedStrategy(reshard_after_forward={value!r}): give None (the "
                     "default), True (least memory), False (least communication) or a "
                     "number of replicas > 1 to reshard to.")


def check_shard_modules(shard_modules: ModuleEntry | Iterable[ModuleEntry] | None
                        ) -> tuple[ModuleEntry, ...] | None:
    """Returns `shard_modules` as a tuple of module classes and names (None: the default
    policy).

    Raises:
      TypeError: an entry that is neither an ``nn.Module`` subclass nor a string, or a
        non-sequence.
    """
    if shard_modules is None:
        return None
    if isinstance(shard_modules, (str, type)):
        shard_modules = [shard_modules]
    try:
        entries = tuple(shard_modules)
    except TypeError:
        raise TypeError(f"ShardedStrategy(shard_modules={shard_modules!r}): give a list of "
                        "nn.Module classes and/or module names.") from None
    for entry in entries:
        if not (isinstance(entry, str) or (isinstance(entry, type)
                                           and issubclass(entry, nn.Module))):
            raise TypeError(
                f"ShardedStrategy(shard_modules=...): entry {entry!r} is neither an nn.Module "
                "subclass (e.g. nn.TransformerEncoderLayer) nor a module name (a qualified "
                "name such as 'encoder.layers.0', or a class name such as 'Block').")
    return entries


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """The default policy: the children of every ``nn.ModuleList`` / ``nn.Sequential`` whose
    class repeats there (at least two children of the same class holding parameters), e.g.
    each layer of a transformer's stack or each Linear of an MLP. Everything else (an
    embedding, a final norm, a head) stays in its parent's unit."""
    chosen: list[nn.Module] = []
    for module in root.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in module.children():
            if _has_parameters(child):
                by_class.setdefault(type(child), []).append(child)
        for children in by_class.values():
            if len(children) >= 2:
                chosen.extend(children)
    return chosen


def named_blocks(root: nn.Module, entries: Sequence[ModuleEntry], matched: set[Any]
                 ) -> list[nn.Module]:
    """The modules of `root` named by `entries` (classes: instances of them; strings: the
    qualified name in `root` or the class name); adds each entry that matched to
    `matched`."""
    chosen: list[nn.Module] = []
    for name, module in root.named_modules():
        for entry in entries:
            hit = isinstance(module, entry) if isinstance(entry, type) else \
                entry in (name, type(module).__name__)
            if hit:
                matched.add(entry)
                if module is not root:
                    chosen.append(module)
                break
    return chosen


def plan_units(roots: Sequence[nn.Module], entries: Sequence[ModuleEntry] | None
               ) -> list[tuple[nn.Module, list[nn.Module]]]:
    """The units of each root, children before parents, the root last: a list of
    ``(root, [modules to shard])`` (empty without roots: nothing new to shard).

    Raises:
      ValueError: an entry of `entries` that names no module of any root (listing the
        module classes there), or a root without parameters.
    """
    if not roots:
        return []
    matched: set[Any] = set()
    plans: list[tuple[nn.Module, list[nn.Module]]] = []
    for root in roots:
        chosen = repeated_blocks(root) if entries is None else \
            named_blocks(root, entries, matched)
        ids = {id(m) for m in chosen}
        # Pre-order lists parents before children; reversed, FSDP2 gets children first.
        ordered = [m for m in reversed(list(root.modules())) if id(m) in ids]
        plans.append((root, [m for m in ordered if _has_parameters(m)]))
    if entries is not None:
        missing = [e for e in entries if e not in matched]
        if missing:
            names = sorted({type(m).__name__ for root in roots for m in root.modules()})
            shown = [e.__name__ if isinstance(e, type) else e for e in missing]
            raise ValueError(
                f"ShardedStrategy(shard_modules=...): {shown} name no module of the model(s) "
                f"created in strategy.scope() (their module classes: {names}). Name a class "
                "or a qualified module name (as in model.named_modules()), or pass "
                "shard_modules=None for the default policy (each repeated block).")
    return plans
