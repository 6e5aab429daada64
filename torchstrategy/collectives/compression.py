"""On-the-wire compression of gradient buckets: all-reduce in bf16 or fp16.

A bucket of fp32 (or fp64) gradients is packed into a buffer of half the bytes (a fused
cast-and-scale kernel), all-reduced, and unpacked back into the gradients. Each replica's
values are scaled by 1/N before the cast and the sum by N after it, so a sum over N
replicas stays in fp16's range whenever each replica's gradient does.

Errors are those of rounding to the wire dtype: every element of the summed gradient is
within about ``N * 2**-8`` (bf16) or ``N * 2**-11`` (fp16) of the largest magnitude among
the replicas' contributions to it, relative.

Error-feedback compression (`PowerSGD`, `Int8`, `OneBitAdam`) sends far fewer bytes and
keeps what it did not send (the residual) to add to the next step's gradient, so that
nothing is lost over steps; `torchstrategy.collectives.error_feedback` runs it as a stage
of the gradient reducer's pipeline, which hands it each bucket as a `GradBucket` (as DDP
hands its communication hooks a ``GradBucket``). The classes here only hold and check the settings,
and describe a bucket.

``compression="auto"`` (`AutoCompression`) lets the gradient reducer choose among these
from measurements (`torchstrategy.collectives.auto_compression`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, Union

import torch

_Ops = TypeVar("_Ops")

_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class GradBucket:
    """One bucket of the gradient reducer, handed to a stage of its pipeline when every
    gradient in it is ready: its flat buffer and where each parameter's gradient lives in
    it, as the C++ core laid it out (csrc/bucket_layout.h: DDP's layout, the slots packed
    back to back; the buffer holds the gradients and nothing else).

    Attributes:
      index: the bucket's place in launch order (the same on every replica).
      buffer: the flat buffer (one dtype and device), reduced in place by the stage.
      parameters: the parameters whose gradients it holds, in slot order.
      indices: their registration indices in the reducer (stable across re-bucketing).
      offsets / numels: each slot's first element and its number of elements.
      flags: one "contributed" flag per parameter (float32, outside `buffer`): 1 where
        this replica contributed a gradient to parameter k. The reducer sums them once per
        step, after launching the last bucket and before waiting for any: a stage whose
        reduction runs when waited for (error feedback) reads them summed, and a parameter
        some replica contributed to has a flag > 0. Stages read them; none sums them again.
      complete: True when every parameter of the bucket got its gradient in this backward
        before the bucket was launched: then this replica's flags are all 1 (known without
        reading `flags`, which on a GPU would wait for the device).
    """

    index: int
    buffer: torch.Tensor
    parameters: tuple[torch.Tensor, ...]
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    flags: torch.Tensor
    complete: bool = False

    def gradient(self, k: int) -> torch.Tensor:
        """The slot of parameter `k` (slot order), flat: a view into `buffer`."""
        return self.buffer.narrow(0, self.offsets[k], self.numels[k])

    def contributed(self) -> list[bool]:
        """Per parameter (slot order), whether its flag is > 0: some replica contributed
        once the reducer has summed the flags, this replica did before. A complete bucket
        needs no read of `flags` (on a GPU, a wait for the device)."""
        if self.complete:
            return [True] * len(self.indices)
        return [bool(f) for f in (self.flags > 0).tolist()]

    @property
    def flags_at(self) -> int:
        """The elements of `buffer` (its gradients): where the flags started when they
        travelled inside it; stages size their own buffers by it."""
        return self.buffer.numel()


def _check_int(name: str, value: Any, minimum: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({what}), got {value!r}.")
    return value


class ErrorFeedback:
    """Base of the error-feedback compressors: each replica adds the residual it kept from
    the previous synchronised step to its gradient, sends a compressed form of the sum, and
    keeps what the compressed form missed. The first `warmup_steps` synchronised steps are
    all-reduced uncompressed (bit for bit the default reduction).

    ``overlap`` (every compressor's argument) says *when* a bucket is compressed, not what
    travels: False compresses every bucket once backward has finished; True compresses a
    bucket and starts sending it as soon as its gradients are ready, while backward goes
    on (on a GPU, on a side stream), and completes its reduction when backward has
    finished. Each compressor's default is the faster of the two in the measurements of
    docs/gradient_reduction.md ("Compression during backward"): on for `Int8`, whose
    gathers carry a quarter of the gradient bytes, off for `PowerSGD` and `OneBitAdam`,
    whose few bytes leave little to hide."""

    warmup_steps: int = 0
    overlap: bool = False
    _OVERLAP_DEFAULT = False   # each compressor's own default (shown in repr when not)

    def _settings(self) -> dict[str, Any]:
        """What the compressed result depends on (and a saved state belongs to)."""
        raise NotImplementedError("abstract: subclasses list their settings")

    def _all_settings(self) -> dict[str, Any]:
        settings = self._settings()
        if self.overlap != self._OVERLAP_DEFAULT:   # shown only when not the default
            settings["overlap"] = self.overlap
        return settings

    def state_tag(self) -> str:
        """The name a saved error-feedback state carries: the compressor and the settings
        its state depends on. ``overlap`` is not one of them: a state saved with it on
        loads with it off, and the other way round."""
        args = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and \
            self._all_settings() == other._all_settings()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self._all_settings().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._all_settings().items())
        return f"{type(self).__name__}({args})"


def _check_overlap(name: str, overlap: Any) -> bool:
    if not isinstance(overlap, bool):
        raise ValueError(f"{name} overlap must be True or False (compress each bucket while "
                         f"backward goes on, or after it), got {overlap!r}.")
    return overlap


class PowerSGD(ErrorFeedback):
    """PowerSGD (Vogels et al., 2019): rank-`rank` gradient compression with error feedback.

    Each gradient of two or more dimensions (reshaped to ``[shape[0], -1]``, an ``n x m``
    matrix M) for which ``rank * (n + m) < n * m`` travels as two thin matrices: P = M Q
    (``n x rank``) is summed over replicas and orthonormalised, then Q = M^T P (``m x
    rank``) is summed, and P Q^T approximates the *sum* of the replicas' M. Q is kept for the
    next step (warm start), so one power iteration a step refines it. Every other gradient
    (vectors, small matrices) is summed uncompressed in one flat buffer.

    Args:
      rank: the rank of the approximation (bytes and accuracy grow with it).
      warmup_steps: synchronised steps all-reduced uncompressed before compression starts.
      seed: the seed of the first Q (the same on every replica).
      overlap: compress each bucket while backward goes on (`ErrorFeedback`).

    Raises:
      ValueError: `rank` < 1, negative `warmup_steps`, a seed that is not an int, or an
        `overlap` that is not a bool.
    """

    def __init__(self, rank: int = 4, warmup_steps: int = 0, seed: int = 0,
                 overlap: bool = False) -> None:
        self.overlap = _check_overlap("PowerSGD", overlap)
        self.rank = _check_int("PowerSGD rank", rank, 1, "the rank of the approximation")
        self.warmup_steps = _check_int("PowerSGD warmup_steps", warmup_steps, 0,
                                       "uncompressed steps first")
        self.seed = _check_int("PowerSGD seed", seed, 0, "the seed of the first Q")

    def _settings(self) -> dict[str, Any]:
        return {"rank": self.rank, "warmup_steps": self.warmup_steps, "seed": self.seed}

    def compresses(self, shape: torch.Size) -> bool:
        """True when a gradient of `shape` travels as P and Q (fewer elements than M)."""
        if len(shape) < 2:
            return False
        rows = int(shape[0])
        cols = 1
        for d in shape[1:]:
            cols *= int(d)
        return self.rank * (rows + cols) < rows * cols


class Int8(ErrorFeedback):
    """8-bit quantisation with error feedback.

    Each bucket's gradients (plus the kept residual) are cut into chunks of `chunk_size`
    elements; a chunk travels as int8 levels times one float scale (its largest magnitude
    / 127, rounded to nearest). The replicas' int8 levels and scales are *gathered* (not
    summed in int8, which would overflow) and every replica adds them up in float, in
    replica order, so every replica gets the same bits. About a quarter of fp32's bytes per
    replica; since every replica receives every other's levels, traffic per replica grows
    with the number of replicas (N bytes per element against about 8 for a ring all-reduce
    of fp32): it pays for up to about 8 replicas.

    Args:
      chunk_size: elements sharing one scale (smaller: more accurate, more scales).
      warmup_steps: synchronised steps all-reduced uncompressed before compression starts.
      overlap: compress each bucket while backward goes on (`ErrorFeedback`; on by
        default: measured faster for Int8). A parameter this replica did not contribute
        to then sends nothing from here, and its residual waits for a step it does.

    Raises:
      ValueError: `chunk_size` < 1, negative `warmup_steps`, or an `overlap` that is not a
        bool.
    """

    _OVERLAP_DEFAULT = True

    def __init__(self, chunk_size: int = 1024, warmup_steps: int = 0,
                 overlap: bool = True) -> None:
        self.overlap = _check_overlap("Int8", overlap)
        self.chunk_size = _check_int("Int8 chunk_size", chunk_size, 1,
                                     "elements sharing one scale")
        self.warmup_steps = _check_int("Int8 warmup_steps", warmup_steps, 0,
                                       "uncompressed steps first")

    def _settings(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "warmup_steps": self.warmup_steps}


class OneBitAdam(ErrorFeedback):
    """1-bit Adam (Tang et al., 2021): Adam's momentum, not the gradient, travels as one bit
    per element and one scale per block, with error feedback; Adam's variance is frozen
    after an uncompressed warm-up.

    The reduction computes Adam's update direction itself and leaves it in ``.grad``, so
    the optimizer must be `ts.OneBitAdamW` (which applies the learning rate and the
    decoupled weight decay to that direction), not ``torch.optim.AdamW``. The first
    `warmup_steps` synchronised steps all-reduce the gradients exactly and update both of
    Adam's moments from the sum, as AdamW does. From then on the variance is frozen (what
    makes compression error in the momentum a linear, recoverable error) and each replica
    sends its share of the next momentum plus the error it kept: the sign of every element
    and, per block of `block_size` elements, the mean magnitude (about 31x fewer bytes
    than fp32 at the default block size).

    Args:
      betas: Adam's (beta1, beta2).
      eps: Adam's epsilon (added to the square root of the variance).
      warmup_steps: synchronised steps all-reduced uncompressed (and the variance
        estimated) before compression starts; at least 1.
      block_size: elements sharing one scale, a multiple of 8 (the signs travel 8 to a
        byte).
      overlap: compress each bucket while backward goes on (`ErrorFeedback`).

    Raises:
      ValueError: betas outside [0, 1), a negative eps, `warmup_steps` < 1, a
        `block_size` that is not a positive multiple of 8, or an `overlap` that is not a
        bool.
    """

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 warmup_steps: int = 100, block_size: int = 2048,
                 overlap: bool = False) -> None:
        self.overlap = _check_overlap("OneBitAdam", overlap)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
                not all(isinstance(b, (int, float)) and not isinstance(b, bool) and
                        0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"OneBitAdam betas must be two numbers in [0, 1) (Adam's beta1 "
                             f"and beta2), got {betas!r}.")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"OneBitAdam eps must be a number >= 0, got {eps!r}.")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.warmup_steps = _check_int(
            "OneBitAdam warmup_steps", warmup_steps, 1,
            "uncompressed steps that estimate Adam's variance before it is frozen")
        self.block_size = _check_int("OneBitAdam block_size", block_size, 8,
                                     "elements sharing one scale")
        if self.block_size % 8:
            raise ValueError(f"OneBitAdam block_size must be a multiple of 8 (the signs "
                             f"travel 8 to a byte), got {block_size!r}.")

    def _settings(self) -> dict[str, Any]:
        return {"betas": self.betas, "eps": self.eps, "warmup_steps": self.warmup_steps,
                "block_size": self.block_size}


#: A mode `AutoCompression` may choose: None, a wire dtype, `PowerSGD` or `Int8`.
Candidate = Union[str, ErrorFeedback, None]


class AutoCompression:
    """``compression="auto"``: the gradient reducer picks its compression itself, from
    measurements, at the start of training (and again on a regrouped world).

    The first `measure_steps` + 1 synchronised steps run uncompressed (bit for bit the
    default reduction). At the end of the last of them every replica times a short
    all-reduce (the link) and a memory copy (its core), and the replicas agree on the
    figures (the slowest replica's); each then predicts the step time of every candidate
    for this model's gradients (`torchstrategy.collectives.auto_compression`) and keeps
    the fastest, which must beat the uncompressed step by `min_gain` (a fraction of it)
    to be chosen over it. Every replica computes the same choice from the same figures.

    Args:
      candidates: the modes to choose from: None (uncompressed), "bf16" / "fp16",
        ``ts.Int8(...)``, ``ts.PowerSGD(...)``. The default, ``(None, "bf16",
        ts.Int8())``, holds the modes that cost no measurable accuracy with any optimizer
        (docs/gradient_reduction.md's convergence table). Add ``ts.PowerSGD(rank=4)`` only
        when training with SGD-type optimizers: with AdamW it ends about 6 % higher in
        loss. ``ts.OneBitAdam`` cannot be a candidate: it changes what ``.grad`` holds
        and needs ``ts.OneBitAdamW`` as the optimizer, so it is never switched on behind
        the user's back.
      measure_steps: uncompressed steps timed (after the first, which lays the buckets
        out); the fastest counts.
      min_gain: a compressed mode is chosen only if its predicted step is at least this
        fraction shorter than the measured uncompressed one (guards against noise:
        compression is an approximation, worth it only where it clearly pays).

    Raises:
      ValueError: a candidate of another kind, an empty or repeated list, `measure_steps`
        < 1, `min_gain` outside [0, 1).
    """

    def __init__(self, candidates: tuple[Candidate, ...] = (None, "bf16", Int8()),
                 measure_steps: int = 2, min_gain: float = 0.1) -> None:
        candidates = tuple(candidates)
        for c in candidates:
            if not (c is None or isinstance(c, (PowerSGD, Int8)) or
                    (isinstance(c, str) and c in _WIRE_DTYPES)):
                raise ValueError(
                    f"AutoCompression candidates must be None, 'bf16', 'fp16', ts.Int8(...) "
                    f"or ts.PowerSGD(...), got {c!r}"
                    + (" (ts.OneBitAdam needs ts.OneBitAdamW as the optimizer: set it "
                       "explicitly, compression=ts.OneBitAdam())"
                       if isinstance(c, OneBitAdam) else "") + ".")
        if not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"AutoCompression candidates must be distinct and at least one, "
                             f"got {candidates!r}.")
        self.candidates = candidates
        self.measure_steps = _check_int("AutoCompression measure_steps", measure_steps, 1,
                                        "uncompressed steps timed")
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or \
                not 0.0 <= min_gain < 1.0:
            raise ValueError(f"AutoCompression min_gain must be a number in [0, 1) (the "
                             f"fraction of the step a compressed mode must save), got "
                             f"{min_gain!r}.")
        self.min_gain = float(min_gain)

    def _settings(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "measure_steps": self.measure_steps,
                "min_gain": self.min_gain}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and \
            self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.candidates, self.measure_steps,
                     self.min_gain))

    def __repr__(self) -> str:
        if self == AutoCompression():
            return "AutoCompression()"
        args = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"AutoCompression({args})"


Compression = Union[str, ErrorFeedback, AutoCompression, None]


def check_compression(compression: Compression) -> Compression:
    """Returns `compression` ("bf16", "fp16", a `PowerSGD` / `Int8` / `OneBitAdam`, an
    `AutoCompression`, or None) after checking it; "auto" becomes ``AutoCompression()``.

    Raises:
      ValueError: any other value, naming the accepted ones.
    """
    if compression == "auto":
        return AutoCompression()
    if compression is None or isinstance(compression, (ErrorFeedback, AutoCompression)) or \
            (isinstance(compression, str) and compression in _WIRE_DTYPES):
        return compression
    raise ValueError(f"compression must be None, 'bf16' or 'fp16' (a wire dtype), or "
                     f"ts.PowerSGD(rank=...) / ts.Int8() / ts.OneBitAdam() (error "
                     f"feedback), or 'auto' / ts.AutoCompression(...) (chosen from "
                     f"measurements), got {compression!r}.")


def wire_dtype(compression: Compression, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a bucket of `dtype` travels in under `compression`, or None when it travels
    as it is (no compression, error feedback, a non-floating bucket, or one already as
    small as the wire)."""
    if not isinstance(compression, str) or not dtype.is_floating_point:
        return None
    wire = _WIRE_DTYPES[compression]
    if torch.finfo(dtype).bits <= torch.finfo(wire).bits:
        return None
    return wire


def with_compression(cross_device_ops: _Ops, compression: Compression) -> _Ops:
    """Returns `cross_device_ops` set to carry `compression` (how a strategy applies
    ``CommunicationOptions.compression`` to its cross-device ops).

    Raises:
      ValueError: a bad value, cross-device ops already set to another compression, or
        error feedback asked of cross-device ops that cannot run it.
    """
    compression = check_compression(compression)
    if compression is None:
        return cross_device_ops
    check_runs_error_feedback(cross_device_ops, compression)
    current = getattr(cross_device_ops, "compression", None)
    if current not in (None, compression):
        raise ValueError(f"CommunicationOptions(compression={compression!r}) disagrees with "
                         f"{cross_device_ops!r}; set compression in one place only.")
    # Any cross-device ops object: those that do not declare `compression` gain it here.
    setattr(cross_device_ops, "compression", compression)
    return cross_device_ops


def check_runs_error_feedback(cross_device_ops: Any, compression: Compression) -> None:
    """Refuses error-feedback `compression` with cross-device ops whose algorithm it would
    replace: it runs its own collectives (all-reduces of P and Q, gathers of int8 levels)
    over the process group, which only ``ts.NcclAllReduce`` (the default) agrees to.

    An `AutoCompression` that may choose an error-feedback mode is refused alike.

    Raises:
      ValueError: naming the cross-device ops and what to use instead.
    """
    may_choose = isinstance(compression, AutoCompression) and \
        any(isinstance(c, ErrorFeedback) for c in compression.candidates)
    if may_choose and (not getattr(cross_device_ops, "runs_error_feedback", False) or
                       getattr(cross_device_ops, "num_packs", 1) != 1):
        raise ValueError(
            f"compression={compression!r} cannot run with cross_device_ops="
            f"{cross_device_ops!r}: it may choose error-feedback compression (ts.Int8, "
            "ts.PowerSGD), which runs its own collectives over the process group in place "
            "of that algorithm and does not split buffers into packs. Use the default "
            "ts.NcclAllReduce() with num_packs=1, or let it choose between the wire "
            "dtypes only: ts.AutoCompression(candidates=(None, 'bf16')).")
    if isinstance(compression, ErrorFeedback) and \
            not getattr(cross_device_ops, "runs_error_feedback", False):
        raise ValueError(
            f"compression={compression!r} cannot run with cross_device_ops="
            f"{cross_device_ops!r}: error-feedback compression runs its own collectives "
            "over the process group in place of that algorithm. Use the default "
            "ts.NcclAllReduce() (ts.NcclAllReduce(compression=...)), or compression='bf16'.")
    if isinstance(compression, ErrorFeedback) and getattr(cross_device_ops, "num_packs", 1) != 1:
        raise ValueError(
            f"compression={compression!r} with cross_device_ops={cross_device_ops!r}: "
            "error-feedback compression sends its own (much smaller) buffers and does not "
            "split them into packs; leave num_packs=1.")
