// PowerSGD's last pass over each compressed matrix, behind torch.ops.torchstrategy.
// powersgd_finish (csrc/bindings.cpp registers it; torchstrategy/_ops.py wraps it). With M
// a gradient viewed as rows x cols, after P (rows x rank, orthonormal), Q_local^T = P^T M
// and the all-reduced Q^T (both rank x cols) are known:
//
//   powersgd_finish(residual [rows, cols] float, p, q_local_t, q_t, out [rows, cols]):
//       residual = residual - p @ q_local_t   (what this replica's own term missed)
//       out = p @ q_t                         (P Q^T, the approximation of the sum)
//
//   powersgd_finish_batched(residual [count, rows, cols] float, p, q_local_t, q_t,
//                           out [count, rows, cols]):
//       the same for each of `count` matrices of one shape (PowerSGD's run of same-shaped
//       matrices, kept back to back): every matrix gets the bits powersgd_finish gives it
//       alone, in one call instead of one per matrix.
//
// The CPU kernel does both in one pass, parallel over rows, in loops compiled per CPU level
// (as float_narrow.h), for ranks 1, 2, 4 and 8; every element's terms are added in the same
// order whatever the thread count or CPU level, so replicas compute the same bits. The
// generic kernel (any device, other ranks and dtypes, and the _reference op of the tests)
// is two ATen products; its batched form is two batched ones (baddbmm_, bmm) on devices
// other than the CPU, and the per-matrix generic kernel in turn on the CPU (ranks or dtypes
// without a fused loop: the bits of a call per matrix).
//
// PowerSGD's first pass, for a run of `count` matrices of one shape:
//
//   powersgd_project(residual [count, rows, cols] float, grad [count, rows, cols],
//                    q_t [count, rank, cols] float, p [count, rows, rank] float):
//       residual = residual + grad            (M, built in the residual's buffer)
//       p = residual @ q_t^T                  (P = M Q)
//
// The CPU kernel (float gradients, ranks 1, 2, 4 and 8) makes both in one sweep over M,
// parallel over the rows of every matrix together: ATen's add_ then a rank-4 product reads
// M twice, and BLAS runs such a thin product far below memory speed on a batch of
// mid-size matrices (3 copies' time for 16 matrices of 1024 x 1024, against 1 for the add).
// Each row's products are summed in 16 lanes, then the lanes in order: the same bits
// whatever the thread count, and for a matrix alone or in a run. The generic kernel is
// add_ and bmm.
#pragma once

#include <ATen/core/Tensor.h>

namespace torchstrategy {

void powersgd_finish_cpu(at::Tensor residual, const at::Tensor& p,
                         const at::Tensor& q_local_t, const at::Tensor& q_t, at::Tensor out);
void powersgd_finish_generic(at::Tensor residual, const at::Tensor& p,
                             const at::Tensor& q_local_t, const at::Tensor& q_t,
                             at::Tensor out);
void powersgd_finish_batched_cpu(at::Tensor residual, const at::Tensor& p,
                                 const at::Tensor& q_local_t, const at::Tensor& q_t,
                                 at::Tensor out);
void powersgd_finish_batched_generic(at::Tensor residual, const at::Tensor& p,
                                     const at::Tensor& q_local_t, const at::Tensor& q_t,
                                     at::Tensor out);
void powersgd_project_cpu(at::Tensor residual, const at::Tensor& grad, const at::Tensor& q_t,
                          at::Tensor p);
void powersgd_project_generic(at::Tensor residual, const at::Tensor& grad,
                              const at::Tensor& q_t, at::Tensor p);

}  // namespace torchstrategy
