"""Cross-device ops: the algorithm used to all-reduce a flat buffer, as tf.distribute names them.

A `CrossDeviceOps` reduces one flat, contiguous buffer in place over the process group and
returns a handle whose ``wait()`` finishes the reduction. The gradient reducer and the
fused collectives hand every buffer to the strategy's cross-device ops.
"""
from __future__ import annotations

import datetime
import numbers
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist

from torchstrategy import context
from torchstrategy.collectives.compression import (Compression, ErrorFeedback,
                                                   check_compression)
from torchstrategy.communication_options import CommunicationOptions
from torchstrategy.reduce_op import ReduceOp, as_reduce_op


class Pending(Protocol):
    """A collective in flight: ``wait()`` returns once it has finished (torch's ``Work``,
    or one of the handles below)."""

    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...


def wait_for(work: Pending, timeout: datetime.timedelta | None = None) -> bool:
    """``work.wait()``, bounded by `timeout` (a timedelta) when one is given; otherwise by
    the process group's own timeout."""
    return work.wait() if timeout is None else work.wait(timeout)


class _Done:
    """A finished handle (world size 1)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True


class _Chain:
    """Runs dependent collectives one after another when waited on."""

    def __init__(self, first: Pending, then: Callable[[], Pending]) -> None:
        self._first = first
        self._then = then

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_for(self._first, timeout)
        wait_for(self._then(), timeout)
        return True


class _All:
    def __init__(self, works: Sequence[Pending]) -> None:
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            wait_for(work, timeout)
        return True


class CrossDeviceOps:
    """Base class. Subclasses implement `all_reduce_async` (a SUM, in place).

    ``compression`` (None here) is the wire dtype the gradient reducer casts buckets to
    before handing them to `all_reduce_async` ("bf16", "fp16" or None).
    """

    compression: Compression = None

    # True for algorithms that let error-feedback compression (ts.PowerSGD, ts.Int8) run its
    # own collectives over their process group in their place.
    runs_error_feedback = False

    def all_reduce_async(self, flat: torch.Tensor, group: dist.ProcessGroup | None
                         ) -> Pending:
        """Starts summing `flat` over `group` in place; the handle's ``wait()`` finishes it."""
        raise NotImplementedError("abstract: subclasses implement all_reduce_async")

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Sums `flat` over the group in place and returns it."""
        self.all_reduce_async(flat, group).wait()
        return flat

    # -- tf.distribute's CrossDeviceOps API, in a strategy's scope (cross-replica context) --
    def _extended(self, what: str) -> Any:
        """The current strategy's `extended`, after checking that there is one (inside its
        scope) and that it reduces with this algorithm (the strategy's process groups are
        where the replicas meet)."""
        if not context.has_strategy():
            raise RuntimeError(
                f"CrossDeviceOps.{what} reduces across the replicas of the current strategy; "
                "none is active here. Call it inside `with strategy.scope():`.")
        strategy = context.get_strategy()
        if context.get_replica_context() is not None and context.in_run():
            raise RuntimeError(f"CrossDeviceOps.{what} must be called in cross-replica "
                               "context (outside strategy.run); inside run use "
                               "ts.get_replica_context().all_reduce(...).")
        own = strategy.extended.cross_device_ops
        if own is not None and repr(own) != repr(self):
            raise ValueError(
                f"{self!r}.{what}: the current strategy {strategy!r} reduces with {own!r}, "
                "and its replicas meet only through that. Call "
                f"strategy.extended.cross_device_ops.{what}(...), or create the strategy "
                f"with cross_device_ops={self!r}.")
        return strategy.extended

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None) -> Any:
        """Reduces `per_replica_value` across the current strategy's replicas and places the
        result on `destinations` (a device, or a tensor / variable whose device to use;
        None: where it is). Returns a `Mirrored` (the tensor with one replica), as
        tf.distribute's ``CrossDeviceOps.reduce``; `options` a ``ts.CommunicationOptions``
        honoured as the strategy's collectives honour it.

        Raises:
          RuntimeError: inside ``strategy.run``.
          ValueError: this is not the strategy's algorithm (see `_extended`); SUM of a
            plain Python number over several replicas (as TensorFlow).
        """
        return self._batch_reduce("reduce", reduce_op, [(per_replica_value, destinations)],
                                  options)[0]

    def batch_reduce(self, reduce_op: ReduceOp | str,
                     value_destination_pairs: Iterable[tuple[Any, Any]],
                     options: CommunicationOptions | None = None) -> list[Any]:
        """`reduce` of many ``(value, destinations)`` pairs at once (fused into one
        collective per dtype); returns the list of results."""
        return self._batch_reduce("batch_reduce", reduce_op, value_destination_pairs, options)

    def _batch_reduce(self, what: str, reduce_op: ReduceOp | str,
                      value_destination_pairs: Iterable[tuple[Any, Any]],
                      options: CommunicationOptions | None) -> list[Any]:
        ext = self._extended(what)
        pairs = list(value_destination_pairs)
        for index, (value, _) in enumerate(pairs):
            if isinstance(value, numbers.Number) and not isinstance(value, torch.Tensor) and \
                    value != 0 and ext.num_replicas_in_sync > 1 and \
                    as_reduce_op(reduce_op) is ReduceOp.SUM:
                raise ValueError(
                    f"{type(self).__name__}.{what}: value {index} is the plain number "
                    f"{value!r}, one value rather than one per replica, so it cannot be "
                    f"summed over {ext.num_replicas_in_sync} replicas (TensorFlow raises "
                    "too). Pass a PerReplica, or a tensor holding this replica's value.")
        return ext.batch_reduce_to(reduce_op, pairs, options)

    def broadcast(self, tensor: torch.Tensor, destinations: Any) -> Any:
        """`tensor` on `destinations` on every replica, as a `Mirrored` (the tensor with one
        replica): tf.distribute's ``CrossDeviceOps.broadcast``. Where replicas are separate
        processes, replica 0's tensor is the one every replica gets."""
        return self._extended("broadcast").broadcast_to(tensor, destinations)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce over the process group: NCCL on GPU, gloo's ring on CPU (the default).

    Args:
      num_packs: the buffer is split into this many chunks, each its own collective, so
        that a large buffer's chunks can be in flight together.
      compression: None, "bf16" or "fp16": gradient buckets of wider floating dtypes travel
        in that dtype (half the bytes; each sum rounded to it, see
        `torchstrategy.collectives.compression`); or ``ts.PowerSGD(rank=...)`` /
        ``ts.Int8()``: error-feedback compression of gradient buckets
        (`torchstrategy.collectives.error_feedback`; the buckets are then reduced after
        backward, not during it); or "auto" / ``ts.AutoCompression(...)``: chosen from
        measurements at the start of training. Values reduced with ``strategy.reduce``
        are never compressed.
    """

    runs_error_feedback = True

    def __init__(self, num_packs: int = 1, compression: Compression = None) -> None:
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive int, got {num_packs!r}.")
        self.num_packs = num_packs
        self.compression = check_compression(compression)
        if isinstance(self.compression, ErrorFeedback) and num_packs != 1:
            raise ValueError(
                f"NcclAllReduce(num_packs={num_packs}, compression={self.compression!r}): "
                "error-feedback compression sends its own (much smaller) buffers and does "
                "not split them into packs; leave num_packs=1.")

    def all_reduce_async(self, flat: torch.Tensor, group: dist.ProcessGroup | None
                         ) -> Pending:
        if dist.get_world_size(group) == 1:
            return _Done()
        if self.num_packs == 1 or flat.numel() < self.num_packs:
            return dist.all_reduce(flat, group=group, async_op=True)
        return _All([dist.all_reduce(chunk, group=group, async_op=True)
                     for chunk in torch.tensor_split(flat, self.num_packs)])

    def __repr__(self) -> str:
        if self.compression is None:
            return f"NcclAllReduce(num_packs={self.num_packs})"
        return f"NcclAllReduce(num_packs={self.num_packs}, compression={self.compression!r})"


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce onto replica `reduce_to_replica` (0), then broadcast from it.

    Args:
      reduce_to_device: must be None. In TensorFlow it names the device one process reduces
        on; here every replica is its own process, so the reduction happens on replica
        `reduce_to_replica`'s device: pick it with that argument.
      accumulation_fn: how the replicas' values are added up on that replica, as
        TensorFlow's (default: the backend's sum, like ``tf.math.add_n``). It is called
        with a list of flat tensors, one per replica in replica order, and returns their
        elementwise combination (e.g. ``lambda xs: torch.stack(xs).sum(0)``); the values
        then travel as a gather to the reducing replica instead of a reduce.
      reduce_to_replica: the replica that receives the sum and broadcasts it.

    Raises:
      ValueError: a `reduce_to_device`, or a negative `reduce_to_replica`.
      TypeError: an `accumulation_fn` that is not callable.
    """

    def __init__(self, reduce_to_device: Any = None,
                 accumulation_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
                 reduce_to_replica: int = 0) -> None:
        if reduce_to_device is not None:
            raise ValueError(
                f"ReductionToOneDevice(reduce_to_device={reduce_to_device!r}) is not "
                "supported: each replica is its own process, so the sum is formed on one "
                "replica's device. Use ReductionToOneDevice(reduce_to_replica=N) instead.")
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(f"accumulation_fn must be a function of a list of tensors (e.g. "
                            f"lambda xs: torch.stack(xs).sum(0)), got {accumulation_fn!r}.")
        if isinstance(reduce_to_replica, bool) or not isinstance(reduce_to_replica, int) \
                or reduce_to_replica < 0:
            raise ValueError(f"reduce_to_replica must be a replica id (int >= 0), got "
                             f"{reduce_to_replica!r}.")
        self.reduce_to_device = None
        self.accumulation_fn = accumulation_fn
        self.reduce_to_replica = reduce_to_replica

    def all_reduce_async(self, flat: torch.Tensor, group: dist.ProcessGroup | None
                         ) -> Pending:
        if dist.get_world_size(group) == 1:
            return _Done()
        root = dist.get_global_rank(group, self.reduce_to_replica) if group is not None and \
            group != dist.group.WORLD else self.reduce_to_replica
        first: Pending
        if self.accumulation_fn is None:
            first = dist.reduce(flat, dst=root, group=group, async_op=True)
        else:
            first = _Accumulate(flat, root, group, self.accumulation_fn)
        # The broadcast may only start once the reduction has landed on the root.
        return _Chain(first, lambda: dist.broadcast(flat, src=root, group=group,
                                                    async_op=True))

    def __repr__(self) -> str:
        if self.accumulation_fn is None and self.reduce_to_replica == 0:
            return "ReductionToOneDevice()"
        parts = []
        if self.accumulation_fn is not None:
            parts.append(f"accumulation_fn={getattr(self.accumulation_fn, '__name__', '?')}")
        if self.reduce_to_replica:
            parts.append(f"reduce_to_replica={self.reduce_to_replica}")
        return f"ReductionToOneDevice({', '.join(parts)})"


class _Accumulate:
    """Gathers every replica's `flat` onto `root`, where ``accumulation_fn`` combines them
    into `flat` (when waited on)."""

    def __init__(self, flat: torch.Tensor, root: int, group: dist.ProcessGroup | None,
                 accumulation_fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        self._flat, self._root, self._fn = flat, root, accumulation_fn
        is_root = dist.get_rank() == root
        self._parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))] \
            if is_root else None
        self._work = dist.gather(flat, self._parts, dst=root, group=group, async_op=True)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_for(self._work, timeout)
        if self._parts is not None:
            combined = self._fn(self._parts)
            if not isinstance(combined, torch.Tensor) or combined.shape != self._flat.shape:
                raise ValueError(
                    "ReductionToOneDevice's accumulation_fn must return one tensor shaped "
                    f"like its inputs ({tuple(self._flat.shape)}), got {combined!r:.80}.")
            with torch.no_grad():
                self._flat.copy_(combined)
        return True


def as_cross_device_ops(value: CrossDeviceOps | None) -> CrossDeviceOps:
    """Returns `value` checked, or the default `NcclAllReduce()` for None.

    Raises:
      TypeError: for anything that is not a `CrossDeviceOps`.
    """
    if value is None:
        return NcclAllReduce()
    if not isinstance(value, CrossDeviceOps):
        raise TypeError(f"cross_device_ops must be a ts.CrossDeviceOps such as "
                        f"ts.NcclAllReduce() or ts.ReductionToOneDevice(), got {value!r}.")
    return value
