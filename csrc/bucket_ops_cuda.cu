// CUDA pack/unpack: one kernel launch moves every tensor of a bucket, with the scale and
// the dtype conversion (bf16/fp16 compression) fused into the copy.
//
// The host splits each tensor into chunks of kChunk elements and uploads one descriptor
// per chunk (source pointer, destination pointer, length); block b moves chunk b. Where
// both pointers are 16-byte aligned (the reducer aligns every slot, and the caching
// allocator aligns every tensor) a thread moves 16 source bytes per load.
// Non-floating dtypes and strided tensors take ATen's copy (rare: fused collectives of
// integer tensors).
#include "bucket_ops.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace torchstrategy {
namespace {

constexpr int64_t kChunk = 1 << 14;
constexpr int kThreads = 256;

struct Chunk {
  const void* src;  // nullptr: write zeros (a missing gradient)
  void* dst;
  int64_t length;
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename S, typename D>
__global__ void copy_scale_kernel(const Chunk* chunks, double scale, bool accumulate) {
  using Math = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>,
                                  double, float>;
  constexpr int kVec = 16 / sizeof(S) > 0 ? 16 / sizeof(S) : 1;
  const Chunk c = chunks[blockIdx.x];
  const Math s = static_cast<Math>(scale);
  D* out = static_cast<D*>(c.dst);
  if (c.src == nullptr) {
    for (int64_t k = threadIdx.x; k < c.length; k += blockDim.x) out[k] = D(0);
    return;
  }
  const S* in = static_cast<const S*>(c.src);
  const bool vectorised = reinterpret_cast<uintptr_t>(in) % (sizeof(S) * kVec) == 0 &&
                          reinterpret_cast<uintptr_t>(out) % (sizeof(D) * kVec) == 0;
  int64_t done = 0;
  if (vectorised) {
    const int64_t packs = c.length / kVec;
    const auto* in_packs = reinterpret_cast<const Pack<S, kVec>*>(in);
    auto* out_packs = reinterpret_cast<Pack<D, kVec>*>(out);
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack<S, kVec> a = in_packs[k];
      Pack<D, kVec> b;
      if (accumulate) b = out_packs[k];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        Math x = static_cast<Math>(a.v[j]) * s;
        if (accumulate) x += static_cast<Math>(b.v[j]);
        b.v[j] = static_cast<D>(x);
      }
      out_packs[k] = b;
    }
    done = packs * kVec;
  }
  for (int64_t k = done + threadIdx.x; k < c.length; k += blockDim.x) {
    Math x = static_cast<Math>(in[k]) * s;
    if (accumulate) x += static_cast<Math>(out[k]);
    out[k] = static_cast<D>(x);
  }
}

bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// True when the kernel takes the pair: contiguous, same device, floating dtypes.
bool fused(const at::Tensor& t, const at::Tensor& flat) {
  return t.device() == flat.device() && t.is_contiguous() &&
         is_float_kind(t.scalar_type()) && is_float_kind(flat.scalar_type());
}

// Launches the kernel for `chunks` (all with source dtype src and destination dtype dst).
void launch(const std::vector<Chunk>& chunks, at::ScalarType src, at::ScalarType dst,
            const at::Tensor& like, double scale, bool accumulate) {
  if (chunks.empty()) return;
  const int64_t bytes = static_cast<int64_t>(chunks.size() * sizeof(Chunk));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), chunks.data(), bytes);
  at::Tensor device = host.to(like.device(), /*non_blocking=*/true);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src, "torchstrategy_cuda_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst, "torchstrategy_cuda_dst",
                                    [&] {
      copy_scale_kernel<S, scalar_t><<<static_cast<unsigned>(chunks.size()), kThreads, 0,
                                       stream>>>(
          static_cast<const Chunk*>(device.const_data_ptr()), scale, accumulate);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The pinned descriptors stay valid until the upload ran: the host caching allocator
  // records the copy's event, and `device` is freed in stream order.
}

void add_chunks(std::vector<Chunk>& chunks, const void* src, void* dst, int64_t n,
                int64_t src_size, int64_t dst_size) {
  for (int64_t b = 0; b < n; b += kChunk) {
    chunks.push_back({src == nullptr ? nullptr : static_cast<const char*>(src) + b * src_size,
                      static_cast<char*>(dst) + b * dst_size, std::min(kChunk, n - b)});
  }
}

}  // namespace

void pack_cuda(at::Tensor flat, const c10::List<std::optional<at::Tensor>>& tensors,
               at::IntArrayRef offsets, at::IntArrayRef numels, double scale) {
  const size_t count = tensors.size();
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "torchstrategy: the flat buffer must be a contiguous 1-D tensor");
  TORCH_CHECK(offsets.size() == count && numels.size() == count,
              "torchstrategy: tensors, offsets and sizes must have the same length");
  c10::cuda::CUDAGuard guard(flat.device());
  // One launch per source dtype (one in practice).
  std::vector<std::pair<at::ScalarType, std::vector<Chunk>>> groups;
  const int64_t out_size = flat.element_size();
  char* base = static_cast<char*>(flat.data_ptr());
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + numels[i] <= flat.numel(),
                "torchstrategy: tensor ", i, " does not fit in a buffer of ", flat.numel(),
                " elements");
    std::optional<at::Tensor> t = tensors.get(i);
    void* dst = base + offsets[i] * out_size;
    if (!t.has_value() || !t->defined()) {
      flat.narrow(0, offsets[i], numels[i]).zero_();
      continue;
    }
    TORCH_CHECK(t->numel() == numels[i], "torchstrategy: tensor ", i, " has ", t->numel(),
                " elements but its slot has ", numels[i]);
    if (!fused(*t, flat)) {
      at::Tensor slot = flat.narrow(0, offsets[i], numels[i]);
      slot.copy_(t->reshape({-1}));
      if (scale != 1.0) slot.mul_(scale);
      continue;
    }
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& g) { return g.first == t->scalar_type(); });
    if (group == groups.end()) {
      groups.emplace_back(t->scalar_type(), std::vector<Chunk>{});
      group = groups.end() - 1;
    }
    add_chunks(group->second, t->const_data_ptr(), dst, numels[i], t->element_size(),
               out_size);
  }
  for (const auto& [dtype, chunks] : groups) {
    launch(chunks, dtype, flat.scalar_type(), flat, scale, false);
  }
}

void unpack_cuda(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                 double scale, bool accumulate) {
  const size_t count = tensors.size();
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "torchstrategy: the flat buffer must be a contiguous 1-D tensor");
  TORCH_CHECK(offsets.size() == count, "torchstrategy: got ", count, " tensors but ",
              offsets.size(), " offsets");
  c10::cuda::CUDAGuard guard(flat.device());
  std::vector<std::pair<at::ScalarType, std::vector<Chunk>>> groups;
  const int64_t in_size = flat.element_size();
  const char* base = static_cast<const char*>(flat.const_data_ptr());
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& dst = tensors[i];
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + dst.numel() <= flat.numel(),
                "torchstrategy: tensor ", i, " does not fit in a buffer of ", flat.numel(),
                " elements");
    if (!fused(dst, flat)) {
      at::Tensor slot = flat.narrow(0, offsets[i], dst.numel()).view(dst.sizes());
      at::Tensor value = scale == 1.0 ? slot : slot * scale;
      if (accumulate) {
        const_cast<at::Tensor&>(dst).add_(value);
      } else {
        const_cast<at::Tensor&>(dst).copy_(value);
      }
      continue;
    }
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& g) { return g.first == dst.scalar_type(); });
    if (group == groups.end()) {
      groups.emplace_back(dst.scalar_type(), std::vector<Chunk>{});
      group = groups.end() - 1;
    }
    add_chunks(group->second, base + offsets[i] * in_size,
               const_cast<at::Tensor&>(dst).data_ptr(), dst.numel(), in_size,
               dst.element_size());
  }
  for (const auto& [dtype, chunks] : groups) {
    launch(chunks, flat.scalar_type(), dtype, flat, scale, accumulate);
  }
}

}  // namespace torchstrategy
