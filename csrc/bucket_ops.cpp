// Fused pack/unpack of many tensors into one flat communication buffer.
//
// The gradient reducer and the fused collectives move many small tensors through one
// collective. These ops do the copies in one call: one Python->C++ crossing per bucket
// instead of one per tensor, with the scale (1/N for MEAN) fused into the same pass.
//
//   pack(flat, tensors, offsets, numels, scale):
//                                           flat[off_i : off_i + n_i] = scale * tensors[i]
//                                           (an undefined tensor packs n_i zeros)
//   unpack(flat, tensors, offsets, scale, accumulate):
//                                           tensors[i] = scale * flat[off_i : off_i + n_i]
//                                           (+ tensors[i] when accumulate)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>

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

// True when the fast path applies: same dtype and device as the buffer, contiguous.
bool is_plain(const at::Tensor& t, const at::Tensor& flat) {
  return t.scalar_type() == flat.scalar_type() && t.device() == flat.device() &&
         t.is_contiguous();
}

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

  // Sources that are not plain (other dtype, strided) go through ATen's copy; they are rare.
  for (size_t i = 0; i < count; ++i) {
    if (sources[i].defined() && !is_plain(sources[i], flat)) {
      at::Tensor slot = flat.narrow(0, offsets[i], numels[i]);
      slot.copy_(sources[i].reshape({-1}));
      if (scale != 1.0) slot.mul_(scale);
    }
  }
  const std::vector<Segment> segments = split_into_segments(numels);
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, flat.scalar_type(),
                             "torchstrategy_pack", [&] {
    scalar_t* out = flat.data_ptr<scalar_t>();
    at::parallel_for(0, segments.size(), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t s = lo; s < hi; ++s) {
        const Segment& seg = segments[s];
        const at::Tensor& src = sources[seg.tensor];
        scalar_t* dst = out + offsets[seg.tensor] + seg.begin;
        if (!src.defined()) {
          std::fill(dst, dst + seg.length, scalar_t(0));
          continue;
        }
        if (!is_plain(src, flat)) continue;  // handled above
        const scalar_t* in = src.const_data_ptr<scalar_t>() + seg.begin;
        if (scale == 1.0) {
          std::copy(in, in + seg.length, dst);
        } else {
          for (int64_t k = 0; k < seg.length; ++k) {
            dst[k] = static_cast<scalar_t>(static_cast<double>(in[k]) * scale);
          }
        }
      }
    });
  });
}

void unpack_cpu(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                double scale, bool accumulate) {
  const size_t count = tensors.size();
  std::vector<int64_t> numels(count);
  for (size_t i = 0; i < count; ++i) numels[i] = tensors[i].numel();
  check_layout(flat, offsets, count, numels);

  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& dst = tensors[i];
    if (is_plain(dst, flat)) continue;
    at::Tensor slot = flat.narrow(0, offsets[i], numels[i]).view(dst.sizes());
    at::Tensor value = scale == 1.0 ? slot : slot * scale;
    if (accumulate) {
      const_cast<at::Tensor&>(dst).add_(value);
    } else {
      const_cast<at::Tensor&>(dst).copy_(value);
    }
  }
  const std::vector<Segment> segments = split_into_segments(numels);
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, flat.scalar_type(),
                             "torchstrategy_unpack", [&] {
    const scalar_t* in_base = flat.const_data_ptr<scalar_t>();
    at::parallel_for(0, segments.size(), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t s = lo; s < hi; ++s) {
        const Segment& seg = segments[s];
        const at::Tensor& dst = tensors[seg.tensor];
        if (!is_plain(dst, flat)) continue;
        scalar_t* out = dst.data_ptr<scalar_t>() + seg.begin;
        const scalar_t* in = in_base + offsets[seg.tensor] + seg.begin;
        if (!accumulate && scale == 1.0) {
          std::copy(in, in + seg.length, out);
        } else if (!accumulate) {
          for (int64_t k = 0; k < seg.length; ++k) {
            out[k] = static_cast<scalar_t>(static_cast<double>(in[k]) * scale);
          }
        } else {
          for (int64_t k = 0; k < seg.length; ++k) {
            out[k] = static_cast<scalar_t>(static_cast<double>(out[k]) +
                                           static_cast<double>(in[k]) * scale);
          }
        }
      }
    });
  });
}

// Device-generic versions built from ATen ops, used for every device without a dedicated
// kernel (CUDA until csrc/ has its own kernels): one cat for the whole pack and foreach
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
      pieces.push_back(t->reshape({-1}).to(flat.device(), flat.scalar_type()));
    } else {
      pieces.push_back(at::zeros({numels[i]}, flat.options()));
    }
  }
  if (count == 0) return;
  if (consecutive) {
    const int64_t total = offsets[count - 1] + numels[count - 1] - offsets[0];
    at::Tensor region = flat.narrow(0, offsets[0], total);
    at::cat_out(region, pieces, 0);
    if (scale != 1.0) region.mul_(scale);
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    at::Tensor slot = flat.narrow(0, offsets[i], numels[i]);
    slot.copy_(pieces[i]);
    if (scale != 1.0) slot.mul_(scale);
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

}  // namespace

TORCH_LIBRARY(torchstrategy, m) {
  m.def("pack(Tensor(a!) flat, Tensor?[] tensors, int[] offsets, int[] numels, "
        "float scale) -> ()");
  m.def("unpack(Tensor flat, Tensor(a!)[] tensors, int[] offsets, float scale, "
        "bool accumulate) -> ()");
  m.def("pack_reference(Tensor(a!) flat, Tensor?[] tensors, int[] offsets, int[] numels, "
        "float scale) -> ()");
  m.def("unpack_reference(Tensor flat, Tensor(a!)[] tensors, int[] offsets, float scale, "
        "bool accumulate) -> ()");
}

// Every device without a dedicated kernel gets the generic implementation.
TORCH_LIBRARY_IMPL(torchstrategy, CompositeExplicitAutograd, m) {
  m.impl("pack", &pack_generic);
  m.impl("unpack", &unpack_generic);
  m.impl("pack_reference", &pack_generic);
  m.impl("unpack_reference", &unpack_generic);
}

TORCH_LIBRARY_IMPL(torchstrategy, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
}

}  // namespace torchstrategy

// The module itself is empty: importing it runs the registrations above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchstrategy's fused kernels, registered as torch.ops.torchstrategy.*";
}
