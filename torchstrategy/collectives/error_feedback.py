"""Error-feedback compression of gradient buckets: `PowerSGD`, `Int8` and `OneBitAdam` at
work.

`ErrorFeedbackStage` is a stage of the gradient reducer's pipeline: the reducer hands it
each full bucket (in bucket order) as a `GradBucket` (its flat buffer, parameters, slot
offsets and flags, as the C++ core laid them out) instead of all-reducing it; the returned
handle does the compressed reduction when the core waits for it, after backward has
finished. With ``overlap=True`` (an argument of every compressor) the stage compresses the
bucket and launches its first collectives at once, while backward goes on (on a GPU, on a
side stream), and the handle completes the reduction. The core keeps doing everything
else as without compression: accumulation under ``no_sync``, averaging
(`ts.scale_mean_loss`: the bucket already holds gradient / N, and the approximation of the
sum of those is the approximation of the mean), the "contributed" flags (one per
parameter, outside the buckets, summed by the core before any handle of this stage is
waited for), and the settling of ``.grad``.

Per bucket, with world size N and ``flags`` the bucket's per-parameter contributed counts:

- Warm-up (the first ``warmup_steps`` synchronised steps): the bucket is all-reduced as it
  is, exactly as without compression.
- `PowerSGD`: the uncompressed gradients (vectors, small matrices) are packed into one
  buffer and all-reduced first; then, for every matrix some replica
  contributed, M = gradient + residual, P = M Q is all-reduced (all matrices in one buffer),
  orthonormalised (``torch.linalg.qr``), Q_local = M^T P, residual = M - P Q_local^T, and
  Q_local is all-reduced (one buffer): the bucket gets P Q^T, the sum over replicas of
  their P Q_local^T. Since each replica keeps exactly what its own term missed, the applied
  sums plus the replicas' residuals always equal the true sums (the identity the tests
  check). Q (the sum) is kept for the next step (warm start). The paper and torch's DDP
  hook keep M - P mean(Q_local)^T instead: another split of the same total between the
  replicas, and since P and Q depend on the replicas' M only through their sum, both
  apply the same gradients (a test checks it; the convergence script's
  ``ddp-powersgd`` run compares the losses with the DDP hook's).
- `Int8`: the bucket (gradient + residual, float) is quantised
  per chunk (``_ops.ef_quantize_int8``, csrc/ef_ops.cpp), levels and scales are gathered
  from every replica and summed in replica order (``_ops.dequantize_sum``).

A parameter no replica contributed (flag sum 0) keeps its residual for later; its ``.grad``
is left as it was by the core.

The state (step counter, residuals, Q matrices) is per replica: residuals differ between
replicas. `ErrorFeedbackStage.state_dict` returns this replica's; the reducer's
``state_dict`` gathers every replica's, so that a checkpoint written by the chief holds
them all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchstrategy import _ops
from torchstrategy.collectives.compression import (ErrorFeedback, GradBucket, Int8, OneBitAdam,
                                                   PowerSGD)
from torchstrategy.collectives.onebit import OneBitAdamReduction


class _Deferred:
    """A bucket's compressed reduction, completed when the reducer waits for it: `run` is
    the whole reduction, or the rest of one started at launch."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run: Callable[[], None] | None = run

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._run is not None:
            run, self._run = self._run, None
            with torch.no_grad():
                run()
        return True


#: What a started reduction leaves to do once backward has finished.
_Finish = Callable[[], None]


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of `p`'s columns (``n x r``, r < n; or of each of a batch of
    them, ``b x n x r``: on CPU each gets the bits it would get alone, LAPACK running per
    matrix), as PowerSGD needs; the same bits on every replica given the same `p` (the
    all-reduced one)."""
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(seed: int, index: int, cols: int, rank: int) -> torch.Tensor:
    """PowerSGD's first Q for the parameter registered `index`-th: standard normal, seeded
    by (`seed`, `index`), so every replica starts from the same one."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(cols, rank, generator=generator)


@dataclasses.dataclass(frozen=True)
class _Run:
    """A run of PowerSGD matrices of one shape, back to back in a bucket: slots `first` to
    ``first + count - 1``, each ``rows x cols``; their residuals (`residual`, float32) and
    Q^T (`q_t`, rank x cols each) back to back in buffers of their own, so that a batched
    product or kernel takes several of them in one call."""

    first: int
    count: int
    rows: int
    cols: int
    residual: torch.Tensor   # count x rows x cols
    q_t: torch.Tensor        # count x rank x cols


@dataclasses.dataclass(frozen=True)
class _PowerLayout:
    """A bucket's PowerSGD runs, valid while the bucket keeps `signature` (its parameters,
    slots, device and the rank); `residuals` and `q_ts` map each compressed matrix's slot
    to its views into the runs' buffers (the residual flat, as `ErrorFeedbackStage.
    residuals` holds it)."""

    signature: tuple[Any, ...]
    runs: list[_Run]
    residuals: dict[int, torch.Tensor]
    q_ts: dict[int, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Stretch:
    """Matrices ``lo`` to ``lo + count - 1`` of `run` (all used this step): their M (the
    residual buffer, where M is built) and their slots in the bucket (`view`)."""

    run: _Run
    lo: int
    count: int
    view: torch.Tensor   # count x rows x cols, in the bucket's dtype

    @property
    def m(self) -> torch.Tensor:
        return self.run.residual.narrow(0, self.lo, self.count)


def _stretches(flags: list[bool], first: int, count: int) -> list[tuple[int, int]]:
    """The maximal stretches of true `flags` among ``flags[first:first + count]``, as
    (offset from `first`, length)."""
    out: list[tuple[int, int]] = []
    start = -1
    for j in range(count + 1):
        if j < count and flags[first + j]:
            if start < 0:
                start = j
        elif start >= 0:
            out.append((start, j - start))
            start = -1
    return out


class ErrorFeedbackStage:
    """Runs `compression` on the buckets the gradient reducer hands it (see the module
    docstring), over `group`.

    Every reduction has two halves: `_start` (build what travels and launch its
    collectives) and the `_Finish` it returns (wait for them, write the bucket, keep the
    residual). Without ``overlap`` both run when the reducer waits for the bucket, after
    backward; with it the first runs when the bucket is launched, while backward goes on,
    and every collective is still issued in the same order on every replica (launches in
    bucket order, then the flags, then the finishes in bucket order).

    Args:
      compression: a `PowerSGD`, `Int8` or `OneBitAdam`.
      group: the process group of the strategy's replicas (None: the default group).
    """

    def __init__(self, compression: ErrorFeedback,
                 group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(compression, (PowerSGD, Int8, OneBitAdam)):
            raise TypeError(f"compression must be ts.PowerSGD, ts.Int8 or ts.OneBitAdam, "
                            f"got {compression!r}.")
        self.compression = compression
        self._group = group
        self.step = 0                                   # synchronised steps so far
        self.residuals: dict[int, torch.Tensor] = {}    # registration index -> float32
        # PowerSGD: index -> Q^T (rank x cols, contiguous). For the skinny product M Q (M
        # row-major rows x cols) CPU BLAS is 4-5x faster with Q stored this way (measured:
        # 0.59 against 2.87 ms for a 512 x 4608 M, 12 against 45 ms for GPT-2's 50257 x 768
        # embedding), and Q_local^T = P^T M comes out in the same layout.
        self.q_ts: dict[int, torch.Tensor] = {}
        # PowerSGD keeps a bucket's residuals and Q^T run by run in buffers of their own
        # (`_PowerLayout`); the entries of `residuals` and `q_ts` are views into them.
        self._power_layouts: dict[int, _PowerLayout] = {}
        # Int8 keeps each bucket's residuals in one flat buffer (the kernel's input); the
        # per-parameter entries of `residuals` are views into it.
        self._flat_residuals: dict[int, tuple[Any, torch.Tensor]] = {}
        self._step_bytes = [0, 0]   # sent, uncompressed equivalent
        self.last_bytes = (0, 0)
        self._compressed_in_step = False   # PowerSGD sent a matrix as P and Q this step
        # OneBitAdam (collectives/onebit.py): its error is kept in `residuals`.
        self._onebit = OneBitAdamReduction(compression, group) \
            if isinstance(compression, OneBitAdam) else None
        # overlap on a GPU: the stream the compression runs on, beside backward's.
        self._side_stream: Any = None

    # -- called by the reducer, per bucket in launch order -------------------------------
    def launch(self, bucket: GradBucket) -> _Deferred:
        """Takes `bucket` (full: every gradient in it is ready). Without ``overlap`` its
        compressed reduction runs when the returned handle is waited for; with it,
        compression starts now and the handle completes it."""
        if bucket.index == 0:
            self._step_bytes = [0, 0]
        if not self.compression.overlap:
            return _Deferred(lambda: self._start(bucket, overlapped=False)())
        stream = self._stream_for(bucket.buffer)
        with self._on(stream), torch.no_grad():
            finish = self._start(bucket, overlapped=True)

        def complete() -> None:
            with self._on(stream):
                finish()
            if stream is not None:   # what reads the bucket next runs on backward's stream
                torch.cuda.current_stream(bucket.buffer.device).wait_stream(stream)
        return _Deferred(complete)

    def _stream_for(self, buffer: torch.Tensor) -> Any:
        """On a GPU, the side stream (made once), set to start after the gradients that
        backward's stream has produced so far; elsewhere None."""
        if buffer.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(buffer.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(buffer.device))
        return self._side_stream

    @staticmethod
    def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def end_step(self, synced: bool) -> None:
        """Called after the reducer's finalisation: counts a synchronised step."""
        if synced and isinstance(self.compression, PowerSGD) and \
                self.step == self.compression.warmup_steps and not self._compressed_in_step:
            # Once, at the first compressing step: an accepted rank that compresses
            # nothing would otherwise pass for compression.
            warnings.warn(
                f"{self.compression!r} compresses none of this model's gradients: a "
                "gradient of n x m travels as P and Q only when rank * (n + m) < n * m, so "
                "every gradient went uncompressed, with error feedback's work on top. Use a "
                "smaller rank (4 to 32 is usual).", RuntimeWarning, stacklevel=2)
        self._compressed_in_step = False
        if synced:
            self.step += 1
            self.last_bytes = (self._step_bytes[0], self._step_bytes[1])

    def _sent(self, *tensors: torch.Tensor) -> None:
        self._step_bytes[0] += sum(t.numel() * t.element_size() for t in tensors)

    def _start(self, bucket: GradBucket, overlapped: bool) -> _Finish:
        """Starts `bucket`'s reduction; `overlapped`: backward is still running (the
        flags are this replica's, not yet summed)."""
        flat = bucket.buffer
        self._step_bytes[1] += flat.numel() * flat.element_size()
        if self._onebit is not None:   # its warm-up also updates Adam's moments
            return self._onebit.start(bucket, self.step, self.residuals, self._sent)
        if self.step < self.compression.warmup_steps:
            work = dist.all_reduce(flat, group=self._group, async_op=True)
            self._sent(flat)
            return work.wait
        if isinstance(self.compression, PowerSGD):
            return self._power_sgd(self.compression, bucket, overlapped)
        assert isinstance(self.compression, Int8)
        return self._int8(self.compression, bucket)

    # -- PowerSGD -----------------------------------------------------------------------
    def _power_layout(self, algo: PowerSGD, bucket: GradBucket) -> _PowerLayout:
        """The bucket's compressed matrices grouped in runs, with their residuals and Q^T
        in buffers of their own (see `_PowerLayout`); built again after a re-bucketing (or
        a loaded state), taking over every matrix's residual and Q from `residuals` and
        `q_ts` (which then hold views into the new buffers)."""
        parameters = bucket.parameters
        signature = (bucket.indices, bucket.offsets, bucket.numels,
                     tuple(tuple(p.shape) for p in parameters), bucket.buffer.device,
                     algo.rank)
        cached = self._power_layouts.get(bucket.index)
        if cached is not None and cached.signature == signature:
            return cached
        specs: list[list[int]] = []   # [first slot, count, rows, cols]
        for k, p in enumerate(parameters):
            if not algo.compresses(p.shape):
                continue
            rows = int(p.shape[0])
            cols = bucket.numels[k] // rows
            last = specs[-1] if specs else None
            if last is not None and last[0] + last[1] == k and last[2:] == [rows, cols] \
                    and bucket.offsets[k] == bucket.offsets[k - 1] + bucket.numels[k - 1]:
                last[1] += 1
            else:
                specs.append([k, 1, rows, cols])
        device, rank = bucket.buffer.device, algo.rank
        residuals = torch.zeros(sum(n * r * c for _, n, r, c in specs), dtype=torch.float32,
                                device=device)
        q_ts = torch.empty(sum(n * rank * c for _, n, _, c in specs), dtype=torch.float32,
                           device=device)
        runs = []
        residual_views: dict[int, torch.Tensor] = {}
        q_views: dict[int, torch.Tensor] = {}
        at = q_at = 0
        for first, count, rows, cols in specs:
            run = _Run(first, count, rows, cols,
                       residuals.narrow(0, at, count * rows * cols).view(count, rows, cols),
                       q_ts.narrow(0, q_at, count * rank * cols).view(count, rank, cols))
            at += count * rows * cols
            q_at += count * rank * cols
            runs.append(run)
            for j in range(count):
                i = bucket.indices[first + j]
                residual_views[first + j] = view = run.residual[j].view(-1)
                old = self.residuals.get(i)
                if old is not None:   # a matrix not used yet has none (and keeps none)
                    view.copy_(old.reshape(-1))
                    self.residuals[i] = view
                q_views[first + j] = q_t = run.q_t[j]
                old = self.q_ts.get(i)
                q_t.copy_(initial_q(algo.seed, i, cols, rank).t() if old is None else old)
                if old is not None:
                    self.q_ts[i] = q_t
        # Another bucket's cached layout holding one of these matrices is stale from now on
        # (this one took its state over): it is built again if that bucket comes back.
        mine = set(bucket.indices)
        for index in [b for b, cached in self._power_layouts.items()
                      if b != bucket.index and mine.intersection(cached.signature[0])]:
            del self._power_layouts[index]
        layout = _PowerLayout(signature, runs, residual_views, q_views)
        self._power_layouts[bucket.index] = layout
        return layout

    def _power_sgd(self, algo: PowerSGD, bucket: GradBucket, overlapped: bool) -> _Finish:
        flat, group, rank = bucket.buffer, self._group, algo.rank
        matrix = [algo.compresses(p.shape) for p in bucket.parameters]
        self._compressed_in_step |= any(matrix)
        plain = [bucket.gradient(k) for k, m in enumerate(matrix) if not m]
        numels = [t.numel() for t in plain]
        offsets = [sum(numels[:k]) for k in range(len(numels))]
        plain_sum: tuple[torch.Tensor, Any] | None = None
        if plain:   # every replica lays the bucket out alike: all skip it or none
            buffer = torch.empty(sum(numels), dtype=flat.dtype, device=flat.device)
            _ops.pack(buffer, plain, offsets, numels)
            plain_sum = (buffer, dist.all_reduce(buffer, group=group, async_op=True))
            self._sent(buffer)
        # The matrices some replica contributed: known when the flags are summed. While
        # backward runs they are not, so every matrix travels (the same sizes on every
        # replica); one that no replica contributed is dropped at the end, its residual
        # untouched (its slot held zeros, so M is the residual as it was).
        used = [True] * len(matrix) if overlapped else bucket.contributed()
        layout = self._power_layout(algo, bucket)

        # Every large step below works in place on the residual's own buffer (M is built
        # there, and becomes the new residual) and writes P Q^T straight into the bucket:
        # on CPU these passes are bound by memory, and a fresh multi-MiB tensor per step
        # costs page faults on top (measured: 3-5x slower for GPT-2's 50257 x 768 matrix).
        # The matrices of a run (same shape, back to back in the bucket, their residuals
        # and Q^T back to back in the layout's buffers) go through each step together, a
        # stretch of used ones at a time: one call per stretch instead of one per matrix,
        # whose fixed cost dominates for small matrices. The first pass (M, and P = M Q)
        # and the last (residual and output) are fused kernels (csrc/powersgd_ops.h).
        work: list[_Stretch] = []
        for run in layout.runs:
            for lo, count in _stretches(used, run.first, run.count):
                for k in range(run.first + lo, run.first + lo + count):
                    self.residuals[bucket.indices[k]] = layout.residuals[k]
                work.append(_Stretch(run, lo, count, flat.narrow(
                    0, bucket.offsets[run.first + lo], count * run.rows * run.cols).view(
                        count, run.rows, run.cols)))
        ps = torch.empty(sum(w.count * w.run.rows for w in work) * rank,
                         dtype=torch.float32, device=flat.device)
        at = 0
        for w in work:
            p = ps.narrow(0, at, w.count * w.run.rows * rank).view(w.count, w.run.rows, rank)
            at += w.count * w.run.rows * rank
            # M = gradient + residual, in place, and P = M Q: one sweep over M on CPU.
            _ops.powersgd_project(w.m, w.view, w.run.q_t.narrow(0, w.lo, w.count), p)
        p_sum = dist.all_reduce(ps, group=group, async_op=True) if work else None
        if work:
            self._sent(ps)

        def finish() -> None:
            if plain_sum is not None:
                plain_sum[1].wait()
                _ops.unpack(plain_sum[0], plain, offsets)
            if p_sum is None:
                return
            p_sum.wait()
            # The flags are summed by now; without overlap `used` already read them.
            used_somewhere = bucket.contributed() if overlapped else used
            # The P of matrices with as many rows lie back to back in `ps`: each run of
            # them is orthonormalised by one batched QR, which gives every matrix the bits
            # its own QR would (LAPACK per matrix) without the fixed cost of a call per
            # matrix (1024 matrices of 128 x 128: 2.2 ms against 22.8, about 1.6 copies
            # of their gradient bytes). The bases are laid out as `ps`, rows by rows.
            bases = torch.empty_like(ps)
            at = 0
            for rows, group_of in itertools.groupby(work, key=lambda w: w.run.rows):
                count = sum(w.count for w in group_of)
                size = count * rows * rank
                bases.narrow(0, at, size).view(count, rows, rank).copy_(
                    orthonormalize(ps.narrow(0, at, size).view(count, rows, rank)))
                at += size
            # Q_local^T = P^T M, reading M by rows, for every stretch into one buffer; the
            # sum is sent as Q^T, the layout kept.
            q_local = torch.empty(sum(w.count * rank * w.run.cols for w in work),
                                  dtype=torch.float32, device=flat.device)
            parts = []   # (stretch, P, Q_local^T, its offset in q_local)
            at = q_at = 0
            for w in work:
                p = bases.narrow(0, at, w.count * w.run.rows * rank).view(
                    w.count, w.run.rows, rank)
                at += w.count * w.run.rows * rank
                q_local_t = q_local.narrow(0, q_at, w.count * rank * w.run.cols).view(
                    w.count, rank, w.run.cols)
                if w.count == 1:
                    torch.mm(p[0].t(), w.m[0], out=q_local_t[0])
                else:
                    torch.bmm(p.transpose(1, 2), w.m, out=q_local_t)
                parts.append((w, p, q_local_t, q_at))
                q_at += w.count * rank * w.run.cols
            q_sum = q_local.clone()
            dist.all_reduce(q_sum, group=group)
            self._sent(q_sum)
            for w, p, q_local_t, q_at in parts:
                q_t = q_sum.narrow(0, q_at, q_local_t.numel()).view(q_local_t.shape)
                # (overlap only) a matrix no replica contributed: nothing to apply, nothing
                # kept, its Q as it was.
                for lo, count in _stretches(used_somewhere, w.run.first + w.lo, w.count):
                    # residual = M - P Q_local^T (this replica's miss); the bucket gets P Q^T.
                    _ops.powersgd_finish_batched(
                        w.m.narrow(0, lo, count), p.narrow(0, lo, count),
                        q_local_t.narrow(0, lo, count), q_t.narrow(0, lo, count),
                        w.view.narrow(0, lo, count))
                    w.run.q_t.narrow(0, w.lo + lo, count).copy_(q_t.narrow(0, lo, count))
                    for k in range(w.run.first + w.lo + lo, w.run.first + w.lo + lo + count):
                        self.q_ts[bucket.indices[k]] = layout.q_ts[k]
        return finish

    # -- Int8 ---------------------------------------------------------------------------
    def _bucket_residual(self, bucket: GradBucket) -> torch.Tensor:
        """The bucket's flat float32 residual; after a re-bucketing (or a loaded state)
        every parameter's residual is moved into the new layout."""
        signature = (bucket.indices, bucket.offsets, bucket.flags_at)
        cached = self._flat_residuals.get(bucket.index)
        if cached is not None and cached[0] == signature:
            return cached[1]
        buffer = torch.zeros(bucket.flags_at, dtype=torch.float32,
                             device=bucket.buffer.device)
        for i, o, n in zip(bucket.indices, bucket.offsets, bucket.numels):
            view = buffer.narrow(0, o, n)
            old = self.residuals.get(i)
            if old is not None:
                view.copy_(old.reshape(-1))
            self.residuals[i] = view
        self._flat_residuals[bucket.index] = (signature, buffer)
        return buffer

    def _int8(self, algo: Int8, bucket: GradBucket) -> _Finish:
        flat, group, size = bucket.buffer, self._group, bucket.flags_at
        residual = self._bucket_residual(bucket)
        # A residual travels only with a gradient: a parameter no replica contributed
        # (flags summed, after backward), or this replica did not (while backward runs:
        # overlap), sends nothing from here and keeps its residual for a later step.
        kept = [(residual.narrow(0, o, n), residual.narrow(0, o, n).clone())
                for o, n, u in zip(bucket.offsets, bucket.numels, bucket.contributed())
                if not u]
        for view, _ in kept:
            view.zero_()
        data = flat.narrow(0, 0, size)
        chunks = (size + algo.chunk_size - 1) // algo.chunk_size
        q = torch.empty(size, dtype=torch.int8, device=flat.device)
        scales = torch.empty(chunks, dtype=torch.float32, device=flat.device)
        _ops.ef_quantize_int8(data, residual, q, scales, algo.chunk_size)
        for view, saved in kept:
            view.copy_(saved)
        world = dist.get_world_size(group)
        all_q = torch.empty(world, size, dtype=torch.int8, device=flat.device)
        all_scales = torch.empty(world, chunks, dtype=torch.float32, device=flat.device)
        gathers = (dist.all_gather(list(all_q.unbind(0)), q, group=group, async_op=True),
                   dist.all_gather(list(all_scales.unbind(0)), scales, group=group,
                                   async_op=True))
        self._sent(q, scales)

        def finish() -> None:
            for work in gathers:
                work.wait()
            _ops.dequantize_sum(all_q, all_scales, data, algo.chunk_size)
        return finish

    # -- checkpoints --------------------------------------------------------------------
    @staticmethod
    def spread_over(states: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
        """One replica's state for a run of `world_size` replicas, from the states of a
        run with another number of replicas (`states`, one per old replica).

        What error feedback owes the model is the *sum* of the replicas' residuals (the
        reduced gradients applied so far plus that sum equal the true gradients, in the
        units of the reduced result whatever the number of replicas); each new replica
        takes an equal share of it, so nothing owed is lost or counted twice. PowerSGD's
        Q matrices and the step counter are the same on every replica and carry over.

        Raises:
          ValueError: states saved under different compressions, or none at all.
        """
        if not states:
            raise ValueError("The error-feedback state holds no replica's state.")
        kinds = {state.get("compression") for state in states}
        if len(kinds) != 1:
            raise ValueError(f"The error-feedback states were saved under different "
                             f"compressions {sorted(map(str, kinds))}; it is not one run's.")
        totals: dict[int, torch.Tensor] = {}
        for state in states:
            for i, residual in state["residuals"].items():
                total = totals.get(int(i))
                residual = residual.to(torch.float32)
                totals[int(i)] = residual.clone() if total is None else total.add_(residual)
        first = states[0]
        spread = {"compression": first["compression"], "step": first["step"],
                  "residuals": {i: t.div_(world_size) for i, t in totals.items()},
                  "q": {int(i): t.clone() for i, t in first["q"].items()}}
        if "onebit" in first:   # OneBitAdam's moments: the same on every replica
            spread["onebit"] = first["onebit"]
        return spread

    def state_dict(self) -> dict[str, Any]:
        """This replica's error-feedback state: the compression (its `state_tag`), the step
        counter, the residuals and (PowerSGD) the Q matrices, keyed by parameter
        registration index; copies, safe to keep."""
        state = {"compression": self.compression.state_tag(), "step": self.step,
                 "residuals": {i: t.detach().clone().cpu() for i, t in self.residuals.items()},
                 "q": {i: t.t().clone(memory_format=torch.contiguous_format).cpu()
                       for i, t in self.q_ts.items()}}
        if self._onebit is not None:
            state["onebit"] = self._onebit.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned (on the same replica of a run with the same
        compression and parameters).

        Raises:
          ValueError: a state saved under another compression.
        """
        if state.get("compression") != self.compression.state_tag():
            raise ValueError(f"This error-feedback state was saved with compression="
                             f"{state.get('compression')}, but this reducer runs "
                             f"{self.compression.state_tag()}; load it into a strategy "
                             "created with the same compression.")
        self.step = int(state["step"])
        self.residuals = {int(i): t.clone() for i, t in state["residuals"].items()}
        self.q_ts = {int(i): t.t().clone(memory_format=torch.contiguous_format)
                     for i, t in state["q"].items()}
        self._flat_residuals = {}
        self._power_layouts = {}
        if self._onebit is not None:
            self._onebit.load_state_dict(state["onebit"])
