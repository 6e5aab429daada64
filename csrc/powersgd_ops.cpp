// PowerSGD's last pass over each matrix: the fused CPU kernel and the generic one
// (csrc/powersgd_ops.h states what they compute). Against ATen's two products (addmm_ into
// the residual, mm into the bucket), one sweep: measured 1.01 against 1.48 ms for a
// 512 x 4608 matrix, 18 against 55 ms for GPT-2's 50257 x 768 embedding, one thread.
#include "powersgd_ops.h"

#include "cpu_levels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>

namespace torchstrategy {
namespace {

#define TORCHSTRATEGY_INLINE inline __attribute__((always_inline))

// Rows [lo, hi) of both outputs in one sweep: residual -= p[i] q_local_t, out = p[i] q_t,
// the R terms added in order r = 0..R-1. R is a constant, so p's row stays in registers and
// the column loop vectorises.
template <int R>
TORCHSTRATEGY_INLINE void finish_rows_of_rank(float* __restrict residual,
                                              const float* __restrict p,
                                              const float* __restrict q_local_t,
                                              const float* __restrict q_t,
                                              float* __restrict out, int64_t lo, int64_t hi,
                                              int64_t cols) {
  for (int64_t i = lo; i < hi; ++i) {
    float* __restrict res = residual + i * cols;
    float* __restrict o = out + i * cols;
    float pi[R];
    for (int r = 0; r < R; ++r) pi[r] = p[i * R + r];
    for (int64_t j = 0; j < cols; ++j) {
      float d = res[j];
      float s = 0.f;
      for (int r = 0; r < R; ++r) {
        d -= pi[r] * q_local_t[r * cols + j];
        s += pi[r] * q_t[r * cols + j];
      }
      res[j] = d;
      o[j] = s;
    }
  }
}

// Rows [lo, hi) of one matrix: m = residual[i] + grad[i], kept in the residual, and
// p[i] = m q_t^T. Each of the R products is summed in kLanes partial sums (column j goes to
// lane j % kLanes), which the compiler keeps in vector registers, then the lanes in order
// and the columns past the last full group of lanes: a fixed order, whatever the threads.
constexpr int kLanes = 16;

template <int R>
TORCHSTRATEGY_INLINE void project_rows_of_rank(float* __restrict residual,
                                               const float* __restrict grad,
                                               const float* __restrict q_t,
                                               float* __restrict p, int64_t lo, int64_t hi,
                                               int64_t cols) {
  for (int64_t i = lo; i < hi; ++i) {
    float* __restrict res = residual + i * cols;
    const float* __restrict g = grad + i * cols;
    float lanes[R][kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= cols; j += kLanes) {
      float m[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        m[l] = res[j + l] + g[j + l];
        res[j + l] = m[l];
      }
      for (int r = 0; r < R; ++r) {
        const float* __restrict q = q_t + r * cols + j;
        for (int l = 0; l < kLanes; ++l) lanes[r][l] += m[l] * q[l];
      }
    }
    float rest[R] = {};
    for (; j < cols; ++j) {
      const float m = res[j] + g[j];
      res[j] = m;
      for (int r = 0; r < R; ++r) rest[r] += m * q_t[r * cols + j];
    }
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int l = 0; l < kLanes; ++l) sum += lanes[r][l];
      p[i * R + r] = sum + rest[r];
    }
  }
}

// The ranks with a fused kernel; others take the generic one.
bool has_fused_rank(int64_t rank) { return rank == 1 || rank == 2 || rank == 4 || rank == 8; }

TORCHSTRATEGY_CLONES
void finish_rows(float* residual, const float* p, const float* q_local_t, const float* q_t,
                 float* out, int64_t lo, int64_t hi, int64_t cols, int64_t rank) {
  switch (rank) {
    case 1: finish_rows_of_rank<1>(residual, p, q_local_t, q_t, out, lo, hi, cols); break;
    case 2: finish_rows_of_rank<2>(residual, p, q_local_t, q_t, out, lo, hi, cols); break;
    case 4: finish_rows_of_rank<4>(residual, p, q_local_t, q_t, out, lo, hi, cols); break;
    case 8: finish_rows_of_rank<8>(residual, p, q_local_t, q_t, out, lo, hi, cols); break;
    default: break;  // excluded by has_fused_rank
  }
}

TORCHSTRATEGY_CLONES
void project_rows(float* residual, const float* grad, const float* q_t, float* p, int64_t lo,
                  int64_t hi, int64_t cols, int64_t rank) {
  switch (rank) {
    case 1: project_rows_of_rank<1>(residual, grad, q_t, p, lo, hi, cols); break;
    case 2: project_rows_of_rank<2>(residual, grad, q_t, p, lo, hi, cols); break;
    case 4: project_rows_of_rank<4>(residual, grad, q_t, p, lo, hi, cols); break;
    case 8: project_rows_of_rank<8>(residual, grad, q_t, p, lo, hi, cols); break;
    default: break;  // excluded by has_fused_rank
  }
}

bool is_float_matrix(const at::Tensor& t, int64_t rows, int64_t cols) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 2 &&
         t.size(0) == rows && t.size(1) == cols && t.is_contiguous();
}

void check_matrix(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "powersgd: ", name,
              " must be ", rows, " x ", cols, ", got ", t.sizes());
}

void check_args(const at::Tensor& residual, const at::Tensor& p, const at::Tensor& q_t) {
  TORCH_CHECK(residual.dim() == 2 && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "powersgd: the residual must be a contiguous float matrix");
  check_matrix(p, "p", residual.size(0), q_t.size(0));
  check_matrix(q_t, "q_t", q_t.size(0), residual.size(1));
}

void check_batch(const at::Tensor& t, const char* name, int64_t count, int64_t rows,
                 int64_t cols) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == count && t.size(1) == rows && t.size(2) == cols,
              "powersgd: ", name, " must be ", count, " x ", rows, " x ", cols, ", got ",
              t.sizes());
}

void check_batch_args(const at::Tensor& residual, const at::Tensor& p,
                      const at::Tensor& q_local_t, const at::Tensor& q_t,
                      const at::Tensor& out) {
  TORCH_CHECK(residual.dim() == 3 && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "powersgd: the batched residual must be a contiguous float tensor of "
              "count x rows x cols");
  const int64_t count = residual.size(0), rows = residual.size(1), cols = residual.size(2);
  TORCH_CHECK(q_t.dim() == 3, "powersgd: q_t must be count x rank x cols, got ", q_t.sizes());
  const int64_t rank = q_t.size(1);
  check_batch(p, "p", count, rows, rank);
  check_batch(q_local_t, "q_local_t", count, rank, cols);
  check_batch(q_t, "q_t", count, rank, cols);
  check_batch(out, "out", count, rows, cols);
}

void check_project_args(const at::Tensor& residual, const at::Tensor& grad,
                        const at::Tensor& q_t, const at::Tensor& p) {
  TORCH_CHECK(residual.dim() == 3 && residual.scalar_type() == at::kFloat &&
                  residual.is_contiguous(),
              "powersgd: the residual must be a contiguous float tensor of "
              "count x rows x cols, got ", residual.sizes());
  const int64_t count = residual.size(0), rows = residual.size(1), cols = residual.size(2);
  TORCH_CHECK(q_t.dim() == 3, "powersgd: q_t must be count x rank x cols, got ", q_t.sizes());
  const int64_t rank = q_t.size(1);
  check_batch(grad, "grad", count, rows, cols);
  check_batch(q_t, "q_t", count, rank, cols);
  check_batch(p, "p", count, rows, rank);
  TORCH_CHECK(p.scalar_type() == at::kFloat, "powersgd: p must be float, got ",
              p.scalar_type());
}

bool is_float_batch(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous();
}

// Rows per task: about 64K elements, so a large matrix spreads over every thread.
int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1));
}

// Calls `rows_of(b, lo, hi)` for rows [lo, hi) of matrix b, over the rows of all `count`
// matrices together, in parallel (many small matrices still fill every thread); a task's
// rows are cut at the matrices' borders.
template <typename RowsOf>
void parallel_over_rows(int64_t count, int64_t rows, int64_t cols, const RowsOf& rows_of) {
  at::parallel_for(0, count * rows, grain_rows(cols), [&](int64_t lo, int64_t hi) {
    while (lo < hi) {
      const int64_t b = lo / rows;
      const int64_t end = std::min(hi, (b + 1) * rows);
      rows_of(b, lo - b * rows, end - b * rows);
      lo = end;
    }
  });
}

}  // namespace

void powersgd_finish_generic(at::Tensor residual, const at::Tensor& p,
                             const at::Tensor& q_local_t, const at::Tensor& q_t,
                             at::Tensor out) {
  check_args(residual, p, q_t);
  check_matrix(q_local_t, "q_local_t", q_t.size(0), q_t.size(1));
  check_matrix(out, "out", residual.size(0), residual.size(1));
  residual.addmm_(p, q_local_t, /*beta=*/1, /*alpha=*/-1);
  if (out.scalar_type() == at::kFloat && out.is_contiguous()) {
    at::mm_out(out, p, q_t);
  } else {
    out.copy_(at::mm(p, q_t));
  }
}

void powersgd_finish_cpu(at::Tensor residual, const at::Tensor& p,
                         const at::Tensor& q_local_t, const at::Tensor& q_t, at::Tensor out) {
  check_args(residual, p, q_t);
  const int64_t rows = residual.size(0), cols = residual.size(1);
  const int64_t rank = q_t.size(0);
  if (!has_fused_rank(rank) || !is_float_matrix(p, rows, rank) ||
      !is_float_matrix(q_local_t, rank, cols) || !is_float_matrix(q_t, rank, cols) ||
      !is_float_matrix(out, rows, cols)) {
    powersgd_finish_generic(residual, p, q_local_t, q_t, out);
    return;
  }
  float* res = residual.data_ptr<float>();
  const float* pp = p.const_data_ptr<float>();
  const float* ql = q_local_t.const_data_ptr<float>();
  const float* q = q_t.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t lo, int64_t hi) {
    finish_rows(res, pp, ql, q, o, lo, hi, cols, rank);
  });
}

void powersgd_finish_batched_generic(at::Tensor residual, const at::Tensor& p,
                                     const at::Tensor& q_local_t, const at::Tensor& q_t,
                                     at::Tensor out) {
  check_batch_args(residual, p, q_local_t, q_t, out);
  residual.baddbmm_(p, q_local_t, /*beta=*/1, /*alpha=*/-1);
  if (out.scalar_type() == at::kFloat && out.is_contiguous()) {
    at::bmm_out(out, p, q_t);
  } else {
    out.copy_(at::bmm(p, q_t));
  }
}

void powersgd_finish_batched_cpu(at::Tensor residual, const at::Tensor& p,
                                 const at::Tensor& q_local_t, const at::Tensor& q_t,
                                 at::Tensor out) {
  check_batch_args(residual, p, q_local_t, q_t, out);
  const int64_t count = residual.size(0), rows = residual.size(1), cols = residual.size(2);
  const int64_t rank = q_t.size(1);
  if (!has_fused_rank(rank) || !is_float_batch(p) || !is_float_batch(q_local_t) ||
      !is_float_batch(q_t) || !is_float_batch(out)) {
    // The per-matrix kernel in turn: each matrix gets the bits of its own call.
    for (int64_t b = 0; b < count; ++b) {
      powersgd_finish_cpu(residual.select(0, b), p.select(0, b), q_local_t.select(0, b),
                          q_t.select(0, b), out.select(0, b));
    }
    return;
  }
  float* res = residual.data_ptr<float>();
  const float* pp = p.const_data_ptr<float>();
  const float* ql = q_local_t.const_data_ptr<float>();
  const float* q = q_t.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t matrix = rows * cols;
  // Each row's terms are added as in the per-matrix kernel: the same bits.
  parallel_over_rows(count, rows, cols, [&](int64_t b, int64_t lo, int64_t hi) {
    finish_rows(res + b * matrix, pp + b * rows * rank, ql + b * rank * cols,
                q + b * rank * cols, o + b * matrix, lo, hi, cols, rank);
  });
}

void powersgd_project_generic(at::Tensor residual, const at::Tensor& grad,
                              const at::Tensor& q_t, at::Tensor p) {
  check_project_args(residual, grad, q_t, p);
  residual.add_(grad);
  if (p.is_contiguous()) {
    at::bmm_out(p, residual, q_t.transpose(1, 2));
  } else {
    p.copy_(at::bmm(residual, q_t.transpose(1, 2)));
  }
}

void powersgd_project_cpu(at::Tensor residual, const at::Tensor& grad, const at::Tensor& q_t,
                          at::Tensor p) {
  check_project_args(residual, grad, q_t, p);
  const int64_t count = residual.size(0), rows = residual.size(1), cols = residual.size(2);
  const int64_t rank = q_t.size(1);
  if (!has_fused_rank(rank) || !is_float_batch(grad) || !is_float_batch(q_t) ||
      !is_float_batch(p)) {
    powersgd_project_generic(residual, grad, q_t, p);
    return;
  }
  float* res = residual.data_ptr<float>();
  const float* g = grad.const_data_ptr<float>();
  const float* q = q_t.const_data_ptr<float>();
  float* pp = p.data_ptr<float>();
  const int64_t matrix = rows * cols;
  parallel_over_rows(count, rows, cols, [&](int64_t b, int64_t lo, int64_t hi) {
    project_rows(res + b * matrix, g + b * matrix, q + b * rank * cols, pp + b * rows * rank,
                 lo, hi, cols, rank);
  });
}

}  // namespace torchstrategy
