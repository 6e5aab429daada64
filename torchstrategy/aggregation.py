"""`VariableAggregation` and `VariableSynchronization`: how a variable's copies are kept in
step, as tf.distribute names them. Plain data (layer 1): `reduce_op` and `variables` both use
them.
"""
from __future__ import annotations

import enum
from typing import TypeVar



class VariableAggregation(enum.Enum):
    """How updates made in replica context are combined: NONE (each replica keeps its own
    update), SUM, MEAN, ONLY_FIRST_REPLICA (replica 0's update is applied everywhere)."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"



class VariableSynchronization(enum.Enum):
    """When copies are synchronised: AUTO/ON_WRITE (mirrored: at every update), ON_READ
    (when read in cross-replica context), NONE (never: a per-replica variable)."""

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


_Enum = TypeVar("_Enum", bound=enum.Enum)


def as_enum(kind: type[_Enum], value: _Enum | str, name: str) -> _Enum:
    """`value` as a member of the enum `kind` (a member, or its name in any case).

    Raises:
      ValueError: naming every accepted member.
    """
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value.upper() in kind.__members__:
        return kind[value.upper()]
    raise ValueError(f"Unknown {name} {value!r}: use one of "
                     f"{', '.join('ts.' + kind.__name__ + '.' + m for m in kind.__members__)}.")
