// The int8 quantiser with error feedback behind torch.ops.torchstrategy.ef_quantize_int8 /
// dequantize_sum (csrc/bindings.cpp registers them; torchstrategy/_ops.py wraps them):
//
//   ef_quantize_int8(grad, residual, q, scales, chunk):
//       c = float(grad) + residual                      (the error-compensated gradient)
//       per chunk j of `chunk` elements: scales[j] = max|c| / 127
//       q = round_half_even(c / scales[j]) (0 where scales[j] == 0), in [-127, 127]
//       residual = c - q * scales[j]                    (what was not sent, kept)
//   dequantize_sum(q [N, n] int8, scales [N, chunks] float, out [n], chunk):
//       out = sum over r = 0..N-1, in that order, of q[r] * scales[r] (summed in float,
//       then cast to out's dtype): the same bits on every replica.
#pragma once

#include <ATen/core/Tensor.h>

namespace torchstrategy {

// CPU: at::parallel_for over chunks (csrc/ef_ops.cpp).
void ef_quantize_int8_cpu(const at::Tensor& grad, at::Tensor residual, at::Tensor q,
                          at::Tensor scales, int64_t chunk);
void dequantize_sum_cpu(const at::Tensor& q, const at::Tensor& scales, at::Tensor out,
                        int64_t chunk);

// Any device (CUDA included), from ATen ops; also the *_reference ops of the tests.
void ef_quantize_int8_generic(const at::Tensor& grad, at::Tensor residual, at::Tensor q,
                              at::Tensor scales, int64_t chunk);
void dequantize_sum_generic(const at::Tensor& q, const at::Tensor& scales, at::Tensor out,
                            int64_t chunk);

}  // namespace torchstrategy
