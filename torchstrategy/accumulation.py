"""Gradient accumulation: `accumulate` groups micro-batches, communicates on the last.

A group of `steps` micro-batches makes one optimizer step. Backward passes of the group's
micro-batches accumulate gradients locally (``strategy.extended.no_sync()``, DDP's
``no_sync``); the last one's backward sums everything accumulated across replicas, once.
Each micro-batch scales its loss for the whole group, so the step equals one step on the
group's examples taken together (single-device training on the large batch). The last
group of an epoch may be shorter: it is scaled by its own size.

    for micro in ts.accumulate(strategy, dist_dataset, steps=4):
        with micro:                                  # no_sync unless it is the last
            strategy.run(micro_step, args=(micro.batch, micro))
        if micro.is_last:
            strategy.run(apply_gradients)            # optimizer.step(); zero_grad()

    def micro_step(batch, micro):
        x, y = batch
        per_example = F.cross_entropy(model(x), y, reduction="none")
        micro.compute_average_loss(per_example).backward()  # or micro.scale_mean_loss(loss)
"""
from __future__ import annotations

import contextlib
import numbers
from types import TracebackType
from typing import Any, Iterable, Iterator, Sequence

import torch

from torchstrategy import losses, nest, values
from torchstrategy.context import AnyStrategy
from torchstrategy.reduce_op import ReduceOp


def accumulate(strategy: AnyStrategy, batches: Iterable[Any], steps: int
               ) -> Iterator[MicroBatch]:
    """Iterates `batches` as `MicroBatch`es in groups of `steps` (the last group of a
    finite iterable may be shorter).

    Args:
      strategy: the strategy whose gradient reduction is deferred to each group's last
        micro-batch (``strategy.extended.no_sync()``).
      batches: an iterable of batches: a distributed dataset (its iterator gives
        per-replica batches) or this process's own batches (a DDP-style loop). Dim 0 of a
        batch's first tensor counts its examples.
      steps: micro-batches per optimizer step (nanoGPT's ``gradient_accumulation_steps``).

    Each group's micro-batches are read before the first of them is yielded (the group's
    size and example count scale every loss of the group), and the replicas sum their
    example counts in one small all-reduce per group: every replica iterates the same
    number of micro-batches, as a distributed dataset guarantees.

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
    return _groups(strategy, iterator, int(steps))


def _groups(strategy: AnyStrategy, iterator: Iterator[Any], steps: int
            ) -> Iterator[MicroBatch]:
    while True:
        group = []
        for batch in iterator:
            group.append(batch)
            if len(group) == steps:
                break
        if not group:
            return
        examples = _global_examples(strategy, group)
        for index, batch in enumerate(group):
            yield MicroBatch(strategy, batch, index, len(group), examples)
        if len(group) < steps:
            return


def _local_examples(batch: Any) -> list[int]:
    """Examples in this process's parts of `batch` (dim 0 of each part's first tensor)."""
    parts = batch.values if isinstance(batch, values.DistributedValues) else None
    if parts is None:
        leaves = [leaf for leaf in nest.flatten(batch)[0]
                  if isinstance(leaf, (torch.Tensor, values.DistributedValues))]
        first = leaves[0] if leaves else None
        if isinstance(first, values.DistributedValues):
            parts = first.values
        else:
            parts = (first,)
    counts = []
    for part in parts:
        if not isinstance(part, torch.Tensor) or part.dim() == 0:
            raise TypeError("ts.accumulate counts a micro-batch's examples along dim 0 of its "
                            f"first tensor, but found {type(part).__name__}"
                            + (" of shape []" if isinstance(part, torch.Tensor) else "")
                            + ". Give batches whose first tensor has a batch dimension.")
        counts.append(part.shape[0])
    return counts


def _global_examples(strategy: AnyStrategy, group: Sequence[Any]) -> float:
    """Examples in the whole group summed over every replica (one all-reduce)."""
    per_part = [_local_examples(batch) for batch in group]
    totals = [float(sum(column)) for column in zip(*per_part)]
    parts = iter(totals)
    counts = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(next(parts), dtype=torch.float64))
    return strategy.reduce(ReduceOp.SUM, counts, axis=None).item()


class MicroBatch:
    """One micro-batch of an accumulation group (see `accumulate`).

    Attributes:
      batch: the micro-batch, as the iterable gave it.
      index: its position in the group (0 .. group_size - 1).
      group_size: micro-batches in this group (`steps`, or fewer for the last group).
      is_last: True for the group's last micro-batch: its backward sums the gradients
        across replicas; take the optimizer step after it.
      group_examples: examples in the whole group, summed over every replica.

    ``with micro:`` defers communication (``strategy.extended.no_sync()``) unless it is
    the last micro-batch; a backward outside it communicates at once, which is slower but
    gives the same gradients.
    """

    def __init__(self, strategy: AnyStrategy, batch: Any, index: int, group_size: int,
                 group_examples: float) -> None:
        self.batch = batch
        self.index = index
        self.group_size = group_size
        self.is_last = index == group_size - 1
        self.group_examples = group_examples
        self._strategy = strategy
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> MicroBatch:
        self._stack = contextlib.ExitStack()
        if not self.is_last:
            self._stack.enter_context(self._strategy.extended.no_sync())
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is None:
            raise RuntimeError("MicroBatch.__exit__ called without __enter__ (use `with micro:`).")
        return stack.__exit__(kind, value, traceback)

    def compute_average_loss(self, per_example_loss: torch.Tensor,
                             sample_weight: torch.Tensor | float | None = None
                             ) -> torch.Tensor:
        """``ts.compute_average_loss`` over the whole group: ``sum(loss * weight)`` divided
        by `group_examples`, so the group's summed gradients are those of the mean loss
        over all its examples on every replica (one device on the large batch)."""
        return losses.compute_average_loss(per_example_loss, sample_weight,
                                           global_batch_size=self.group_examples)

    def scale_mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``ts.scale_mean_loss(loss) / group_size``: a per-replica mean loss scaled as a
        DDP loop with accumulation does (``loss / gradient_accumulation_steps``, averaged
        over replicas), the short last group by its own size."""
        return losses.scale_mean_loss(loss) / self.group_size

    def __repr__(self) -> str:
        return (f"MicroBatch(index={self.index}, group_size={self.group_size}, "
                f"group_examples={self.group_examples:g})")
