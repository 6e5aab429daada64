// How the gradient reducer groups parameters into buckets: a pure function of sizes, so
// that the policy can be tested on its own and Reducer::build() only allocates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torchstrategy {

// Every slot starts on this boundary, so that the CUDA kernels move 16 bytes a load.
constexpr int64_t kSlotAlignmentBytes = 16;

// `elements` rounded up so that what follows starts on a 16-byte boundary.
int64_t aligned_elements(int64_t elements, int64_t element_size);

struct BucketSpec {
  std::vector<int64_t> params;   // parameter indices, in slot order
  std::vector<int64_t> offsets;  // each slot's first element
  int64_t elements = 0;          // up to the end of the last slot
};

// Lays out the parameters named by `order` (indices into the other vectors), in that order,
// into buckets. Parameters with equal `keys` (dtype and device) may share a bucket;
// parameters of different keys never do. The first bucket (capped at `first_cap_bytes`, at
// most `cap_bytes`) takes parameters until it has reached its cap, the parameter crossing
// it included. Any other bucket takes a parameter unless that would take it past
// `cap_bytes`: then it is closed and a new one opened, so a parameter larger than the cap
// gets a bucket of its own. Buckets come in the order they were opened, which is the order
// they are launched in.
std::vector<BucketSpec> compute_bucket_layout(const std::vector<int64_t>& order,
                                              const std::vector<int64_t>& numels,
                                              const std::vector<int64_t>& element_sizes,
                                              const std::vector<std::string>& keys,
                                              int64_t first_cap_bytes, int64_t cap_bytes);

}  // namespace torchstrategy
