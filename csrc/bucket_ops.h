// The fused pack/unpack kernels behind torch.ops.torchstrategy.pack / unpack, one pair per
// device (csrc/bindings.cpp registers them):
//
//   pack(flat, tensors, offsets, numels, scale):
//                                           flat[off_i : off_i + n_i] = scale * tensors[i]
//                                           (an undefined tensor packs n_i zeros)
//   unpack(flat, tensors, offsets, scale, accumulate):
//                                           tensors[i] = scale * flat[off_i : off_i + n_i]
//                                           (+ tensors[i] when accumulate)
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace torchstrategy {

// CPU: at::parallel_for over chunks, vectorised (csrc/bucket_ops.cpp).
void pack_cpu(at::Tensor flat, const c10::List<std::optional<at::Tensor>>& tensors,
              at::IntArrayRef offsets, at::IntArrayRef numels, double scale);
void unpack_cpu(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                double scale, bool accumulate);

// Any device, from ATen ops; also the *_reference ops the tests compare against
// (csrc/bucket_ops.cpp).
void pack_generic(at::Tensor flat, const c10::List<std::optional<at::Tensor>>& tensors,
                  at::IntArrayRef offsets, at::IntArrayRef numels, double scale);
void unpack_generic(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                    double scale, bool accumulate);

// CUDA: one multi-tensor kernel launch per bucket (csrc/bucket_ops_cuda.cu, built only
// with TORCHSTRATEGY_WITH_CUDA).
void pack_cuda(at::Tensor flat, const c10::List<std::optional<at::Tensor>>& tensors,
               at::IntArrayRef offsets, at::IntArrayRef numels, double scale);
void unpack_cuda(at::Tensor flat, at::TensorList tensors, at::IntArrayRef offsets,
                 double scale, bool accumulate);

}  // namespace torchstrategy
