// 1-bit Adam's compression kernels (torchstrategy/collectives/onebit.py states the
// algorithm). Each runs block by block: a block (block_size floats, 8 KiB by default)
// stays in the core's cache between the passes over it, so each kernel reads and writes
// each array from memory once.
//
//   onebit_compress(error, exp_avg, grad, momentum_weight, grad_weight, bits, scales, block)
//     x = error + momentum_weight * exp_avg + grad_weight * grad   (grad: 0 past its end)
//     scales[j] = mean |x| over block j; bit k of bits[i] = x[8 i + k] >= 0;
//     error = x - scale * sign (in place).
//   onebit_decompress(bits [R, n/8], scales [R, n/block], exp_avg, inverse_denominator,
//                     step_scale, out, block)
//     exp_avg = sum over rows r, in order, of scales[r] * sign_r;
//     out[k] = exp_avg[k] * inverse_denominator[k] * step_scale for k < out.numel().
//
// Registered here with TORCH_LIBRARY_FRAGMENT (CPU kernels only; other devices run the
// same arithmetic as ATen operations in onebit.py).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace torchstrategy {
namespace {

// values[byte][b]: +1 where bit b of byte is set, else -1. Eight contiguous floats a byte,
// so applying or summing signs runs as vector multiply-adds instead of a branch per bit.
struct SignTable {
  float values[256][8];
  SignTable() {
    for (int byte = 0; byte < 256; ++byte)
      for (int b = 0; b < 8; ++b) values[byte][b] = ((byte >> b) & 1) ? 1.0f : -1.0f;
  }
};

const SignTable& sign_table() {
  static const SignTable table;   // built once, read-only afterwards
  return table;
}

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              op, ": ", name, " must be a contiguous float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
}

void onebit_compress_cpu(at::Tensor error, const at::Tensor& exp_avg,
                         const at::Tensor& grad, double momentum_weight,
                         double grad_weight, at::Tensor bits, at::Tensor scales,
                         int64_t block) {
  const char* op = "onebit_compress";
  check_float(error, op, "error");
  check_float(exp_avg, op, "exp_avg");
  check_float(scales, op, "scales");
  const int64_t n = error.numel();
  TORCH_CHECK(block > 0 && block % 8 == 0 && n % block == 0, op,
              ": block must be a positive multiple of 8 dividing error's ", n,
              " elements, got ", block);
  TORCH_CHECK(exp_avg.numel() == n, op, ": exp_avg must have ", n, " elements");
  TORCH_CHECK(grad.is_floating_point() && grad.device().is_cpu() && grad.numel() <= n,
              op, ": grad must be a floating CPU tensor of at most ", n, " elements");
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.is_contiguous() &&
                  bits.numel() == n / 8,
              op, ": bits must be a contiguous uint8 tensor of ", n / 8, " elements");
  TORCH_CHECK(scales.numel() == n / block, op, ": scales must have ", n / block,
              " elements");
  const at::Tensor g = grad.contiguous();
  const int64_t size = g.numel();
  float* e = error.data_ptr<float>();
  const float* m = exp_avg.const_data_ptr<float>();
  uint8_t* out = bits.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  const float wm = static_cast<float>(momentum_weight);
  const float wg = static_cast<float>(grad_weight);
  const SignTable& sign_of = sign_table();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "onebit_compress",
                                  [&] {
    const scalar_t* in = g.const_data_ptr<scalar_t>();
    at::parallel_for(0, n / block, 1, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        const int64_t begin = j * block, end = begin + block;
        const int64_t live = std::max(begin, std::min(end, size));
        // Eight partial sums, one per lane: independent additions the compiler can run
        // as one vector (a single running sum would serialise the block).
        float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        int64_t k = begin;
        for (; k + 8 <= live; k += 8) {
          for (int b = 0; b < 8; ++b) {
            const float x = e[k + b] + wm * m[k + b] + wg * static_cast<float>(in[k + b]);
            e[k + b] = x;
            part[b] += std::fabs(x);
          }
        }
        for (; k < end; ++k) {   // the gradient's last elements, then the padding
          const float gk = k < live ? static_cast<float>(in[k]) : 0.0f;
          const float x = e[k] + wm * m[k] + wg * gk;
          e[k] = x;
          part[k & 7] += std::fabs(x);
        }
        float total = 0.0f;
        for (int b = 0; b < 8; ++b) total += part[b];
        const float scale = total / static_cast<float>(block);
        s[j] = scale;
        for (int64_t k8 = begin; k8 < end; k8 += 8) {
          float* ek = e + k8;
          uint8_t byte = 0;
          for (int b = 0; b < 8; ++b) byte |= static_cast<uint8_t>(ek[b] >= 0.0f) << b;
          const float* sign = sign_of.values[byte];
          for (int b = 0; b < 8; ++b) ek[b] -= scale * sign[b];
          out[k8 / 8] = byte;
        }
      }
    });
  });
}

void onebit_decompress_cpu(const at::Tensor& bits, const at::Tensor& scales,
                           at::Tensor exp_avg, const at::Tensor& inverse_denominator,
                           double step_scale, at::Tensor out, int64_t block) {
  const char* op = "onebit_decompress";
  check_float(exp_avg, op, "exp_avg");
  check_float(inverse_denominator, op, "inverse_denominator");
  const int64_t n = exp_avg.numel();
  TORCH_CHECK(block > 0 && block % 8 == 0 && n % block == 0, op,
              ": block must be a positive multiple of 8 dividing exp_avg's ", n,
              " elements, got ", block);
  TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == at::kByte && bits.size(1) == n / 8,
              op, ": bits must be a uint8 tensor [replicas, ", n / 8, "]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == bits.size(0) && scales.size(1) == n / block,
              op, ": scales must be a float32 tensor [replicas, ", n / block, "]");
  TORCH_CHECK(inverse_denominator.numel() == n, op, ": inverse_denominator must have ", n,
              " elements");
  TORCH_CHECK(out.is_floating_point() && out.device().is_cpu() && out.is_contiguous() &&
                  out.numel() <= n,
              op, ": out must be a contiguous floating CPU tensor of at most ", n,
              " elements");
  const at::Tensor bc = bits.contiguous();
  const at::Tensor sc = scales.contiguous();
  const int64_t replicas = bc.size(0), blocks = n / block, size = out.numel();
  const uint8_t* in = bc.const_data_ptr<uint8_t>();
  const float* s = sc.const_data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  const float* inv = inverse_denominator.const_data_ptr<float>();
  const float step = static_cast<float>(step_scale);
  const SignTable& sign_of = sign_table();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(),
                                  "onebit_decompress", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        const int64_t begin = j * block, end = begin + block;
        for (int64_t k = begin; k < end; ++k) m[k] = 0.0f;
        for (int64_t r = 0; r < replicas; ++r) {   // replica order: the same bits everywhere
          const float scale = s[r * blocks + j];
          const uint8_t* row = in + r * (n / 8);
          for (int64_t k = begin; k < end; k += 8) {
            const float* sign = sign_of.values[row[k / 8]];
            float* mk = m + k;
            for (int b = 0; b < 8; ++b) mk[b] += scale * sign[b];
          }
        }
        const int64_t live = std::min(end, size);
        for (int64_t k = begin; k < live; ++k)
          o[k] = static_cast<scalar_t>(m[k] * inv[k] * step);
      }
    });
  });
}

}  // namespace
}  // namespace torchstrategy

TORCH_LIBRARY_FRAGMENT(torchstrategy, m) {
  m.def("onebit_compress(Tensor(a!) error, Tensor exp_avg, Tensor grad, "
        "float momentum_weight, float grad_weight, Tensor(b!) bits, Tensor(c!) scales, "
        "int block) -> ()");
  m.def("onebit_decompress(Tensor bits, Tensor scales, Tensor(a!) exp_avg, "
        "Tensor inverse_denominator, float step_scale, Tensor(b!) out, int block) -> ()");
}

TORCH_LIBRARY_IMPL(torchstrategy, CPU, m) {
  m.impl("onebit_compress", &torchstrategy::onebit_compress_cpu);
  m.impl("onebit_decompress", &torchstrategy::onebit_decompress_cpu);
}
