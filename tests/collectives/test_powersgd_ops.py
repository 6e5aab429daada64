"""PowerSGD's fused CPU kernels (csrc/powersgd_ops.cpp) against the ATen operations they
replace, and their determinism: the same bits whatever the thread count."""
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


def _projection(count, rows, cols, rank, grad_dtype=torch.float32, seed=2):
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(count, rows, cols, generator=g)
    grad = torch.randn(count, rows, cols, generator=g).to(grad_dtype)
    q_t = torch.randn(count, rank, cols, generator=g)
    return residual, grad, q_t


@pytest.mark.parametrize("count,rows,cols,rank", [(1, 64, 4608 + 5, 4), (3, 300, 17, 1),
                                                  (16, 9, 33, 8), (2, 2048, 512, 2),
                                                  (4, 40, 30, 3), (1, 12, 7, 4)])
def test_projection_equals_add_then_the_aten_product(count, rows, cols, rank):
    # Ranks 1, 2, 4, 8 take the fused loop (columns past the last 16 included); 3 the
    # generic path. M is the same bits as ATen's add (one addition per element).
    residual, grad, q_t = _projection(count, rows, cols, rank)
    fused, reference = residual.clone(), residual.clone()
    p, p_ref = torch.empty(count, rows, rank), torch.empty(count, rows, rank)
    _ops.powersgd_project(fused, grad, q_t, p)
    OPS.powersgd_project_reference(reference, grad, q_t, p_ref)
    m = residual + grad
    assert torch.equal(fused, m) and torch.equal(reference, m)
    torch.testing.assert_close(p, torch.bmm(m, q_t.transpose(1, 2)), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-4)


def test_projection_of_a_reduced_precision_gradient_adds_it_in_float():
    residual, grad, q_t = _projection(2, 40, 24, 4, grad_dtype=torch.bfloat16)
    fused, p = residual.clone(), torch.empty(2, 40, 4)
    _ops.powersgd_project(fused, grad, q_t, p)
    assert torch.equal(fused, residual + grad.float())
    torch.testing.assert_close(p, torch.bmm(fused, q_t.transpose(1, 2)), rtol=1e-5, atol=1e-4)


def test_projection_gives_the_same_bits_alone_in_a_run_and_with_any_thread_count():
    residual, grad, q_t = _projection(6, 700, 96, 4, seed=3)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            res, p = residual.clone(), torch.empty(6, 700, 4)
            _ops.powersgd_project(res, grad, q_t, p)
            results.append((res, p))
    finally:
        torch.set_num_threads(before)
    for res, p in results[1:]:
        assert torch.equal(res, results[0][0]) and torch.equal(p, results[0][1])
    for b in range(6):   # each matrix alone: the bits it got in the run
        res, p = residual[b:b + 1].clone(), torch.empty(1, 700, 4)
        _ops.powersgd_project(res, grad[b:b + 1], q_t[b:b + 1], p)
        assert torch.equal(p[0], results[0][1][b]), b


def test_projection_shapes_that_do_not_fit_are_refused_by_name():
    residual, grad, q_t = _projection(2, 8, 6, 2)
    with pytest.raises(RuntimeError, match="p must be 2 x 8 x 2"):
        _ops.powersgd_project(residual, grad, q_t, torch.empty(2, 8, 3))
    with pytest.raises(RuntimeError, match="grad must be 2 x 8 x 6"):
        _ops.powersgd_project(residual, grad[:, :7], q_t, torch.empty(2, 8, 2))
    with pytest.raises(RuntimeError, match="q_t must be 2 x 2 x 6"):
        _ops.powersgd_project(residual, grad, q_t[:, :, :5], torch.empty(2, 8, 2))
    with pytest.raises(RuntimeError, match="residual must be a contiguous float tensor"):
        _ops.powersgd_project(residual.double(), grad, q_t, torch.empty(2, 8, 2))
