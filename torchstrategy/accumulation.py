"""Gradient accumulation: `accumulate` groups micro-batches, communicates on the last.

A group of `steps` micro-batches makes one optimizer step. Backward passes of the group's
micro-batches accumulate gradients locally (``strategy.extended.no_sync()``, DDP's
``no_sync``); the last one's backward sums everything accumulated across replicas, once.
Each micro-batch scales its loss for the whole group, so the step equals one step on the
group's examples taken together (single-device training on the large batch).

    for micro in ts.accumulate(strategy, dist_dataset, steps=4):
        with micro:                                  # no_sync unless it is the last
            strategy.run(micro_step, args=(micro.batch, micro))
        if micro.is_last:
            strategy.run(apply_gradients)            # optimizer.step(); zero_grad()

    def micro_step(batch, micro):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        micro.scale_mean_loss(loss).backward()   # or micro.compute_average_loss(per_example)

Micro-batches are read one at a time, when the loop asks for the next one, exactly as a
hand-written ``no_sync`` loop reads them: random draws of the data (a batch sampled with
the global generator) and of the model (dropout) keep their order, so the weights are the
loop's own. Only the example count of `MicroBatch.compute_average_loss` needs the whole
group: the first call of a group reads the group's remaining micro-batches then (kept for
the coming iterations) and sums their examples over the replicas in one all-reduce;
`MicroBatch.scale_mean_loss` needs neither.
"""
from __future__ import annotations

import numbers
import threading
from types import TracebackType
from typing import Any, Iterable, Iterator

import torch

from torchstrategy import context, losses, nest, values
from torchstrategy.context import AnyStrategy
from torchstrategy.reduce_op import ReduceOp


def accumulate(strategy: AnyStrategy, batches: Iterable[Any], steps: int
               ) -> Iterator[MicroBatch]:
    """Iterates `batches` as `MicroBatch`es in groups of `steps`.

    Args:
      strategy: the strategy whose gradient reduction is deferred to each group's last
        micro-batch (``strategy.extended.no_sync()``).
      batches: any iterable: a distributed dataset (its iterator gives per-replica
        batches), this process's own batches (a DDP-style loop), or anything else when
        only the syncing is wanted (``ts.accumulate(strategy, range(k), k)``). Dim 0 of a
        batch's first tensor counts its examples where `MicroBatch.compute_average_loss`
        needs them.
      steps: micro-batches per optimizer step (nanoGPT's ``gradient_accumulation_steps``).

    Batches are read lazily, one per iteration, in order. Each group has `steps`
    micro-batches, except the last group of a sized `batches` (one with ``len()``, such as
    a list, a DataLoader or a distributed dataset) whose length is not a multiple of
    `steps`: that group is shorter and its micro-batches know it (`MicroBatch.group_size`,
    `MicroBatch.is_last`). An unsized iterable (a generator) must end on a group boundary,
    as a DDP loop's ``range(gradient_accumulation_steps)`` does: finding out that a group
    is short would mean reading one batch ahead, which moves the data's random draws
    before the model's; an unsized iterable that ends inside a group raises RuntimeError
    when the loop asks for the next micro-batch.

    Raises:
      ValueError: `steps` not a positive whole number.
      TypeError: `strategy` not a strategy, `batches` not iterable.
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"ts.accumulate(..., steps={steps!r}): steps is the number of "
                         "micro-batches per optimizer step, a whole number >= 1.")
    if not hasattr(strategy, "extended") or not hasattr(strategy, "reduce"):
        raise TypeError(f"ts.accumulate(strategy, ...) takes a ts.Strategy (e.g. "
                        f"ts.get_strategy()), got {type(strategy).__name__}.")
    try:
        iterator = iter(batches)
    except TypeError:
        raise TypeError(f"ts.accumulate(strategy, batches, ...): batches must be iterable, "
                        f"got {type(batches).__name__}.") from None
    return _micro_batches(strategy, iterator, int(steps), _length(batches))


def _length(batches: Iterable[Any]) -> int | None:
    """``len(batches)`` where it has one (read without iterating: no draws), else None."""
    try:
        return len(batches)  # type: ignore[arg-type]
    except TypeError:
        return None


def _micro_batches(strategy: AnyStrategy, iterator: Iterator[Any], steps: int,
                   length: int | None) -> Iterator[MicroBatch]:
    read = 0
    while True:
        remaining = None if length is None else length - read
        if remaining is not None and remaining <= 0:
            # A sized iterable may still give more than its len() (an estimate): carry on
            # with full groups rather than drop batches.
            remaining = None
        size = steps if remaining is None else min(steps, remaining)
        group = _Group(strategy, iterator, size)
        for index in range(size):
            batch = group.batch(index)
            if batch is _END:
                if index == 0:
                    return
                raise RuntimeError(
                    f"ts.accumulate(strategy, batches, steps={steps}): batches ended after "
                    f"{index} micro-batch(es) of a group of {size}; their gradients were "
                    "accumulated without communication and no group ended. Give batches "
                    "with a len() (a list, a DataLoader, a distributed dataset: the last "
                    "group is then shorter), or a number of batches that is a multiple of "
                    "steps.")
            read += 1
            yield MicroBatch(strategy, batch, index, size, group)


_END = object()
_OUTSIDE = object()   # a MicroBatch's context when `with micro:` is not entered


class _Group:
    """One group's micro-batches, read from the shared iterator as they are asked for; its
    example count over every replica is found once, on first request."""

    def __init__(self, strategy: AnyStrategy, iterator: Iterator[Any], size: int) -> None:
        self._strategy = strategy
        self._iterator = iterator
        self._size = size
        self._batches: list[Any] = []
        self._examples: float | None = None
        # Replica threads (CentralStorageStrategy) ask for the count at once: one reads.
        self._lock = threading.Lock()

    def batch(self, index: int) -> Any:
        """The group's `index`-th micro-batch (read now unless already read), or _END."""
        with self._lock:
            self._read_up_to(index + 1)
            return self._batches[index] if index < len(self._batches) else _END

    def _read_up_to(self, count: int) -> None:
        while len(self._batches) < count:
            batch = next(self._iterator, _END)
            if batch is _END:
                return
            self._batches.append(batch)

    def examples(self, device: torch.device | None) -> float:
        """Examples in the whole group summed over every replica: one all-reduce, at the
        first request (inside ``strategy.run`` every replica's all-reduce, outside it the
        strategy's reduce); later requests reuse it."""
        with self._lock:
            self._read_up_to(self._size)
            if self._examples is not None:
                return self._examples
            totals = _local_totals(self._batches)
        # Not under the lock: replica threads meet in the all-reduce. Once one of them has
        # the total, every replica has entered it, so a replica that finds the total set
        # owes no collective.
        examples = self._reduce(totals, device)
        with self._lock:
            self._examples = examples
        return examples

    def _reduce(self, totals: dict[int | None, int], device: torch.device | None) -> float:
        replica_context = context.get_replica_context()
        if self._strategy.extended.traces_global_batch:
            return float(sum(totals.values()))   # one traced program sees every example
        if context.in_run() and replica_context is not None:
            mine = replica_context.replica_id_in_sync_group
            local = totals.get(mine, totals.get(None))
            if local is None:
                raise RuntimeError(f"ts.accumulate: replica {mine} has no part of the "
                                   "micro-batches to count.")
            if replica_context.num_replicas_in_sync == 1:
                return float(local)
            count = torch.tensor(float(local), device=device)
            return float(replica_context.all_reduce(ReduceOp.SUM, count).item())
        parts = iter(float(total) for total in totals.values())
        counts = self._strategy.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor(next(parts), dtype=torch.float64))
        return float(self._strategy.reduce(ReduceOp.SUM, counts, axis=None).item())


def _local_totals(batches: list[Any]) -> dict[int | None, int]:
    """This process's examples in `batches`, per replica id (None: not per-replica)."""
    totals: dict[int | None, int] = {}
    for batch in batches:
        for replica, count in _local_examples(batch):
            totals[replica] = totals.get(replica, 0) + count
    return totals


def _local_examples(batch: Any) -> list[tuple[int | None, int]]:
    """(replica id, examples) of this process's parts of `batch` (dim 0 of each part's
    first tensor; replica id None for a batch that is not per-replica)."""
    parts: tuple[Any, ...]
    replicas: tuple[int | None, ...]
    first: Any = batch
    if not isinstance(batch, values.DistributedValues):
        leaves = [leaf for leaf in nest.flatten(batch)[0]
                  if isinstance(leaf, (torch.Tensor, values.DistributedValues))]
        first = leaves[0] if leaves else batch
    if isinstance(first, values.DistributedValues):
        parts, replicas = first.values, first.replica_ids
    else:
        parts, replicas = (first,), (None,)
    counts = []
    for replica, part in zip(replicas, parts):
        if not isinstance(part, torch.Tensor) or part.dim() == 0:
            raise TypeError("micro.compute_average_loss counts a micro-batch's examples "
                            "along dim 0 of its first tensor, but found "
                            f"{type(part).__name__}"
                            + (" of shape []" if isinstance(part, torch.Tensor) else "")
                            + ". Give batches whose first tensor has a batch dimension, or "
                            "use micro.scale_mean_loss(loss), which needs no count.")
        counts.append((replica, int(part.shape[0])))
    return counts


class MicroBatch:
    """One micro-batch of an accumulation group (see `accumulate`).

    Attributes:
      batch: the micro-batch, as the iterable gave it.
      index: its position in the group (0 .. group_size - 1).
      group_size: micro-batches in this group (`steps`, or fewer for the last group of a
        sized iterable).
      is_last: True for the group's last micro-batch: its backward sums the gradients
        across replicas; take the optimizer step after it.

    ``with micro:`` defers communication (``strategy.extended.no_sync()``) unless it is
    the last micro-batch; a backward outside it communicates at once, which is slower but
    gives the same gradients.
    """

    def __init__(self, strategy: AnyStrategy, batch: Any, index: int, group_size: int,
                 group: _Group) -> None:
        self.batch = batch
        self.index = index
        self.group_size = group_size
        self.is_last = index == group_size - 1
        self._group = group
        self._strategy = strategy
        # The no_sync context while inside `with micro:` (None for the last micro-batch).
        self._deferring: Any = _OUTSIDE

    @property
    def group_examples(self) -> float:
        """Examples in the whole group, summed over every replica. The first request of a
        group reads the group's remaining micro-batches (kept for the coming iterations)
        and all-reduces their count; every replica asks at the same point."""
        return self._group.examples(None)

    def __enter__(self) -> MicroBatch:
        if self._deferring is not _OUTSIDE:
            raise RuntimeError("`with micro:` entered twice; enter each micro-batch once.")
        deferring = None if self.is_last else self._strategy.extended.no_sync()
        if deferring is not None:
            deferring.__enter__()
        self._deferring = deferring
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> bool | None:
        deferring, self._deferring = self._deferring, _OUTSIDE
        if deferring is _OUTSIDE:
            raise RuntimeError("MicroBatch.__exit__ called without __enter__ (use `with micro:`).")
        if deferring is None:
            return None
        return deferring.__exit__(kind, value, traceback)

    def compute_average_loss(self, per_example_loss: torch.Tensor,
                             sample_weight: torch.Tensor | float | None = None
                             ) -> torch.Tensor:
        """``ts.compute_average_loss`` over the whole group: ``sum(loss * weight)`` divided
        by `group_examples`, so the group's summed gradients are those of the mean loss
        over all its examples on every replica (one device on the large batch). The count
        costs one all-reduce per group and reads the group's remaining micro-batches ahead
        (see `group_examples`)."""
        device = per_example_loss.device if isinstance(per_example_loss, torch.Tensor) \
            else None
        return losses.compute_average_loss(per_example_loss, sample_weight,
                                           global_batch_size=self._group.examples(device))

    def scale_mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``ts.scale_mean_loss(loss / group_size)``: a per-replica mean loss scaled as a
        DDP loop with accumulation does (nanoGPT's ``loss / gradient_accumulation_steps``,
        then averaged over replicas). Needs no communication and reads nothing ahead."""
        return losses.scale_mean_loss(loss / self.group_size)

    def __repr__(self) -> str:
        return (f"MicroBatch(index={self.index}, group_size={self.group_size}, "
                f"is_last={self.is_last})")
