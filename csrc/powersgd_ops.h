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
// without a fused loop: the bits of a call per matrix). (The first pass, M = residual +
// grad and P = M Q, stays ATen's: add_ and a BLAS product, bmm for a run of matrices, run
// near memory speed for large matrices once Q is stored rank-major.)
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

}  // namespace torchstrategy
