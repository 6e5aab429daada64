"""`ReduceOp`: how values from several replicas are combined, as in tf.distribute."""
from __future__ import annotations

import enum

import torch

from torchstrategy.aggregation import VariableAggregation


class ReduceOp(enum.Enum):
    """How per-replica values are combined: ``SUM`` or ``MEAN``.

    Anywhere a reduce op is taken, the strings ``"SUM"`` and ``"MEAN"`` (any case) are
    accepted too.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: VariableAggregation) -> ReduceOp:
        """The reduce op matching a `VariableAggregation` (SUM or MEAN), as TensorFlow maps it."""
        mapping = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
        if aggregation not in mapping:
            raise ValueError(f"Could not convert from `VariableAggregation` {aggregation} to "
                             "`ReduceOp`: only SUM and MEAN have one.")
        return mapping[aggregation]


def as_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """Returns `op` as a `ReduceOp`; accepts a `ReduceOp` or "SUM"/"MEAN" in any case.

    Raises:
      ValueError: naming the accepted values, for anything else.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    raise ValueError(f"Unknown reduce op {op!r}: use ts.ReduceOp.SUM or ts.ReduceOp.MEAN "
                     "(or the strings 'SUM' / 'MEAN').")


def mean_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``MEAN`` of `dtype` values gives: floating and complex dtypes keep theirs;
    integers give a floating result, as TensorFlow's true division makes it (int8, uint8,
    int16: float32; wider integers: float64, exact for counts up to 2**53).

    Raises:
      ValueError: for bool (a mean of truth values is not defined; cast first).
    """
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    if dtype == torch.bool:
        raise ValueError("ReduceOp.MEAN of bool tensors is not defined; cast to a number "
                         "first (t.float()), or use SUM (which gives 'any').")
    return torch.float32 if dtype in (torch.int8, torch.uint8, torch.int16) else torch.float64


def as_mean_input(op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` ready to be averaged by `op`: for ``MEAN`` of an integer tensor, converted to
    `mean_dtype` (the sum is then exact and the division a true division); otherwise as it
    is.

    Raises:
      ValueError: MEAN of a bool tensor.
    """
    if op is not ReduceOp.MEAN:
        return tensor
    dtype = mean_dtype(tensor.dtype)
    return tensor if dtype == tensor.dtype else tensor.to(dtype)


def check_mean_dtype(op: ReduceOp, tensor: torch.Tensor) -> None:
    """Refuses ``MEAN`` of an integer or bool tensor where a collective cannot change the
    dtype it returns (``ReplicaContext.all_reduce``, fused all-reduces in place);
    ``strategy.reduce`` converts integers first (see `as_mean_input`).

    Raises:
      ValueError: saying to cast first or use SUM.
    """
    if op is ReduceOp.MEAN and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"ReduceOp.MEAN of a {tensor.dtype} tensor here would have to "
                         f"return {tensor.dtype}, truncating the mean; cast to a floating "
                         "dtype first (t.float()), or use SUM and divide.")
