"""Variables with tf.distribute's synchronisation and aggregation semantics.

``ts.Variable(value)`` made inside a strategy's scope is a `MirroredVariable` (the same
value on every replica, kept so by aggregating updates) or, with
``synchronization=ON_READ``, a `SyncOnReadVariable` (each replica updates its own copy;
reading it in cross-replica context aggregates the copies: metrics, counters). Made outside
every scope it is a plain `Variable` (updates applied as given), as ``tf.Variable`` is a
plain variable under TensorFlow's default strategy.

A variable wraps a torch tensor (`tensor`; an ``nn.Parameter`` when trainable, so it can be
handed to an optimizer and gets its gradient summed like any mirrored parameter). Torch
functions and Python operators accept a variable wherever they accept a tensor.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from torchstrategy import _compat, context, module_state
from torchstrategy.aggregation import (VariableAggregation, VariableSynchronization,
                                      as_enum as _as_enum)
from torchstrategy.reduce_op import ReduceOp


def _in_replica_context_of(strategy: context.AnyStrategy) -> bool:
    replica = context.get_replica_context()
    return replica is not None and context.in_run() and replica.strategy is strategy


class Variable:
    """A variable of the current strategy (see the module docstring).

    Args:
      initial_value: tensor, array or number (or a callable returning one).
      trainable: whether it takes part in training (default: True unless ON_READ).
      name: a name for printing and checkpoints.
      dtype: optional dtype to convert the initial value to.
      aggregation: a `VariableAggregation` (or its name).
      synchronization: a `VariableSynchronization` (or its name).

    Raises:
      ValueError: unknown enum values, or ON_READ with aggregation NONE or trainable=True.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable:
            # A strategy that keeps variables elsewhere (ParameterServerStrategy) makes them.
            made = context.get_strategy().extended.create_variable(*args, **kwargs)
            if made is not None:
                return made
            if not context.has_strategy():
                return object.__new__(cls)     # outside every scope: a plain variable
            sync = kwargs.get("synchronization", VariableSynchronization.AUTO)
            sync = _as_enum(VariableSynchronization, sync, "synchronization")
            cls = SyncOnReadVariable if sync is VariableSynchronization.ON_READ \
                else MirroredVariable
        return object.__new__(cls)

    def __init__(self, initial_value: Any, trainable: bool | None = None,
                 name: str | None = None, dtype: torch.dtype | None = None,
                 aggregation: VariableAggregation | str = VariableAggregation.NONE,
                 synchronization: VariableSynchronization | str =
                 VariableSynchronization.AUTO) -> None:
        self._aggregation = _as_enum(VariableAggregation, aggregation, "aggregation")
        self._synchronization = _as_enum(VariableSynchronization, synchronization,
                                         "synchronization")
        if callable(initial_value):
            initial_value = initial_value()
        self._strategy = context.get_strategy()
        device = self._strategy.extended.torch_device or torch.device("cpu")
        value = torch.as_tensor(initial_value, dtype=dtype).detach().clone().to(device)
        if trainable is None:
            trainable = self._synchronization is not VariableSynchronization.ON_READ
        self._check(trainable)
        self._trainable = bool(trainable) and (value.is_floating_point() or value.is_complex())
        self._tensor = torch.nn.Parameter(value, requires_grad=True) if self._trainable \
            else value
        self._name = name or "Variable"
        self._strategy.extended.check_variable(self)
        if context.has_strategy():
            self._strategy.extended.record_variable(self)
        self._strategy.extended.created_variable(self)

    def _check(self, trainable: bool) -> None:
        """Refuses what TensorFlow refuses for an ON_READ variable (any variable class)."""
        if self._synchronization is not VariableSynchronization.ON_READ and \
                not isinstance(self, SyncOnReadVariable):
            return
        if self._aggregation is VariableAggregation.NONE:
            raise ValueError("A SyncOnReadVariable (synchronization=ON_READ) needs an "
                             "aggregation: SUM, MEAN or ONLY_FIRST_REPLICA.")
        if trainable:
            raise ValueError("A SyncOnReadVariable (synchronization=ON_READ) cannot be "
                             "trainable; pass trainable=False.")

    # -- reading -------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The underlying tensor (an ``nn.Parameter`` when trainable)."""
        return self._tensor

    def read_value(self) -> torch.Tensor:
        """The variable's value as a tensor (see the subclasses for cross-replica reads)."""
        return self._tensor

    def value(self) -> torch.Tensor:
        return self.read_value()

    def numpy(self) -> Any:
        return self.read_value().detach().cpu().numpy()

    @property
    def name(self) -> str:
        return self._name

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    @property
    def shape(self) -> torch.Size:
        return self._tensor.shape

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    # -- writing -------------------------------------------------------------------------
    def _write(self, new_value: torch.Tensor) -> Variable:
        self._strategy.extended.write_variable(self, new_value)
        return self

    def assign(self, value: Any) -> Variable:
        """Sets the value as given (a plain variable, made outside every scope); returns
        self. `MirroredVariable` and `SyncOnReadVariable` aggregate first."""
        return self._write(value)

    def assign_add(self, delta: Any) -> Variable:
        """Adds `delta` as given; returns self."""
        return self._write(self._tensor.detach() + torch.as_tensor(delta))

    def assign_sub(self, delta: Any) -> Variable:
        return self.assign_add(-torch.as_tensor(delta))

    # -- behaving like a tensor ------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.read_value() if isinstance(x, Variable) else x
        args = _compat.tree_map(unwrap, args)
        kwargs = _compat.tree_map(unwrap, kwargs or {})
        return func(*args, **kwargs)

    def __array__(self, dtype: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __float__(self) -> float:
        return float(self.read_value().detach())

    def __int__(self) -> int:
        return int(self.read_value().detach())

    def __bool__(self) -> bool:
        return bool(self.read_value().detach())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self._name!r}, "
                f"aggregation={self._aggregation.name}, value={self.read_value()!r})")


def _binary(name: str) -> Callable[[Variable, Any], Any]:
    def method(self: Variable, other: Any) -> Any:
        return getattr(self.read_value(), name)(
            other.read_value() if isinstance(other, Variable) else other)
    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__pow__", "__matmul__",
              "__rmatmul__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
              "__getitem__"):
    setattr(Variable, _name, _binary(_name))
setattr(Variable, "__neg__", lambda self: -self.read_value())
setattr(Variable, "__hash__", object.__hash__)  # by identity, though __eq__ compares values


class MirroredVariable(Variable):
    """The same value on every replica.

    In replica context (inside ``run``) an update is aggregated across replicas by the
    variable's aggregation before it is applied: SUM adds up the replicas' updates, MEAN
    averages them, ONLY_FIRST_REPLICA applies replica 0's, NONE applies each replica's own
    (the copies may then differ). In cross-replica context an update is applied as given
    (every replica runs the same code with the same value).
    """

    def _aggregated(self, value: Any) -> torch.Tensor:
        value = torch.as_tensor(value, dtype=self._tensor.dtype, device=self._tensor.device)
        if not _in_replica_context_of(self._strategy) or \
                self._strategy.num_replicas_in_sync == 1:
            return value
        comm = self._strategy.extended.communicator
        if self._aggregation is VariableAggregation.SUM:
            return comm.all_reduce([value], ReduceOp.SUM)[0]
        if self._aggregation is VariableAggregation.MEAN:
            return comm.all_reduce([value], ReduceOp.MEAN)[0]
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            value = value.clone()
            comm.broadcast_([value], src=0)
        return value

    def assign(self, value: Any) -> Variable:
        """Sets the value (aggregated across replicas in replica context); returns self."""
        return self._write(self._aggregated(value))

    def assign_add(self, delta: Any) -> Variable:
        """Adds `delta` (aggregated across replicas in replica context); returns self."""
        return self._write(self._tensor.detach() + self._aggregated(delta))


class SyncOnReadVariable(Variable):
    """Each replica updates its own copy; reading in cross-replica context aggregates.

    Reading (``read_value()``, torch ops, printing) outside ``run`` all-reduces the copies
    by the aggregation (SUM, MEAN, or replica 0's for ONLY_FIRST_REPLICA), so every replica
    must read at the same point. In cross-replica context ``assign(v)`` sets the copies so
    that they aggregate to `v` (each gets v / N for SUM).
    """

    def _cross_replica(self) -> bool:
        return not _in_replica_context_of(self._strategy) and \
            self._strategy.num_replicas_in_sync > 1

    def read_value(self) -> torch.Tensor:
        if not self._cross_replica():
            return self._tensor
        comm = self._strategy.extended.communicator
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            value = self._tensor.clone()
            comm.broadcast_([value], src=0)
            return value
        op = ReduceOp.SUM if self._aggregation is VariableAggregation.SUM else ReduceOp.MEAN
        return comm.all_reduce([self._tensor], op)[0]

    def _local_share(self, value: Any) -> torch.Tensor:
        value = torch.as_tensor(value, dtype=self._tensor.dtype, device=self._tensor.device)
        if self._cross_replica() and self._aggregation is VariableAggregation.SUM:
            value = value / self._strategy.num_replicas_in_sync
        return value

    def assign(self, value: Any) -> Variable:
        return self._write(self._local_share(value))

    def assign_add(self, delta: Any) -> Variable:
        return self._write(self._tensor + self._local_share(delta))

    def __repr__(self) -> str:
        return (f"SyncOnReadVariable(name={self._name!r}, "
                f"aggregation={self._aggregation.name}, local={self._tensor!r})")


class VariablesByTensor:
    """The ``ts.Variable``s made under one strategy, found by their tensor.

    Weak in the variables: an entry goes when its variable does (until then it holds the
    tensor, as the variable does). Keyed by the tensor's identity (`module_state.IdentityMap`,
    which keeps it alive), so a new tensor is never taken for a dead variable's, and no weak
    reference is put on the tensor (``torch.utils.swap_tensors`` refuses tensors that have
    one).
    """

    def __init__(self) -> None:
        self._entries: module_state.IdentityMap[torch.Tensor, weakref.ReferenceType[Variable]]
        self._entries = module_state.IdentityMap()

    def add(self, variable: Variable) -> None:
        """Remembers `variable` under its tensor (a later variable of the same tensor wins)."""
        tensor = variable.tensor
        entries = weakref.ref(self._entries)

        def forget(ref: weakref.ReferenceType[Variable]) -> None:
            table = entries()
            if table is not None and table.get(tensor) is ref:
                table.pop(tensor)

        self._entries[tensor] = weakref.ref(variable, forget)

    def get(self, tensor: object) -> Variable | None:
        """The live variable whose tensor is `tensor` (itself, not an equal one), or None."""
        ref = self._entries.get(tensor)
        variable = None if ref is None else ref()
        return variable if variable is not None and variable.tensor is tensor else None

    def __len__(self) -> int:
        return len(self._entries)
