"""The fused pack/unpack kernels of torchstrategy._C against a plain-torch reference."""
import pytest
import torch

from torchstrategy import _ops

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
    with pytest.raises(RuntimeError, match="does not fit"):
        _ops.pack(torch.zeros(4), [torch.ones(5)], [0], [5])
    with pytest.raises(RuntimeError, match="has 3 elements but its slot has 2"):
        _ops.pack(torch.zeros(4), [torch.ones(3)], [0], [2])


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
