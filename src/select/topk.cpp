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
  // The kth key by one radix step: a histogram of the ranks' top kRadixBits bits finds the bin that holds it (every
  // key of a lower bin is taken); only that bin's keys go to the quickselect.
  constexpr int kRadixBits = 12;
  constexpr int kShift = 32 - kRadixBits;
  thread_local std::vector<uint32_t> rank_buffer;
  thread_local std::vector<uint64_t> key_buffer;
  if (rank_buffer.size() < static_cast<size_t>(n)) rank_buffer.resize(static_cast<size_t>(n));
  uint32_t* ranks = rank_buffer.data();
  uint32_t hist[1u << kRadixBits] = {};
  for (int64_t i = 0; i < n; ++i) {
    ranks[i] = descending_rank(scores[i]);
    ++hist[ranks[i] >> kShift];
  }
  uint32_t bin = 0;
  int64_t below = 0;  // keys in the bins before `bin`
  while (below + hist[bin] < k) below += hist[bin++];
  // the bin's keys, written branch-free (a key of another bin is overwritten by the next)
  if (key_buffer.size() < static_cast<size_t>(hist[bin]) + 1) key_buffer.resize(static_cast<size_t>(hist[bin]) + 1);
  uint64_t* keys = key_buffer.data();
  int64_t in_bin = 0;
  for (int64_t i = 0; i < n && in_bin < hist[bin]; ++i) {
    keys[in_bin] = static_cast<uint64_t>(ranks[i]) << 32 | static_cast<uint32_t>(i);
    in_bin += (ranks[i] >> kShift) == bin;
  }
  const uint64_t last = kth_smallest(keys, in_bin, k - 1 - below);
  const uint32_t last_rank = static_cast<uint32_t>(last >> 32);
  const int64_t last_index = static_cast<uint32_t>(last);
  int64_t written = 0;
  for (int64_t i = 0; i < n && written < k; ++i) {  // out[written] stays in bounds
    const uint32_t rank = ranks[i];
    out[written] = static_cast<int32_t>(base + i);
    written +=
        static_cast<int>(rank < last_rank) | (static_cast<int>(rank == last_rank) & static_cast<int>(i <= last_index));
  }
}

}  // namespace kvret
