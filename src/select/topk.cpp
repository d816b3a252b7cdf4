#include "select/topk.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

namespace kvret {

void topk_positions(const float* scores, int64_t n, int64_t k, int64_t base, int32_t* out) {
  if (k <= 0) return;
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  if (k < n) {
    // NaN (possible when check_finite is off) ranks lowest, so the comparator stays a strict weak order.
    auto key = [scores](int32_t i) {
      const float s = scores[i];
      return s == s ? s : -std::numeric_limits<float>::infinity();
    };
    std::nth_element(idx.begin(), idx.begin() + k, idx.end(),
                     [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    idx.resize(static_cast<size_t>(k));
  }
  std::sort(idx.begin(), idx.end());
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int32_t>(base + idx[static_cast<size_t>(i)]);
}

}  // namespace kvret
