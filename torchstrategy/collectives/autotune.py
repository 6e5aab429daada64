"""`BucketAutotuner`: picks the gradient reducer's bucket cap by timing the first steps.

Horovod's autotuner is the model: during the first steps of training, try a few settings,
keep the fastest. Here the setting is the reducer's bucket cap. The search is driven by
the reducer itself (`GradientReducer.on_synced_step`): at the end of each synchronised
backward the tuner records the time, so one measured interval is one whole training step
(forward, backward with its overlapped all-reduces, optimizer). Only the bucketing changes
between candidates, so the differences between intervals are the bucketing's.

Every replica must use the same buckets (each bucket is one collective, launched in the
same order everywhere). The replicas therefore agree once, at the end of the search: each
replica's per-candidate median goes through one all-reduce with MAX (a step is as slow as
its slowest replica), and every replica takes the argmin of the same numbers.

Re-bucketing changes no number: each gradient element is summed across replicas on its
own, wherever it sits in a bucket (bit for bit with 2 replicas; with more, the ring's
summation order for an element depends on its offset in the bucket; see
docs/gradient_reduction.md).
"""
from __future__ import annotations

import logging
import statistics
import time
import typing
from typing import Sequence

import torch

from torchstrategy.collectives.reducer import DEFAULT_FIRST_BUCKET_BYTES, GradientReducer

MIB = 1024 * 1024

#: The default candidates: 1, 4, 16 and 64 MiB, then one bucket for everything.
DEFAULT_CANDIDATES: tuple[int | None, ...] = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, None)

_log = logging.getLogger("torchstrategy.autotune")


class AutotuneResult(typing.NamedTuple):
    """The outcome of a bucket-cap search.

    Attributes:
      bucket_cap_bytes: the cap kept (for the "one bucket" candidate: the bytes of all
        gradients, which the first bucket's cap was raised to as well).
      candidate: the candidate as given (an int of bytes, or None for "one bucket").
      step_seconds: per candidate, in the order given, the median step time agreed
        between replicas (the maximum over replicas of each replica's median).
    """

    bucket_cap_bytes: int
    candidate: int | None
    step_seconds: tuple[float, ...]


class BucketAutotuner:
    """Searches the bucket cap of a strategy's gradient reducer during the first steps.

    Usage (every replica, before training)::

        tuner = ts.BucketAutotuner(strategy.extended.gradient_reducer)

    Then train as usual. After ``warmup_steps + len(candidates) * (settle_steps +
    steps_per_candidate)`` synchronised steps the fastest cap is kept, logged on the
    ``torchstrategy.autotune`` logger, and reported by `result` and by the reducer's
    ``stats().bucket_cap_bytes``.

    Args:
      reducer: the `GradientReducer` (``strategy.extended.gradient_reducer``; it is None
        with one replica, where there is nothing to tune).
      candidates: bucket caps in bytes to try, in this order; None means one bucket for
        every gradient (the first bucket's cap raised too). At least two, distinct.
      steps_per_candidate: steps timed per candidate (their median counts).
      settle_steps: steps run but not timed after each change (the first step with new
        buckets copies the gradients into them).
      warmup_steps: synchronised steps before the search starts (the first step records
        the order gradients arrive in and rebuilds the buckets).

    Raises:
      TypeError / ValueError: naming the bad argument.
    """

    def __init__(self, reducer: GradientReducer, candidates: Sequence[int | None] =
                 DEFAULT_CANDIDATES, steps_per_candidate: int = 3, settle_steps: int = 1,
                 warmup_steps: int = 1) -> None:
        candidates = tuple(candidates)
        for c in candidates:
            if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c <= 0):
                raise ValueError(f"candidates must be positive ints of bytes or None (one "
                                 f"bucket), got {c!r} in {candidates!r}.")
        if len(candidates) < 2 or len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must hold at least two distinct bucket caps, got "
                             f"{candidates!r}.")
        for name, value, least in (("steps_per_candidate", steps_per_candidate, 1),
                                   ("settle_steps", settle_steps, 0),
                                   ("warmup_steps", warmup_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}.")
        if not isinstance(reducer, GradientReducer):
            raise TypeError(
                f"reducer must be a GradientReducer (strategy.extended.gradient_reducer), "
                f"got {reducer!r}. With one replica the strategy has no reducer and there "
                "is no bucket size to tune.")
        self._reducer = reducer
        self._candidates = candidates
        self._per_candidate = steps_per_candidate
        self._settle = settle_steps
        self._warmup = warmup_steps
        self._steps = 0                          # synchronised steps seen
        self._last: float | None = None          # when the previous one ended
        self._times: list[list[float]] = [[] for _ in candidates]
        self._result: AutotuneResult | None = None
        reducer.on_synced_step(self._on_step)

    @property
    def candidates(self) -> tuple[int | None, ...]:
        """The candidates, as given."""
        return self._candidates

    @property
    def total_steps(self) -> int:
        """Synchronised steps from the first until the choice is made."""
        return self._warmup + len(self._candidates) * (self._settle + self._per_candidate)

    @property
    def done(self) -> bool:
        """True once the choice is made."""
        return self._result is not None

    @property
    def result(self) -> AutotuneResult | None:
        """The choice and the timings behind it; None while searching."""
        return self._result

    def _cap_of(self, candidate: int | None) -> tuple[int, int]:
        """(bucket cap, first bucket cap) for a candidate."""
        if candidate is not None:
            return candidate, DEFAULT_FIRST_BUCKET_BYTES
        # One bucket: a cap above every gradient's bytes plus each slot's alignment.
        total = sum(p.numel() * p.element_size() + 16 for p in self._reducer.parameters)
        total = max(total, 1)
        return total, total

    def _on_step(self) -> None:
        if self._result is not None:
            return
        now = time.perf_counter()
        self._steps += 1
        # Steps after the warm-up, each candidate owns settle + timed steps in turn.
        k = self._steps - self._warmup
        span = self._settle + self._per_candidate
        if k > 0 and self._last is not None:
            index, offset = divmod(k - 1, span)
            if offset >= self._settle:
                self._times[index].append(now - self._last)
        if k >= 0 and k % span == 0:
            index = k // span
            if index < len(self._candidates):
                self._reducer.rebucket(*self._cap_of(self._candidates[index]))
            else:
                self._choose()
        self._last = time.perf_counter()

    def _choose(self) -> None:
        local = torch.tensor([[statistics.median(t) for t in self._times]],
                             dtype=torch.float64)
        (every,) = self._reducer.communicator.all_gather([local], axis=0)
        seconds = tuple(float(x) for x in every.amax(dim=0).tolist())
        best = min(range(len(seconds)), key=seconds.__getitem__)
        cap, first = self._cap_of(self._candidates[best])
        self._reducer.rebucket(cap, first)
        self._result = AutotuneResult(cap, self._candidates[best], seconds)
        _log.info("bucket autotune: kept %s (bucket cap %d bytes); median step seconds "
                  "per candidate %s: %s", "one bucket" if first == cap else
                  f"{cap / MIB:g} MiB", cap, list(self._candidates),
                  [f"{s:.4f}" for s in seconds])

