"""`ReduceOp`: how values from several replicas are combined, as in tf.distribute."""
import enum

from torchstrategy.aggregation import VariableAggregation


class ReduceOp(enum.Enum):
    """How per-replica values are combined: ``SUM`` or ``MEAN``.

    Anywhere a reduce op is taken, the strings ``"SUM"`` and ``"MEAN"`` (any case) are
    accepted too.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation):
        """The reduce op matching a `VariableAggregation` (SUM or MEAN), as TensorFlow maps it."""
        mapping = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
        if aggregation not in mapping:
            raise ValueError(f"Could not convert from `VariableAggregation` {aggregation} to "
                             "`ReduceOp`: only SUM and MEAN have one.")
        return mapping[aggregation]


def as_reduce_op(op):
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


def check_mean_dtype(op, tensor):
    """Refuses ``MEAN`` of an integer or bool tensor (floating and complex are fine).

    Raises:
      ValueError: saying to cast first or use SUM.
    """
    if op is ReduceOp.MEAN and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"ReduceOp.MEAN of integer tensors is ambiguous (this one is "
                         f"{tensor.dtype}); cast to a floating dtype first, or use SUM.")
