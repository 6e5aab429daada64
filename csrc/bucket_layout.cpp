#include "bucket_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

namespace torchstrategy {

int64_t aligned_elements(int64_t elements, int64_t element_size) {
  const int64_t step = std::max<int64_t>(1, kSlotAlignmentBytes / element_size);
  return (elements + step - 1) / step * step;
}

std::vector<BucketSpec> compute_bucket_layout(const std::vector<int64_t>& order,
                                              const std::vector<int64_t>& numels,
                                              const std::vector<int64_t>& element_sizes,
                                              const std::vector<std::string>& keys,
                                              int64_t first_cap_bytes, int64_t cap_bytes) {
  const int64_t count = static_cast<int64_t>(numels.size());
  TORCH_CHECK_VALUE(element_sizes.size() == numels.size() && keys.size() == numels.size(),
                    "torchstrategy: got ", numels.size(), " sizes, ", element_sizes.size(),
                    " element sizes and ", keys.size(), " keys");
  std::vector<char> placed(count, 0);
  for (int64_t i : order) {
    TORCH_CHECK_VALUE(i >= 0 && i < count, "torchstrategy: parameter index ", i,
                      " out of range for ", count, " parameters");
    TORCH_CHECK_VALUE(!placed[i], "torchstrategy: parameter ", i, " appears twice");
    placed[i] = 1;
    const int64_t size = element_sizes[i];
    // A power of two, so that rounding to whole elements lands on 16-byte boundaries.
    TORCH_CHECK_VALUE(size > 0 && (size & (size - 1)) == 0, "torchstrategy: parameter ", i,
                      " has element size ", size, ", not a power of two");
    TORCH_CHECK_VALUE(numels[i] >= 0, "torchstrategy: parameter ", i, " has ", numels[i],
                      " elements");
  }
  const int64_t first_cap = std::min(first_cap_bytes, cap_bytes);

  std::vector<BucketSpec> buckets;
  std::map<std::string, size_t> open;  // key -> its bucket still taking parameters
  for (int64_t i : order) {
    const int64_t size = element_sizes[i];
    auto found = open.find(keys[i]);
    if (found != open.end()) {
      const BucketSpec& b = buckets[found->second];
      // The first bucket is there to start communicating early: it takes parameters until
      // it has reached its cap, the one crossing it included (DDP's rule), so that a large
      // first gradient (ResNet-50's 8 MB classifier) is sent at once instead of waiting
      // for a full bucket of company. The others never pass their cap unless alone.
      const bool full = found->second == 0
                            ? b.elements * size >= first_cap
                            : (aligned_elements(b.elements, size) + numels[i]) * size >
                                  cap_bytes;
      if (full) {
        open.erase(found);
        found = open.end();
      }
    }
    if (found == open.end()) {
      buckets.emplace_back();
      found = open.emplace(keys[i], buckets.size() - 1).first;
    }
    BucketSpec& b = buckets[found->second];
    const int64_t offset = aligned_elements(b.elements, size);
    b.params.push_back(i);
    b.offsets.push_back(offset);
    b.elements = offset + numels[i];
  }
  return buckets;
}

}  // namespace torchstrategy
