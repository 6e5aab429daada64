"""`OneBitAdamW`: the optimizer half of 1-bit Adam (`ts.OneBitAdam`).

Under ``compression=ts.OneBitAdam(...)`` the gradient reduction keeps Adam's moments and
leaves Adam's bias-corrected update direction in each ``.grad``
(`torchstrategy.collectives.onebit`). What stays in the optimizer is what a training loop
changes between steps: the learning rate (schedules act on ``param_groups``) and the
decoupled weight decay. The update is AdamW's::

    p = p * (1 - lr * weight_decay) - lr * direction
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from torchstrategy import context, ownership
from torchstrategy.collectives.compression import OneBitAdam


def _strategy_compression(strategy: Any) -> tuple[Any, int]:
    """The compression of `strategy`'s gradient reduction and its number of replicas."""
    extended = strategy.extended
    communicator = getattr(extended, "communicator", None)
    ops = getattr(communicator, "cross_device_ops", None)
    return getattr(ops, "compression", None), int(strategy.num_replicas_in_sync)


class OneBitAdamW(torch.optim.Optimizer):
    """AdamW whose moments are kept by the strategy's ``ts.OneBitAdam`` compression.

    Use it with a strategy created with ``compression=ts.OneBitAdam(...)`` (Adam's betas,
    eps and the warm-up are set there, where the moments live); this optimizer applies
    ``p = p * (1 - lr * weight_decay) - lr * p.grad``, where ``p.grad`` holds Adam's
    direction. During the warm-up this is AdamW with the summed gradients, to rounding.

    Args:
      params: the parameters (or parameter groups) to optimize.
      lr: the learning rate.
      weight_decay: the decoupled weight decay (AdamW's; torch's default 1e-2).
      strategy: the strategy whose reduction computes the directions (default: the one
        whose scope was entered last, else the current one).

    Raises:
      ValueError: a negative lr or weight_decay, or a strategy that does not run
        ``ts.OneBitAdam`` compression over more than one replica (its ``.grad`` would hold
        gradients, not Adam's directions).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 1e-2,
                 *, strategy: Any = None) -> None:
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"OneBitAdamW {name} must be a number >= 0, got {value!r}.")
        if strategy is None:
            strategy = ownership.live_strategy() or context.get_strategy()
        compression, replicas = _strategy_compression(strategy)
        if not isinstance(compression, OneBitAdam) or replicas < 2:
            raise ValueError(
                f"OneBitAdamW applies the Adam directions that ts.OneBitAdam compression "
                f"leaves in .grad, but {type(strategy).__name__} runs compression="
                f"{compression!r} over {replicas} replica(s), so .grad would hold plain "
                "gradients. Create the strategy with cross_device_ops=ts.NcclAllReduce("
                "compression=ts.OneBitAdam(...)) over 2 or more replicas, or use "
                "torch.optim.AdamW.")
        super().__init__(params, {"lr": float(lr), "weight_decay": float(weight_decay)})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Applies each parameter's direction (``.grad``) with its group's learning rate
        and weight decay; parameters without ``.grad`` are left as they are."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if decay:
                    p.mul_(1 - lr * decay)
                p.add_(p.grad, alpha=-lr)
        return loss
