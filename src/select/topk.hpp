#pragma once
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

namespace kvret {

/// The rank of a score as an integer: ascending in the order (score descending; NaN ranks lowest, as -inf; -0
/// counts as +0, as == has it).
inline uint32_t descending_rank(float score) noexcept {
  const float f = score == score ? score + 0.0f : -std::numeric_limits<float>::infinity();
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  const uint32_t ascending = b ^ ((0u - (b >> 31)) | 0x80000000u);  // negative: all bits flipped; else the sign
  return ~ascending;
}

/// The order (score descending, id ascending) as one integer, ascending: (descending_rank(score) << 32 | id).
inline uint64_t descending_key(float score, uint32_t id) noexcept {
  return static_cast<uint64_t>(descending_rank(score)) << 32 | id;
}

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

/// A per-token selection: topk_positions of the folded scores of positions [base, base + n), and, when `scores_out`
/// is not null, the score of each position taken, aligned with `out`.
void take_top_tokens(const float* folded, int64_t n, int64_t k, int64_t base, int32_t* out, float* scores_out);

}  // namespace kvret
