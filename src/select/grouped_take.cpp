#include "select/grouped_take.hpp"

#include <algorithm>

#include "select/topk.hpp"

namespace kvret {

int64_t grouped_take(const float* scores, const int32_t* counts, int64_t groups, int64_t budget,
                     std::vector<uint64_t>& keys_buf, uint8_t* state) {
  std::fill(state, state + groups, kSkip);
  if (keys_buf.size() < static_cast<size_t>(groups)) keys_buf.resize(static_cast<size_t>(groups));
  uint64_t* keys = keys_buf.data();
  int64_t hi = 0;
  for (int64_t u = 0; u < groups; ++u)
    if (counts[u] > 0) keys[hi++] = descending_key(scores[u], static_cast<uint32_t>(u));
  auto id = [](uint64_t key) { return static_cast<uint32_t>(key); };
  int64_t lo = 0;
  int64_t rem = budget;
  while (lo < hi && rem > 0) {
    if (hi - lo <= 16) {
      std::sort(keys + lo, keys + hi);
      for (int64_t i = lo; i < hi && rem > 0; ++i) {
        const uint32_t u = id(keys[i]);
        if (counts[u] <= rem) {
          state[u] = kTake;
          rem -= counts[u];
        } else {
          state[u] = kTrim;
          return rem;
        }
      }
      return 0;
    }
    const uint64_t pivot = median3_pivot(keys, lo, hi);
    // branch-free Lomuto partition of [lo, hi - 1): [lo, i) before the pivot, the weight of which is `before`
    int64_t i = lo;
    int64_t before = 0;
    for (int64_t j = lo; j < hi - 1; ++j) {
      const uint64_t x = keys[j];
      const bool less = x < pivot;
      keys[j] = keys[i];
      keys[i] = x;
      i += less;
      before += less ? counts[id(x)] : 0;
    }
    std::swap(keys[i], keys[hi - 1]);  // the pivot, at i
    if (before > rem) {                // the budget runs out before the pivot
      hi = i;
      continue;
    }
    for (int64_t j = lo; j < i; ++j) state[id(keys[j])] = kTake;
    rem -= before;
    const uint32_t u = id(pivot);
    if (counts[u] > rem) {
      if (rem > 0) state[u] = kTrim;
      return rem;
    }
    state[u] = kTake;
    rem -= counts[u];
    lo = i + 1;
  }
  return 0;
}

}  // namespace kvret
