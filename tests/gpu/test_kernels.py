"""The CUDA kernels of torchstrategy._C (csrc/bucket_ops_cuda.cu: pack, unpack, and the
narrowing to the bf16/fp16 wire fused into pack) and the compression kernels on CUDA
(ef_quantize_int8, dequantize_sum, powersgd_finish, powersgd_project: the generic ATen
kernels there) against torch's reference, exactly: fp32, bf16 and fp16, odd sizes, slots
and tensors at misaligned addresses, one tensor spanning several of the kernel's 16K-element
chunks.

Every test runs on each device: "cpu" checks the CPU kernels against the same reference here
(the comparison logic is the same), "cuda" is skipped without a GPU, saying so.
scripts/gpu_check.sh runs the "cuda" cases a second time under compute-sanitizer memcheck.
"""
import pytest
import torch

from torchstrategy import _ops
from tests.collectives.test_compression_ef import _quantize_reference
from tests.gpu.devices import DEVICES

FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REFERENCE = torch.ops.torchstrategy
# 1 and 3 elements, a tail that fills no 16-byte pack, and one tensor over three of the CUDA
# kernel's chunks (1 << 14 elements) plus a remainder.
SIZES = [1, 3, 7, 1000, 3 * (1 << 14) + 5, 33]


def _sources(dtype, device, misaligned):
    """Tensors of SIZES in `dtype`; misaligned: each starts one element into its storage,
    so its data pointer is not 16-byte aligned (the kernel's scalar path)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for n in SIZES:
        values = (torch.randn(n + 1, generator=g) * 8).to(dtype).to(device)
        out.append(values[1:] if misaligned else values[:n].clone())
    return out


def _layout(numels, misaligned):
    """Slot offsets: packed back to back with a gap of one element after each slot when
    misaligned (slots at odd offsets), else each slot rounded up to 16 elements."""
    offsets, total = [], 1 if misaligned else 0
    for n in numels:
        offsets.append(total)
        total += n + 1 if misaligned else -(-n // 16) * 16
    return offsets, total


def _flat(total, dtype, device, misaligned):
    """A buffer of `total` elements, filled with 3 (what no slot writes must keep); when
    misaligned it starts one element into its storage."""
    storage = torch.full((total + 1,), 3.0, dtype=dtype, device=device)
    return storage[1:] if misaligned else storage[:total]


def _same(a, b):
    """Bitwise equal (NaN payloads aside), with the dtype and device checked."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("scale", [0.5, 1 / 3], ids=["half", "third"])
@pytest.mark.parametrize("name", FLOATS)
def test_pack_and_unpack_equal_the_reference(device, misaligned, scale, name):
    dtype = FLOATS[name]
    sources = _sources(dtype, device, misaligned)
    sources[1] = None                                   # an unused parameter: zeros
    numels = SIZES
    offsets, total = _layout(numels, misaligned)
    flat = _flat(total, dtype, device, misaligned)
    reference = _flat(total, dtype, device, misaligned)
    _ops.pack(flat, sources, offsets, numels, scale)
    REFERENCE.pack_reference(reference, sources, offsets, numels, scale)
    assert _same(flat, reference)
    for source, offset, n in zip(sources, offsets, numels):   # and torch's own expression
        expected = torch.zeros(n, dtype=dtype, device=device) if source is None else \
            source * scale
        assert _same(flat[offset:offset + n], expected)
    if misaligned:                                      # the gaps are untouched
        gaps = [o + n for o, n in zip(offsets, numels)]
        assert bool((flat[gaps] == 3).all()) and bool((flat[0] == 3).all())

    outs = [torch.empty(n + 1, dtype=dtype, device=device)[1:] if misaligned else
            torch.empty(n, dtype=dtype, device=device) for n in numels]
    expected = [o.clone() for o in outs]
    _ops.unpack(flat, outs, offsets, scale)
    REFERENCE.unpack_reference(flat, expected, offsets, scale, False)
    for out, want, offset in zip(outs, expected, offsets):
        assert _same(out, flat[offset:offset + out.numel()] * scale)   # torch's expression
        if scale == 0.5:
            # The reference op multiplies with _foreach_mul_, which on the CPU rounds the
            # scale to bf16/fp16 first: the same only where the scale is exact there.
            assert _same(out, want)
    # Accumulating, with a power-of-two scale (a fused multiply-add and a multiply then an
    # add round the same there): out += 2 * slot.
    before = [o.clone() for o in outs]
    _ops.unpack(flat, outs, offsets, 2.0, True)
    REFERENCE.unpack_reference(flat, expected, offsets, 2.0, True)
    for out, want, old, offset in zip(outs, expected, before, offsets):
        assert _same(out, old + flat[offset:offset + out.numel()] * 2)
        if dtype == torch.float32:   # the reference op's 16-bit foreach add rounds twice
            assert _same(out, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_narrowing_onto_the_wire_and_back_equals_torch(device, wire, misaligned):
    # What compression="bf16"/"fp16" does per bucket: fp32 gradients scaled by 1/N into the
    # 16-bit wire (rounded once, after the multiplication), then widened back times N.
    dtype = FLOATS[wire]
    sources = _sources(torch.float32, device, misaligned)
    offsets, total = _layout(SIZES, misaligned)
    flat = _flat(total, dtype, device, misaligned)
    _ops.pack(flat, sources, offsets, SIZES, 1 / 3)
    for source, offset, n in zip(sources, offsets, SIZES):
        assert _same(flat[offset:offset + n], (source * (1 / 3)).to(dtype))
    outs = [torch.empty_like(s) for s in sources]
    _ops.unpack(flat, outs, offsets, 3.0)
    for out, offset, n in zip(outs, offsets, SIZES):
        assert _same(out, flat[offset:offset + n].float() * 3.0)


def _edge_values(dtype):
    """Ties, overflow to infinity, infinities, NaN, and 20,003 random bit patterns (every
    exponent), as float32."""
    info = torch.finfo(dtype)
    ties = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max,
                             -info.max, info.max * 1.01, info.tiny, *ties, 65504.0, 65520.0,
                             3.3895e38])
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (20_003,), generator=g, dtype=torch.int64)
    return torch.cat([specials, bits.to(torch.int32).view(torch.float32)])


def _narrow_and_compare(source, dtype, scale, device):
    source = source.to(device)
    flat = torch.empty(source.numel(), dtype=dtype, device=device)
    _ops.pack(flat, [source], [0], [source.numel()], scale)
    expected = (source * scale).to(dtype)
    nan = expected.isnan()
    assert torch.equal(flat.isnan(), nan)
    mismatch = (flat[~nan].view(torch.int16) != expected[~nan].view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} values differ, e.g. {source[~nan][mismatch[:5, 0]].tolist()} -> "
        f"{flat[~nan][mismatch[:5, 0]].tolist()} instead of "
        f"{expected[~nan][mismatch[:5, 0]].tolist()}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3], ids=["one", "half", "third"])
def test_narrowing_edge_values_bit_for_bit(device, wire, scale):
    # The float32 subnormals (inputs and products) are left to the next test.
    source = _edge_values(FLOATS[wire])
    tiny = torch.finfo(torch.float32).tiny
    normal = ~((source.abs() < tiny) | ((source * scale).abs() < tiny)) | (source == 0)
    _narrow_and_compare(source[normal], FLOATS[wire], scale, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 1 / 3], ids=["one", "third"])
def test_narrowing_keeps_float32_subnormals(device, scale):
    # bf16 has float32's exponent range: a gradient below 1.2e-38 is a bf16 subnormal in
    # torch's rounding, not a zero. (A kernel compiled with flush-to-zero, e.g. nvcc
    # --use_fast_math, zeroes it.)
    tiny = torch.finfo(torch.float32).tiny
    source = torch.tensor([tiny / 3, -tiny / 7, 1e-40, -1e-45, tiny * 0.999, 4 * tiny])
    _narrow_and_compare(source, torch.bfloat16, scale, device)


@pytest.mark.parametrize("device", DEVICES)
def test_the_cuda_kernels_are_registered(device):
    # On CUDA the extension must have been built with nvcc: otherwise pack/unpack fall back
    # to the generic ATen kernels silently (and the benchmarks measure those).
    key = "CUDA" if device == "cuda" else "CPU"
    for op in ("pack", "unpack"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torchstrategy::{op}", key), \
            f"torchstrategy::{op} has no {key} kernel: rebuild with nvcc matching torch's CUDA"


# -- the compression kernels on the device ----------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("n,chunk", [(1, 4), (5000, 1024), (20001, 64)])
def test_int8_quantisation_equals_the_cpu_reference(device, name, n, chunk):
    g = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=g) * 3).to(FLOATS[name])
    if n >= 2 * chunk:
        grad[chunk:2 * chunk] = 0                   # an all-zero chunk: scale 0, levels 0
    residual = torch.randn(n, generator=g) * 0.01
    q_ref, s_ref, r_ref = _quantize_reference(grad, residual.clone(), chunk)
    r = residual.to(device)
    q = torch.empty(n, dtype=torch.int8, device=device)
    s = torch.empty(-(-n // chunk), device=device)
    _ops.ef_quantize_int8(grad.to(device), r, q, s, chunk)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    torch.testing.assert_close(r.cpu(), r_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_name", ["fp32", "bf16"])
def test_dequantize_sum_equals_the_cpu_reference(device, out_name):
    g = torch.Generator().manual_seed(0)
    n, chunk, replicas = 70001, 100, 3
    q = torch.randint(-127, 128, (replicas, n), generator=g).to(torch.int8)
    scales = torch.rand(replicas, -(-n // chunk), generator=g)
    expected = torch.zeros(n)
    for r in range(replicas):                       # in replica order, in float
        expected += q[r].float() * scales[r].repeat_interleave(chunk)[:n]
    out = torch.empty(n, dtype=FLOATS[out_name], device=device)
    _ops.dequantize_sum(q.to(device), scales.to(device), out, chunk)
    assert torch.equal(out.cpu(), expected.to(FLOATS[out_name]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,cols,rank", [(1024, 768, 4), (300, 17, 1), (40, 30, 3)])
def test_powersgd_finish_equals_the_products(device, rows, cols, rank):
    g = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(rows, rank, generator=g, dtype=torch.float64)).Q
    q_local_t = basis.t() @ residual
    q_sum_t = q_local_t * 2 + torch.randn(rank, cols, generator=g, dtype=torch.float64)
    # Computed in float64 on the CPU, compared with float32 on the device.
    want_residual, want_out = residual - basis @ q_local_t, basis @ q_sum_t
    got_residual = residual.float().to(device)
    got_out = torch.empty(rows, cols, device=device)
    _ops.powersgd_finish(got_residual, basis.float().contiguous().to(device),
                         q_local_t.float().contiguous().to(device),
                         q_sum_t.float().contiguous().to(device), got_out)
    torch.testing.assert_close(got_residual.cpu().double(), want_residual, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_out.cpu().double(), want_out, rtol=0, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count,rows,cols,rank", [(1, 1024, 768, 4), (3, 300, 17, 1),
                                                  (2, 40, 30, 3)])
def test_powersgd_project_equals_the_add_and_product(device, count, rows, cols, rank):
    g = torch.Generator().manual_seed(rows)
    residual = torch.randn(count, rows, cols, generator=g, dtype=torch.float64)
    grad = torch.randn(count, rows, cols, generator=g, dtype=torch.float64)
    q_t = torch.randn(count, rank, cols, generator=g, dtype=torch.float64)
    # M in float32 on the device is the float32 sum exactly; P against float64 on the CPU.
    want_m = residual.float() + grad.float()
    want_p = torch.bmm(residual + grad, q_t.transpose(1, 2))
    got_m = residual.float().to(device)
    got_p = torch.empty(count, rows, rank, device=device)
    _ops.powersgd_project(got_m, grad.float().to(device), q_t.float().contiguous().to(device),
                          got_p)
    assert torch.equal(got_m.cpu(), want_m)
    torch.testing.assert_close(got_p.cpu().double(), want_p, rtol=1e-5, atol=1e-3)
