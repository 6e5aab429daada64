"""The fused pack/unpack kernels of torchstrategy._C against a plain-torch reference."""
import shutil
import subprocess
import sys

import pytest
import torch

from torchstrategy import _C, _ops

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
OPS = {"cpu-kernel": (torch.ops.torchstrategy.pack, torch.ops.torchstrategy.unpack),
       "generic": (torch.ops.torchstrategy.pack_reference,
                   torch.ops.torchstrategy.unpack_reference)}


def _tensors(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (2, 5), (70000,), (1,), (4, 4, 4)]  # one above the 64K chunk size
    out = []
    for shape in shapes:
        t = torch.randint(-50, 50, shape, generator=g).to(dtype)
        out.append(t.to(device))
    return out


def _layout(tensors):
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    return offsets, [t.numel() for t in tensors], total


@pytest.mark.parametrize("which", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_then_unpack_round_trips_with_scale_and_holes(which, dtype):
    pack, unpack = OPS[which]
    tensors = _tensors(dtype)
    offsets, numels, total = _layout(tensors)
    flat = torch.full((total + 3,), 7, dtype=dtype)
    sources = list(tensors)
    sources[1] = None                                   # an unused parameter packs zeros
    scale = 1.0 if dtype == torch.int64 else 0.5
    pack(flat, sources, offsets, numels, scale)
    expected = torch.cat([torch.zeros(10, dtype=dtype) if s is None else s.reshape(-1) * scale
                          for s in sources])
    assert torch.equal(flat[:total], expected.to(dtype))
    assert torch.equal(flat[total:], torch.full((3,), 7, dtype=dtype))  # nothing past the end
    outs = [torch.empty_like(t) for t in tensors]
    unpack(flat, outs, offsets, 1.0 if dtype == torch.int64 else 2.0, False)
    for src, out in zip(sources, outs):
        assert torch.equal(out, torch.zeros_like(out) if src is None else src)
    unpack(flat, outs, offsets, 1.0, True)             # accumulate
    for src, out in zip(sources, outs):
        if src is not None:
            assert torch.equal(out, src + (src * scale).to(dtype))


@pytest.mark.parametrize("which", OPS)
def test_strided_sources_and_other_dtypes_are_converted(which):
    pack, unpack = OPS[which]
    source = torch.arange(12.0).reshape(3, 4).t()      # not contiguous
    half = torch.tensor([1.5, 2.5], dtype=torch.float16)
    flat = torch.zeros(14)
    pack(flat, [source, half], [0, 12], [12, 2], 1.0)
    assert torch.equal(flat[:12], source.reshape(-1))
    assert torch.equal(flat[12:], torch.tensor([1.5, 2.5]))
    target = torch.zeros(2, 6, dtype=torch.float64).t()  # strided, another dtype
    unpack(flat, [target], [0], 1.0, False)
    assert torch.equal(target, flat[:12].view(6, 2).double())


def test_bad_layouts_are_refused_with_a_clear_error():
    # The numbers are part of the check: an extension carrying a private copy of the C++
    # runtime (linked with -static-libstdc++) formatted them as nothing, or crashed here.
    with pytest.raises(RuntimeError, match=r"tensor 0 \(5 elements at offset 0\) does not fit "
                                           r"in a buffer of 4 elements"):
        _ops.pack(torch.zeros(4), [torch.ones(5)], [0], [5])
    with pytest.raises(RuntimeError, match="tensor 0 has 3 elements but its slot has 2"):
        _ops.pack(torch.zeros(4), [torch.ones(3)], [0], [2])


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="reads the extension's ELF dynamic section with readelf (Linux)")
def test_extension_uses_the_shared_cpp_runtime_that_torch_uses():
    # setup.py links libstdc++ by its soname: a compiler that adds -static-libstdc++ on its
    # own would otherwise give the extension a second C++ runtime beside torch's.
    dynamic = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert "[libstdc++.so.6]" in dynamic, dynamic


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_use_the_generic_path():
    tensors = _tensors(torch.float32, "cuda")
    offsets, numels, total = _layout(tensors)
    flat = torch.empty(total, device="cuda")
    _ops.pack(flat, tensors, offsets, numels, 2.0)
    outs = [torch.empty_like(t) for t in tensors]
    _ops.unpack(flat, outs, offsets, 0.5)
    for t, o in zip(tensors, outs):
        assert torch.equal(t, o)


# -- compression: the fused cast-and-scale of the gradient reducer's wire buffers -----------
WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("which", OPS)
@pytest.mark.parametrize("wire", WIRE)
@pytest.mark.parametrize("source", [torch.float32, torch.float64])
def test_pack_into_a_narrower_dtype_rounds_once_after_scaling(which, wire, source):
    pack, unpack = OPS[which]
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g, dtype=source) * 10 for n in (5, 70001, 33)]
    offsets, numels, total = _layout(tensors)
    flat = torch.empty(total, dtype=WIRE[wire])
    pack(flat, tensors, offsets, numels, 0.5)
    expected = torch.cat([t * 0.5 for t in tensors]).to(WIRE[wire])
    if source == torch.float32:
        assert torch.equal(flat, expected)          # fp32 -> wire: exactly torch's rounding
    else:                                           # fp64 -> wire may round via fp32
        torch.testing.assert_close(flat.double(), expected.double(), rtol=2 ** -7, atol=0)
    # Back off the wire, scaled: within the wire dtype's rounding of the original.
    outs = [torch.empty_like(t) for t in tensors]
    unpack(flat, outs, offsets, 2.0, False)
    eps = torch.finfo(WIRE[wire]).eps
    for i, (t, out) in enumerate(zip(tensors, outs)):
        assert out.dtype == source
        assert torch.equal(out, flat[offsets[i]:offsets[i] + t.numel()].to(source) * 2)
        assert bool(((out - t).abs() <= eps * t.abs()).all())


@pytest.mark.parametrize("wire", WIRE)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_narrowing_matches_torch_bit_for_bit_on_edge_values(wire, scale):
    # The CPU kernel narrows in loops compiled per CPU level (csrc/float_narrow.cpp): ties,
    # subnormals, overflow to infinity, infinities and NaN round exactly as torch's .to().
    dtype = WIRE[wire]
    info = torch.finfo(dtype)
    ulp_tie = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), info.max, -info.max,
                             info.max * 1.01, info.tiny, info.tiny / 3, 1e-40, -1e-45,
                             *ulp_tie, 65504.0, 65520.0, 3.3895e38])
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (100_003,), generator=g, dtype=torch.int64)
    random = bits.to(torch.int32).view(torch.float32)   # every exponent, NaNs included
    source = torch.cat([specials, random])
    flat = torch.empty(source.numel(), dtype=dtype)
    _ops.pack(flat, [source], [0], [source.numel()], scale)
    expected = (source * scale).to(dtype)
    nan = expected.isnan()
    assert torch.equal(flat.isnan(), nan)
    assert torch.equal(flat[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("which", OPS)
def test_unpack_from_the_wire_accumulates_in_the_target_dtype(which):
    pack, unpack = OPS[which]
    wire = torch.tensor([1.5, -2.0, 0.25, 4.0], dtype=torch.bfloat16)
    target = torch.ones(4)
    unpack(wire, [target], [0], 2.0, True)
    assert torch.equal(target, torch.tensor([4.0, -3.0, 1.5, 9.0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_packs_many_tensors_with_scale_and_compression(wire):
    g = torch.Generator().manual_seed(2)
    sizes = [1, 3, 4, 1000, 16384 * 3 + 5, 7]                 # unaligned tails, many chunks
    tensors = [torch.randn(n, generator=g).cuda() for n in sizes]
    offsets, total = [], 0
    for t in tensors:                                         # 16-byte aligned slots
        offsets.append(total)
        total += -(-t.numel() // 8) * 8
    flat = torch.full((total,), 3.0, device="cuda", dtype=wire)
    sources = list(tensors)
    sources[1] = None
    _ops.pack(flat, sources, offsets, [t.numel() for t in tensors], 0.25)
    for i, t in enumerate(tensors):
        got = flat[offsets[i]:offsets[i] + t.numel()]
        want = torch.zeros_like(t) if sources[i] is None else t * 0.25
        assert torch.equal(got, want.to(wire))
    outs = [torch.zeros_like(t) for t in tensors]
    _ops.unpack(flat, outs, offsets, 4.0, True)
    for i, (t, out) in enumerate(zip(tensors, outs)):
        want = flat[offsets[i]:offsets[i] + t.numel()].float() * 4.0
        assert torch.equal(out, want)
