#include "engine/kvcrush_layer.hpp"

#include <algorithm>
#include <atomic>
#include <limits>

#include "core/parallel.hpp"
#include "index/retriever.hpp"
#include "math/kvcrush_math.h"
#include "select/kvcrush.hpp"
#include "select/topk.hpp"

namespace kvret {

namespace {
/// A value no state of the process had before (epoch()).
uint64_t next_epoch() noexcept {
  static std::atomic<uint64_t> last{0};
  return ++last;
}
/// Writes the merged row from the marks over the middle (`taken`: the row's tokens and the representatives;
/// `chosen`: the representatives), ascending, clearing every word it reads: without scores from the front (row is
/// not read); with them from the back, so that each important score is read before its place is written.
void write_merged_row(uint64_t* taken, uint64_t* chosen, size_t words, int64_t mid_begin, int32_t* row, float* scores,
                      int64_t n_important, int64_t count) {
  if (scores == nullptr) {
    int64_t o = 0;
    for (size_t w = 0; w < words && o < count; ++w) {
      uint64_t bits = taken[w];
      if (bits == 0) continue;
      taken[w] = 0;
      chosen[w] = 0;
      const int64_t base = mid_begin + static_cast<int64_t>(w) * 64;
      for (; bits != 0; bits &= bits - 1) row[o++] = static_cast<int32_t>(base + __builtin_ctzll(bits));
    }
    return;
  }
  int64_t o = count, i = n_important;
  for (size_t w = words; w-- > 0 && o > 0;) {
    uint64_t bits = taken[w];
    if (bits == 0) continue;
    const uint64_t reps = chosen[w];
    taken[w] = 0;
    chosen[w] = 0;
    const int64_t base = mid_begin + static_cast<int64_t>(w) * 64;
    while (bits != 0) {
      const int bit = 63 - __builtin_clzll(bits);
      bits &= ~(uint64_t{1} << bit);
      row[--o] = static_cast<int32_t>(base + bit);
      const bool rep = ((reps >> bit) & 1u) != 0;
      scores[o] = cuda::math::kvcrush_merged_score(rep, rep ? 0.0f : scores[--i]);
    }
  }
}

}  // namespace

void KvCrushLayer::init(int sig_heads, int kv_heads) {
  epoch_ = next_epoch();
  sig_heads_ = sig_heads;
  heads_ = kv_heads;
  group_ = sig_heads / kv_heads;
  words_ = signature_words(sig_heads);
  anchor_.resize(static_cast<size_t>(words_));
  make_anchor(Anchor::kAlternating, sig_heads, 0, nullptr, nullptr, 0, anchor_.data());
  by_distance_.resize(static_cast<size_t>(sig_heads) + 1);
  importance_by_distance_.resize(static_cast<size_t>(sig_heads) + 1);
}

std::vector<std::vector<float>> KvCrushLayer::kv_importance(const float* flat, int64_t count) const {
  std::vector<std::vector<float>> out(static_cast<size_t>(heads_));
  for (int h = 0; h < heads_; ++h) {
    std::vector<float>& o = out[static_cast<size_t>(h)];
    const float* first = flat + static_cast<int64_t>(h) * group_ * count;
    o.assign(first, first + count);
    for (int g = 1; g < group_; ++g) {  // the group's query heads in order
      const float* row = first + static_cast<int64_t>(g) * count;
      for (int64_t t = 0; t < count; ++t) o[static_cast<size_t>(t)] += row[t];
    }
  }
  return out;
}

void KvCrushLayer::append_tokens(const uint64_t* bits, const std::vector<std::vector<float>>& importance,
                                 int64_t count) {
  std::vector<int> distance(static_cast<size_t>(count));
  std::vector<int64_t> per(static_cast<size_t>(sig_heads_) + 1, 0);
  for (int64_t t = 0; t < count; ++t) {
    distance[static_cast<size_t>(t)] = cuda::math::kvcrush_alternating_distance(bits + t * words_, words_, sig_heads_);
    ++per[static_cast<size_t>(distance[static_cast<size_t>(t)])];
  }
  // everything that may throw first: the room in every list
  bits_.reserve(static_cast<size_t>((n_ + count) * words_));
  for (int d = 0; d <= sig_heads_; ++d) {
    const auto i = static_cast<size_t>(d);
    by_distance_[i].reserve(by_distance_[i].size() + static_cast<size_t>(per[i]));
    importance_by_distance_[i].reserve(importance_by_distance_[i].size() + static_cast<size_t>(per[i] * heads_));
  }
  bits_.resize(static_cast<size_t>(n_ * words_));
  bits_.insert(bits_.end(), bits, bits + count * words_);
  for (int64_t t = 0; t < count; ++t) {
    const auto d = static_cast<size_t>(distance[static_cast<size_t>(t)]);
    by_distance_[d].push_back(static_cast<int32_t>(n_ + t));
    for (int h = 0; h < heads_; ++h)
      importance_by_distance_[d].push_back(importance[static_cast<size_t>(h)][static_cast<size_t>(t)]);
  }
  n_ += count;
}

void KvCrushLayer::update(const HostKvStore& store, float scale, int n_threads, const float* queries, int q_heads,
                          int w) {
  const int64_t length = store.size();
  if (length <= n_) return;
  if (window_end_ == 0) {
    // the first signatures: every token against the window
    KvCrushLayer next;
    const bool from_keys = queries == nullptr;
    next.init(from_keys ? store.n_kv_heads() : q_heads, store.n_kv_heads());
    next.d_ = store.head_dim();
    next.w_ = from_keys ? static_cast<int>(std::min<int64_t>(kWindow, length)) : w;
    next.scale_ = scale;
    const int sig = next.sig_heads_, group = next.group_, d = next.d_, rows = next.w_;
    next.window_.resize(static_cast<size_t>(sig) * rows * d);
    if (!from_keys) std::copy_n(queries, next.window_.size(), next.window_.begin());
    next.lse_.resize(static_cast<size_t>(sig) * rows);
    next.threshold_.resize(static_cast<size_t>(sig));
    std::vector<float> flat(static_cast<size_t>(sig) * length);
    std::vector<uint64_t> bits(static_cast<size_t>(length) * next.words_);
    parallel_for(sig, n_threads, int64_t{rows} * length * sig >= SelectRequest::kParallelLogits, Schedule::kDynamic,
                 [&](int64_t s) {
                   const int kv = static_cast<int>(s / group);
                   std::vector<float> keys(static_cast<size_t>(length) * d);
                   float* win = next.window_.data() + s * rows * d;
                   if (from_keys) store.keys_f32(kv, length - rows, length, win);
                   store.keys_f32(kv, 0, length, keys.data());
                   snapkv_importance(win, rows, keys.data(), length, d, scale, flat.data() + s * length,
                                     next.lse_.data() + s * rows);
                 });
    signatures(flat.data(), sig, length, kMarkedFraction, bits.data());
    for (int h = 0; h < sig; ++h) {  // the smallest importance a head marked
      float t = std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < length; ++p)
        if ((bits[static_cast<size_t>(p * next.words_ + h / 64)] >> (h % 64)) & 1u)
          t = std::min(t, flat[static_cast<size_t>(h * length + p)]);
      next.threshold_[static_cast<size_t>(h)] = t;
    }
    next.append_tokens(bits.data(), next.kv_importance(flat.data(), length), length);
    next.window_end_ = length;
    *this = std::move(next);  // no throw
    return;
  }
  // later tokens: scored against the same window, marked at or above each signature head's threshold
  const int64_t added = length - n_;
  std::vector<float> keys(static_cast<size_t>(added) * d_);
  std::vector<float> flat(static_cast<size_t>(sig_heads_) * added);
  std::vector<uint64_t> bits(static_cast<size_t>(added) * words_, 0);
  for (int s = 0; s < sig_heads_; ++s) {
    if (s % group_ == 0) store.keys_f32(s / group_, n_, length, keys.data());
    float* is = flat.data() + static_cast<int64_t>(s) * added;
    window_importance(window_.data() + static_cast<int64_t>(s) * w_ * d_, w_,
                      lse_.data() + static_cast<int64_t>(s) * w_, keys.data(), added, d_, scale_, is);
    for (int64_t t = 0; t < added; ++t)
      if (is[t] >= threshold_[static_cast<size_t>(s)])
        bits[static_cast<size_t>(t * words_ + s / 64)] |= uint64_t{1} << (s % 64);
  }
  append_tokens(bits.data(), kv_importance(flat.data(), added), added);
}

void KvCrushLayer::rebuild_from_sums(const float* sums, int sig_heads, int64_t n_sums, int kv_heads, int64_t length,
                                     int64_t steps) {
  KvCrushLayer next;
  next.init(sig_heads, kv_heads);
  std::vector<float> flat(static_cast<size_t>(sig_heads) * length, 0.0f);
  for (int s = 0; s < sig_heads; ++s)
    std::copy_n(sums + static_cast<int64_t>(s) * n_sums, std::min(n_sums, length),
                flat.data() + static_cast<int64_t>(s) * length);
  std::vector<uint64_t> bits(static_cast<size_t>(length) * next.words_);
  if (length > 0) signatures(flat.data(), sig_heads, length, kMarkedFraction, bits.data());
  next.append_tokens(bits.data(), next.kv_importance(flat.data(), length), length);
  next.from_sums_ = true;
  next.sums_steps_ = steps;
  *this = std::move(next);  // no throw
}

void KvCrushLayer::truncate(int64_t length) noexcept {
  if (length >= n_) return;
  if (length < window_end_ || from_sums_) {  // the window's keys are gone (or sums to rebuild from): start again
    *this = KvCrushLayer{};
    return;
  }
  for (size_t d = 0; d < by_distance_.size(); ++d) {
    std::vector<int32_t>& list = by_distance_[d];
    const auto keep = static_cast<size_t>(std::lower_bound(list.begin(), list.end(), length) - list.begin());
    list.resize(keep);
    importance_by_distance_[d].resize(keep * static_cast<size_t>(heads_));
  }
  n_ = length;            // bits_ keeps its tail until the next append overwrites it
  epoch_ = next_epoch();  // rows from `length` on will hold other tokens
}

float KvCrushLayer::importance(int h, int64_t t) const noexcept {
  const int d = hamming_distance(bits_.data() + t * words_, anchor_.data(), words_);
  const std::vector<int32_t>& list = by_distance_[static_cast<size_t>(d)];
  const auto i = static_cast<size_t>(std::lower_bound(list.begin(), list.end(), t) - list.begin());
  return importance_by_distance_[static_cast<size_t>(d)][i * static_cast<size_t>(heads_) + static_cast<size_t>(h)];
}

void KvCrushLayer::importance_range(int h, int64_t begin, int64_t end, float* out) const noexcept {
  for (size_t d = 0; d < by_distance_.size(); ++d) {
    const std::vector<int32_t>& list = by_distance_[d];
    const std::vector<float>& imp = importance_by_distance_[d];  // [list.size(), heads_]: may be empty
    for (auto i = static_cast<size_t>(std::lower_bound(list.begin(), list.end(), begin) - list.begin());
         i < list.size() && list[i] < end; ++i)
      out[list[i] - begin] = imp[i * static_cast<size_t>(heads_) + static_cast<size_t>(h)];
  }
}

KvCrushLayer::MiddleOrder KvCrushLayer::middle_order(int64_t mid_begin, int64_t mid_end, int64_t buckets) const {
  MiddleOrder o;
  o.mid_begin = mid_begin;
  o.mid_end = mid_end;
  o.begin.resize(by_distance_.size());
  o.prefix.assign(by_distance_.size() + 1, 0);
  for (size_t d = 0; d < by_distance_.size(); ++d) {
    const std::vector<int32_t>& list = by_distance_[d];
    const auto size = static_cast<int64_t>(list.size());
    // at most mid_begin entries lie before the middle, at most n_ - mid_end after it
    const int64_t head = std::min(size, std::max<int64_t>(mid_begin, 0));
    const int64_t tail = std::min(size, std::max<int64_t>(n_ - mid_end, 0));
    const int64_t lo = std::lower_bound(list.begin(), list.begin() + head, mid_begin) - list.begin();
    const int64_t hi = std::lower_bound(list.end() - tail, list.end(), mid_end) - list.begin();
    o.begin[d] = lo;
    o.prefix[d + 1] = o.prefix[d] + std::max<int64_t>(hi - lo, 0);
  }
  const int64_t m = mid_end - mid_begin;
  if (buckets > 0 && n_ >= mid_end && o.prefix.back() == m) {
    o.buckets = cuda::math::kvcrush_bucket_count(buckets, m);
    o.first.resize(static_cast<size_t>(o.buckets));
    int d = 0;
    for (int64_t b = 0; b < o.buckets; ++b) {
      const int64_t k = cuda::math::kvcrush_bucket_begin(b, m, o.buckets);
      d = cuda::math::kvcrush_list_from(o.prefix.data(), d, k);
      o.first[static_cast<size_t>(b)] =
          by_distance_[static_cast<size_t>(d)]
                      [static_cast<size_t>(cuda::math::kvcrush_list_index(o.begin.data(), o.prefix.data(), d, k))];
    }
  }
  return o;
}

int64_t KvCrushLayer::add_representatives(int h, int64_t mid_begin, int64_t mid_end, int32_t* row, float* scores,
                                          int64_t n_important, int64_t n_rep) const {
  if (n_ < mid_end || mid_end <= mid_begin) return n_important;
  return add_representatives(h, middle_order(mid_begin, mid_end, n_rep), row, scores, n_important, n_rep);
}

int64_t KvCrushLayer::add_representatives(int h, const MiddleOrder& order, int32_t* row, float* scores,
                                          int64_t n_important, int64_t n_rep) const {
  (void)h;  // the representatives do not depend on the head beyond its important set
  const int64_t mid_begin = order.mid_begin, m = order.mid_end - order.mid_begin;
  // n_rep past the middle: min(n_rep, m) buckets, and never more than the candidates are added (the row is written
  // up to kvcrush_selected_count, at most m); a negative n_rep or an important row longer than the middle adds none
  const int64_t buckets = cuda::math::kvcrush_bucket_count(n_rep, m);
  if (buckets <= 0 || n_important < 0 || n_important > m || n_ < order.mid_end || order.prefix.empty() ||
      order.prefix.back() != m)
    return n_important;
  // `taken` marks the row and the representatives chosen over the middle; `chosen` the representatives alone. Both
  // are all zero between calls: the read-back below clears every word it set.
  thread_local std::vector<uint64_t> tls_taken, tls_chosen;
  std::vector<uint64_t>& taken_v = tls_taken;  // one lookup of each thread-local
  std::vector<uint64_t>& chosen_v = tls_chosen;
  const auto words = static_cast<size_t>((m + 63) / 64);
  if (taken_v.size() < words) {
    taken_v.resize(words, 0);
    chosen_v.resize(words, 0);
  }
  uint64_t* const taken = taken_v.data();
  uint64_t* const chosen = chosen_v.data();
  for (int64_t i = 0; i < n_important; ++i) {
    const int64_t off = row[i] - mid_begin;
    taken[off >> 6] |= uint64_t{1} << (off & 63);
  }
  const int64_t* const prefix = order.prefix.data();
  // the k-th middle token in (distance, position) order, k ascending: the list follows k
  size_t d = 0;
  const int32_t* list = by_distance_[0].data() + order.begin[0];  // list[k - prefix[d]] is the k-th token
  auto token = [&](int64_t k) {
    if (k < prefix[d]) {  // back to the start
      d = 0;
      list = by_distance_[0].data() + order.begin[0];
    }
    if (prefix[d + 1] <= k) {
      d = static_cast<size_t>(cuda::math::kvcrush_list_from(prefix, static_cast<int>(d), k));
      list = by_distance_[d].data() + order.begin[d];
    }
    return list[k - prefix[d]];
  };
  // takes the token at offset `off` from mid_begin when it is not taken
  auto take = [&](int64_t off) {
    const uint64_t bit = uint64_t{1} << (off & 63);
    if (taken[off >> 6] & bit) return false;
    taken[off >> 6] |= bit;
    chosen[off >> 6] |= bit;
    return true;
  };
  // takes the first middle token of order index in [k, hi) that is not taken; false when there is none
  auto take_first = [&](int64_t k, int64_t hi) {
    return cuda::math::kvcrush_take_first(k, hi, [&](int64_t e) { return take(token(e) - mid_begin); }) < hi;
  };
  const bool firsts = order.buckets == buckets && static_cast<int64_t>(order.first.size()) == buckets;
  int64_t found = 0, missing = 0;
  for (int64_t b = 0; b < buckets; ++b) {
    const int64_t lo = cuda::math::kvcrush_bucket_begin(b, m, buckets);
    // the bucket's first token, from the order's table when it has one (the common case: not important)
    const bool ok = (firsts && take(order.first[static_cast<size_t>(b)] - mid_begin)) ||
                    take_first(firsts ? lo + 1 : lo, cuda::math::kvcrush_bucket_begin(b + 1, m, buckets));
    ++(ok ? found : missing);
  }
  // the places of buckets without a candidate: the first candidates in the order not yet taken
  int64_t filled = 0;
  for (int64_t k = 0; k < m && cuda::math::kvcrush_fill_takes(filled, missing); ++k)
    if (take(token(k) - mid_begin)) ++filled;
  found += filled;
  const int64_t count = n_important + found;
  write_merged_row(taken, chosen, words, mid_begin, row, scores, n_important, count);
  return count;
}

KvCrushLayer::UnitOrder KvCrushLayer::unit_order(int64_t mid_begin, int64_t mid_end, int64_t granularity) const {
  UnitOrder o;
  o.mid_begin = mid_begin;
  o.mid_end = mid_end;
  o.granularity = granularity;
  if (mid_end <= mid_begin || granularity < 2 || n_ < mid_end || words_ == 0) return o;
  const int64_t first_unit = mid_begin / granularity, units = (mid_end - 1) / granularity - first_unit + 1;
  std::vector<int32_t> distance(static_cast<size_t>(units));
  std::vector<int32_t> ones(static_cast<size_t>(sig_heads_));
  std::vector<uint64_t> majority(static_cast<size_t>(words_));
  std::vector<int64_t> at(static_cast<size_t>(sig_heads_) + 2, 0);  // per distance: its units, then where they go
  for (int64_t u = 0; u < units; ++u) {
    const int64_t lo = std::max(mid_begin, (first_unit + u) * granularity);
    const int64_t hi = std::min(mid_end, (first_unit + u + 1) * granularity);
    std::fill(ones.begin(), ones.end(), 0);
    for (int64_t t = lo; t < hi; ++t)
      for (int w = 0; w < words_; ++w)
        for (uint64_t b = bits_[static_cast<size_t>(t * words_ + w)]; b != 0; b &= b - 1)
          ++ones[static_cast<size_t>(w * 64 + __builtin_ctzll(b))];
    std::fill(majority.begin(), majority.end(), 0);
    for (int i = 0; i < sig_heads_; ++i)
      if (2 * static_cast<int64_t>(ones[static_cast<size_t>(i)]) > hi - lo)
        majority[static_cast<size_t>(i / 64)] |= uint64_t{1} << (i % 64);
    const int d = hamming_distance(majority.data(), anchor_.data(), words_);
    distance[static_cast<size_t>(u)] = d;
    ++at[static_cast<size_t>(d) + 1];
  }
  for (size_t d = 1; d < at.size(); ++d) at[d] += at[d - 1];  // a stable counting sort: ties by position
  o.units.resize(static_cast<size_t>(units));
  for (int64_t u = 0; u < units; ++u)
    o.units[static_cast<size_t>(at[static_cast<size_t>(distance[static_cast<size_t>(u)])]++)] =
        static_cast<int32_t>(std::max(mid_begin, (first_unit + u) * granularity));
  return o;
}

int64_t KvCrushLayer::add_unit_representatives(const UnitOrder& order, int32_t* row, float* scores, int64_t n_important,
                                               int64_t n_rep) const {
  const int64_t mid_begin = order.mid_begin, m = order.mid_end - order.mid_begin, g = order.granularity;
  const auto units = static_cast<int64_t>(order.units.size());
  if (n_rep <= 0 || n_important < 0 || n_important >= m || units == 0 || g < 2) return n_important;
  const int64_t want = std::min(n_rep, m - n_important);  // the token rule's count of representatives
  const auto words = static_cast<size_t>((m + 63) / 64);
  std::vector<uint64_t> taken(words, 0), chosen(words, 0);
  for (int64_t i = 0; i < n_important; ++i) {
    const int64_t off = row[i] - mid_begin;
    taken[static_cast<size_t>(off >> 6)] |= uint64_t{1} << (off & 63);
  }
  int64_t added = 0;
  // takes the unit's tokens not yet taken, in position order, while the count allows; how many it took
  auto take_unit = [&](int64_t u) {
    const int64_t lo = order.units[static_cast<size_t>(u)];
    const int64_t hi = std::min(order.mid_end, (lo / g + 1) * g);
    int64_t took = 0;
    for (int64_t t = lo; t < hi && added < want; ++t) {
      const int64_t off = t - mid_begin;
      const uint64_t bit = uint64_t{1} << (off & 63);
      if (taken[static_cast<size_t>(off >> 6)] & bit) continue;
      taken[static_cast<size_t>(off >> 6)] |= bit;
      chosen[static_cast<size_t>(off >> 6)] |= bit;
      ++added;
      ++took;
    }
    return took;
  };
  const int64_t buckets = std::min(n_rep / g, units);
  for (int64_t b = 0; b < buckets && added < want; ++b) {
    const int64_t hi = cuda::math::kvcrush_bucket_begin(b + 1, units, buckets);
    for (int64_t u = cuda::math::kvcrush_bucket_begin(b, units, buckets); u < hi; ++u)
      if (take_unit(u) > 0) break;
  }
  for (int64_t u = 0; u < units && added < want; ++u) take_unit(u);  // the fill: whole units in order
  const int64_t count = n_important + added;
  write_merged_row(taken.data(), chosen.data(), words, mid_begin, row, scores, n_important, count);
  return count;
}

}  // namespace kvret
