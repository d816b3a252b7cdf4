#include "index/cluster_retriever.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/serial.hpp"
#include "core/vec_math.hpp"
#include "index/change_log.hpp"
#include "index/kmeans.hpp"
#include "math/cluster_math.h"
#include "math/kmeans_math.h"
#include "select/gqa_fold.hpp"
#include "select/grouped_take.hpp"

namespace kvret {

namespace {

constexpr int64_t kAssignBlock = 64;       ///< points scored against every centroid at a time
constexpr int64_t kParallelTokens = 1024;  ///< below this an extend runs on the calling thread (decode intervals)

/// Unit rows of x [n, d]; a zero (or non-finite) row stays zero (kmeans_math.h).
void normalize_rows(const float* x, int64_t n, int d, float* out) {
  for (int64_t i = 0; i < n; ++i) cuda::math::kmeans_unit_row(x + i * d, d, out + i * d);
}

/// The centroid of maximum cosine (ties: the lower index) of each of n unit rows against k unit centroids: writes
/// labels and cosines, returns how many labels changed.
int64_t assign_max_cosine(const float* xn, int64_t n, int d, const float* directions, int k, int32_t* labels,
                          float* cosine, std::vector<float>& scratch) {
  scratch.resize(static_cast<size_t>(kAssignBlock) * k);
  int64_t changed = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kAssignBlock) {
    const int64_t m = std::min(kAssignBlock, n - i0);
    scaled_dots(xn + i0 * d, d, static_cast<int>(m), directions, d, k, d, 1.0f, scratch.data(), k);
    for (int64_t p = 0; p < m; ++p) {
      const float* s = scratch.data() + p * k;  // scaled_dots with scale 1: kmeans_cosine's bits (dot8's order)
      const int32_t best = cuda::math::kmeans_argmax(s, k);
      int32_t& label = labels[i0 + p];
      if (label != best) {
        ++changed;
        label = best;
      }
      cosine[i0 + p] = s[best];
    }
  }
  return changed;
}

/// The seg.exacts points of lowest cosine to their cluster's direction (ties: the earlier position), marked in
/// `exact` ([n]); the rest keep their labels.
void mark_exact(const float* keys, int64_t n, int d, const CosineKmeansResult& km, int64_t exacts,
                std::vector<uint8_t>& exact) {
  exact.assign(static_cast<size_t>(n), 0);
  if (exacts <= 0) return;
  std::vector<std::pair<float, int64_t>> fit(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float* dir = km.directions.data() + static_cast<size_t>(km.labels[static_cast<size_t>(i)]) * d;
    fit[static_cast<size_t>(i)] = {cuda::math::kmeans_fit(keys + i * d, dir, d), i};
  }
  const auto cut = fit.begin() + std::min(exacts, n);
  std::nth_element(fit.begin(), cut - 1, fit.end());
  for (auto it = fit.begin(); it != cut; ++it) exact[static_cast<size_t>(it->second)] = 1;
}

/// One (head, segment)'s part of the index, built by `builder` (the backend's device) or on the CPU.
void cluster_segment(const HostKvStore& store, int head, int d, const ClusterRetriever::Segment& seg, uint64_t seed,
                     const ClusterRetriever::Params& params, const ClusterSegmentBuilder* builder,
                     ClusterSegmentIndex& out) {
  const int64_t n = seg.end - seg.begin;
  std::vector<float> keys(static_cast<size_t>(n) * d);
  store.keys_f32(head, seg.begin, seg.end, keys.data());
  ClusterSegmentJob job;
  job.keys = keys.data();
  job.n = n;
  job.d = d;
  job.k = seg.clusters;
  job.exacts = seg.exacts;
  job.begin = seg.begin;
  job.seed = seed;
  job.max_iters = params.max_iters;
  job.sample = static_cast<int64_t>(params.sample_per_cluster) * seg.clusters;
  out = builder != nullptr ? builder->build(job) : cluster_segment_index(job);
  out.kmeans = CosineKmeansResult{};  // only the layout is kept
}

/// Reserves room for `needed` elements, growing geometrically (decode appends a segment now and then).
template <class T>
void reserve_for(std::vector<T>& v, size_t needed) {
  if (v.capacity() < needed) v.reserve(std::max(needed, v.capacity() + v.capacity() / 2));
}

}  // namespace

CosineKmeansResult cosine_kmeans(const float* x, int64_t n, int d, int k, uint64_t seed, int max_iters,
                                 int64_t sample) {
  CosineKmeansResult r;
  k = std::max(1, k);
  r.directions.assign(static_cast<size_t>(k) * d, 0.0f);
  if (n <= 0) return r;
  std::vector<float> xn(static_cast<size_t>(n) * d);
  normalize_rows(x, n, d, xn.data());

  // the training points: all of them, or a sample of at least k drawn without repeats, in their order
  const std::vector<int64_t> order = cosine_kmeans_sample(n, k, seed, sample);
  const auto m = order.empty() ? n : static_cast<int64_t>(order.size());
  std::vector<float> drawn;
  if (m < n) {
    drawn.resize(static_cast<size_t>(m) * d);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(drawn.data() + i * d, xn.data() + order[static_cast<size_t>(i)] * d,
                  sizeof(float) * static_cast<size_t>(d));
  }
  const float* train = m < n ? drawn.data() : xn.data();
  r.trained = m;

  forgy_init(train, m, d, d, k, seed, r.directions.data());  // the seeds: k of the points, drawn without repeats

  std::vector<int32_t> labels(static_cast<size_t>(m), -1);
  std::vector<float> cosine(static_cast<size_t>(m));
  std::vector<float> scratch;
  std::vector<double> sums(static_cast<size_t>(k) * d);
  std::vector<int64_t> counts(static_cast<size_t>(k));
  const int iters = std::max(1, max_iters);
  for (int it = 0; it < iters; ++it) {
    const int64_t changed =
        assign_max_cosine(train, m, d, r.directions.data(), k, labels.data(), cosine.data(), scratch);
    double objective = 0;
    for (const float c : cosine) objective += c;
    r.objective.push_back(objective);
    r.iterations = it + 1;
    if (changed == 0 || it + 1 == iters) break;  // settled, or the cap: directions stay the ones assigned to

    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < m; ++i) {
      const size_t c = static_cast<size_t>(labels[static_cast<size_t>(i)]);
      ++counts[c];
      const float* xi = train + i * d;
      double* s = &sums[c * static_cast<size_t>(d)];
      for (int t = 0; t < d; ++t) s[t] = cuda::math::kmeans_sum_step(s[t], xi[t]);
    }
    std::vector<int64_t> lowest;  // points by increasing cosine, built only if a centroid emptied
    size_t next_low = 0;
    for (int j = 0; j < k; ++j) {
      float* c = &r.directions[static_cast<size_t>(j) * d];
      const double* s = &sums[static_cast<size_t>(j) * d];
      if (counts[static_cast<size_t>(j)] > 0) {
        // a sum of zero keeps the centroid: the cluster's cosines are 0 whatever it is
        cuda::math::kmeans_direction(s, d, c);
        continue;
      }
      if (lowest.empty()) {
        lowest.resize(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) lowest[static_cast<size_t>(i)] = i;
        std::sort(lowest.begin(), lowest.end(), [&](int64_t a, int64_t b) {
          return cosine[static_cast<size_t>(a)] < cosine[static_cast<size_t>(b)] ||
                 (cosine[static_cast<size_t>(a)] == cosine[static_cast<size_t>(b)] && a < b);
        });
      }
      const int64_t p = lowest[next_low++ % lowest.size()];
      std::memcpy(c, train + p * d, sizeof(float) * static_cast<size_t>(d));
    }
  }
  if (m == n) {
    r.labels = std::move(labels);
  } else {  // every point, once, to the max-cosine of the trained directions
    r.labels.assign(static_cast<size_t>(n), -1);
    cosine.resize(static_cast<size_t>(n));
    assign_max_cosine(xn.data(), n, d, r.directions.data(), k, r.labels.data(), cosine.data(), scratch);
  }
  return r;
}

std::vector<int64_t> cosine_kmeans_sample(int64_t n, int k, uint64_t seed, int64_t sample) {
  const int64_t m = sample > 0 ? std::min(n, std::max<int64_t>(sample, k)) : n;
  if (m >= n) return {};
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  uint64_t state = seed ^ 0x73616d706c65ull;  // another stream than forgy_init's
  for (int64_t i = 0; i < m; ++i) {
    const int64_t j = i + static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(n - i));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  order.resize(static_cast<size_t>(m));
  std::sort(order.begin(), order.end());
  return order;
}

ClusterSegmentIndex cluster_segment_index(const ClusterSegmentJob& job) {
  const int64_t n = job.n;
  const int d = job.d;
  const int k = job.k;
  ClusterSegmentIndex out;
  out.kmeans = cosine_kmeans(job.keys, n, d, k, job.seed, job.max_iters, job.sample);
  const CosineKmeansResult& km = out.kmeans;
  std::vector<uint8_t> exact;
  mark_exact(job.keys, n, d, km, job.exacts, exact);
  for (int64_t i = 0; i < n; ++i)
    if (exact[static_cast<size_t>(i)]) {
      out.exact_pos.push_back(static_cast<int32_t>(job.begin + i));
      out.exact_keys.insert(out.exact_keys.end(), job.keys + i * d, job.keys + (i + 1) * d);
    }

  std::vector<int32_t>& sizes = out.sizes;
  sizes.assign(static_cast<size_t>(k), 0);
  for (int64_t i = 0; i < n; ++i)
    if (!exact[static_cast<size_t>(i)]) ++sizes[static_cast<size_t>(km.labels[static_cast<size_t>(i)])];
  std::vector<int64_t> next(static_cast<size_t>(k), 0);  // stable counting sort by label
  for (int j = 1; j < k; ++j)
    next[static_cast<size_t>(j)] = next[static_cast<size_t>(j - 1)] + sizes[static_cast<size_t>(j - 1)];
  out.ids.assign(static_cast<size_t>(n - job.exacts), 0);
  for (int64_t i = 0; i < n; ++i)
    if (!exact[static_cast<size_t>(i)])
      out.ids[static_cast<size_t>(next[static_cast<size_t>(km.labels[static_cast<size_t>(i)])]++)] =
          static_cast<int32_t>(job.begin + i);

  // scoring centroids: the raw mean of each cluster's keys (q . mu is the cluster's mean logit)
  std::vector<double> sums(static_cast<size_t>(k) * d, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (exact[static_cast<size_t>(i)]) continue;
    double* s = sums.data() + static_cast<size_t>(km.labels[static_cast<size_t>(i)]) * d;
    const float* key = job.keys + static_cast<size_t>(i) * d;
    for (int t = 0; t < d; ++t) s[t] = cuda::math::kmeans_sum_step(s[t], key[t]);
  }
  out.centroids.assign(static_cast<size_t>(k) * d, 0.0f);
  for (int j = 0; j < k; ++j) {
    const int32_t size = sizes[static_cast<size_t>(j)];
    if (size == 0) continue;
    for (int t = 0; t < d; ++t)
      out.centroids[static_cast<size_t>(j) * d + t] =
          cuda::math::kmeans_mean(sums[static_cast<size_t>(j) * d + t], size);
  }
  return out;
}

ClusterRetriever::ClusterRetriever(int n_kv_heads, int head_dim, const Params& params)
    : n_kv_(n_kv_heads),
      d_(head_dim),
      params_(params),
      centroids_(static_cast<size_t>(n_kv_heads)),
      sizes_(static_cast<size_t>(n_kv_heads)),
      offsets_(static_cast<size_t>(n_kv_heads), std::vector<int32_t>{0}),
      ids_(static_cast<size_t>(n_kv_heads)),
      exact_pos_(static_cast<size_t>(n_kv_heads)),
      exact_keys_(static_cast<size_t>(n_kv_heads)),
      version_(ChangeLog::next_version()) {
  require(params.cluster_tokens >= 1 && params.decode_interval >= 1 && params.decode_k >= 1, KVRET_ERR_INVALID_ARGUMENT,
          "cluster_tokens, cluster_decode_interval and cluster_decode_k must be >= 1");
  require(params.segment_tokens >= 0 && params.sample_per_cluster >= 0, KVRET_ERR_INVALID_ARGUMENT,
          "segment_tokens and sample_per_cluster must be >= 0");
  require(params.exact_fraction >= 0.0f && params.exact_fraction <= 0.5f, KVRET_ERR_INVALID_ARGUMENT,
          "exact_fraction must be in [0, 0.5]");
  require(head_dim >= 1 && head_dim <= kMaxHeadDim, KVRET_ERR_INVALID_ARGUMENT, "head_dim above kMaxHeadDim");
}

uint64_t ClusterRetriever::segment_seed(int head, int64_t begin) const noexcept {
  uint64_t state =
      params_.seed + static_cast<uint64_t>(head) * 0x632be59bd9b4e019ull + static_cast<uint64_t>(begin) * 0x85157af5ull;
  return splitmix64(state);
}

int64_t ClusterRetriever::bytes() const noexcept {
  int64_t b = static_cast<int64_t>(segments_.size() * sizeof(Segment));
  for (int h = 0; h < n_kv_; ++h) {
    const auto i = static_cast<size_t>(h);
    b += static_cast<int64_t>((centroids_[i].size() + exact_keys_[i].size()) * sizeof(float) +
                              // offsets: the leading 0 is not counted
                              (sizes_[i].size() + offsets_[i].size() - 1 + ids_[i].size() + exact_pos_[i].size()) *
                                  sizeof(int32_t));
  }
  return b;
}

void ClusterRetriever::on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain,
                                 int n_threads) {
  const int64_t base = base_ < 0 ? begin : base_;
  int64_t clustered = segments_.empty() ? base : segments_.back().end;
  int64_t next_cluster = clusters();
  int64_t next_exact = exacts();
  std::vector<Segment> fresh;
  const auto add = [&](int64_t seg_end, int64_t k) {
    const int64_t len = seg_end - clustered;
    k = std::min(k, len);
    // ceil(fraction * len), leaving at least one token per cluster
    const int64_t e = std::min(
        static_cast<int64_t>(std::ceil(static_cast<double>(params_.exact_fraction) * static_cast<double>(len))),
        len - k);
    KVRET_REQUIRE(next_cluster + k <= std::numeric_limits<int32_t>::max() &&
                      next_exact + e <= std::numeric_limits<int32_t>::max(),
                  KVRET_ERR_INTERNAL, "too many clusters");
    fresh.push_back({clustered, seg_end, static_cast<int32_t>(next_cluster), static_cast<int32_t>(k),
                     static_cast<int32_t>(next_exact), static_cast<int32_t>(e)});
    next_cluster += k;
    next_exact += e;
    clustered = seg_end;
  };
  if (may_retrain) {  // a prefill: everything not yet clustered, pending decode tokens included, in equal segments
    const int64_t start = clustered, n = end - start;
    const int64_t parts = params_.segment_tokens > 0 ? (n + params_.segment_tokens - 1) / params_.segment_tokens : 1;
    for (int64_t i = 1; i <= parts && n > 0; ++i) {
      const int64_t seg_end = start + n * i / parts;
      add(seg_end, (seg_end - clustered + params_.cluster_tokens - 1) / params_.cluster_tokens);
    }
  } else {  // decode: every full interval of pending tokens
    while (end - clustered >= params_.decode_interval) add(clustered + params_.decode_interval, params_.decode_k);
  }
  if (fresh.empty()) return;  // the new tokens wait in the pending tail

  // Cluster aside; everything that may throw happens before the commit.
  // one task per (head, segment): a long prefill's segments keep more threads busy than its heads alone
  const auto n_fresh = static_cast<int64_t>(fresh.size());
  std::vector<ClusterSegmentIndex> tails(static_cast<size_t>(n_kv_ * n_fresh));  // [head][segment]
  // (a device builder takes them one at a time: its passes are parallel themselves)
  parallel_for(n_kv_ * n_fresh, n_threads, builder_ == nullptr && clustered - fresh.front().begin >= kParallelTokens,
               Schedule::kDynamic, [&](int64_t task) {
                 const auto h = static_cast<int>(task / n_fresh);
                 const Segment& seg = fresh[static_cast<size_t>(task % n_fresh)];
                 cluster_segment(store, h, d_, seg, segment_seed(h, seg.begin), params_, builder_.get(),
                                 tails[static_cast<size_t>(task)]);
               });
  const auto total_clusters = static_cast<size_t>(next_cluster);
  const auto total_exact = static_cast<size_t>(next_exact);
  const auto total_ids = static_cast<size_t>(clustered - base) - total_exact;
  reserve_for(segments_, segments_.size() + fresh.size());
  reserve_for(stamps_, segments_.size() + fresh.size());
  for (int h = 0; h < n_kv_; ++h) {
    const auto i = static_cast<size_t>(h);
    reserve_for(centroids_[i], total_clusters * static_cast<size_t>(d_));
    reserve_for(sizes_[i], total_clusters);
    reserve_for(offsets_[i], total_clusters + 1);
    reserve_for(ids_[i], total_ids);
    reserve_for(exact_pos_[i], total_exact);
    reserve_for(exact_keys_[i], total_exact * static_cast<size_t>(d_));
  }

  // commit (no throw below: every insert fits the reserved capacity)
  const uint64_t version = ChangeLog::next_version();
  segments_.insert(segments_.end(), fresh.begin(), fresh.end());
  stamps_.resize(segments_.size(), version);
  for (int h = 0; h < n_kv_; ++h) {
    const auto i = static_cast<size_t>(h);
    for (int64_t f = 0; f < n_fresh; ++f) {  // the head's segments in order
      const ClusterSegmentIndex& t = tails[static_cast<size_t>(h * n_fresh + f)];
      centroids_[i].insert(centroids_[i].end(), t.centroids.begin(), t.centroids.end());
      sizes_[i].insert(sizes_[i].end(), t.sizes.begin(), t.sizes.end());
      for (const int32_t s : t.sizes) offsets_[i].push_back(offsets_[i].back() + s);
      ids_[i].insert(ids_[i].end(), t.ids.begin(), t.ids.end());
      exact_pos_[i].insert(exact_pos_[i].end(), t.exact_pos.begin(), t.exact_pos.end());
      exact_keys_[i].insert(exact_keys_[i].end(), t.exact_keys.begin(), t.exact_keys.end());
    }
  }
  version_ = version;
}

bool ClusterRetriever::can_cut(int64_t end) const noexcept {
  if (base_ < 0 || end >= end_ || end <= base_ || end >= clustered_end()) return true;
  return std::any_of(segments_.begin(), segments_.end(), [end](const Segment& s) { return s.begin == end; });
}

void ClusterRetriever::on_cut(const HostKvStore&, int64_t end) noexcept {
  size_t keep = segments_.size();
  while (keep > 0 && (end <= base_ || segments_[keep - 1].begin >= end)) --keep;
  if (keep < segments_.size()) version_ = ChangeLog::next_version();
  segments_.resize(keep);  // shrinking: no allocation
  stamps_.resize(keep);
  const auto c = static_cast<size_t>(clusters());
  const auto e = static_cast<size_t>(exacts());
  for (int h = 0; h < n_kv_; ++h) {
    const auto i = static_cast<size_t>(h);
    centroids_[i].resize(c * static_cast<size_t>(d_));
    sizes_[i].resize(c);
    offsets_[i].resize(c + 1);
    ids_[i].resize(static_cast<size_t>(offsets_[i].back()));
    exact_pos_[i].resize(e);
    exact_keys_[i].resize(e * static_cast<size_t>(d_));
  }
}

int64_t ClusterRetriever::select(const HostKvStore& store, const SelectRequest& r, int32_t* const* out_rows,
                                 float* const* out_scores) const {
  require_covers(r, "cluster");
  const int64_t n_clusters = clusters();
  const int64_t first_pending = clustered_end();
  const int64_t n_pending = end_ - first_pending;
  const int64_t n_exact = exacts();
  const int64_t singles = n_clusters + n_exact;  // where the pending tokens' groups begin
  const int64_t groups = singles + n_pending;    // every cluster, every exact singleton, every pending token alone
  const int group = r.group;
  const auto d = static_cast<size_t>(d_);
  namespace cm = cuda::math;

  parallel_for(n_kv_, r.n_threads, r.parallel(), Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<size_t>(h_i);
    const float* q = r.q + h * static_cast<size_t>(group) * d;
    std::vector<float> logits(static_cast<size_t>(group * groups));  // [group, groups]
    std::vector<float> folded(static_cast<size_t>(groups));
    std::vector<int32_t> weight(static_cast<size_t>(groups), 1);
    std::vector<uint8_t> state(static_cast<size_t>(groups));
    std::vector<uint64_t> keys;
    std::vector<uint64_t> picked;  // position << 32 | group
    picked.reserve(static_cast<size_t>(r.budget));

    if (n_clusters > 0)
      scaled_dots(q, d_, group, centroids_[h].data(), d_, n_clusters, d_, r.scale, logits.data(), groups);
    if (n_exact > 0)  // the exact singletons: their own logits
      scaled_dots(q, d_, group, exact_keys_[h].data(), d_, n_exact, d_, r.scale, logits.data() + n_clusters, groups);
    if (n_pending > 0) {  // pending decode tokens: their exact logits
      std::vector<float> pending_keys(static_cast<size_t>(n_pending) * d);
      store.keys_f32(static_cast<int>(h), first_pending, end_, pending_keys.data());
      scaled_dots(q, d_, group, pending_keys.data(), d_, n_pending, d_, r.scale, logits.data() + singles, groups);
    }
    std::copy(sizes_[h].begin(), sizes_[h].end(), weight.begin());
    // kernels/math/cluster_math.h, which the CUDA backend's device select runs too: the same bits on both
    // (scaled_dots above is cluster_logit's dot8 order, blocked)
    if (r.fold == KVRET_FOLD_MAX_LOGIT) {
      std::fill(folded.begin(), folded.end(), cm::neg_inf());
      for (int g = 0; g < group; ++g) {
        const float* l = logits.data() + static_cast<size_t>(g) * groups;
        for (int64_t u = 0; u < groups; ++u)
          folded[static_cast<size_t>(u)] = cm::cluster_max_step(folded[static_cast<size_t>(u)], l[u]);
      }
    } else if (cpu_has_avx2()) {
      // the AVX2 softmax of gqa_fold.cpp: cluster_softmax_terms' bits, eight groups at a time (test_device_select.cpp
      // checks that the two agree bit for bit)
      fold_weighted_logits(logits.data(), weight.data(), group, groups, r.fold, folded.data());
    } else {
      std::fill(folded.begin(), folded.end(), 0.0f);
      for (int g = 0; g < group; ++g) {
        float* e = logits.data() + static_cast<size_t>(g) * groups;
        const cm::PageSoftmax s = cm::cluster_softmax_terms(e, groups, sizes_[h].data(), n_clusters);
        if (s.used)
          for (int64_t u = 0; u < groups; ++u)
            folded[static_cast<size_t>(u)] = cm::cluster_sum_prob_step(folded[static_cast<size_t>(u)], e[u], s);
      }
    }
    // whole clusters best first; the cluster that crosses the budget keeps its earliest positions: grouped_take's
    // quickselect makes cluster_order_key's and cluster_take's decisions (test_device_select.cpp checks it)
    const int64_t quota = grouped_take(folded.data(), weight.data(), groups, r.budget, keys, state.data());
    const int32_t* ids = ids_[h].data();
    const int32_t* offsets = offsets_[h].data();
    for (int64_t c = 0; c < n_clusters; ++c) {
      if (state[static_cast<size_t>(c)] == kSkip) continue;
      const int64_t count = state[static_cast<size_t>(c)] == kTrim ? quota : weight[static_cast<size_t>(c)];
      for (int64_t t = 0; t < count; ++t)
        picked.push_back(static_cast<uint64_t>(ids[offsets[c] + t]) << 32 | static_cast<uint64_t>(c));
    }
    for (int64_t x = 0; x < n_exact; ++x)
      if (state[static_cast<size_t>(n_clusters + x)] != kSkip)
        picked.push_back(static_cast<uint64_t>(exact_pos_[h][static_cast<size_t>(x)]) << 32 |
                         static_cast<uint64_t>(n_clusters + x));
    for (int64_t p = 0; p < n_pending; ++p)
      if (state[static_cast<size_t>(singles + p)] != kSkip)
        picked.push_back(static_cast<uint64_t>(first_pending + p) << 32 | static_cast<uint64_t>(singles + p));
    KVRET_REQUIRE(
        static_cast<int64_t>(picked.size()) == r.budget, KVRET_ERR_INTERNAL,
        "cluster select took " + std::to_string(picked.size()) + " tokens for a budget of " + std::to_string(r.budget));
    std::sort(picked.begin(), picked.end());  // ascending positions
    int32_t* out = out_rows[h];
    for (size_t i = 0; i < picked.size(); ++i) out[i] = static_cast<int32_t>(picked[i] >> 32);
    if (out_scores != nullptr)  // a token shares its cluster's score
      for (size_t i = 0; i < picked.size(); ++i) out_scores[h][i] = folded[picked[i] & 0xffffffffu];
  });
  return r.budget;
}

namespace {
constexpr uint32_t kClusterTag = 0x434c5553u;  // "CLUS"
}

std::vector<std::byte> ClusterRetriever::save() const {
  ByteWriter w;
  write_header(w, kClusterTag, 2);
  w.value<int32_t>(n_kv_);
  w.value<int32_t>(d_);
  w.value<int32_t>(params_.cluster_tokens);
  w.value<int32_t>(params_.decode_interval);
  w.value<int32_t>(params_.decode_k);
  w.value<int32_t>(params_.max_iters);
  w.value<uint64_t>(params_.seed);
  w.value<float>(params_.exact_fraction);
  write_range(w);
  std::vector<int64_t> bounds;  // begin of every segment, then the end of the last
  std::vector<int32_t> counts, exact_counts;
  for (const Segment& s : segments_) {
    bounds.push_back(s.begin);
    counts.push_back(s.clusters);
    exact_counts.push_back(s.exacts);
  }
  if (!segments_.empty()) bounds.push_back(segments_.back().end);
  w.array(bounds);
  w.array(counts);
  w.array(exact_counts);
  for (int h = 0; h < n_kv_; ++h) {
    const auto i = static_cast<size_t>(h);
    w.array(centroids_[i]);
    w.array(sizes_[i]);
    w.array(ids_[i]);
    w.array(exact_pos_[i]);
    w.array(exact_keys_[i]);
  }
  return std::move(w.bytes());
}

void ClusterRetriever::restore(const HostKvStore& store, const std::byte* data, size_t size) {
  ByteReader r(data, size);
  read_header(r, kClusterTag, 2);
  require_intact(r.value<int32_t>() == n_kv_ && r.value<int32_t>() == d_, "another geometry than this context's");
  require_intact(r.value<int32_t>() == params_.cluster_tokens && r.value<int32_t>() == params_.decode_interval &&
                     r.value<int32_t>() == params_.decode_k && r.value<int32_t>() == params_.max_iters &&
                     r.value<uint64_t>() == params_.seed && r.value<float>() == params_.exact_fraction,
                 "other cluster parameters (or another layer's seed) than this retriever's");
  const auto range = read_range(r, store);
  const bool empty = range.first < 0;
  const auto bounds = r.array<int64_t>();
  const auto counts = r.array<int32_t>();
  const auto exact_counts = r.array<int32_t>(static_cast<int64_t>(counts.size()));
  require_intact(bounds.size() == (counts.empty() ? 0 : counts.size() + 1), "segment bounds and counts disagree");
  require_intact(!empty || counts.empty(), "segments in an empty index");
  std::vector<Segment> segments;
  int64_t total_clusters = 0, total_exact = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    const int64_t b = bounds[s], e = bounds[s + 1];
    require_intact(b < e && counts[s] >= 1 && exact_counts[s] >= 0 && counts[s] + exact_counts[s] <= e - b,
                   "a malformed segment");
    require_intact(total_clusters + counts[s] <= std::numeric_limits<int32_t>::max() &&
                       total_exact + exact_counts[s] <= std::numeric_limits<int32_t>::max(),
                   "too many clusters");
    segments.push_back(
        {b, e, static_cast<int32_t>(total_clusters), counts[s], static_cast<int32_t>(total_exact), exact_counts[s]});
    total_clusters += counts[s];
    total_exact += exact_counts[s];
  }
  require_intact(counts.empty() || (bounds.front() == range.first && bounds.back() <= range.second),
                 "segments outside the indexed range");
  const int64_t first = empty ? 0 : range.first;
  const int64_t clustered = counts.empty() ? 0 : bounds.back() - first;

  std::vector<std::vector<float>> centroids(static_cast<size_t>(n_kv_)), exact_keys(static_cast<size_t>(n_kv_));
  std::vector<std::vector<int32_t>> sizes(static_cast<size_t>(n_kv_)), offsets(static_cast<size_t>(n_kv_)),
      ids(static_cast<size_t>(n_kv_)), exact_pos(static_cast<size_t>(n_kv_));
  std::vector<uint8_t> seen(static_cast<size_t>(clustered));
  for (int h = 0; h < n_kv_; ++h) {
    const auto i = static_cast<size_t>(h);
    centroids[i] = r.array<float>(total_clusters * d_);
    sizes[i] = r.array<int32_t>(total_clusters);
    ids[i] = r.array<int32_t>(clustered - total_exact);
    exact_pos[i] = r.array<int32_t>(total_exact);
    exact_keys[i] = r.array<float>(total_exact * d_);
    offsets[i].assign(static_cast<size_t>(total_clusters) + 1, 0);
    std::fill(seen.begin(), seen.end(), uint8_t{0});
    for (const Segment& s : segments) {
      for (int32_t x = s.first_exact; x < s.first_exact + s.exacts; ++x) {  // ascending, inside the segment, once
        const int32_t pos = exact_pos[i][static_cast<size_t>(x)];
        require_intact(
            pos >= s.begin && pos < s.end && (x == s.first_exact || pos > exact_pos[i][static_cast<size_t>(x - 1)]),
            "an exact position outside its segment or out of order");
        seen[static_cast<size_t>(pos - first)] = 1;
      }
      int64_t tokens = s.exacts;
      for (int32_t c = s.first_cluster; c < s.first_cluster + s.clusters; ++c) {
        const int32_t n = sizes[i][static_cast<size_t>(c)];
        require_intact(n >= 0 && n <= s.end - s.begin - tokens, "cluster sizes that do not fill their segment");
        const int64_t at = offsets[i][static_cast<size_t>(c)];
        offsets[i][static_cast<size_t>(c) + 1] = static_cast<int32_t>(at + n);
        for (int64_t t = 0; t < n; ++t) {  // positions of the segment, ascending within the cluster, each once
          const int32_t pos = ids[i][static_cast<size_t>(at + t)];
          require_intact(pos >= s.begin && pos < s.end && (t == 0 || pos > ids[i][static_cast<size_t>(at + t - 1)]),
                         "a clustered position outside its segment or out of order");
          uint8_t& mark = seen[static_cast<size_t>(pos - first)];
          require_intact(mark == 0, "a position in two clusters");
          mark = 1;
        }
        tokens += n;
      }
      require_intact(tokens == s.end - s.begin, "cluster sizes that do not fill their segment");
    }
  }
  require_intact(r.left() == 0, "trailing bytes");
  std::vector<uint64_t> stamps(segments.size());
  const uint64_t version = ChangeLog::next_version();
  std::fill(stamps.begin(), stamps.end(), version);
  // commit
  segments_.swap(segments);
  stamps_.swap(stamps);
  centroids_.swap(centroids);
  sizes_.swap(sizes);
  offsets_.swap(offsets);
  ids_.swap(ids);
  exact_pos_.swap(exact_pos);
  exact_keys_.swap(exact_keys);
  set_range(range);
  version_ = version;
}

namespace {

class ClusterKind final : public RetrieverKind {
 public:
  explicit ClusterKind(std::shared_ptr<const ClusterSegmentBuilder> builder = nullptr) : builder_(std::move(builder)) {}
  const char* name() const noexcept override { return "cluster"; }
  std::unique_ptr<Retriever> make(const kvret_config& c, int layer) const override {
    ClusterRetriever::Params p;
    p.cluster_tokens = c.cluster_tokens;
    p.decode_interval = c.cluster_decode_interval;
    p.decode_k = c.cluster_decode_k;
    p.segment_tokens = c.cluster_segment_tokens;
    p.exact_fraction = c.cluster_exact_fraction;
    uint64_t state = c.seed ^ (static_cast<uint64_t>(layer) << 32) ^ 0x436c75737465724bull;
    p.seed = splitmix64(state);
    auto r = std::make_unique<ClusterRetriever>(c.n_kv_heads, c.head_dim, p);
    r->set_builder(builder_);
    return r;
  }

 private:
  std::shared_ptr<const ClusterSegmentBuilder> builder_;
};

}  // namespace

std::shared_ptr<const RetrieverKind> make_cluster_kind() { return std::make_shared<ClusterKind>(); }

std::shared_ptr<const RetrieverKind> with_cluster_builder(std::shared_ptr<const RetrieverKind> kind,
                                                          std::shared_ptr<const ClusterSegmentBuilder> builder) {
  if (builder == nullptr || dynamic_cast<const ClusterKind*>(kind.get()) == nullptr) return kind;
  return std::make_shared<ClusterKind>(std::move(builder));
}

}  // namespace kvret
