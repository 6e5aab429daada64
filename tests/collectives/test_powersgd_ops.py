"""PowerSGD's fused CPU kernel (csrc/powersgd_ops.cpp) against the ATen products it
replaces, and its determinism: the same bits whatever the thread count."""
import pytest
import torch

from torchstrategy import _ops

OPS = torch.ops.torchstrategy


def _problem(rows, cols, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(rows, cols, generator=g)
    basis = torch.linalg.qr(torch.randn(rows, rank, generator=g)).Q.contiguous()
    q_local_t = basis.t() @ residual
    q_sum_t = q_local_t * 2 + torch.randn(rank, cols, generator=g)
    return residual, basis, q_local_t, q_sum_t


@pytest.mark.parametrize("rows,cols,rank", [(64, 4608 + 5, 4), (300, 17, 1), (9, 33, 8),
                                            (2048, 512, 2), (40, 30, 3), (12, 50, 9)])
def test_finish_equals_the_aten_products(rows, cols, rank):
    # Ranks 1, 2, 4, 8 take the fused loops; 3 and 9 the generic path.
    residual, basis, q_local_t, q_sum_t = _problem(rows, cols, rank)
    fused, reference = residual.clone(), residual.clone()
    out, out_ref = torch.empty(rows, cols), torch.empty(rows, cols)
    _ops.powersgd_finish(fused, basis, q_local_t, q_sum_t, out)
    OPS.powersgd_finish_reference(reference, basis, q_local_t, q_sum_t, out_ref)
    torch.testing.assert_close(fused, residual - basis @ q_local_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, basis @ q_sum_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


def test_a_reduced_precision_bucket_gets_the_product_rounded_once():
    residual, basis, q_local_t, q_sum_t = _problem(40, 24, 4)
    out = torch.empty(40, 24, dtype=torch.bfloat16)
    _ops.powersgd_finish(residual.clone(), basis, q_local_t, q_sum_t, out)
    assert torch.equal(out, (basis @ q_sum_t).to(torch.bfloat16))


def test_the_same_bits_with_one_thread_or_several():
    residual, basis, q_local_t, q_sum_t = _problem(4096, 96, 4, seed=1)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            res, out = residual.clone(), torch.empty(4096, 96)
            _ops.powersgd_finish(res, basis, q_local_t, q_sum_t, out)
            results.append((res, out))
    finally:
        torch.set_num_threads(before)
    for res, out in results[1:]:
        assert torch.equal(res, results[0][0]) and torch.equal(out, results[0][1])


def test_shapes_that_do_not_fit_are_refused_by_name():
    residual, basis, q_local_t, q_sum_t = _problem(8, 6, 2)
    out = torch.empty(8, 6)
    with pytest.raises(RuntimeError, match="p must be 8 x 2"):
        _ops.powersgd_finish(residual, torch.empty(8, 3), q_local_t, q_sum_t, out)
    with pytest.raises(RuntimeError, match="q_t must be 2 x 6"):
        _ops.powersgd_finish(residual, basis, q_local_t, torch.empty(2, 5), out)
    with pytest.raises(RuntimeError, match="out must be 8 x 6"):
        _ops.powersgd_finish(residual, basis, q_local_t, q_sum_t, torch.empty(6, 8))
    with pytest.raises(RuntimeError, match="residual must be a contiguous float matrix"):
        _ops.powersgd_finish(residual.double(), basis, q_local_t, q_sum_t, out)
