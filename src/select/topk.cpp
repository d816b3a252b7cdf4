#include "select/topk.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/vec_math.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVRET_TOPK_AVX2 1
#endif

namespace kvret {

namespace {

/// The sample of scores that bounds topk_positions' candidates.
constexpr int64_t kTopkSamples = 1024;

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

/// The keys (rank << 32 | index) of the scores whose rank is at most `bound`, in index order; returns their count.
/// keys must hold n + 1 entries.
int64_t gather_candidates_scalar(const float* scores, int64_t i, int64_t n, uint32_t bound, uint64_t* keys,
                                 int64_t count) noexcept {
  for (; i < n; ++i) {  // branch-free: a key above the bound is overwritten by the next
    const uint32_t rank = descending_rank(scores[i]);
    keys[count] = static_cast<uint64_t>(rank) << 32 | static_cast<uint32_t>(i);
    count += rank <= bound;
  }
  return count;
}

#ifdef KVRET_TOPK_AVX2
/// gather_candidates_scalar eight scores at a time: descending_rank's bits in the lanes, an unsigned compare with
/// the bound (both offset by 2^31 for the signed compare), and the keys of the set bits written in lane order.
__attribute__((target("avx2,bmi"))) int64_t gather_candidates_avx2(const float* scores, int64_t n, uint32_t bound,
                                                                   uint64_t* keys) noexcept {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i top = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m256i ones = _mm256_set1_epi32(-1);
  const __m256i bound_signed = _mm256_set1_epi32(static_cast<int32_t>(bound ^ 0x80000000u));
  alignas(32) uint32_t rank[8];
  int64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(scores + i);
    const __m256 f = _mm256_add_ps(_mm256_blendv_ps(x, lowest, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)),
                                   _mm256_setzero_ps());  // NaN -> -inf, -0 -> +0
    const __m256i b = _mm256_castps_si256(f);
    const __m256i ascending = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi32(b, 31), top));
    const __m256i r = _mm256_xor_si256(ascending, ones);
    const __m256i above = _mm256_cmpgt_epi32(_mm256_xor_si256(r, top), bound_signed);
    auto take = static_cast<uint32_t>(~_mm256_movemask_ps(_mm256_castsi256_ps(above))) & 0xffu;
    if (take == 0) continue;
    _mm256_store_si256(reinterpret_cast<__m256i*>(rank), r);
    for (; take != 0; take &= take - 1) {
      const int lane = __builtin_ctz(take);
      keys[count++] = static_cast<uint64_t>(rank[lane]) << 32 | static_cast<uint32_t>(i + lane);
    }
  }
  return gather_candidates_scalar(scores, i, n, bound, keys, count);
}
#endif

int64_t gather_candidates(const float* scores, int64_t n, uint32_t bound, uint64_t* keys) noexcept {
#ifdef KVRET_TOPK_AVX2
  if (cpu_has_avx2()) return gather_candidates_avx2(scores, n, bound, keys);
#endif
  return gather_candidates_scalar(scores, 0, n, bound, keys, 0);
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
  // A rank bound from a strided sample keeps only the candidates at or below it (every one of the k taken when at
  // least k pass); the kth key is selected among them alone. The sample only decides how many keys the quickselect
  // sees, never the result: with fewer than k candidates every key is a candidate.
  thread_local std::vector<uint64_t> key_buffer, work_buffer;
  if (key_buffer.size() < static_cast<size_t>(n) + 1) key_buffer.resize(static_cast<size_t>(n) + 1);
  uint64_t* keys = key_buffer.data();
  const int64_t samples = std::min<int64_t>(n, kTopkSamples);
  uint32_t sample[kTopkSamples];
  for (int64_t s = 0; s < samples; ++s) sample[s] = descending_rank(scores[s * n / samples]);
  // the sample's order statistic a few standard deviations past the expected position of the kth key
  const double p = static_cast<double>(k) / static_cast<double>(n);
  const double spread = 4.0 * std::sqrt(p * (1.0 - p) * static_cast<double>(samples));
  const auto at = static_cast<int64_t>(std::ceil(p * static_cast<double>(samples) + spread)) + 1;
  uint32_t bound = std::numeric_limits<uint32_t>::max();
  if (at < samples) {
    std::nth_element(sample, sample + at, sample + samples);
    bound = sample[at];
  }
  int64_t candidates = 0;
  for (int pass = 0; pass < 2; ++pass) {
    candidates = gather_candidates(scores, n, bound, keys);
    if (candidates >= k) break;
    bound = std::numeric_limits<uint32_t>::max();  // an unlucky sample: every key
  }
  if (work_buffer.size() < static_cast<size_t>(candidates)) work_buffer.resize(static_cast<size_t>(candidates));
  uint64_t* work = work_buffer.data();
  std::copy_n(keys, candidates, work);
  const uint64_t last = kth_smallest(work, candidates, k - 1);
  int64_t written = 0;
  for (int64_t c = 0; c < candidates && written < k; ++c) {  // out[written] stays in bounds
    out[written] = static_cast<int32_t>(base + static_cast<uint32_t>(keys[c]));
    written += keys[c] <= last;
  }
}

void take_top_tokens(const float* folded, int64_t n, int64_t k, int64_t base, int32_t* out, float* scores_out) {
  topk_positions(folded, n, k, base, out);
  if (scores_out != nullptr)
    for (int64_t i = 0; i < k; ++i) scores_out[i] = folded[static_cast<size_t>(out[i] - base)];
}

}  // namespace kvret
