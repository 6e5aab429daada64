"""Loss scaling for SUM-gradient semantics: `compute_average_loss`,
`scale_regularization_loss`, and DDP's convention, `scale_mean_loss`.

Under a strategy, ``backward()`` *sums* gradients over replicas (TensorFlow's semantics).
Dividing each replica's summed per-example loss by the *global* batch size makes that sum
the gradient of the global-batch mean loss, exactly as single-device training computes it.
A DDP program instead computes a mean loss per replica and relies on DDP *averaging*
gradients: `scale_mean_loss` keeps such a loss's value (it logs as DDP's) and makes the
backward through it leave DDP's average in ``.grad``.

How many replicas a ``backward()`` sums over is known inside ``strategy.run`` (its replica
context). Outside ``run`` (a DDP-style loop, with or without the scope) it is the *live*
strategy's: the one whose ``scope()`` was entered last (`torchstrategy.ownership`), never
the default strategy's one replica while a multi-replica strategy sums the gradients.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from torchstrategy import context, ownership
from torchstrategy.collectives.reducer import GradientReducer
from torchstrategy.reduce_op import ReduceOp


def compute_average_loss(per_example_loss: torch.Tensor | Any,
                         sample_weight: torch.Tensor | float | None = None,
                         global_batch_size: int | float | torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Scales per-example losses by the global batch size: ``sum(loss * weight) / B``.

    Args:
      per_example_loss: tensor of shape [local_batch, ...] (use ``reduction="none"``);
        all its elements are summed, as TensorFlow does.
      sample_weight: optional weights: a number, or a tensor that broadcasts to
        `per_example_loss`'s shape without changing it (one weight per example: shape
        [local_batch] for a 1-D loss, [local_batch, 1] for [local_batch, tokens]).
      global_batch_size: B. If None, B is the sum of the local batch sizes of all replicas,
        found with one small all-reduce (exact for an uneven last batch); pass it
        explicitly to avoid that collective. Outside ``strategy.run`` that all-reduce is
        the live strategy's (the replicas' ``backward()`` sums gradients there too, in a
        DDP-style loop): every replica must then call this function at the same point.

    Returns:
      A scalar tensor; summed over replicas it is the global-batch mean loss.

    Raises:
      ValueError: a scalar `per_example_loss`, a `sample_weight` whose shape does not fit
        it (named, with both shapes), or a non-positive `global_batch_size`.
    """
    if not isinstance(per_example_loss, torch.Tensor):
        per_example_loss = torch.as_tensor(per_example_loss)
    if per_example_loss.dim() == 0:
        raise ValueError("compute_average_loss needs per-example losses (shape [batch, ...]); "
                         "got a scalar. Compute the loss with reduction='none'.")
    if global_batch_size is not None:
        global_batch_size = _checked_batch_size(global_batch_size)
    if sample_weight is not None:
        per_example_loss = per_example_loss * _checked_weight(sample_weight, per_example_loss)
    # As in TensorFlow, every element is summed: a per-token loss of shape [batch, tokens]
    # gives sum / global_batch_size. Reduce the extra dimensions first to average them.
    if global_batch_size is None:
        global_batch_size = _global_count(per_example_loss.shape[0], per_example_loss.device)
    if global_batch_size <= 0:
        if per_example_loss.numel() == 0:
            return per_example_loss.sum()
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}.")
    return per_example_loss.sum() / global_batch_size


def _checked_weight(sample_weight: torch.Tensor | float, per_example_loss: torch.Tensor
                    ) -> torch.Tensor | float:
    """`sample_weight` if multiplying keeps `per_example_loss`'s shape, else a ValueError
    naming both shapes and the fix: a weight that broadcasts *up* ([batch, 1] against
    [batch]) would silently sum a batch x batch product."""
    if not isinstance(sample_weight, torch.Tensor):
        if isinstance(sample_weight, numbers.Real) and not isinstance(sample_weight, bool):
            return sample_weight
        sample_weight = torch.as_tensor(sample_weight)
    loss_shape = tuple(per_example_loss.shape)
    weight_shape = tuple(sample_weight.shape)
    try:
        fits = torch.broadcast_shapes(loss_shape, weight_shape) == loss_shape
    except RuntimeError:
        fits = False
    if not fits:
        hint = ""
        if len(weight_shape) > len(loss_shape) and \
                sample_weight.numel() == per_example_loss.numel():
            hint = (f" It has more dimensions than the loss: write "
                    f"sample_weight.reshape({list(loss_shape)}).")
        elif len(weight_shape) < len(loss_shape) and weight_shape and \
                weight_shape[0] == loss_shape[0]:
            hint = (" For one weight per example of a loss with more dimensions, write "
                    "sample_weight[:, None] (or reshape it to "
                    f"{(loss_shape[0],) + (1,) * (len(loss_shape) - 1)}).")
        elif weight_shape and loss_shape and weight_shape[0] != loss_shape[0]:
            hint = (f" It has {weight_shape[0]} weights for {loss_shape[0]} examples: give "
                    "this replica's weights, one per example of its local batch (the "
                    "same slice of the batch as the loss).")
        raise ValueError(f"compute_average_loss: sample_weight of shape {list(weight_shape)} "
                         f"does not fit per_example_loss of shape {list(loss_shape)}: it must "
                         f"broadcast to that shape without changing it (a scalar, "
                         f"{list(loss_shape[:1])} for a 1-D loss, or the loss's own shape)."
                         + hint)
    return sample_weight


def _checked_batch_size(value: int | float | torch.Tensor) -> float:
    """`value` as a Python number of examples, or a ValueError naming it and the fix. A
    one-element tensor is read once, here (the division needs its value anyway)."""
    number: Any = value   # a number once checked below
    if isinstance(value, torch.Tensor) and value.numel() == 1 and \
            not value.dtype.is_complex and value.dtype != torch.bool:
        number = value.item()
    valid = isinstance(number, numbers.Real) and not isinstance(number, bool) and \
        math.isfinite(number) and float(number) > 0 and float(number).is_integer()
    if not valid:
        raise ValueError(f"compute_average_loss: global_batch_size must be positive and whole "
                         f"(a number of examples), got global_batch_size={value!r}. Pass the "
                         "batch size summed over all replicas, or None to count it.")
    return number


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """Divides a regularisation loss (e.g. an L2 term) by the number of replicas, so that
    summing gradients over replicas adds it once. Under a strategy that traces one program
    for all replicas (TPUStrategy) the term is already added once and is returned as is."""
    if _traces_global_batch():
        return regularization_loss
    return regularization_loss / _num_replicas()


def scale_mean_loss(loss: torch.Tensor | float) -> torch.Tensor:
    """DDP's convention: `loss` is already a mean over this replica's examples (a criterion
    with its default ``reduction="mean"``). Returns a tensor with the same value as `loss`
    (so ``loss.item()`` logs what DDP's program logs) whose backward leaves in ``.grad``
    the *average* of the replicas' gradients, what ``DistributedDataParallel`` leaves. A
    DDP training loop then ports without arithmetic::

        loss = ts.scale_mean_loss(F.cross_entropy(model(x), y))
        loss.backward()

    Only the gradient is scaled, and where DDP scales it: under a strategy whose gradient
    reducer sums over processes (MirroredStrategy, MultiWorkerMirroredStrategy) the
    backward marks itself as averaging, and the reducer divides each float32 gradient by
    the number of replicas as it enters its bucket, before the SUM all-reduce, exactly as
    DDP's reducer does. So weights stay bit-identical to DDP's with fp16 autocast and a
    GradScaler too (a factor run through the fp16 backward would round differently).
    Under ``no_sync()`` nothing is divided: the synchronising backward divides what
    accumulated, as in DDP. Strategies that reduce another way (CentralStorageStrategy's
    replica threads, ShardedStrategy's FSDP2 reduce-scatter) divide the loss's gradient
    by the number of replicas as it enters the backward: the same average, with the
    rounding of that order. A strategy that traces one program over the whole global
    batch (TPUStrategy), or a single replica, returns `loss` as it is.

    Use it on the whole loss of a backward: a backward that averages divides every
    gradient it produces, so a term scaled for summing (`compute_average_loss`,
    `scale_regularization_loss`) added outside it would be divided twice.

    With equal local batches this is the global-batch mean (single-device training). With
    an uneven last batch every replica weighs the same, as in DDP; use
    `compute_average_loss` for the exact global-batch mean. Inside ``run`` the replica
    count is the run's; outside it, the live strategy's (see the module docstring).

    Raises:
      ValueError: `loss` is not a scalar (pass per-example losses to
        `compute_average_loss` instead).
    """
    if not isinstance(loss, torch.Tensor):
        loss = torch.as_tensor(loss)
    if loss.dim() != 0:
        raise ValueError(f"scale_mean_loss takes a scalar mean loss, got a tensor of shape "
                         f"{list(loss.shape)}. Average it first, or pass per-example losses "
                         "to ts.compute_average_loss.")
    if _traces_global_batch():
        return loss
    replicas = _num_replicas()
    if replicas == 1:
        return loss
    reducer = _summing_strategy().extended.gradient_reducer
    return _AveragedGradient.apply(loss, reducer, replicas)


class _AveragedGradient(torch.autograd.Function):
    """The identity on a mean loss; its backward makes the gradients the average over
    `replicas`: by the gradient reducer, as DDP does, when `reducer` is open, else by
    dividing the incoming gradient (the same division ``loss / replicas`` would do)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, reducer: GradientReducer | None,
                replicas: int) -> torch.Tensor:
        ctx.reducer = reducer
        ctx.replicas = replicas
        # A new tensor, not a view: the caller may change it in place (``loss *= k``), as
        # it could the ``loss / n`` this replaced.
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.reducer is not None and ctx.reducer.average_this_backward():
            return grad, None, None
        return grad / ctx.replicas, None, None


def _summing_strategy() -> context.AnyStrategy:
    """The strategy whose replicas a ``backward()`` here sums over: the run's inside
    ``run``, else the live strategy (only asked when there are several replicas)."""
    if context.in_run():
        return context.get_strategy()
    return _outside_run_strategy()[0]


def _traces_global_batch() -> bool:
    return context.get_strategy().extended.traces_global_batch


def _outside_run_strategy() -> tuple[context.AnyStrategy | None, int]:
    """The strategy whose replicas a ``backward()`` here sums over when it is not the
    current replica context's, and their number: outside ``run``, the live strategy."""
    live = ownership.live_strategy()
    if live is None:
        return None, 1
    return live, live.extended.backward_replicas_outside_run


def _num_replicas() -> int:
    replica = context.get_replica_context()
    if context.in_run():
        if replica is not None:
            return replica.num_replicas_in_sync
        return context.get_strategy().num_replicas_in_sync   # merge_call
    return _outside_run_strategy()[1]


def _global_count(local: int, device: torch.device) -> float:
    """The number of examples over every replica whose gradients the coming backward sums,
    given this replica's `local` count (one small all-reduce when there are several)."""
    if _traces_global_batch():
        return local  # one traced program over the whole global batch
    replica = context.get_replica_context()
    count = torch.tensor(float(local), device=device)
    if context.in_run():
        if replica is not None and replica.num_replicas_in_sync > 1:
            return float(replica.all_reduce(ReduceOp.SUM, count).item())
        return local * _num_replicas()
    live, replicas = _outside_run_strategy()
    if replicas > 1 and live is not None:
        # One float made here on every replica: no layout to compare first.
        (total,) = live.extended.communicator.all_reduce([count], ReduceOp.SUM,
                                                         check_layout=False)
        return float(total.item())
    return local
