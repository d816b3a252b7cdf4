#pragma once
#include <cstdint>
#include <utility>

namespace kvret {

/// A quickselect's pivot over keys[lo, hi) (hi - lo >= 3): moves the median of the first, middle and last keys to
/// keys[hi - 1] and returns it.
inline uint64_t median3_pivot(uint64_t* keys, int64_t lo, int64_t hi) noexcept {
  int64_t a = lo, m = lo + (hi - lo) / 2, c = hi - 1;
  if (keys[m] < keys[a]) std::swap(a, m);
  if (keys[c] < keys[m]) std::swap(m, c);
  if (keys[m] < keys[a]) std::swap(a, m);
  std::swap(keys[m], keys[hi - 1]);
  return keys[hi - 1];
}

/// Writes base + i for the k largest scores[i] (ties: the lower i first), in ascending order, to out.
/// Requires 0 <= k <= n.
void topk_positions(const float* scores, int64_t n, int64_t k, int64_t base, int32_t* out);

}  // namespace kvret
