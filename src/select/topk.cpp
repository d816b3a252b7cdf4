#include "select/topk.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <vector>

namespace kvret {

namespace {

/// The kth smallest (0-based) of keys[0, n), which it reorders: a quickselect with median-of-three pivots and a
/// branch-free Lomuto partition (its comparisons are unpredictable), std::nth_element past a depth limit.
uint64_t kth_smallest(uint64_t* keys, int64_t n, int64_t kth) {
  int64_t lo = 0, hi = n;
  int depth = 2 * static_cast<int>(std::bit_width(static_cast<uint64_t>(n))) + 8;
  while (hi - lo > 16) {
    if (--depth < 0) {
      std::nth_element(keys + lo, keys + kth, keys + hi);
      return keys[kth];
    }
    const uint64_t pivot = median3_pivot(keys, lo, hi);
    int64_t i = lo;
    for (int64_t j = lo; j < hi - 1; ++j) {
      const uint64_t x = keys[j];
      keys[j] = keys[i];
      keys[i] = x;
      i += x < pivot;
    }
    std::swap(keys[i], keys[hi - 1]);  // the pivot, at i
    if (kth < i)
      hi = i;
    else if (kth > i)
      lo = i + 1;
    else
      return pivot;
  }
  std::sort(keys + lo, keys + hi);
  return keys[kth];
}

}  // namespace

void topk_positions(const float* scores, int64_t n, int64_t k, int64_t base, int32_t* out) {
  if (k <= 0) return;
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(base + i);
    return;
  }
  // The order (score descending, index ascending) is the ascending order of (rank << 32 | index): the kth key is
  // the last one taken, and the taken indices are those whose key is not above it, written in index order.
  thread_local std::vector<uint64_t> buffer;
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(static_cast<size_t>(n));
  uint64_t* keys = buffer.data();
  for (int64_t i = 0; i < n; ++i) keys[i] = descending_key(scores[i], static_cast<uint32_t>(i));
  const uint64_t last = kth_smallest(keys, n, k - 1);
  const uint32_t last_rank = static_cast<uint32_t>(last >> 32);
  const int64_t last_index = static_cast<uint32_t>(last);
  int64_t written = 0;
  for (int64_t i = 0; i < n && written < k; ++i) {  // out[written] stays in bounds
    const uint32_t rank = descending_rank(scores[i]);
    out[written] = static_cast<int32_t>(base + i);
    written += rank < last_rank || (rank == last_rank && i <= last_index);
  }
}

}  // namespace kvret
