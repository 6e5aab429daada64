// How the gradient reducer groups parameters into buckets: a pure function of sizes, so
// that the policy can be tested on its own and Reducer::build() only allocates.
//
// The layout is DistributedDataParallel's (torch's compute_bucket_assignment_by_size):
// slots packed back to back, buckets cut by the same rule. gloo's ring all-reduce adds an
// element's contributions in an order set by where the element sits in the buffer and by
// the buffer's size, so only buffers laid out exactly as DDP's give DDP's sums bit for bit
// with 3 or more replicas. The fused kernels (csrc/bucket_ops*) take any offset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torchstrategy {

struct BucketSpec {
  std::vector<int64_t> params;   // parameter indices, in slot order
  std::vector<int64_t> offsets;  // each slot's first element: the slots before it, packed
  int64_t elements = 0;          // of all its slots
};

// Lays out the parameters named by `order` (indices into the other vectors), in that order,
// into buckets. Parameters with equal `keys` (dtype and device) may share a bucket;
// parameters of different keys never do. A bucket takes parameters until its bytes have
// reached its cap, the parameter crossing it included, and is then closed (a parameter
// larger than the cap closes the bucket it lands in). The first bucket of each key is
// capped at `first_cap_bytes` (at most `cap_bytes`), the later ones at `cap_bytes`.
// Buckets come in the order they were closed, then those still open at the end in the
// order they were opened: the order they are launched in.
std::vector<BucketSpec> compute_bucket_layout(const std::vector<int64_t>& order,
                                              const std::vector<int64_t>& numels,
                                              const std::vector<int64_t>& element_sizes,
                                              const std::vector<std::string>& keys,
                                              int64_t first_cap_bytes, int64_t cap_bytes);

// DDP's layout before its first backward has shown the order gradients arrive in: every
// parameter of a key in one bucket, slots in `order` (the registration order), and the
// buckets launched in the reverse of the order their keys first appear.
std::vector<BucketSpec> compute_whole_layout(const std::vector<int64_t>& order,
                                             const std::vector<int64_t>& numels,
                                             const std::vector<int64_t>& element_sizes,
                                             const std::vector<std::string>& keys);

}  // namespace torchstrategy
