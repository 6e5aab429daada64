"""``compression="auto"``: the gradient reducer picks its compression from measurements.

Two parts:

- `choose_compression`, a pure function of measured figures (`MeasuredFigures`): it
  predicts the synchronised step time of every candidate mode for this model's gradients
  and returns the fastest that beats the uncompressed step by the settings' `min_gain`.
  It runs no collective and reads no clock, so it is tested on numbers alone.
- `AutoCompressionProbe`, the thin measuring part, driven by the gradient reducer at the
  end of each synchronised backward: it times the first uncompressed steps, then once
  times a short all-reduce (the link) and a memory copy (the core), agrees on the figures
  with the other replicas (one all-gather; every replica takes the slowest replica's
  figures) and calls `choose_compression`. Every replica computes the same choice from the
  same numbers.

The model of a step (N replicas, B gradient bytes, a link of latency `a` and `b` bytes a
second each way per replica, `c` bytes a second of memory copy on one core):

- A ring all-reduce of x bytes takes ``a + 2 (N - 1) / N * x / b``; a gather of x bytes
  from every replica ``a + (N - 1) x / b`` (what `Int8` does).
- Uncompressed: the step measured (`step_seconds`). Of it, `exposed_seconds` was spent
  waiting for the all-reduce after backward (the least over replicas: a faster replica
  also waits for the slower one); ``local = step - exposed`` is the compute. The part of
  `exposed` beyond the modelled all-reduce of the bytes (a late replica, a busy core) is
  no transfer a compression can shorten: the modes reducing after backward keep it.
- bf16 / fp16 overlap backward like the default, so halving the bytes can only shorten
  the wait: ``step - min(exposed, transfer of the bytes no longer sent) + cast``, the
  cast costing `WIRE_CAST_COPIES` copies of the bytes cast. (Predicting from the bytes
  saved, not from a modelled all-reduce, keeps a small model's latency-bound step from
  looking shorter than it can be.)
- `Int8` and `PowerSGD` reduce after backward (error_feedback.py): ``local + compress +
  transfer``; with ``overlap=True`` (Int8's default) they send during backward, and the
  part of the uncompressed transfer that backward hid (the modelled all-reduce minus the
  wait it explains) is taken off theirs: ``local + compress + max(transfer - hidden, 0)``.
  Their kernels stay in the sum: on a CPU they run on the core backward uses. Int8's
  quantisation and summation are timed by the probe itself (its two kernels on up to 4 MiB
  of float32, with N replicas' levels), then scaled to the gradients; it gathers a byte
  an element plus a float a chunk (three collectives a bucket: the flags, the levels, the
  scales). PowerSGD (a candidate only when the user lists it) costs `POWERSGD_COPIES`
  copies of the matrices' float32 bytes, one copy of the rest and
  `POWERSGD_MATRIX_COPY_BYTES` a matrix, and all-reduces P, Q and the uncompressed rest
  (three collectives a bucket).

The copy counts were measured on the project's 2-core CPU machines (one thread, the
kernels of error_feedback.py against ``Tensor.copy_`` of the same bytes: PowerSGD rank 4
about 4 copies of large matrices plus about 0.6 ms a matrix; the bf16 cast runs at copy
speed, twice per bucket). They tie the prediction to the machine: a faster core (larger
`c`) makes compression cheaper.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from torchstrategy import _ops
from torchstrategy.collectives.communicator import Communicator, explained_failures
from torchstrategy.collectives.compression import (AutoCompression, Candidate, Int8, PowerSGD,
                                                   wire_dtype)

_log = logging.getLogger("torchstrategy.auto_compression")

#: Copies of the bytes cast that narrowing to bf16/fp16 and widening back cost.
WIRE_CAST_COPIES = 1.5
#: Copies of the matrices' float32 bytes that PowerSGD's passes over them cost.
POWERSGD_COPIES = 4.0
#: PowerSGD's fixed cost per matrix (QR, small products, launches), in bytes copied.
POWERSGD_MATRIX_COPY_BYTES = 4 * 1024 * 1024

#: The link probe's all-reduce: this many bytes (fewer for a smaller model).
PROBE_BYTES = 8 * 1024 * 1024
#: Int8's kernels are timed on up to this many bytes of float32.
INT8_PROBE_BYTES = 4 * 1024 * 1024
#: The memory-copy probe: larger than a CPU's caches, as the gradients are.
COPY_PROBE_BYTES = 32 * 1024 * 1024
_PROBE_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class MeasuredFigures:
    """What a choice is based on (every replica holds the same figures).

    Attributes:
      replicas: N, the replicas in sync.
      gradients: per gradient, (shape, element size in bytes), in registration order.
      num_buckets: the reducer's buckets (collectives a step).
      step_seconds: the uncompressed synchronised step (the fastest timed, of the
        slowest replica).
      exposed_seconds: of it, the time backward's end waited for the all-reduces (the
        least over replicas).
      latency_seconds: one all-reduce of a few bytes.
      link_bytes_per_second: bytes a second each replica sends (and receives) during a
        ring all-reduce, from the probe.
      copy_bytes_per_second: a memory copy on one replica's device (the slowest
        replica's).
      int8_bytes_per_second: float32 bytes a second that `Int8`'s quantisation plus the
        summation of N replicas' levels get through on one replica (the slowest
        replica's).
    """

    replicas: int
    gradients: tuple[tuple[tuple[int, ...], int], ...]
    num_buckets: int
    step_seconds: float
    exposed_seconds: float
    latency_seconds: float
    link_bytes_per_second: float
    copy_bytes_per_second: float
    int8_bytes_per_second: float

    @property
    def gradient_bytes(self) -> int:
        """B: the bytes of all gradients, as they live in the buckets."""
        return sum(_numel(shape) * size for shape, size in self.gradients)

    def describe(self) -> str:
        """The figures in a line, in the units people read (for the log)."""
        return (f"{self.replicas} replicas, {self.gradient_bytes / 2**20:.1f} MiB of "
                f"gradients in {self.num_buckets} bucket(s); uncompressed step "
                f"{self.step_seconds * 1e3:.1f} ms of which {self.exposed_seconds * 1e3:.1f} "
                f"ms waiting for the all-reduce; link {self.link_bytes_per_second * 8 / 1e9:.2f}"
                f" Gbit/s each way, latency {self.latency_seconds * 1e6:.0f} us; memory "
                f"copy {self.copy_bytes_per_second / 1e9:.1f} GB/s, Int8 "
                f"{self.int8_bytes_per_second / 1e9:.2f} GB/s")


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The outcome of ``compression="auto"``.

    Attributes:
      compression: the mode chosen: None, "bf16" / "fp16", a `ts.Int8` or `ts.PowerSGD`.
      predicted_seconds: per candidate (in the order given), (its name, the predicted
        step in seconds); the uncompressed one is the step measured.
      figures: the `MeasuredFigures` behind it.
    """

    compression: Candidate
    predicted_seconds: tuple[tuple[str, float], ...]
    figures: MeasuredFigures

    def describe(self) -> str:
        """The choice, the predictions and the figures in a line (for the log)."""
        predictions = ", ".join(f"{name} {seconds * 1e3:.1f} ms"
                                for name, seconds in self.predicted_seconds)
        return (f"compression='auto' chose {candidate_name(self.compression)}; predicted "
                f"steps: {predictions}; from: {self.figures.describe()}")


def candidate_name(candidate: Candidate) -> str:
    """How a mode is named in the log and in `AutoChoice.predicted_seconds`."""
    return "none" if candidate is None else \
        candidate if isinstance(candidate, str) else repr(candidate)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _ring_seconds(nbytes: float, figures: MeasuredFigures, collectives: int) -> float:
    n = figures.replicas
    return collectives * figures.latency_seconds + \
        2 * (n - 1) / n * nbytes / figures.link_bytes_per_second


def _gather_seconds(nbytes: float, figures: MeasuredFigures, collectives: int) -> float:
    return collectives * figures.latency_seconds + \
        (figures.replicas - 1) * nbytes / figures.link_bytes_per_second


def predict_step_seconds(candidate: Candidate, figures: MeasuredFigures) -> float:
    """The synchronised step under `candidate`, predicted from `figures` (the model in the
    module docstring). For None it is the step measured.

    Raises:
      ValueError: a candidate that is not None, "bf16" / "fp16", `Int8` or `PowerSGD`.
    """
    if candidate is None:
        return figures.step_seconds
    buckets = max(figures.num_buckets, 1)
    # Of the measured wait, the part that moving the bytes does not explain (a replica
    # arriving late, a busy core) is waited for by any reduction after backward too: it
    # stays in those modes' predictions instead of counting as compute they would save.
    # (The buckets' all-reduces and the flags' one bound the uncompressed transfer.)
    uncompressed_transfer = _ring_seconds(figures.gradient_bytes, figures, buckets + 1)
    unexplained = max(figures.exposed_seconds - uncompressed_transfer, 0.0)
    local = max(figures.step_seconds - figures.exposed_seconds, 0.0) + unexplained
    # What backward hid of the uncompressed transfer: a compressor that sends during
    # backward (overlap=True) can hide as much of its own.
    hidden = max(uncompressed_transfer - (figures.exposed_seconds - unexplained), 0.0)
    copy_rate = figures.copy_bytes_per_second
    if isinstance(candidate, str):
        wire_bytes = cast_bytes = 0
        for shape, size in figures.gradients:
            wire = wire_dtype(candidate, _dtype_of_size(size))
            numel = _numel(shape)
            if wire is None:
                wire_bytes += numel * size
            else:
                wire_bytes += numel * torch.finfo(wire).bits // 8
                cast_bytes += numel * size
        saved = _ring_seconds(figures.gradient_bytes - wire_bytes, figures, 0)
        cast = WIRE_CAST_COPIES * cast_bytes / copy_rate
        return figures.step_seconds - min(figures.exposed_seconds, saved) + cast
    numel_total = sum(_numel(shape) for shape, _ in figures.gradients)
    if isinstance(candidate, Int8):
        sent = numel_total + 4 * math.ceil(numel_total / candidate.chunk_size)
        compress = 4 * numel_total / figures.int8_bytes_per_second
        # The flags' all-reduce and the levels' and scales' gathers, per bucket.
        transfer = _gather_seconds(sent, figures, 2 * buckets) + _ring_seconds(0, figures, buckets)
        return local + compress + _exposed(transfer, hidden, candidate.overlap)
    if isinstance(candidate, PowerSGD):
        sent = 0
        matrix_bytes = rest_bytes = 0
        matrices = 0
        for shape, size in figures.gradients:
            numel = _numel(shape)
            if candidate.compresses(torch.Size(shape)):
                rows = int(shape[0])
                sent += 4 * candidate.rank * (rows + numel // rows)
                matrix_bytes += 4 * numel
                matrices += 1
            else:
                sent += numel * size
                rest_bytes += numel * size
        compress = (POWERSGD_COPIES * matrix_bytes + rest_bytes +
                    POWERSGD_MATRIX_COPY_BYTES * matrices) / copy_rate
        transfer = _ring_seconds(sent, figures, 3 * buckets)
        return local + compress + _exposed(transfer, hidden, candidate.overlap)
    raise ValueError(f"compression='auto' cannot predict {candidate!r}: the candidates are "
                     "None, 'bf16', 'fp16', ts.Int8(...) and ts.PowerSGD(...).")


def _exposed(transfer: float, hidden: float, overlap: bool) -> float:
    """The part of a compressor's `transfer` the step waits for: all of it after backward;
    launched during backward, what exceeds the `hidden` time backward already hid of the
    uncompressed transfer. The compression's kernels are not hidden: on a CPU they take
    the core backward runs on."""
    return max(transfer - hidden, 0.0) if overlap else transfer


def _dtype_of_size(size: int) -> torch.dtype:
    """A floating dtype of `size` bytes (what `wire_dtype` compares widths by)."""
    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(size, torch.uint8)


def choose_compression(figures: MeasuredFigures, settings: AutoCompression) -> AutoChoice:
    """The candidate of `settings` with the shortest predicted step, where None (when a
    candidate) is kept unless the best compressed mode is predicted at least
    ``settings.min_gain`` of the measured step faster. Ties go to the earlier candidate.
    A pure function: the same figures give the same choice on every replica.
    """
    predicted = tuple((candidate_name(c), predict_step_seconds(c, figures))
                      for c in settings.candidates)
    best = min(range(len(predicted)), key=lambda i: (predicted[i][1], i))
    chosen = settings.candidates[best]
    if None in settings.candidates and chosen is not None and \
            predicted[best][1] > (1.0 - settings.min_gain) * figures.step_seconds:
        chosen = None
    return AutoChoice(compression=chosen, predicted_seconds=predicted, figures=figures)


class AutoCompressionProbe:
    """Times the first synchronised steps and then measures the link and the copy speed,
    for `choose_compression` (see the module docstring). The gradient reducer calls
    `on_synced_step` at the end of each synchronised backward, on every replica, until it
    returns the choice.

    Args:
      settings: the `AutoCompression` (candidates, steps timed, the gain required).
      communicator: the strategy's `Communicator` (its process group is probed).
    """

    def __init__(self, settings: AutoCompression, communicator: Communicator) -> None:
        self.settings = settings
        self._comm = communicator
        self._steps = 0
        self._last: float | None = None
        self._timed: list[tuple[float, float]] = []   # (step seconds, exposed seconds)
        self.choice: AutoChoice | None = None

    def on_synced_step(self, exposed_seconds: float, parameters: Sequence[torch.Tensor],
                       num_buckets: int) -> AutoChoice | None:
        """Records the synchronised step that just ended (`exposed_seconds`: its wait for
        the all-reduces after backward); after ``settings.measure_steps`` timed steps
        measures, agrees and returns the choice (a collective then: every replica calls
        this at the same step). The first step is not timed: it lays the buckets out."""
        now = time.perf_counter()
        self._steps += 1
        if self._last is not None:
            self._timed.append((now - self._last, exposed_seconds))
        self._last = now
        if self.choice is not None or len(self._timed) < self.settings.measure_steps:
            return None
        figures = self._measure(parameters, num_buckets)
        self.choice = choose_compression(figures, self.settings)
        if self._comm.rank == 0:
            _log.info("torchstrategy: %s", self.choice.describe())
        return self.choice

    def _measure(self, parameters: Sequence[torch.Tensor], num_buckets: int
                 ) -> MeasuredFigures:
        step, exposed = min(self._timed)
        gradient_bytes = sum(p.numel() * p.element_size() for p in parameters)
        latency, link = self._probe_link()
        copy_rate = self._probe_copy(gradient_bytes)
        int8_rate = self._probe_int8(gradient_bytes)
        # The slowest replica sets the pace: the largest step, latency and transfer time,
        # the smallest copy rate; and the least exposed wait (a faster replica's wait
        # includes waiting for the slower one).
        mine = torch.tensor([[step, -exposed, latency, -link, -copy_rate, -int8_rate]],
                            dtype=torch.float64)
        (every,) = self._comm.all_gather([mine], axis=0)
        worst = every.amax(dim=0).tolist()
        return MeasuredFigures(
            replicas=self._comm.world_size,
            gradients=tuple((tuple(int(d) for d in p.shape), p.element_size())
                            for p in parameters),
            num_buckets=num_buckets, step_seconds=worst[0], exposed_seconds=-worst[1],
            latency_seconds=worst[2], link_bytes_per_second=-worst[3],
            copy_bytes_per_second=-worst[4], int8_bytes_per_second=-worst[5])

    def _synchronize(self) -> None:
        device = self._comm.device
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    def _timed_all_reduce(self, buffer: torch.Tensor) -> float:
        """The median of a few all-reduces of `buffer` (after one untimed)."""
        times = []
        with explained_failures("compression='auto''s link probe", self._comm.rank,
                                self._comm.diagnose):
            for repeat in range(_PROBE_REPEATS + 1):
                self._synchronize()
                start = time.perf_counter()
                dist.all_reduce(buffer, group=self._comm.group)
                self._synchronize()
                if repeat:
                    times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _probe_link(self) -> tuple[float, float]:
        """(latency in seconds, bytes a second each way) of the replicas' link."""
        device = self._comm.device
        latency = self._timed_all_reduce(torch.zeros(1, device=device))
        # The full probe even for a small model: a smaller one would be bound by latency
        # and tell nothing of the bandwidth.
        nbytes = PROBE_BYTES
        seconds = self._timed_all_reduce(torch.zeros(nbytes // 4, device=device))
        n = self._comm.world_size
        moved = 2 * (n - 1) / n * nbytes
        # A probe no slower than the latency (a very fast link): bounded by the clock.
        return latency, moved / max(seconds - latency, 1e-6)

    def _time_local(self, work: Callable[[], None]) -> float:
        """The median of a few runs of `work` on this replica's device (after one)."""
        times = []
        for repeat in range(_PROBE_REPEATS + 1):
            self._synchronize()
            start = time.perf_counter()
            work()
            self._synchronize()
            if repeat:
                times.append(time.perf_counter() - start)
        return max(statistics.median(times), 1e-9)

    def _probe_int8(self, gradient_bytes: int) -> float:
        """Float32 bytes a second through Int8's two kernels (quantise with error feedback,
        then sum N replicas' levels), when Int8 is a candidate; else 0 (not measured: its
        prediction is then never used)."""
        chunk = next((c.chunk_size for c in self.settings.candidates if isinstance(c, Int8)),
                     None)
        if chunk is None:
            return 0.0
        device = self._comm.device
        numel = max(chunk, min(INT8_PROBE_BYTES, gradient_bytes) // 4)
        chunks = -(-numel // chunk)
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
        residual = torch.zeros(numel, device=device)
        levels = torch.empty(numel, dtype=torch.int8, device=device)
        scales = torch.empty(chunks, device=device)
        every_levels = torch.zeros(self._comm.world_size, numel, dtype=torch.int8,
                                   device=device)
        every_scales = torch.ones(self._comm.world_size, chunks, device=device)
        total = torch.empty(numel, device=device)

        def int8() -> None:
            _ops.ef_quantize_int8(grad, residual, levels, scales, chunk)
            _ops.dequantize_sum(every_levels, every_scales, total, chunk)

        return 4 * numel / self._time_local(int8)

    def _probe_copy(self, gradient_bytes: int) -> float:
        """Bytes a second of a memory copy on this replica's device."""
        nbytes = max(1024 * 1024, min(COPY_PROBE_BYTES, gradient_bytes))
        source = torch.ones(nbytes // 4, device=self._comm.device)
        target = torch.empty_like(source)

        def copy() -> None:
            target.copy_(source)

        return nbytes / self._time_local(copy)
