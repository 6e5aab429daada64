// The int8 quantiser with error feedback: the CPU kernels and the device-generic ones
// (csrc/ef_ops.h states what the ops compute). One fused pass per bucket replaces the five
// ATen passes (add, abs-max, divide-round, multiply, subtract) of the generic version.
#include "ef_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/round.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>

namespace torchstrategy {
namespace {

void check_quantize_args(const at::Tensor& grad, const at::Tensor& residual,
                         const at::Tensor& q, const at::Tensor& scales, int64_t chunk) {
  TORCH_CHECK(chunk > 0, "ef_quantize_int8: chunk must be positive, got ", chunk);
  const int64_t n = grad.numel();
  TORCH_CHECK(grad.is_floating_point(), "ef_quantize_int8: grad must be floating, got ",
              grad.scalar_type());
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.numel() == n &&
                  residual.is_contiguous(),
              "ef_quantize_int8: residual must be a contiguous float tensor of ", n,
              " elements");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.numel() == n && q.is_contiguous(),
              "ef_quantize_int8: q must be a contiguous int8 tensor of ", n, " elements");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == (n + chunk - 1) / chunk,
              "ef_quantize_int8: scales must be a contiguous float tensor of ",
              (n + chunk - 1) / chunk, " elements");
}

void check_sum_args(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out,
                    int64_t chunk) {
  TORCH_CHECK(chunk > 0, "dequantize_sum: chunk must be positive, got ", chunk);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar,
              "dequantize_sum: q must be an int8 tensor [replicas, n]");
  const int64_t n = q.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == q.size(0) && scales.size(1) == (n + chunk - 1) / chunk,
              "dequantize_sum: scales must be a float tensor [replicas, chunks]");
  TORCH_CHECK(out.numel() == n && out.is_floating_point(),
              "dequantize_sum: out must be a floating tensor of ", n, " elements");
}

}  // namespace

// Round to nearest, ties to even, as std::nearbyint does in the default rounding mode, for
// |x| < 2^22 (the levels are within +-127 here): adding and subtracting 1.5 * 2^23 leaves no
// fraction bits. Written out because std::nearbyint is a library call per element without
// SSE4.1 (the extension builds for the baseline x86-64), which kept the loop from
// vectorising: the quantiser ran at about 8 memory copies of its bytes (measured with
// scripts/bench_compression_kernels.py). The compiler may not fold it away (no fast-math).
inline float round_half_even_small(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (x + kShift) - kShift;
}

// max |x| over [begin, end): eight independent lanes, so the loop vectorises without
// reassociating a reduction (max is exact in any order). NaNs are skipped, as std::max did.
inline float abs_max(const float* x, int64_t begin, int64_t end) {
  constexpr int64_t kLanes = 8;
  float lane[kLanes] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t k = begin;
  for (; k + kLanes <= end; k += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float a = std::fabs(x[k + l]);
      lane[l] = a > lane[l] ? a : lane[l];
    }
  }
  float absmax = 0.0f;
  for (; k < end; ++k) {
    const float a = std::fabs(x[k]);
    absmax = a > absmax ? a : absmax;
  }
  for (int64_t l = 0; l < kLanes; ++l) absmax = lane[l] > absmax ? lane[l] : absmax;
  return absmax;
}

void ef_quantize_int8_cpu(const at::Tensor& grad, at::Tensor residual, at::Tensor q,
                          at::Tensor scales, int64_t chunk) {
  check_quantize_args(grad, residual, q, scales, chunk);
  const at::Tensor g = grad.contiguous();
  const int64_t n = g.numel();
  const int64_t chunks = (n + chunk - 1) / chunk;
  float* r = residual.data_ptr<float>();
  int8_t* out = q.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "ef_quantize",
                                  [&] {
    const scalar_t* in = g.const_data_ptr<scalar_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        const int64_t begin = j * chunk, end = std::min(n, begin + chunk);
        for (int64_t k = begin; k < end; ++k) {
          r[k] += static_cast<float>(in[k]);  // the residual now holds c
        }
        const float scale = abs_max(r, begin, end) / 127.0f;
        s[j] = scale;
        if (scale > 0.0f) {
          for (int64_t k = begin; k < end; ++k) {
            float level = round_half_even_small(r[k] / scale);
            // Clamped as std::max(-127, level) then std::min(127, .) did (a NaN gives -127).
            level = -127.0f < level ? level : -127.0f;
            level = level < 127.0f ? level : 127.0f;
            out[k] = static_cast<int8_t>(level);
            r[k] -= level * scale;
          }
        } else {  // an all-zero chunk (absmax 0): levels 0, the residual kept
          for (int64_t k = begin; k < end; ++k) out[k] = 0;
        }
      }
    });
  });
}

void dequantize_sum_cpu(const at::Tensor& q, const at::Tensor& scales, at::Tensor out,
                        int64_t chunk) {
  check_sum_args(q, scales, out, chunk);
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  const int64_t replicas = qc.size(0), n = qc.size(1), chunks = sc.size(1);
  // Summed straight into `out` when it can hold the float sums: a fresh buffer of the
  // bucket's size costs a page fault per page on every call, and a copy.
  const bool in_place = out.scalar_type() == at::kFloat && out.is_contiguous();
  at::Tensor total = in_place ? out : at::empty({n}, out.options().dtype(at::kFloat));
  const int8_t* in = qc.const_data_ptr<int8_t>();
  const float* s = sc.const_data_ptr<float>();
  float* t = total.data_ptr<float>();
  if (replicas == 0) total.zero_();
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int64_t begin = j * chunk, end = std::min(n, begin + chunk);
      for (int64_t rep = 0; rep < replicas; ++rep) {  // replica order: same bits everywhere
        const float scale = s[rep * chunks + j];
        const int8_t* row = in + rep * n;
        if (rep == 0) {  // 0 + x, not x: the same bits as summing onto zeros (-0 -> +0)
          for (int64_t k = begin; k < end; ++k) t[k] = 0.0f + static_cast<float>(row[k]) * scale;
        } else {
          for (int64_t k = begin; k < end; ++k) t[k] += static_cast<float>(row[k]) * scale;
        }
      }
    }
  });
  if (!in_place) out.view({n}).copy_(total);
}

void ef_quantize_int8_generic(const at::Tensor& grad, at::Tensor residual, at::Tensor q,
                              at::Tensor scales, int64_t chunk) {
  check_quantize_args(grad, residual, q, scales, chunk);
  const int64_t n = grad.numel();
  const int64_t chunks = (n + chunk - 1) / chunk;
  residual.add_(grad.reshape({n}).to(at::kFloat));
  at::Tensor padded = at::constant_pad_nd(residual, {0, chunks * chunk - n}, 0.0);
  at::Tensor absmax = padded.view({chunks, chunk}).abs().amax(1);
  // Divided by a tensor of 127s, not by the scalar: CUDA divides by a scalar as a multiply
  // by its reciprocal (one ulp off the CPU kernel's absmax / 127.0f in some chunks; found
  // on the first H100 run), while tensor by tensor division is IEEE's, as on the CPU.
  at::Tensor scale = absmax.div(at::full_like(absmax, 127.0f));
  scales.copy_(scale);
  at::Tensor per_element = scale.repeat_interleave(chunk).narrow(0, 0, n);
  at::Tensor level = at::where(per_element.gt(0), at::round(residual.div(per_element)),
                               at::zeros_like(residual))
                         .clamp(-127, 127);
  q.copy_(level);
  residual.sub_(level.mul(per_element));
}

void dequantize_sum_generic(const at::Tensor& q, const at::Tensor& scales, at::Tensor out,
                            int64_t chunk) {
  check_sum_args(q, scales, out, chunk);
  const int64_t n = q.size(1);
  at::Tensor total = at::zeros({n}, out.options().dtype(at::kFloat));
  for (int64_t rep = 0; rep < q.size(0); ++rep) {
    at::Tensor per_element = scales[rep].repeat_interleave(chunk).narrow(0, 0, n);
    total.add_(q[rep].to(at::kFloat).mul(per_element));
  }
  out.view({n}).copy_(total);
}

}  // namespace torchstrategy
