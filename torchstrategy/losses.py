"""Loss scaling for SUM-gradient semantics: `compute_average_loss`, `scale_regularization_loss`.

Under a strategy, ``backward()`` *sums* gradients over replicas (TensorFlow's semantics).
Dividing each replica's summed per-example loss by the *global* batch size makes that sum
the gradient of the global-batch mean loss, exactly as single-device training computes it.
"""
import math
import numbers

import torch

from torchstrategy import context
from torchstrategy.reduce_op import ReduceOp


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Scales per-example losses by the global batch size: ``sum(loss * weight) / B``.

    Args:
      per_example_loss: tensor of shape [local_batch, ...] (use ``reduction="none"``);
        all its elements are summed, as TensorFlow does.
      sample_weight: optional weights, broadcastable to `per_example_loss`.
      global_batch_size: B. If None, B is the sum of the local batch sizes of all replicas,
        found with one small all-reduce in replica context (exact for an uneven last batch);
        pass it explicitly to avoid that collective.

    Returns:
      A scalar tensor; summed over replicas it is the global-batch mean loss.

    Raises:
      ValueError: a scalar `per_example_loss`, or a non-positive `global_batch_size`.
    """
    if not isinstance(per_example_loss, torch.Tensor):
        per_example_loss = torch.as_tensor(per_example_loss)
    if per_example_loss.dim() == 0:
        raise ValueError("compute_average_loss needs per-example losses (shape [batch, ...]); "
                         "got a scalar. Compute the loss with reduction='none'.")
    if global_batch_size is not None:
        global_batch_size = _checked_batch_size(global_batch_size)
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
    # As in TensorFlow, every element is summed: a per-token loss of shape [batch, tokens]
    # gives sum / global_batch_size. Reduce the extra dimensions first to average them.
    if global_batch_size is None:
        local = per_example_loss.shape[0]
        replica = context.get_replica_context()
        if _traces_global_batch():
            global_batch_size = local  # one traced program over the whole global batch
        elif replica is not None and replica.num_replicas_in_sync > 1:
            count = torch.tensor(float(local), device=per_example_loss.device)
            global_batch_size = float(replica.all_reduce(ReduceOp.SUM, count).item())
        else:
            global_batch_size = local * _num_replicas()
    if global_batch_size <= 0:
        if per_example_loss.numel() == 0:
            return per_example_loss.sum()
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}.")
    return per_example_loss.sum() / global_batch_size


def _checked_batch_size(value):
    """`value` as a Python number of examples, or a ValueError naming it and the fix. A
    one-element tensor is read once, here (the division needs its value anyway)."""
    number = value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and \
            not value.dtype.is_complex and value.dtype != torch.bool:
        number = value.item()
    valid = isinstance(number, numbers.Real) and not isinstance(number, bool) and \
        math.isfinite(number) and number > 0 and float(number).is_integer()
    if not valid:
        raise ValueError(f"compute_average_loss: global_batch_size must be positive and whole "
                         f"(a number of examples), got global_batch_size={value!r}. Pass the "
                         "batch size summed over all replicas, or None to count it.")
    return number


def scale_regularization_loss(regularization_loss):
    """Divides a regularisation loss (e.g. an L2 term) by the number of replicas, so that
    summing gradients over replicas adds it once. Under a strategy that traces one program
    for all replicas (TPUStrategy) the term is already added once and is returned as is."""
    if _traces_global_batch():
        return regularization_loss
    return regularization_loss / _num_replicas()


def _traces_global_batch():
    return context.get_strategy().extended.traces_global_batch


def _num_replicas():
    replica = context.get_replica_context()
    if replica is not None:
        return replica.num_replicas_in_sync
    return context.get_strategy().num_replicas_in_sync
