"""1-bit Adam at work: the reduction half of `ts.OneBitAdam`, run by the error-feedback
stage of the gradient reducer (`torchstrategy.collectives.error_feedback`) on each bucket.

Why in the reduction: the quantity compressed is Adam's momentum, which needs the
gradient of this replica (not yet summed) and Adam's state, and compression must decide
what travels before any sum exists. So this reduction keeps Adam's two moments itself,
per parameter (keyed by registration index, the same on every replica), and leaves in
each ``.grad`` Adam's bias-corrected update direction, ``m_hat / (sqrt(v_hat) + eps)``;
`ts.OneBitAdamW` (the optimizer) then applies the learning rate and the decoupled weight
decay to it, so learning-rate schedules and parameter groups work as with AdamW.

Per bucket (``n`` gradient elements, world size ``N``; the bucket holds this replica's
share ``b`` of the summed gradient, as every reduction of this library sums), at Adam step
``t`` (1 at the first synchronised step):

- Warm-up (``t <= warmup_steps``): the bucket is all-reduced uncompressed, exactly as
  without compression, and both moments follow AdamW from the sum ``g``: ``m = beta1 m +
  (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``.
- Afterwards ``v`` is frozen (with its bias correction at the last warm-up step): the
  update is then linear in ``m``, so an error in ``m`` that error feedback releases later
  moves the parameters as far in total as the exact ``m`` would have. Each replica forms
  its share of the next momentum plus the error it kept, ``x = beta1 m / N + (1 - beta1) b
  + e``, and sends, per block of ``block_size`` elements, the sign of each element (one
  bit) and the block's mean magnitude ``s`` (the scale minimising the squared error of
  ``s * sign(x)``); it keeps ``e = x - s * sign(x)``. The signs and scales of every
  replica are gathered and summed in replica order (``m = sum over replicas of s *
  sign(x)``), so every replica gets the same bits of ``m``, and the sum of the ``m``
  increments sent plus the replicas' errors equals the exact momentum's (the identity
  the tests check).

Gathering rather than reducing: a sum of signs is not a sign, so every replica receives
every other's bits (``N - 1`` times ``n / 8`` bytes, against about ``8 n`` for a ring
all-reduce of fp32): 32x fewer bytes at 2 replicas, fewer gained as N grows (16x at 4).

The fused kernels (``torch.ops.torchstrategy.onebit_compress`` and ``onebit_decompress``,
csrc/onebit_ops.cpp) do the per-block work in one pass each on CPU; on other devices the
same arithmetic runs as ATen operations (`compress_reference`, `decompress_reference`).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchstrategy import _ops  # noqa: F401  (loads the compiled extension's ops)
from torchstrategy.collectives.compression import GradBucket, OneBitAdam

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def compress_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One-bit compression of `x` (float32, a multiple of `block` elements, in place):
    returns (``bits``: uint8, the signs 8 to a byte, bit k of byte j for element 8 j + k,
    set where ``x >= 0``; ``scales``: float32, each block's mean magnitude) and leaves in
    `x` what the compressed form missed, ``x - scale * sign``."""
    blocks = x.view(-1, block)
    scales = blocks.abs().mean(1)
    positive = blocks >= 0
    blocks.sub_(torch.where(positive, scales[:, None], -scales[:, None]))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    bits = (positive.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
    return bits, scales


def decompress_reference(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                         block: int) -> None:
    """Writes into `out` (float32, ``bits.shape[1] * 8`` elements) the sum over replicas
    (rows of `bits` and `scales`, in order) of ``scale * sign``."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    out.zero_()
    blocks = out.view(-1, block)
    for row, scale in zip(bits.unbind(0), scales.unbind(0)):
        positive = (row[:, None] & weights).ne(0).view(-1, block)
        blocks.add_(torch.where(positive, scale[:, None], -scale[:, None]))


def _has_cpu_kernel(x: torch.Tensor, name: str) -> bool:
    """True when `x` is on the CPU and the compiled extension registers op `name`."""
    if x.device.type != "cpu":
        return False
    try:
        getattr(torch.ops.torchstrategy, name)
    except (AttributeError, RuntimeError):   # an extension built before the op existed
        return False
    return True


def _compress(error: torch.Tensor, exp_avg: torch.Tensor, grad: torch.Tensor,
              momentum_weight: float, grad_weight: float,
              block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = error + momentum_weight * exp_avg + grad_weight * grad`` (`grad` shorter: 0
    past its end) compressed to signs and block scales; `error` becomes what they miss."""
    if _has_cpu_kernel(error, "onebit_compress"):
        bits = torch.empty(error.numel() // 8, dtype=torch.uint8)
        scales = torch.empty(error.numel() // block, dtype=torch.float32)
        torch.ops.torchstrategy.onebit_compress(error, exp_avg, grad, momentum_weight,
                                                grad_weight, bits, scales, block)
        return bits, scales
    error.add_(exp_avg, alpha=momentum_weight)
    error.narrow(0, 0, grad.numel()).add_(grad.to(torch.float32), alpha=grad_weight)
    return compress_reference(error, block)


def _decompress(bits: torch.Tensor, scales: torch.Tensor, exp_avg: torch.Tensor,
                inverse_denominator: torch.Tensor, step_scale: float, out: torch.Tensor,
                block: int) -> None:
    """`exp_avg` = the sum of the replicas' ``scale * sign``; `out` (shorter) = ``exp_avg *
    inverse_denominator * step_scale``, in its own dtype."""
    if _has_cpu_kernel(exp_avg, "onebit_decompress") and out.is_contiguous():
        torch.ops.torchstrategy.onebit_decompress(bits, scales, exp_avg, inverse_denominator,
                                                  step_scale, out, block)
        return
    decompress_reference(bits, scales, exp_avg, block)
    size = out.numel()
    out.copy_(exp_avg.narrow(0, 0, size) * inverse_denominator.narrow(0, 0, size)
              * step_scale)


#: (an entry of a state, a copy of it, the parameter's slot in its bucket)
_Kept = list[tuple[torch.Tensor, torch.Tensor, int]]


def _restore(kept: _Kept, used: list[bool] | None = None) -> None:
    """Puts back the copies `OneBitAdamReduction._kept` made: all of them, or those of the
    slots `used` says no replica contributed."""
    for view, old, k in kept:
        if used is None or not used[k]:
            view.copy_(old)


class _Layout:
    """One bucket's Adam state as flat float32 buffers over its elements (padded to whole
    blocks), each parameter's entry a view into them."""

    def __init__(self, signature: Any, size: int, padded: int, device: torch.device,
                 gaps: torch.Tensor) -> None:
        self.signature = signature
        self.size = size                    # the bucket's gradient elements
        self.exp_avg = torch.zeros(padded, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(padded, dtype=torch.float32, device=device)
        self.error = torch.zeros(padded, dtype=torch.float32, device=device)
        self.gaps = gaps                    # elements of no parameter (alignment padding)
        self.inverse_denominator: torch.Tensor | None = None   # once the variance froze


class OneBitAdamReduction:
    """The reduction of `ts.OneBitAdam` (module docstring) over `group`. Its per-replica
    error lives in the `residuals` dict the caller passes (the error-feedback stage's,
    which checkpoints and spreads residuals over another number of replicas); the two
    moments, the same on every replica, live here."""

    def __init__(self, compression: OneBitAdam, group: dist.ProcessGroup | None) -> None:
        self.compression = compression
        self._group = group
        self.exp_avg: dict[int, torch.Tensor] = {}      # registration index -> m
        self.exp_avg_sq: dict[int, torch.Tensor] = {}   # registration index -> v
        self._layouts: dict[int, _Layout] = {}

    def _layout(self, bucket: GradBucket, residuals: dict[int, torch.Tensor]) -> _Layout:
        signature = (bucket.indices, bucket.offsets, bucket.flags_at)
        layout = self._layouts.get(bucket.index)
        if layout is not None and layout.signature == signature:
            return layout
        block = self.compression.block_size
        size = bucket.flags_at
        padded = (size + block - 1) // block * block
        device = bucket.buffer.device
        covered = torch.zeros(size, dtype=torch.bool)
        for o, n in zip(bucket.offsets, bucket.numels):
            covered[o:o + n] = True
        gaps = (~covered).nonzero().view(-1).to(device)
        layout = _Layout(signature, size, padded, device, gaps)
        # A re-bucketing (or a loaded state): every parameter's state moves into the new
        # layout, and its entries become views into it.
        for i, o, n in zip(bucket.indices, bucket.offsets, bucket.numels):
            for flat, table in ((layout.exp_avg, self.exp_avg),
                                (layout.exp_avg_sq, self.exp_avg_sq),
                                (layout.error, residuals)):
                view = flat.narrow(0, o, n)
                old = table.get(i)
                if old is not None:
                    view.copy_(old.reshape(-1))
                table[i] = view
        self._layouts[bucket.index] = layout
        return layout

    def start(self, bucket: GradBucket, step: int, residuals: dict[int, torch.Tensor],
              sent: Callable[..., None]) -> Callable[[], None]:
        """Starts reducing `bucket` at synchronised step `step` (0 first): launches what
        travels and returns what completes the reduction, leaving Adam's direction in its
        gradients (run once the reducer has summed the flags). `sent` is told every tensor
        this replica sends. Called while backward still runs (``overlap``) or after it."""
        algo, group = self.compression, self._group
        beta1, beta2 = algo.betas
        layout = self._layout(bucket, residuals)
        size = layout.size
        data = bucket.buffer.narrow(0, 0, size)
        t = step + 1
        if t <= algo.warmup_steps:
            plain_sum = dist.all_reduce(data, group=group, async_op=True)   # as uncompressed
            sent(data)

            def finish_warmup() -> None:
                plain_sum.wait()
                kept = self._kept(bucket, (layout.exp_avg, layout.exp_avg_sq))
                g = data.to(torch.float32)
                m = layout.exp_avg.narrow(0, 0, size)
                m.lerp_(g, 1 - beta1)
                layout.exp_avg_sq.narrow(0, 0, size).mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denominator = (layout.exp_avg_sq.narrow(0, 0, size).sqrt()
                               / math.sqrt(1 - beta2 ** t)).add_(algo.eps)
                direction = m.div(denominator).div_(1 - beta1 ** t)
                _restore(kept)
                data.copy_(direction)
            return finish_warmup
        world = dist.get_world_size(group)
        m = layout.exp_avg
        if layout.inverse_denominator is None:
            # The variance froze at the last warm-up step, with its bias correction.
            correction = math.sqrt(1 - beta2 ** algo.warmup_steps)
            layout.inverse_denominator = \
                (layout.exp_avg_sq.sqrt() / correction).add_(algo.eps).reciprocal_()
            m.index_fill_(0, layout.gaps, 0.0)
        inverse_denominator = layout.inverse_denominator
        # Alignment gaps in the bucket must hold 0 (they join the blocks' scales).
        data.index_fill_(0, layout.gaps, 0.0)
        # The error of a parameter that may turn out to have no contribution from any
        # replica, as it was: restored then. Once the flags are summed they say which;
        # while backward runs, those this replica did not contribute may be.
        maybe_unused = self._kept(bucket, (layout.error,))
        # The error becomes x = beta1 m / N + (1 - beta1) b + e, then what x's signs and
        # scales miss.
        bits, scales = _compress(layout.error, m, data, beta1 / world, 1 - beta1,
                                 algo.block_size)
        all_bits = torch.empty(world, bits.numel(), dtype=torch.uint8, device=bits.device)
        all_scales = torch.empty(world, scales.numel(), dtype=torch.float32,
                                 device=scales.device)
        gathers = (dist.all_gather(list(all_bits.unbind(0)), bits, group=group,
                                   async_op=True),
                   dist.all_gather(list(all_scales.unbind(0)), scales, group=group,
                                   async_op=True))
        sent(bits, scales)

        def finish() -> None:
            for work in gathers:
                work.wait()
            kept = self._kept(bucket, (layout.exp_avg, layout.exp_avg_sq))
            _decompress(all_bits, all_scales, m, inverse_denominator,
                        1 / (1 - beta1 ** t), data, algo.block_size)
            # The gaps and the tail past the last gradient belong to no parameter: no
            # momentum, no error, no direction there.
            for state in (m, layout.error):
                state.index_fill_(0, layout.gaps, 0.0)
                state.narrow(0, size, state.numel() - size).zero_()
            data.index_fill_(0, layout.gaps, 0.0)
            _restore(kept)
            _restore(maybe_unused, bucket.contributed())   # the flags are summed by now
        return finish

    @staticmethod
    def _kept(bucket: GradBucket, states: tuple[torch.Tensor, ...]) -> _Kept:
        """Copies of `states`' entries for every parameter of `bucket` whose flag is 0 (no
        replica contributed, once summed; this replica did not, before), to be put back
        with `_restore`: such a parameter's state waits, as its ``.grad`` does."""
        return [(state.narrow(0, o, n), state.narrow(0, o, n).clone(), k)
                for k, (o, n, f) in enumerate(zip(bucket.offsets, bucket.numels,
                                                  bucket.contributed()))
                if not f for state in states]

    def state_dict(self) -> dict[str, Any]:
        """The two moments (the same on every replica), copies keyed by registration
        index."""
        return {"exp_avg": {i: t.detach().clone().cpu() for i, t in self.exp_avg.items()},
                "exp_avg_sq": {i: t.detach().clone().cpu()
                               for i, t in self.exp_avg_sq.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned; the layouts are rebuilt at the next step."""
        self.exp_avg = {int(i): t.clone() for i, t in state["exp_avg"].items()}
        self.exp_avg_sq = {int(i): t.clone() for i, t in state["exp_avg_sq"].items()}
        self._layouts = {}
