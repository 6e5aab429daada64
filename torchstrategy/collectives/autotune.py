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

import datetime
import itertools
import logging
import statistics
import time
import typing
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.collectives.reducer import DEFAULT_FIRST_BUCKET_BYTES, GradientReducer
from torchstrategy.launch import world as world_lib

MIB = 1024 * 1024

#: The default candidates: 1, 4, 16 and 64 MiB, then one bucket for everything.
DEFAULT_CANDIDATES: tuple[int | None, ...] = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, None)

_log = logging.getLogger("torchstrategy.autotune")

# How long a tuner about to change the buckets waits for the other replicas' tuners to have
# signed in (they are made before training, so at the end of the first step they have).
_SIGN_IN_SECONDS = 10.0
# The store key by which replica {rank}'s tuner number {number} signs in.
_SIGNED_IN_KEY = "torchstrategy/autotune/{number}/{rank}"


def _describe_missing_reducer(reducer: Any) -> str:
    """Why there is no `GradientReducer` to tune, for the TypeError."""
    extended = getattr(reducer, "extended", None)
    if extended is not None:  # a strategy was passed
        if getattr(extended, "shards_parameters", False):
            return (f"got {type(reducer).__name__}, which has no gradient reducer by "
                    "design: FSDP2 reduce-scatters each sharded module's gradients itself, "
                    "one collective per module (shard_modules= decides their sizes), so "
                    "there is no bucket cap to tune. Leave BucketAutotuner out.")
        return (f"got the strategy {type(reducer).__name__}; pass its reducer, "
                "strategy.extended.gradient_reducer.")
    return (f"got {reducer!r}. strategy.extended.gradient_reducer is None where the strategy "
            "has no gradient reducer: with one replica (nothing is reduced, no bucket cap "
            "to tune), and with ShardedStrategy by design (FSDP2 reduce-scatters each "
            "sharded module's gradients itself; shard_modules= decides their sizes). Leave "
            "BucketAutotuner out there.")


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
      TypeError / ValueError: naming the bad argument; TypeError where there is no
        reducer (one replica, ShardedStrategy), saying why; ValueError for a second tuner
        on one reducer.
      RuntimeError: (from the backward that would first change the buckets) when a
        replica did not make its tuner: refused there, and the reason is named in the
        other replicas' failing all-reduce.
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
            raise TypeError("reducer must be a GradientReducer (strategy.extended."
                            f"gradient_reducer): {_describe_missing_reducer(reducer)}")
        tuners: weakref.WeakKeyDictionary[GradientReducer, BucketAutotuner] = \
            runtime.current().state("torchstrategy.autotune.tuners",
                                    weakref.WeakKeyDictionary)
        first = tuners.get(reducer)
        if first is not None:
            state = "still searching" if first.result is None else \
                f"it kept {first.result.bucket_cap_bytes} bytes"
            raise ValueError(
                f"This reducer already has a BucketAutotuner ({state}); a second one would "
                "re-bucket it against the first, and each would report its own cap. Keep "
                "one tuner per reducer (read its `result`).")
        tuners[reducer] = self
        self._reducer = reducer
        # Every replica must re-bucket alike: each tuner signs in at the rendezvous store
        # and, before it first changes the buckets, checks that every replica's did.
        self._number = next(runtime.current().state("torchstrategy.autotune.count",
                                                     itertools.count))
        self._sign_in()
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

    def _store(self) -> dist.Store | None:
        return runtime.current().rendezvous_store() \
            if self._reducer.communicator.world_size > 1 else None

    def _sign_in(self) -> None:
        store = self._store()
        if store is not None:
            store.set(_SIGNED_IN_KEY.format(number=self._number,
                                            rank=self._reducer.communicator.rank), "here")

    def _check_every_replica_tunes(self) -> None:
        """Before the buckets first change: every replica made this tuner (the N-th of
        its process), else this replica refuses, naming those that did not (one that
        re-bucketed alone would send buckets of other sizes than its peers', which gloo
        answers by aborting the process). The reason is written in the store, where the
        other replicas' failing collective reads it (`roll_call`)."""
        store = self._store()
        if store is None:
            return
        comm = self._reducer.communicator
        keys = {r: _SIGNED_IN_KEY.format(number=self._number, rank=r)
                for r in range(comm.world_size)}
        deadline = time.monotonic() + _SIGN_IN_SECONDS
        while True:
            missing = [r for r, key in keys.items() if not store.check([key])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not missing:
            return
        made = [r for r in keys if r not in missing]
        message = (f"ts.BucketAutotuner was made on replica(s) {', '.join(map(str, made))} "
                   f"but not on replica(s) {', '.join(map(str, missing))}: every replica "
                   "must make it (with the same arguments, before training), because the "
                   "tuner changes the gradient buckets, and replicas with different buckets "
                   "cannot all-reduce together. Make the tuner on every replica, not under "
                   "`if replica_id == 0`.")
        try:
            store.set_timeout(datetime.timedelta(seconds=3))
            store.set(world_lib.ENDED_KEY.format(comm.rank), f"raised RuntimeError: {message}")
        except (RuntimeError, OSError):
            pass
        raise RuntimeError(message)

    def _cap_of(self, candidate: int | None) -> tuple[int, int]:
        """(bucket cap, first bucket cap) for a candidate."""
        if candidate is not None:
            return candidate, DEFAULT_FIRST_BUCKET_BYTES
        # One bucket: a cap above the bytes of every gradient together (the slots are
        # packed as DDP's, without padding; the 16 bytes per gradient only keep the cap
        # safely above that sum).
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
            if index == 0:
                self._check_every_replica_tunes()
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

