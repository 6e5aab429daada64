// Fused pack/unpack of many tensors into one flat communication buffer: the CPU kernels
// and the device-generic ones (csrc/bucket_ops.h states what the ops compute).
//
// The gradient reducer and the fused collectives move many small tensors through one
// collective. These ops do the copies in one call: one Python->C++ crossing per bucket
// instead of one per tensor, with the scale (1/N for MEAN) fused into the same pass.
#include "bucket_ops.h"
#include "float_narrow.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace torchstrategy {
namespace {

// Work is split into chunks of at most this many elements so that a bucket holding one
// large tensor is still spread over every intra-op thread.
constexpr int64_t kChunk = 1 << 16;

struct Segment {
  int64_t tensor;  // index into the tensor list
  int64_t begin;   // element offset inside that tensor
  int64_t length;
};

std::vector<Segment> split_into_segments(const std::vector<int64_t>& numels) {
  std::vector<Segment> segments;
  for (int64_t i = 0; i < static_cast<int64_t>(numels.size()); ++i) {
    for (int64_t b = 0; b < numels[i]; b += kChunk) {
      segments.push_back({i, b, std::min(kChunk, numels[i] - b)});
    }
  }
  return segments;
}

void check_layout(const at::Tensor& flat, at::IntArrayRef offsets, size_t count,
                  const std::vector<int64_t>& numels) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "torchstrategy: the flat buffer must be a contiguous 1-D tensor");
  TORCH_CHECK(offsets.size() == count, "torchstrategy: got ", count, " tensors but ",
              offsets.size(), " offsets");
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + numels[i] <= flat.numel(),
                "torchstrategy: tensor ", i, " (", numels[i], " elements at offset ",
                offsets[i], ") does not fit in a buffer of ", flat.numel(), " elements");
  }
}

// One segment copy: out[k] = scale * in[k] (+ out[k] when accumulate), converting from the
// source dtype S to the destination dtype D. The arithmetic is done in float (double for
// double data), so a pack into bf16/fp16 rounds once, after scaling.
template <typename S, typename D>
void copy_scale(const S* in, D* out, int64_t n, double scale, bool accumulate) {
  using Math = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>,
                                  double, float>;
  const Math s = static_cast<Math>(scale);
  if constexpr (std::is_same_v<S, D> &&
                (std::is_same_v<S, float> || std::is_same_v<S, double>)) {
    // The common case (fp32/fp64 gradients, no compression): at::vec, one FMA a vector.
    using Vec = at::vec::Vectorized<S>;
    if (!accumulate && scale == 1.0) {
      std::memcpy(out, in, n * sizeof(S));
      return;
    }
    const Vec vs(static_cast<S>(scale));
    int64_t k = 0;
    for (; k + Vec::size() <= n; k += Vec::size()) {
      Vec x = Vec::loadu(in + k) * vs;
      if (accumulate) x = x + Vec::loadu(out + k);
      x.store(out + k);
    }
    for (; k < n; ++k) out[k] = accumulate ? out[k] + in[k] * s : in[k] * s;
  } else if constexpr (std::is_same_v<S, float> && at::vec::is_reduced_floating_point_v<D>) {
    // Compression onto the wire: fp32 -> bf16/fp16, in loops compiled per CPU level
    // (float_narrow.h: at::vec here is the baseline's, scalar conversions, 4x slower).
    if (!accumulate) {
      if constexpr (std::is_same_v<D, c10::BFloat16>) {
        narrow_to_bf16(in, out, n, s);
      } else {
        narrow_to_fp16(in, out, n, s);
      }
      return;
    }
    for (int64_t k = 0; k < n; ++k) {  // accumulating into a reduced buffer: rare
      out[k] = static_cast<D>(static_cast<Math>(out[k]) + static_cast<Math>(in[k]) * s);
    }
  } else if constexpr (at::vec::is_reduced_floating_point_v<S> && std::is_same_v<D, float>) {
    // Decompression off the wire: bf16/fp16 -> fp32.
    using VecF = at::vec::Vectorized<float>;
    using VecS = at::vec::Vectorized<S>;
    const VecF vs(s);
    int64_t k = 0;
    for (; k + VecS::size() <= n; k += VecS::size()) {
      auto [a, b] = at::vec::convert_to_float<S>(VecS::loadu(in + k));
      a = a * vs;
      b = b * vs;
      if (accumulate) {
        a = a + VecF::loadu(out + k);
        b = b + VecF::loadu(out + k + VecF::size());
      }
      a.store(out + k);
      b.store(out + k + VecF::size());
    }
    for (; k < n; ++k) {
      Math x = static_cast<Math>(in[k]) * s;
      out[k] = static_cast<D>(accumulate ? static_cast<Math>(out[k]) + x : x);
    }
  } else {
    // Everything else (fp16/bf16 buckets, fp64 <-> reduced): scalar, in float or double.
    if (!accumulate && scale == 1.0 && std::is_same_v<S, D>) {
      std::memcpy(out, in, n * sizeof(S));
      return;
    }
    for (int64_t k = 0; k < n; ++k) {
      Math x = static_cast<Math>(in[k]);
      if (scale != 1.0) x *= s;
      out[k] = static_cast<D>(accumulate ? static_cast<Math>(out[k]) + x : x);
    }
  }
}

// Integer and bool tensors (fused collectives of counts and masks): copy, or add; a
// non-unit scale is applied in double.
template <typename T>
void copy_scale_exact(const T* in, T* out, int64_t n, double scale, bool accumulate) {
  if (!accumulate && scale == 1.0) {
    std::memcpy(out, in, n * sizeof(T));
    return;
  }
  for (int64_t k = 0; k < n; ++k) {
    T x = scale == 1.0 ? in[k] : static_cast<T>(static_cast<double>(in[k]) * scale);
    out[k] = accumulate ? static_cast<T>(out[k] + x) : x;
  }
}

bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Calls fn.template operator()<S, D>() for the pair of floating dtypes (src, dst).
template <typename Fn>
void dispatch_float_pair(at::ScalarType src, at::ScalarType dst, const Fn& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src, "torchstrategy_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst, "torchstrategy_dst", [&] {
      fn(static_cast<const S*>(nullptr), static_cast<scalar_t*>(nullptr));
    });
  });
}

// True when the fused loop handles the pair: the same dtype, or two floating dtypes.
bool fused_pair(const at::Tensor& t, const at::Tensor& flat) {
  return t.device() == flat.device() && t.is_contiguous() &&
         (t.scalar_type() == flat.scalar_type() ||
          (is_float_kind(t.scalar_type()) && is_float_kind(flat.scalar_type())));
}

// Copies `segments` of tensors[i] <-> flat (to_flat: pack; else unpack) in parallel.
void run_segments(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                  at::IntArrayRef offsets, const std::vector<Segment>& segments,
                  double scale, bool accumulate, bool to_flat) {
  at::parallel_for(0, segments.size(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const Segment& seg = segments[s];
      const at::Tensor& t = tensors[seg.tensor];
      const int64_t flat_at = offsets[seg.tensor] + seg.begin;
      if (!t.defined()) {  // pack of a missing gradient: zeros
        char* base = static_cast<char*>(flat.data_ptr());
        std::memset(base + flat_at * flat.element_size(), 0, seg.length * flat.element_size());
        continue;
      }
      if (!fused_pair(t, flat)) continue;  // converted by ATen beforehand
      const at::Tensor& src = to_flat ? t : flat;
      const at::Tensor& dst = to_flat ? flat : t;
      const int64_t src_at = to_flat ? seg.begin : flat_at;
      const int64_t dst_at = to_flat ? flat_at : seg.begin;
      if (is_float_kind(src.scalar_type()) && is_float_kind(dst.scalar_type())) {
        dispatch_float_pair(src.scalar_type(), dst.scalar_type(), [&](auto s0, auto d0) {
          using S = std::remove_const_t<std::remove_pointer_t<decltype(s0)>>;
          using D = std::remove_pointer_t<decltype(d0)>;
          copy_scale<S, D>(static_cast<const S*>(src.const_data_ptr()) + src_at,
                           static_cast<D*>(dst.data_ptr()) + dst_at, seg.length, scale,
                           accumulate);
        });
      } else {
        AT_DISPATCH_INTEGRAL_TYPES_AND(at::kBool, src.scalar_type(), "torchstrategy_int", [&] {
          copy_scale_exact<scalar_t>(src.const_data_ptr<scalar_t>() + src_at,
                                     dst.data_ptr<scalar_t>() + dst_at, seg.length, scale,
                                     accumulate);
        });
      }
    }
  });
}

}  // namespace

void pack_cpu(at::Tensor flat, const c10::List<std::optional<at::Tensor>>& tensors,
              at::IntArrayRef offsets, at::IntArrayRef sizes, double scale) {
  const size_t count = tensors.size();
  std::vector<at::Tensor> sources(count);
  TORCH_CHECK(sizes.size() == count, "torchstrategy: got ", count, " tensors but ",
              sizes.size(), " sizes");
  std::vector<int64_t> numels(sizes.begin(), sizes.end());
  for (size_t i = 0; i < count; ++i) {
    std::optional<at::Tensor> t = tensors.get(i);
    if (t.has_value() && t->defined()) {
      sources[i] = *t;
      TORCH_CHECK(t->numel() == numels[i], "torchstrategy: tensor ", i, " has ", t->numel(),
                  " elements but its slot has ", numels[i]);
    }
  }
  check_layout(flat, offsets, count, numels);

  // Sources the fused loop does not take (strided, integer <-> float) go through ATen's
  // copy; they are rare.
  for (size_t i = 0; i < count; ++i) {
    if (sources[i].defined() && !fused_pair(sources[i], flat)) {
      at::Tensor slot = flat.narrow(0, offsets[i], numels[i]);
      slot.copy_(sources[i].reshape({-1}));
      if (scale != 1.0) slot.mul_(scale);
    }
  }
  run_segments(flat, sources, offsets, split_into_segments(numels), scale, false, true);
}

void unpack_cpu(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                double scale, bool accumulate) {
  const size_t count = tensors.size();
  std::vector<int64_t> numels(count);
  std::vector<at::Tensor> targets(tensors.begin(), tensors.end());
  for (size_t i = 0; i < count; ++i) numels[i] = targets[i].numel();
  check_layout(flat, offsets, count, numels);

  for (size_t i = 0; i < count; ++i) {
    at::Tensor& dst = targets[i];
    if (fused_pair(dst, flat)) continue;
    at::Tensor slot = flat.narrow(0, offsets[i], numels[i]).view(dst.sizes());
    at::Tensor value = scale == 1.0 ? slot : slot.mul(scale);
    if (accumulate) {
      dst.add_(value);
    } else {
      dst.copy_(value);
    }
  }
  run_segments(flat, targets, offsets, split_into_segments(numels), scale, accumulate,
               false);
}

// Device-generic versions built from ATen ops, used for every device without a dedicated
// kernel (CUDA too, where the extension was built without nvcc): one cat for the whole pack and foreach
// ops for the unpack, so a bucket still costs a handful of kernel launches, not one per
// tensor. Also registered as *_reference ops so the CPU tests check them.
void pack_generic(at::Tensor flat, const c10::List<std::optional<at::Tensor>>& tensors,
                  at::IntArrayRef offsets, at::IntArrayRef sizes, double scale) {
  const size_t count = tensors.size();
  TORCH_CHECK(sizes.size() == count && offsets.size() == count,
              "torchstrategy: tensors, offsets and sizes must have the same length");
  std::vector<int64_t> numels(sizes.begin(), sizes.end());
  check_layout(flat, offsets, count, numels);
  bool consecutive = true;
  for (size_t i = 0; i + 1 < count; ++i) {
    consecutive = consecutive && offsets[i] + numels[i] == offsets[i + 1];
  }
  std::vector<at::Tensor> pieces;
  pieces.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    std::optional<at::Tensor> t = tensors.get(i);
    if (t.has_value() && t->defined()) {
      TORCH_CHECK(t->numel() == numels[i], "torchstrategy: tensor ", i, " has ", t->numel(),
                  " elements but its slot has ", numels[i]);
      // Scaled before the cast, so that a narrower buffer (compression) rounds once.
      at::Tensor piece = t->reshape({-1});
      if (scale != 1.0) piece = piece.mul(scale);
      pieces.push_back(piece.to(flat.device(), flat.scalar_type()));
    } else {
      pieces.push_back(at::zeros({numels[i]}, flat.options()));
    }
  }
  if (count == 0) return;
  if (consecutive) {
    const int64_t total = offsets[count - 1] + numels[count - 1] - offsets[0];
    at::Tensor region = flat.narrow(0, offsets[0], total);
    at::cat_out(region, pieces, 0);
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    flat.narrow(0, offsets[i], numels[i]).copy_(pieces[i]);
  }
}

void unpack_generic(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                    double scale, bool accumulate) {
  const size_t count = tensors.size();
  std::vector<int64_t> numels(count);
  for (size_t i = 0; i < count; ++i) numels[i] = tensors[i].numel();
  check_layout(flat, offsets, count, numels);
  std::vector<at::Tensor> sources;
  std::vector<at::Tensor> targets;
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& dst = tensors[i];
    at::Tensor slot = flat.narrow(0, offsets[i], numels[i]).view(dst.sizes());
    if (dst.scalar_type() != flat.scalar_type() || dst.device() != flat.device()) {
      slot = slot.to(dst.options());
    }
    sources.push_back(slot);
    targets.push_back(dst);
  }
  if (accumulate && scale == 1.0) {
    at::_foreach_add_(targets, sources);  // integer tensors refuse a floating alpha
  } else if (accumulate) {
    at::_foreach_add_(targets, sources, scale);
  } else {
    at::_foreach_copy_(targets, sources);
    if (scale != 1.0) at::_foreach_mul_(targets, at::Scalar(scale));
  }
}

}  // namespace torchstrategy
