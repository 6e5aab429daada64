"""Training helpers that FSDP2 users reach for, made to fit the strategies: a gradient-norm
clip that returns a plain tensor (`clip_grad_norm_`) and per-block activation checkpointing
(`checkpoint_activations`, applied by ``ShardedStrategy(activation_checkpointing=True)``).

Nothing here imports ``torch.distributed.tensor`` (DTensor): `import torchstrategy` must
stay cheap, and a DTensor can exist only once that module has been imported by whoever
made it (ShardedStrategy, or the user's own FSDP2).
"""
from __future__ import annotations

import sys
import types
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_DTENSOR_MODULE = "torch.distributed.tensor"


def _plain(norm: torch.Tensor) -> torch.Tensor:
    """`norm` as a plain tensor: a DTensor's full value (for the replicated DTensor that
    torch's clip returns, this replica's local copy: no communication), anything else as
    it is."""
    dtensor = sys.modules.get(_DTENSOR_MODULE)
    if dtensor is not None and isinstance(norm, dtensor.DTensor):
        return norm.full_tensor()
    return norm


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded and mirrored parameters alike: clips
    the gradients of `parameters` in place so that their global norm is at most
    `max_norm`, and returns that norm (before clipping) as a *plain* 0-dim tensor.

    Guarantees: with ShardedStrategy (DTensor parameters, any mesh: 1-D or hybrid
    ``shard_group_size``) the norm is the norm of the full gradients, the same value on
    every replica and equal to what ``torch.nn.utils.clip_grad_norm_`` returns on one
    device for the same gradients, and every shard is scaled by the same factor one device
    would use. torch (checked on 2.13) computes and clips the same way but returns a
    replicated DTensor, which spreads to what it is combined with, fails with plain tensors
    of one or more dimensions ("got mixed torch.Tensor and DTensor") and in an f-string
    format (``f"{norm:.3f}"``); this returns its value as a ``torch.Tensor`` (``.item()``
    gives the float).
    With plain parameters (MirroredStrategy, one device) it is torch's function unchanged.

    With sharded parameters it is a collective (the norms of the shards are summed over
    the replicas): every replica calls it, with the same parameters, outside or inside
    ``strategy.run``. Arguments are torch's, passed through.
    """
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite,
                                          foreach=foreach)
    return _plain(norm)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's own forward, recomputed in backward: non-reentrant checkpointing
    # (torch's recommended mode) supports keyword arguments, inputs that do not require
    # gradients and torch.compile, and restores the RNG state so dropout repeats exactly.
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(module: nn.Module) -> None:
    """Makes `module` keep no activations of its forward for backward: only its inputs
    are kept, and backward runs its forward again (``torch.utils.checkpoint``,
    non-reentrant) to get the rest. Gradients are unchanged (the same operations in the
    same order; random operations see the same random numbers).

    Applied to an FSDP2 unit, the recomputation runs inside the unit's backward, after
    FSDP2 has gathered its parameters again, so it costs one more forward of the unit and
    no communication beyond what ``reshard_after_forward`` already implies. The module's
    class, parameters and ``state_dict`` keys are unchanged (no wrapper module); the
    forward is replaced on the instance by a bound method, which ``copy.deepcopy``
    rebinds to the copy.

    Raises:
      ValueError: `module` already has its own per-instance ``forward`` (checkpointed
        twice, or patched by someone else: checkpointing it would drop that forward).
    """
    if "forward" in vars(module):
        raise ValueError(
            f"checkpoint_activations: this {type(module).__name__} already has a forward of "
            "its own (set on the instance: already checkpointed, or replaced by other code); "
            "checkpoint each module once, and before replacing its forward.")
    module.forward = types.MethodType(_checkpointed_forward, module)
