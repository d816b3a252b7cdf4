#include "select/kvcrush.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/vec_math.hpp"
#include "math/kvcrush_math.h"
#include "select/topk.hpp"

namespace kvret {

int hamming_distance(const uint64_t* a, const uint64_t* b, int words) noexcept {
  return cuda::math::kvcrush_hamming(a, b, words);
}

int64_t bucket_begin(int64_t b, int64_t c, int64_t buckets) noexcept {
  return cuda::math::kvcrush_bucket_begin(b, c, buckets);
}

int64_t signature_marked(int64_t n, float fraction) noexcept {
  if (n <= 0) return 0;
  const auto k = static_cast<int64_t>(std::ceil(static_cast<double>(fraction) * static_cast<double>(n)));
  return std::clamp<int64_t>(k, 1, n);
}

void signatures(const float* importance, int heads, int64_t n, float fraction, uint64_t* bits) {
  const int words = signature_words(heads);
  std::fill(bits, bits + n * words, uint64_t{0});
  const int64_t k = signature_marked(n, fraction);
  std::vector<int32_t> top(static_cast<size_t>(k));
  for (int h = 0; h < heads; ++h) {
    topk_positions(importance + static_cast<int64_t>(h) * n, n, k, 0, top.data());
    const uint64_t bit = uint64_t{1} << (h % 64);
    for (const int32_t t : top) bits[static_cast<int64_t>(t) * words + h / 64] |= bit;
  }
}

namespace {

/// scale * q_j . k_t for the w window queries over n keys: logits [w, n].
std::vector<float> window_logits(const float* window, int w, const float* keys, int64_t n, int d, float scale) {
  std::vector<float> l(static_cast<size_t>(w) * static_cast<size_t>(n));
  scaled_dots(window, d, w, keys, d, n, d, scale, l.data(), n);
  return l;
}

}  // namespace

double exp_from_max(float* row, int64_t n, float* max_out) {
  const float mx = *std::max_element(row, row + n);
  double z = 0;
  for (int64_t t = 0; t < n; ++t) {
    row[t] = std::exp(row[t] - mx);
    z += row[t];
  }
  *max_out = mx;
  return z;
}

void snapkv_importance(const float* window, int w, const float* keys, int64_t n, int d, float scale, float* importance,
                       float* lse) {
  std::fill(importance, importance + n, 0.0f);
  if (n <= 0) return;
  std::vector<float> l = window_logits(window, w, keys, n, d, scale);
  for (int j = 0; j < w; ++j) {
    float* row = l.data() + static_cast<int64_t>(j) * n;
    float mx = 0;
    const double z = exp_from_max(row, n, &mx);
    const auto inv = static_cast<float>(1.0 / z);
    for (int64_t t = 0; t < n; ++t) importance[t] += row[t] * inv;
    if (lse) lse[j] = mx + static_cast<float>(std::log(z));
  }
}

void window_importance(const float* window, int w, const float* lse, const float* keys, int64_t n, int d, float scale,
                       float* importance) {
  std::fill(importance, importance + n, 0.0f);
  if (n <= 0) return;
  const std::vector<float> l = window_logits(window, w, keys, n, d, scale);
  for (int j = 0; j < w; ++j)
    for (int64_t t = 0; t < n; ++t) importance[t] += std::exp(l[static_cast<size_t>(j * n + t)] - lse[j]);
}

void AttentionAccumulator::add(const float* probs, int64_t n) {
  if (n > n_) {
    std::vector<float> grown(static_cast<size_t>(heads_) * static_cast<size_t>(n), 0.0f);
    for (int h = 0; h < heads_; ++h)
      std::copy_n(sum_.data() + static_cast<int64_t>(h) * n_, n_, grown.data() + static_cast<int64_t>(h) * n);
    sum_.swap(grown);
    n_ = n;
  }
  for (int h = 0; h < heads_; ++h)
    for (int64_t t = 0; t < n; ++t) sum_[static_cast<size_t>(h * n_ + t)] += probs[h * n + t];
}

void AttentionAccumulator::truncate(int64_t n) noexcept {
  if (n >= n_) return;
  erase(n, n_ - n);
}

void AttentionAccumulator::erase(int64_t begin, int64_t count) noexcept {
  if (begin >= n_ || count <= 0) return;
  count = std::min(count, n_ - begin);
  const int64_t n = n_ - count;
  // every destination is at or before its source: one forward pass
  for (int h = 0; h < heads_; ++h)
    for (int64_t t = 0; t < n; ++t)
      sum_[static_cast<size_t>(h * n + t)] = sum_[static_cast<size_t>(h * n_ + (t < begin ? t : t + count))];
  sum_.resize(static_cast<size_t>(heads_ * n));
  n_ = n;
}

void make_anchor(Anchor kind, int heads, uint64_t seed, const uint64_t* bits, const int32_t* positions, int64_t n,
                 uint64_t* anchor) {
  const int words = signature_words(heads);
  std::fill(anchor, anchor + words, uint64_t{0});
  switch (kind) {
    case Anchor::kRandom: {
      uint64_t state = seed;
      for (int w = 0; w < words; ++w) anchor[w] = splitmix64(state);
      break;
    }
    case Anchor::kAlternating:
      for (int w = 0; w < words; ++w) anchor[w] = cuda::math::kvcrush_alternating_word(w, heads);
      break;
    case Anchor::kMajority: {
      std::vector<int64_t> count(static_cast<size_t>(heads), 0);
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t* row = bits + static_cast<int64_t>(positions[i]) * words;
        for (int h = 0; h < heads; ++h) count[static_cast<size_t>(h)] += (row[h / 64] >> (h % 64)) & 1u;
      }
      for (int h = 0; h < heads; ++h)
        if (2 * count[static_cast<size_t>(h)] > n) anchor[h / 64] |= uint64_t{1} << (h % 64);
      break;
    }
  }
  for (int w = 0; w < words; ++w) anchor[w] &= cuda::math::kvcrush_word_mask(w, heads);  // no bit past the heads
}

void order_by_distance(const uint64_t* bits, int words, int heads, const uint64_t* anchor, const int32_t* positions,
                       int64_t c, int32_t* ordered) {
  thread_local std::vector<uint16_t> distance;
  thread_local std::vector<int64_t> start;
  distance.resize(static_cast<size_t>(c));
  start.assign(static_cast<size_t>(heads) + 2, 0);
  for (int64_t i = 0; i < c; ++i) {
    const int dist = hamming_distance(bits + static_cast<int64_t>(positions[i]) * words, anchor, words);
    distance[static_cast<size_t>(i)] = static_cast<uint16_t>(std::min(dist, heads));
    ++start[static_cast<size_t>(distance[static_cast<size_t>(i)]) + 1];
  }
  for (int h = 1; h <= heads + 1; ++h) start[static_cast<size_t>(h)] += start[static_cast<size_t>(h - 1)];
  // stable: the candidates of one distance keep their (ascending) order
  for (int64_t i = 0; i < c; ++i) ordered[start[distance[static_cast<size_t>(i)]]++] = positions[i];
}

int64_t representatives(const uint64_t* bits, int words, int heads, const uint64_t* anchor, int64_t begin, int64_t end,
                        const int32_t* important, int64_t n_important, int64_t buckets, int32_t* ordered,
                        int32_t* reps) {
  const int64_t m = end - begin;
  buckets = std::min(buckets, m);
  if (buckets <= 0) return 0;
  std::vector<int32_t> all(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) all[static_cast<size_t>(i)] = static_cast<int32_t>(begin + i);
  order_by_distance(bits, words, heads, anchor, all.data(), m, ordered);
  std::vector<char> taken(static_cast<size_t>(m), 0);  // important, or already a representative
  for (int64_t i = 0; i < n_important; ++i) taken[static_cast<size_t>(important[i] - begin)] = 1;
  int64_t n = 0, missing = 0;
  for (int64_t b = 0; b < buckets; ++b) {
    const int64_t lo = bucket_begin(b, m, buckets), hi = bucket_begin(b + 1, m, buckets);
    int64_t i = lo;
    while (i < hi && taken[static_cast<size_t>(ordered[i] - begin)]) ++i;
    if (i == hi) {
      ++missing;
      continue;
    }
    reps[n++] = ordered[i];
    taken[static_cast<size_t>(ordered[i] - begin)] = 1;
  }
  for (int64_t i = 0; i < m && missing > 0; ++i)  // the places of buckets without a candidate
    if (!taken[static_cast<size_t>(ordered[i] - begin)]) {
      reps[n++] = ordered[i];
      taken[static_cast<size_t>(ordered[i] - begin)] = 1;
      --missing;
    }
  std::sort(reps, reps + n);
  return n;
}

BudgetSplit split_budget(int64_t budget, float share, int64_t max_buckets) noexcept {
  BudgetSplit s;
  if (budget <= 0) return s;
  int64_t r = static_cast<int64_t>(std::floor(static_cast<double>(share) * static_cast<double>(budget)));
  r = std::clamp<int64_t>(r, 0, budget);
  if (max_buckets > 0) r = std::min(r, max_buckets);
  s.representatives = r;
  s.important = budget - r;
  return s;
}

int64_t complement(int64_t begin, int64_t end, const int32_t* important, int64_t n_important, int32_t* out) {
  int64_t n = 0, i = 0;
  for (int64_t p = begin; p < end; ++p) {
    if (i < n_important && important[i] == p) {
      ++i;
      continue;
    }
    out[n++] = static_cast<int32_t>(p);
  }
  return n;
}

int64_t merge_selection(const int32_t* a, const float* a_scores, int64_t n_a, const int32_t* b, int64_t n_b,
                        float b_score, int32_t* out, float* out_scores) {
  // from the back, so that out may hold a in its first n_a entries
  int64_t i = n_a - 1, j = n_b - 1, o = n_a + n_b - 1;
  while (j >= 0) {
    if (i >= 0 && a[i] > b[j]) {
      out[o] = a[i];
      if (out_scores) out_scores[o] = a_scores[i];
      --i;
    } else {
      out[o] = b[j];
      if (out_scores) out_scores[o] = b_score;
      --j;
    }
    --o;
  }
  for (; i >= 0; --i, --o) {
    out[o] = a[i];
    if (out_scores) out_scores[o] = a_scores[i];
  }
  return n_a + n_b;
}

void crush_topk(const float* scores, int64_t n, int64_t budget, float share, int64_t max_buckets, const uint64_t* bits,
                int heads, const uint64_t* anchor, int32_t* out) {
  budget = std::clamp<int64_t>(budget, 0, n);
  const BudgetSplit s = split_budget(budget, share, max_buckets);
  topk_positions(scores, n, s.important, 0, out);
  if (s.representatives == 0) return;
  std::vector<int32_t> ordered(static_cast<size_t>(n)), reps(static_cast<size_t>(s.representatives));
  const int64_t r = representatives(bits, signature_words(heads), heads, anchor, 0, n, out, s.important,
                                    s.representatives, ordered.data(), reps.data());
  merge_selection(out, nullptr, s.important, reps.data(), r, 0.0f, out, nullptr);
}

}  // namespace kvret
