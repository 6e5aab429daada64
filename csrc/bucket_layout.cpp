#include "bucket_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <map>

namespace torchstrategy {

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
    TORCH_CHECK_VALUE(size > 0 && (size & (size - 1)) == 0, "torchstrategy: parameter ", i,
                      " has element size ", size, ", not a power of two");
    TORCH_CHECK_VALUE(numels[i] >= 0, "torchstrategy: parameter ", i, " has ", numels[i],
                      " elements");
  }
  const int64_t first_cap = std::min(first_cap_bytes, cap_bytes);

  struct Open {
    BucketSpec spec;
    int64_t bytes = 0;
    int64_t cap = 0;
    size_t opened = 0;  // opening order, for the buckets still open at the end
  };
  std::vector<BucketSpec> closed;
  std::map<std::string, Open> open;       // key -> its bucket taking parameters
  std::map<std::string, bool> had_first;  // key -> its first bucket was opened
  size_t opened = 0;
  for (int64_t i : order) {
    auto found = open.find(keys[i]);
    if (found == open.end()) {
      Open fresh;
      // The first bucket is small so that communication starts early (DDP's 1 MiB).
      fresh.cap = had_first[keys[i]] ? cap_bytes : first_cap;
      had_first[keys[i]] = true;
      fresh.opened = opened++;
      found = open.emplace(keys[i], std::move(fresh)).first;
    }
    Open& b = found->second;
    b.spec.params.push_back(i);
    b.spec.offsets.push_back(b.spec.elements);
    b.spec.elements += numels[i];
    b.bytes += numels[i] * element_sizes[i];
    if (b.bytes >= b.cap) {
      closed.push_back(std::move(b.spec));
      open.erase(found);
    }
  }
  std::vector<Open*> rest;
  for (auto& [key, b] : open) rest.push_back(&b);
  std::sort(rest.begin(), rest.end(),
            [](const Open* a, const Open* b) { return a->opened < b->opened; });
  for (Open* b : rest) closed.push_back(std::move(b->spec));
  return closed;
}

std::vector<BucketSpec> compute_whole_layout(const std::vector<int64_t>& order,
                                             const std::vector<int64_t>& numels,
                                             const std::vector<int64_t>& element_sizes,
                                             const std::vector<std::string>& keys) {
  constexpr int64_t unlimited = std::numeric_limits<int64_t>::max();
  std::vector<BucketSpec> buckets =
      compute_bucket_layout(order, numels, element_sizes, keys, unlimited, unlimited);
  // DDP sorts its buckets by their first parameter and launches them in reverse.
  std::reverse(buckets.begin(), buckets.end());
  return buckets;
}

}  // namespace torchstrategy
