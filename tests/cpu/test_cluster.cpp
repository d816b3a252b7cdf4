// CLUSTER index (ClusterKV) properties: the golden vector of the grouped take over clusters; the layout (sizes,
// prefix sums, ids sorted stably by cluster); cosine k-means (max-cosine assignments, an objective that never falls);
// well-formed and nested selections at every budget, with an attention-mass recall that never falls as the budget
// grows; decode intervals that make new clusters while pending tokens stay selectable; cuts, save/restore and the
// strong guarantee of extend. The kind also runs in the generic truncate, fork, save/restore, scores and attend
// suites.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <numeric>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "c_api/handles.hpp"
#include "core/error.hpp"
#include "core/serial.hpp"
#include "engine/sequence.hpp"
#include "index/cluster_retriever.hpp"
#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;
using test::I32;

constexpr int kH = 2, kD = 64, kQ = 8, kGroup = kQ / kH;

/// A one-layer CLUSTER sequence over clustered keys.
struct ClusterFixture {
  kvret_config config;
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  F32 k, v;

  explicit ClusterFixture(int64_t n, uint64_t seed = 1, int cluster_tokens = 80, int interval = 320, int decode_k = 4,
                          int fold = KVRET_FOLD_SUM_PROB, int segment_tokens = 8192)
      : config(test::small_config(KVRET_INDEX_CLUSTER)), k({n, kH, kD}), v({n, kH, kD}) {
    config.n_layers = 1;
    config.cluster_tokens = cluster_tokens;
    config.cluster_decode_interval = interval;
    config.cluster_decode_k = decode_k;
    config.gqa_fold = fold;
    config.cluster_segment_tokens = segment_tokens;
    ctx = test::make_context(config);
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    test::clustered_kv(n, kH, kD, seed, k, v);
  }
  ~ClusterFixture() { kvret_seq_close(seq); }
  void prefill(int64_t begin, int64_t end) {
    F32 kp({end - begin, kH, kD}), vp({end - begin, kH, kD});
    std::copy(k.data.begin() + begin * kH * kD, k.data.begin() + end * kH * kD, kp.data.begin());
    std::copy(v.data.begin() + begin * kH * kD, v.data.begin() + end * kH * kD, vp.data.begin());
    ASSERT_EQ(kvret_append_prefill(seq, 0, &kp, &vp), KVRET_OK) << kvret_last_error();
  }
  void decode(int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      F32 kt({kH, kD}), vt({kH, kD});
      std::copy_n(k.data.begin() + t * kH * kD, kH * kD, kt.data.begin());
      std::copy_n(v.data.begin() + t * kH * kD, kH * kD, vt.data.begin());
      ASSERT_EQ(kvret_append_decode(seq, 0, &kt, &vt), KVRET_OK) << kvret_last_error();
    }
  }
  Sequence& sequence() { return *sequence_from_handle(seq); }
  const ClusterRetriever& index() {
    EXPECT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
    return dynamic_cast<const ClusterRetriever&>(sequence().index(0));
  }
};

/// Selects `budget` per head through the retriever directly; rows [H][budget], scores likewise.
struct Selection {
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<float>> scores;
};
Selection select_direct(const Retriever& r, const HostKvStore& store, const std::vector<float>& q, int64_t budget,
                        kvret_gqa_fold fold = KVRET_FOLD_SUM_PROB, int heads = kH, int d = kD, int q_heads = kQ) {
  SelectRequest req;
  req.q = q.data();
  req.n_q_heads = q_heads;
  req.group = q_heads / heads;
  req.scale = 1.0f / std::sqrt(static_cast<float>(d));
  req.mid_begin = r.indexed_begin();
  req.mid_end = r.indexed_end();
  req.budget = budget;
  req.fold = fold;
  req.n_threads = 2;
  Selection s;
  s.rows.assign(static_cast<size_t>(heads), std::vector<int32_t>(static_cast<size_t>(budget), -1));
  s.scores.assign(static_cast<size_t>(heads), std::vector<float>(static_cast<size_t>(budget), NAN));
  std::vector<int32_t*> rows;
  std::vector<float*> scores;
  for (int h = 0; h < heads; ++h) {
    rows.push_back(s.rows[static_cast<size_t>(h)].data());
    scores.push_back(s.scores[static_cast<size_t>(h)].data());
  }
  EXPECT_EQ(r.select(store, req, rows.data(), scores.data()), budget);
  return s;
}

// ---- the golden vector ----------------------------------------------------------------------------------------

// Six middle tokens labelled [2, 0, 1, 1, 1, 2] (cluster 0 = {1}, cluster 1 = {2, 3, 4}, cluster 2 = {0, 5}); the
// query scores the clusters 2 > 0 > 1, so a budget of 3 takes cluster 2 whole (2 tokens) and then cluster 0 (1
// token): {0, 1, 5}. The state is written in the saved-state layout (restore checks it like any saved index).
TEST(Cluster, GoldenVector) {
  kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
  c.n_layers = 1;
  c.n_sink = 0;
  c.n_local = 0;
  c.cluster_exact_fraction = 0;  // ClusterKV's own index: clusters only
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  ASSERT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
  F32 k({6, kH, kD}, 0.0f), v({6, kH, kD}, 0.0f);
  ASSERT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
  Sequence& s = *sequence_from_handle(seq);
  const auto& built = dynamic_cast<const ClusterRetriever&>(s.index(0));

  ByteWriter w;
  write_header(w, 0x434c5553u, 2);
  w.value<int32_t>(kH);
  w.value<int32_t>(kD);
  w.value<int32_t>(c.cluster_tokens);
  w.value<int32_t>(c.cluster_decode_interval);
  w.value<int32_t>(c.cluster_decode_k);
  w.value<int32_t>(built.params().max_iters);
  w.value<uint64_t>(built.params().seed);
  w.value<float>(0.0f);  // exact_fraction
  w.value<int64_t>(0);   // indexed range [0, 6)
  w.value<int64_t>(6);
  w.array(std::vector<int64_t>{0, 6});  // one segment [0, 6) of 3 clusters and no exact singletons
  w.array(std::vector<int32_t>{3});
  w.array(std::vector<int32_t>{0});
  // centroid c = logit[c] * e_0: with q = sqrt(d) e_0 (scale 1/sqrt(d)), cluster c's logit is exactly logit[c]
  const float logit[3] = {1.0f, -1.0f, 2.0f};
  for (int h = 0; h < kH; ++h) {
    std::vector<float> centroids(3 * kD, 0.0f);
    for (int cl = 0; cl < 3; ++cl) centroids[static_cast<size_t>(cl * kD)] = logit[cl];
    w.array(centroids);
    w.array(std::vector<int32_t>{1, 3, 2});           // sizes
    w.array(std::vector<int32_t>{1, 2, 3, 4, 0, 5});  // ids sorted stably by label
    w.array(std::vector<int32_t>{});                  // exact positions
    w.array(std::vector<float>{});                    // exact keys
  }
  auto index = make_retriever(c, 0);
  index->restore(s.store(0), w.bytes().data(), w.bytes().size());
  const auto& ci = dynamic_cast<const ClusterRetriever&>(*index);
  EXPECT_EQ(ci.offsets(0), (std::vector<int32_t>{0, 1, 4, 6}));

  std::vector<float> q(static_cast<size_t>(kQ * kD), 0.0f);
  for (int g = 0; g < kQ; ++g) q[static_cast<size_t>(g * kD)] = std::sqrt(static_cast<float>(kD));
  for (const kvret_gqa_fold fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
    const Selection got = select_direct(*index, s.store(0), q, 3, fold);
    for (int h = 0; h < kH; ++h) {
      EXPECT_EQ(got.rows[static_cast<size_t>(h)], (std::vector<int32_t>{0, 1, 5})) << "fold " << fold;
      const auto& sc = got.scores[static_cast<size_t>(h)];
      EXPECT_EQ(sc[0], sc[2]);  // positions 0 and 5 share cluster 2's score, above cluster 0's
      EXPECT_GT(sc[0], sc[1]);
    }
    // budget 4: the cluster that crosses the budget (cluster 1) keeps its earliest position, 2
    EXPECT_EQ(select_direct(*index, s.store(0), q, 4, fold).rows[0], (std::vector<int32_t>{0, 1, 2, 5}));
  }
  kvret_seq_close(seq);
}

// The same golden vector through the k-means: keys in three directions (identical within a group) make the
// partition {0, 5}, {1}, {2, 3, 4}, whatever the cluster ids.
TEST(Cluster, GoldenVectorThroughKmeans) {
  kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
  c.n_layers = 1;
  c.n_sink = 0;
  c.n_local = 0;
  c.cluster_tokens = 2;  // 6 tokens: 3 clusters
  c.cluster_exact_fraction = 0;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  ASSERT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
  F32 k({6, kH, kD}, 0.0f), v({6, kH, kD}, 0.0f);
  const int direction[6] = {2, 0, 1, 1, 1, 2};  // axis of each token's key
  for (int t = 0; t < 6; ++t)
    for (int h = 0; h < kH; ++h)
      k.data[static_cast<size_t>((t * kH + h) * kD + direction[t])] = 1.0f + 0.1f * static_cast<float>(t);
  ASSERT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
  Sequence& s = *sequence_from_handle(seq);
  const auto& index = dynamic_cast<const ClusterRetriever&>(s.index(0));
  ASSERT_EQ(index.clusters(), 3);
  for (int h = 0; h < kH; ++h) {
    std::set<std::set<int32_t>> parts;
    for (int cl = 0; cl < 3; ++cl) {
      const auto& off = index.offsets(h);
      parts.insert(std::set<int32_t>(index.sorted_ids(h).begin() + off[static_cast<size_t>(cl)],
                                     index.sorted_ids(h).begin() + off[static_cast<size_t>(cl) + 1]));
    }
    EXPECT_EQ(parts, (std::set<std::set<int32_t>>{{0, 5}, {1}, {2, 3, 4}})) << "head " << h;
  }
  // q scores the axes 2 > 0 > 1
  std::vector<float> q(static_cast<size_t>(kQ * kD), 0.0f);
  for (int g = 0; g < kQ; ++g) {
    q[static_cast<size_t>(g * kD + 2)] = 3.0f;
    q[static_cast<size_t>(g * kD + 0)] = 2.0f;
    q[static_cast<size_t>(g * kD + 1)] = 1.0f;
  }
  F32 qt({kQ, kD});
  qt.data = q;
  qt.refresh();
  I32 out({kH, 3});
  int32_t count = 0;
  ASSERT_EQ(kvret_select(seq, 0, &qt, 3, &out, &count), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(count, 3);
  EXPECT_EQ(out.data, (std::vector<int32_t>{0, 1, 5, 0, 1, 5}));
  kvret_seq_close(seq);
}

// ---- layout -------------------------------------------------------------------------------------------------------

void expect_layout(const ClusterRetriever& idx, int heads) {
  const int64_t segment_tokens = idx.clustered_end() - idx.indexed_begin();
  const int64_t clustered = segment_tokens - idx.exacts();
  for (int h = 0; h < heads; ++h) {
    const auto& sizes = idx.sizes(h);
    const auto& off = idx.offsets(h);
    const auto& ids = idx.sorted_ids(h);
    ASSERT_EQ(static_cast<int64_t>(sizes.size()), idx.clusters());
    ASSERT_EQ(off.size(), sizes.size() + 1);
    ASSERT_EQ(std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), clustered) << "sizes sum to the clustered count";
    ASSERT_EQ(off[0], 0);
    for (size_t c = 0; c < sizes.size(); ++c) ASSERT_EQ(off[c + 1], off[c] + sizes[c]) << "prefix sums";
    ASSERT_EQ(static_cast<int64_t>(ids.size()), clustered);
    const auto& exact = idx.exact_positions(h);
    ASSERT_EQ(static_cast<int64_t>(exact.size()), idx.exacts());
    ASSERT_EQ(idx.exact_keys(h).size(), exact.size() * static_cast<size_t>(kD));
    std::vector<int32_t> sorted = ids;  // with the exact singletons, a permutation of the segments' positions
    sorted.insert(sorted.end(), exact.begin(), exact.end());
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < segment_tokens; ++i)
      ASSERT_EQ(sorted[static_cast<size_t>(i)], idx.indexed_begin() + i) << "ids and exact positions: a permutation";
    // labels (from the prefix sums) non-decreasing along the ids; ascending positions within a cluster; each
    // segment's clusters hold exactly its positions
    int32_t label = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      int32_t l = label;
      while (off[static_cast<size_t>(l) + 1] <= static_cast<int32_t>(i)) ++l;
      ASSERT_GE(l, label);
      if (l == label && i > 0) {
        ASSERT_LT(ids[i - 1], ids[i]) << "stable within a cluster";
      }
      label = l;
    }
    for (const auto& seg : idx.segments()) {
      for (int32_t i = off[static_cast<size_t>(seg.first_cluster)];
           i < off[static_cast<size_t>(seg.first_cluster + seg.clusters)]; ++i) {
        ASSERT_GE(ids[static_cast<size_t>(i)], seg.begin);
        ASSERT_LT(ids[static_cast<size_t>(i)], seg.end);
      }
      // ceil(fraction * length) exact singletons per segment, leaving a token per cluster; ascending, inside it
      const int64_t len = seg.end - seg.begin;
      const auto want = std::min<int64_t>(
          static_cast<int64_t>(std::ceil(static_cast<double>(idx.params().exact_fraction) * static_cast<double>(len))),
          len - seg.clusters);
      ASSERT_EQ(seg.exacts, want);
      for (int32_t x = seg.first_exact; x < seg.first_exact + seg.exacts; ++x) {
        ASSERT_GE(exact[static_cast<size_t>(x)], seg.begin);
        ASSERT_LT(exact[static_cast<size_t>(x)], seg.end);
        if (x > seg.first_exact) {
          ASSERT_LT(exact[static_cast<size_t>(x) - 1], exact[static_cast<size_t>(x)]);
        }
      }
    }
  }
}

TEST(Cluster, LayoutOfPrefillAndDecodeSegments) {
  ClusterFixture f(1700, 3, 80, 64, 4);
  f.prefill(0, 1500);
  const ClusterRetriever& idx = f.index();
  const int64_t mid = 1500 - f.config.n_sink - f.config.n_local;
  ASSERT_EQ(idx.indexed_begin(), f.config.n_sink);
  ASSERT_EQ(idx.segments().size(), 1u);
  ASSERT_EQ(idx.clusters(), (mid + 79) / 80);
  ASSERT_EQ(idx.pending(), 0);
  expect_layout(idx, kH);
  f.decode(1500, 1700);  // 200 tokens leave the local window: 3 intervals of 64, 8 pending
  const ClusterRetriever& grown = f.index();
  ASSERT_EQ(grown.segments().size(), 4u);
  ASSERT_EQ(grown.clusters(), (mid + 79) / 80 + 3 * 4);
  ASSERT_EQ(grown.pending(), 8);
  expect_layout(grown, kH);
}

// ---- k-means --------------------------------------------------------------------------------------------------

/// Independent reference of a dot product, in double.
double dotd(const float* a, const float* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

std::vector<float> unit(const float* x, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(x[i]) * x[i];
  std::vector<float> u(x, x + d);
  if (s > 0)
    for (auto& e : u) e = static_cast<float>(e / std::sqrt(s));
  return u;
}

class CosineKmeans : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

TEST_P(CosineKmeans, AssignsMaxCosineAndNeverLowersTheObjective) {
  const auto [n, k] = GetParam();
  F32 keys({n, 1, kD}), values({n, 1, kD});
  test::clustered_kv(n, 1, kD, 77 + static_cast<uint64_t>(k), keys, values);
  for (int64_t i = 0; i < n; i += 5) keys.data[static_cast<size_t>(i * kD)] *= 9.0f;  // varied norms
  const CosineKmeansResult r = cosine_kmeans(keys.data.data(), n, kD, k, 5, 25);
  ASSERT_EQ(static_cast<int64_t>(r.labels.size()), n);
  ASSERT_EQ(static_cast<int>(r.objective.size()), r.iterations);
  ASSERT_LE(r.iterations, 25);
  for (size_t i = 1; i < r.objective.size(); ++i)
    ASSERT_GE(r.objective[i], r.objective[i - 1] - 1e-6 * std::fabs(r.objective[i - 1])) << "iteration " << i;
  double objective = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto x = unit(keys.data.data() + i * kD, kD);
    double best = -2;
    for (int j = 0; j < k; ++j) best = std::max(best, static_cast<double>(dotd(x.data(), &r.directions[j * kD], kD)));
    const int32_t l = r.labels[static_cast<size_t>(i)];
    ASSERT_GE(l, 0);
    ASSERT_LT(l, k);
    const double mine = dotd(x.data(), &r.directions[static_cast<size_t>(l) * kD], kD);
    ASSERT_GE(mine, best - 1e-5) << "point " << i << " is not at its max-cosine centroid";
    objective += mine;
  }
  EXPECT_NEAR(objective, r.objective.back(), 1e-3 * static_cast<double>(n));
  for (int j = 0; j < k; ++j) {  // unit directions (or a zero one never moved from a zero point)
    double s = 0;
    for (int t = 0; t < kD; ++t) s += static_cast<double>(r.directions[j * kD + t]) * r.directions[j * kD + t];
    EXPECT_NEAR(s, 1.0, 1e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CosineKmeans,
                         ::testing::Values(std::make_tuple(int64_t{500}, 7), std::make_tuple(int64_t{2000}, 25),
                                           std::make_tuple(int64_t{300}, 40), std::make_tuple(int64_t{5}, 9)));

TEST(Cluster, KmeansIsDeterministicAndSeeded) {
  F32 keys({800, 1, kD}), values({800, 1, kD});
  test::clustered_kv(800, 1, kD, 9, keys, values);
  const auto a = cosine_kmeans(keys.data.data(), 800, kD, 10, 1, 10);
  const auto b = cosine_kmeans(keys.data.data(), 800, kD, 10, 1, 10);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.directions, b.directions);
  const auto one = cosine_kmeans(keys.data.data(), 800, kD, 10, 1, 1);
  EXPECT_EQ(one.iterations, 1);
}

// Training on a sample: every point (sampled or not) is at its max-cosine direction of the trained directions; the
// objective over the training points never falls; a sample of n or more is the plain k-means, bit for bit.
TEST(Cluster, SampledKmeansAssignsEveryPointToItsMaxCosineDirection) {
  constexpr int64_t n = 3000;
  constexpr int k = 30;
  F32 keys({n, 1, kD}), values({n, 1, kD});
  test::clustered_kv(n, 1, kD, 21, keys, values);
  const CosineKmeansResult r = cosine_kmeans(keys.data.data(), n, kD, k, 3, 10, 16 * k);
  ASSERT_EQ(r.trained, 16 * k);
  ASSERT_EQ(static_cast<int64_t>(r.labels.size()), n);
  ASSERT_EQ(static_cast<int>(r.objective.size()), r.iterations);
  ASSERT_LE(r.iterations, 10);
  for (size_t i = 1; i < r.objective.size(); ++i)
    ASSERT_GE(r.objective[i], r.objective[i - 1] - 1e-6 * std::fabs(r.objective[i - 1])) << "iteration " << i;
  std::vector<int64_t> sizes(k, 0);
  for (int64_t i = 0; i < n; ++i) {
    const auto x = unit(keys.data.data() + i * kD, kD);
    double best = -2;
    for (int j = 0; j < k; ++j) best = std::max(best, dotd(x.data(), &r.directions[static_cast<size_t>(j) * kD], kD));
    const int32_t l = r.labels[static_cast<size_t>(i)];
    ASSERT_GE(l, 0);
    ASSERT_LT(l, k);
    ASSERT_GE(dotd(x.data(), &r.directions[static_cast<size_t>(l) * kD], kD), best - 1e-5) << "point " << i;
    ++sizes[static_cast<size_t>(l)];
  }
  EXPECT_GT(*std::min_element(sizes.begin(), sizes.end()), 0) << "a trained direction no point chose";

  const auto again = cosine_kmeans(keys.data.data(), n, kD, k, 3, 10, 16 * k);
  EXPECT_EQ(again.labels, r.labels);
  EXPECT_EQ(again.directions, r.directions);
  const auto other_seed = cosine_kmeans(keys.data.data(), n, kD, k, 4, 10, 16 * k);
  EXPECT_NE(other_seed.directions, r.directions);
  const auto whole = cosine_kmeans(keys.data.data(), n, kD, k, 3, 10);
  for (const int64_t sample : {n, n + 1, int64_t{0}}) {
    const auto same = cosine_kmeans(keys.data.data(), n, kD, k, 3, 10, sample);
    EXPECT_EQ(same.trained, n);
    EXPECT_EQ(same.labels, whole.labels);
    EXPECT_EQ(same.directions, whole.directions);
  }
  EXPECT_EQ(cosine_kmeans(keys.data.data(), n, kD, k, 3, 10, 5).trained, k) << "at least k training points";
}

// A long prefill is cut into segments of equal length, at most segment_tokens each, each of ceil(len /
// cluster_tokens) clusters, with the layout properties; the build does not depend on the thread count.
TEST(Cluster, LongPrefillIsClusteredInSegmentsOfAtMostSegmentTokens) {
  ClusterFixture f(3000, 11);
  f.prefill(0, 3000);
  const ClusterRetriever& whole = f.index();
  const int64_t mb = whole.indexed_begin(), me = whole.indexed_end(), n = me - mb;
  ASSERT_EQ(whole.segments().size(), 1u) << "below the default segment_tokens: one segment";
  ASSERT_EQ(whole.params().segment_tokens, f.config.cluster_segment_tokens);
  {  // through the config: cluster_segment_tokens = 1000 cuts the same prefill into 3 segments
    ClusterFixture g(3000, 11, 80, 320, 4, KVRET_FOLD_SUM_PROB, 1000);
    g.prefill(0, 3000);
    EXPECT_EQ(g.index().segments().size(), 3u);
    expect_layout(g.index(), kH);
  }
  for (const int cap : {500, 1000, 2920, 2919}) {
    ClusterRetriever::Params p = whole.params();
    p.segment_tokens = cap;
    ClusterRetriever idx(kH, kD, p);
    idx.extend(f.sequence().store(0), mb, me, true, 1);
    const int64_t parts = (n + cap - 1) / cap;
    ASSERT_EQ(static_cast<int64_t>(idx.segments().size()), parts) << "cap " << cap;
    int64_t clusters = 0;
    for (const auto& seg : idx.segments()) {
      const int64_t len = seg.end - seg.begin;
      EXPECT_LE(len, cap);
      EXPECT_GE(len, n / parts);
      EXPECT_LE(len, n / parts + 1);
      EXPECT_EQ(seg.clusters, (len + 79) / 80);
      EXPECT_EQ(seg.first_cluster, clusters);
      clusters += seg.clusters;
    }
    EXPECT_EQ(idx.segments().front().begin, mb);
    EXPECT_EQ(idx.segments().back().end, me);
    EXPECT_EQ(idx.clusters(), clusters);
    expect_layout(idx, kH);
    // the same selections as the sequence's own index would make with this cap: a cut inside a segment rebuilds
    // with one prefill extend, which is this build
    ClusterRetriever again(kH, kD, p);
    again.extend(f.sequence().store(0), mb, me, true, 2);
    for (int h = 0; h < kH; ++h) {
      EXPECT_EQ(again.sorted_ids(h), idx.sorted_ids(h));
      EXPECT_EQ(again.centroids(h), idx.centroids(h));
    }
  }
}

// ---- select -------------------------------------------------------------------------------------------------------

// Every budget: budget positions per head, strictly ascending, in the middle; scores aligned (a cluster's tokens
// share its score); selections nested (a larger budget keeps every position of a smaller one); the attention-mass
// recall never falls as the budget grows.
class ClusterSelect : public ::testing::TestWithParam<int> {};

TEST_P(ClusterSelect, WellFormedNestedAndRecallNeverFalls) {
  const int fold = GetParam();
  ClusterFixture f(1300, 5, 40, 50, 3, fold);
  f.prefill(0, 1200);
  f.decode(1200, 1290);  // 90 tokens leave the local window: one decode segment of 50, 40 pending
  const ClusterRetriever& idx = f.index();
  ASSERT_GT(idx.pending(), 0);
  const HostKvStore& store = f.sequence().store(0);
  const int64_t mb = idx.indexed_begin(), me = idx.indexed_end(), n = me - mb;
  const auto q = test::random_vector(static_cast<size_t>(kQ * kD), 91, 0.6f);
  std::vector<std::vector<double>> exact(kH);
  for (int h = 0; h < kH; ++h) {
    exact[static_cast<size_t>(h)] =
        test::exact_folded(f.k.data, kH, kD, q, kGroup, h, mb, me, false);  // attention mass (sum of probabilities)
  }
  std::vector<std::set<int32_t>> previous(kH);
  std::vector<double> previous_recall(kH, 0.0);
  std::vector<int64_t> budgets;
  for (int64_t budget = 1; budget < n; budget += (budget < 40 ? 1 : 37)) budgets.push_back(budget);
  budgets.push_back(n);
  for (const int64_t budget : budgets) {
    const Selection s = select_direct(idx, store, q, budget, static_cast<kvret_gqa_fold>(fold));
    for (int h = 0; h < kH; ++h) {
      const auto& rows = s.rows[static_cast<size_t>(h)];
      const auto& sc = s.scores[static_cast<size_t>(h)];
      for (int64_t i = 0; i < budget; ++i) {
        ASSERT_GE(rows[static_cast<size_t>(i)], mb);
        ASSERT_LT(rows[static_cast<size_t>(i)], me);
        if (i > 0) {
          ASSERT_LT(rows[static_cast<size_t>(i) - 1], rows[static_cast<size_t>(i)]);
        }
        ASSERT_TRUE(std::isfinite(sc[static_cast<size_t>(i)]));
      }
      const std::set<int32_t> now(rows.begin(), rows.end());
      for (const int32_t p : previous[static_cast<size_t>(h)]) ASSERT_TRUE(now.count(p)) << "budget " << budget;
      double mass = 0, total = 0;
      for (const double e : exact[static_cast<size_t>(h)]) total += e;
      for (const int32_t p : now) mass += exact[static_cast<size_t>(h)][static_cast<size_t>(p - mb)];
      ASSERT_GE(mass / total, previous_recall[static_cast<size_t>(h)] - 1e-12);
      previous_recall[static_cast<size_t>(h)] = mass / total;
      previous[static_cast<size_t>(h)] = now;
    }
  }
  for (int h = 0; h < kH; ++h) EXPECT_NEAR(previous_recall[static_cast<size_t>(h)], 1.0, 1e-9);
}

INSTANTIATE_TEST_SUITE_P(Folds, ClusterSelect, ::testing::Values(KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT));

// On clustered keys, a tenth of the middle holds most of the attention mass, and more than a tenth of random picks.
TEST(Cluster, RecallOnClusteredKeys) {
  ClusterFixture f(3000, 11);
  f.prefill(0, 3000);
  const ClusterRetriever& idx = f.index();
  const int64_t mb = idx.indexed_begin(), me = idx.indexed_end();
  double sum = 0;
  int cases = 0;
  for (uint64_t seed = 0; seed < 6; ++seed) {
    // a query aimed at one token's key: the heads attend to that key's neighbourhood
    std::vector<float> q(static_cast<size_t>(kQ * kD));
    const int64_t target = mb + static_cast<int64_t>((seed * 7919) % static_cast<uint64_t>(me - mb));
    const auto noise = test::random_vector(q.size(), 300 + seed, 0.3f);
    for (int g = 0; g < kQ; ++g)
      for (int i = 0; i < kD; ++i)
        q[static_cast<size_t>(g * kD + i)] = 0.5f * f.k.data[static_cast<size_t>((target * kH + g / kGroup) * kD + i)] +
                                             noise[static_cast<size_t>(g * kD + i)];
    const int64_t budget = (me - mb) / 10;
    const Selection s = select_direct(idx, f.sequence().store(0), q, budget);
    for (int h = 0; h < kH; ++h) {
      const auto exact = test::exact_folded(f.k.data, kH, kD, q, kGroup, h, mb, me, false);
      double mass = 0, total = 0;
      for (const double e : exact) total += e;
      for (const int32_t p : s.rows[static_cast<size_t>(h)]) mass += exact[static_cast<size_t>(p - mb)];
      sum += mass / total;
      ++cases;
    }
  }
  EXPECT_GT(sum / cases, 0.9) << "mean attention-mass recall at a tenth of the middle";
  std::printf("[ cluster  ] mean attention-mass recall at a tenth of the middle: %.3f\n", sum / cases);
}

// ---- decode -----------------------------------------------------------------------------------------------------

TEST(Cluster, DecodeIntervalsMakeNewClustersAndPendingTokensStaySelectable) {
  ClusterFixture f(1400, 13, 80, 32, 3);
  f.prefill(0, 1000);
  const ClusterRetriever& before = f.index();
  const int32_t prefill_clusters = before.clusters();
  const auto prefill_centroids = before.centroids(0);
  const auto prefill_ids = before.sorted_ids(1);
  ASSERT_EQ(before.pending(), 0);
  // 31 tokens leave the window: pending, no new cluster
  f.decode(1000, 1031);
  ASSERT_EQ(f.index().clusters(), prefill_clusters);
  ASSERT_EQ(f.index().pending(), 31);
  // the 32nd fills the interval: 3 new clusters over [clustered_end - 32, clustered_end)
  f.decode(1031, 1032);
  const ClusterRetriever& after = f.index();
  ASSERT_EQ(after.clusters(), prefill_clusters + 3);
  ASSERT_EQ(after.pending(), 0);
  ASSERT_EQ(after.segments().back().end - after.segments().back().begin, 32);
  // the prefill clusters stay as they were
  EXPECT_TRUE(std::equal(prefill_centroids.begin(), prefill_centroids.end(), after.centroids(0).begin()));
  EXPECT_TRUE(std::equal(prefill_ids.begin(), prefill_ids.end(), after.sorted_ids(1).begin()));
  expect_layout(after, kH);

  // a pending token whose key the query aims at is selected at budget 1 (scored by its exact logit)
  f.decode(1032, 1040);
  const ClusterRetriever& idx = f.index();
  ASSERT_EQ(idx.pending(), 8);
  const int64_t pending_pos = idx.clustered_end() + 3;
  std::vector<float> q(static_cast<size_t>(kQ * kD));
  for (int g = 0; g < kQ; ++g)
    for (int i = 0; i < kD; ++i)
      q[static_cast<size_t>(g * kD + i)] =
          3.0f * f.k.data[static_cast<size_t>((pending_pos * kH + g / kGroup) * kD + i)];
  const Selection s = select_direct(idx, f.sequence().store(0), q, 1);
  for (int h = 0; h < kH; ++h) EXPECT_EQ(s.rows[static_cast<size_t>(h)][0], pending_pos) << "head " << h;
}

// A decode interval's clustering equals the one a direct build of the same history makes (seeded by position).
TEST(Cluster, ChunkedPrefillAndDecodeAreDeterministic) {
  ClusterFixture a(1300, 17, 80, 40, 4), b(1300, 17, 80, 40, 4);
  for (ClusterFixture* f : {&a, &b}) {
    f->prefill(0, 600);
    f->prefill(600, 1000);
    f->decode(1000, 1300);
  }
  const ClusterRetriever& x = a.index();
  const ClusterRetriever& y = b.index();
  ASSERT_EQ(x.segments(), y.segments());
  ASSERT_EQ(x.segments().size(), 2u + 7u);  // two prefill chunks, then (300 - 0) / 40 = 7 decode intervals
  for (int h = 0; h < kH; ++h) {
    EXPECT_EQ(x.centroids(h), y.centroids(h));
    EXPECT_EQ(x.sorted_ids(h), y.sorted_ids(h));
  }
  expect_layout(x, kH);
}

// ---- cut, clone, save/restore -------------------------------------------------------------------------------------

TEST(Cluster, CutsAtSegmentBoundariesAndInsideThePendingTail) {
  ClusterFixture f(1400, 19, 80, 32, 2);
  f.prefill(0, 1000);
  f.decode(1000, 1100);  // 3 decode segments of 32, 4 pending
  const ClusterRetriever& idx = f.index();
  ASSERT_EQ(idx.segments().size(), 4u);
  ASSERT_EQ(idx.pending(), 4);
  const int64_t boundary = idx.segments()[2].begin;
  EXPECT_TRUE(idx.can_cut(boundary));
  EXPECT_TRUE(idx.can_cut(idx.indexed_end() - 2));       // inside the pending tail
  EXPECT_TRUE(idx.can_cut(idx.indexed_begin()));         // everything
  EXPECT_FALSE(idx.can_cut(boundary + 1));               // inside a decode segment
  EXPECT_FALSE(idx.can_cut(idx.indexed_begin() + 100));  // inside the prefill segment

  // cut at the boundary: equals the sequence that stopped there
  auto cut = idx.clone();
  cut->cut(f.sequence().store(0), boundary);
  ClusterFixture g(1400, 19, 80, 32, 2);
  g.prefill(0, 1000);
  g.decode(1000, boundary + g.config.n_local);
  EXPECT_EQ(cut->save(), g.index().save());
  // cut inside the pending tail
  auto tail = idx.clone();
  tail->cut(f.sequence().store(0), idx.indexed_end() - 2);
  ClusterFixture t(1400, 19, 80, 32, 2);
  t.prefill(0, 1000);
  t.decode(1000, 1098);
  EXPECT_EQ(tail->save(), t.index().save());
  // the clone is independent
  EXPECT_EQ(idx.segments().size(), 4u);
}

TEST(Cluster, SaveRestoreRoundTripAndDamage) {
  ClusterFixture f(1400, 23, 80, 32, 2);
  f.prefill(0, 1000);
  f.decode(1000, 1090);
  const ClusterRetriever& idx = f.index();
  const HostKvStore& store = f.sequence().store(0);
  const auto state = idx.save();
  auto fresh = make_retriever(f.config, 0);
  fresh->restore(store, state.data(), state.size());
  EXPECT_EQ(fresh->save(), state);
  EXPECT_EQ(fresh->bytes(), idx.bytes());
  const auto q = test::random_vector(static_cast<size_t>(kQ * kD), 5);
  for (const int64_t budget : {int64_t{1}, int64_t{77}, idx.size()}) {
    const Selection a = select_direct(idx, store, q, budget), b = select_direct(*fresh, store, q, budget);
    EXPECT_EQ(a.rows, b.rows);
    EXPECT_EQ(a.scores, b.scores);
  }
  // damaged: refused with KVRET_ERR_CORRUPT, the retriever unchanged
  const auto refused = [&](std::vector<std::byte> bytes, const char* what) {
    auto target = make_retriever(f.config, 0);
    const auto empty = target->save();
    try {
      target->restore(store, bytes.data(), bytes.size());
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), KVRET_ERR_CORRUPT) << what << ": " << e.what();
    }
    EXPECT_EQ(target->save(), empty) << what;
  };
  refused(std::vector<std::byte>(state.begin(), state.end() - 1), "truncated");
  // another layer (another seed)
  auto other_layer = make_retriever(f.config, 1);
  try {
    other_layer->restore(store, state.data(), state.size());
    ADD_FAILURE() << "another layer's state accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), KVRET_ERR_CORRUPT);
  }
  // head 1's ids, exact positions and exact keys end the state: swap two of its ids across clusters, duplicate
  // one, move one out; likewise an exact position
  const size_t n_exact = idx.exact_positions(1).size();
  ASSERT_GT(n_exact, 0u) << "the default keeps exact singletons";
  const size_t exact_keys_bytes = sizeof(uint64_t) + n_exact * kD * sizeof(float);
  const size_t exact_at = state.size() - exact_keys_bytes - n_exact * sizeof(int32_t);
  const size_t ids_bytes = static_cast<size_t>(idx.sorted_ids(1).size()) * sizeof(int32_t);
  const size_t at = exact_at - sizeof(uint64_t) - ids_bytes;
  const auto write_id = [&](std::vector<std::byte>& b, size_t i, int32_t pos) {
    std::memcpy(b.data() + at + i * sizeof(int32_t), &pos, sizeof pos);
  };
  const auto& ids = idx.sorted_ids(1);
  auto dup = state;
  write_id(dup, 1, ids[0]);
  refused(dup, "a duplicated position");
  auto outside = state;
  write_id(outside, 0, static_cast<int32_t>(idx.indexed_end() + 5));
  refused(outside, "a position outside its segment");
  auto unordered = state;
  const auto& off = idx.offsets(1);
  size_t c = 0;
  while (off[c + 1] - off[c] < 2) ++c;
  write_id(unordered, static_cast<size_t>(off[c]), ids[static_cast<size_t>(off[c]) + 1]);
  write_id(unordered, static_cast<size_t>(off[c]) + 1, ids[static_cast<size_t>(off[c])]);
  refused(unordered, "positions out of order within a cluster");
  const auto write_exact = [&](std::vector<std::byte>& b, size_t i, int32_t pos) {
    std::memcpy(b.data() + exact_at + i * sizeof(int32_t), &pos, sizeof pos);
  };
  auto exact_in_cluster = state;
  write_exact(exact_in_cluster, 0, ids[0]);
  refused(exact_in_cluster, "an exact position that is also clustered");
  auto exact_outside = state;
  write_exact(exact_outside, 0, static_cast<int32_t>(idx.indexed_end() + 5));
  refused(exact_outside, "an exact position outside its segment");
}

// Strong guarantee: an extend (a prefill build, a decode interval) that fails on any allocation leaves the index as
// it was; the index that survives equals one built without failures.
TEST(Cluster, ExtendLeavesTheIndexAsItWasWhenAnAllocationFails) {
  HostKvStore store{kH, kD, DType::F32};
  F32 k({700, kH, kD}), v({700, kH, kD});
  test::clustered_kv(700, kH, kD, 29, k, v);
  store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), 700, true);
  ClusterRetriever::Params p;
  p.decode_interval = 20;
  p.decode_k = 2;
  ClusterRetriever index(kH, kD, p);
  index.extend(store, 4, 300, true, 1);
  const std::pair<int64_t, int64_t> steps[] = {{300, 319}, {319, 320}, {320, 321}, {321, 400}, {400, 650}};
  const bool retrain[] = {false, false, false, false, true};
  for (size_t i = 0; i < std::size(steps); ++i) {
    const int64_t begin = steps[i].first, end = steps[i].second;
    const bool may_retrain = retrain[i];
    const auto before = index.save();
    const size_t segments_before = index.segments().size();
    const int failures = test::fail_each_allocation(
        [&] { index.extend(store, begin, end, may_retrain, 1); },
        [&](int64_t fail_at) {
          ASSERT_EQ(index.save(), before) << "failure " << fail_at << " at [" << begin << ", " << end << ")";
        });
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    if (index.segments().size() > segments_before) {
      EXPECT_GT(failures, 0) << "a clustering allocates";
    } else {
      EXPECT_EQ(failures, 0) << "a token that waits in the pending tail allocates nothing";
    }
    ASSERT_EQ(index.indexed_end(), end);
  }
  ClusterRetriever again(kH, kD, p);
  again.extend(store, 4, 300, true, 2);
  for (int64_t t = 300; t < 400; ++t) again.extend(store, t, t + 1, false, 2);
  again.extend(store, 400, 650, true, 2);
  EXPECT_EQ(again.save(), index.save());
}

// ---- exact singletons ---------------------------------------------------------------------------------------------

/// A store of n clustered tokens (kH heads, kD dims).
HostKvStore clustered_store(int64_t n, uint64_t seed, F32* keys = nullptr) {
  HostKvStore store{kH, kD, DType::F32};
  F32 k({n, kH, kD}), v({n, kH, kD});
  test::clustered_kv(n, kH, kD, seed, k, v);
  store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), n, true);
  if (keys != nullptr) *keys = k;
  return store;
}

// The exact singletons of a segment are its keys of lowest cosine to the k-means direction they were assigned to
// (the k-means rerun here with the segment's seed), and the index holds their keys as stored.
TEST(Cluster, ExactSingletonsAreTheKeysFarthestFromTheirDirection) {
  const int64_t n = 1300;
  HostKvStore store = clustered_store(n, 41);
  ClusterRetriever::Params p;
  p.exact_fraction = 0.07f;
  p.segment_tokens = 600;  // two segments
  ClusterRetriever index(kH, kD, p);
  index.extend(store, 4, 1204, true, 2);
  ASSERT_EQ(index.segments().size(), 2u);
  for (int h = 0; h < kH; ++h) {
    const auto& exact = index.exact_positions(h);
    for (const auto& seg : index.segments()) {
      const int64_t len = seg.end - seg.begin;
      ASSERT_EQ(seg.exacts, static_cast<int32_t>(std::ceil(0.07 * static_cast<double>(len))));
      std::vector<float> keys(static_cast<size_t>(len * kD));
      store.keys_f32(h, seg.begin, seg.end, keys.data());
      const CosineKmeansResult km = cosine_kmeans(keys.data(), len, kD, seg.clusters, index.segment_seed(h, seg.begin),
                                                  p.max_iters, int64_t{p.sample_per_cluster} * seg.clusters);
      std::vector<double> cos(static_cast<size_t>(len));
      for (int64_t i = 0; i < len; ++i) {
        const float* key = keys.data() + i * kD;
        const auto u = unit(key, kD);
        cos[static_cast<size_t>(i)] =
            dotd(u.data(), km.directions.data() + static_cast<size_t>(km.labels[static_cast<size_t>(i)]) * kD, kD);
      }
      std::vector<uint8_t> is_exact(static_cast<size_t>(len), 0);
      double worst_exact = -2;
      for (int32_t x = seg.first_exact; x < seg.first_exact + seg.exacts; ++x) {
        const int32_t pos = exact[static_cast<size_t>(x)];
        is_exact[static_cast<size_t>(pos - seg.begin)] = 1;
        worst_exact = std::max(worst_exact, cos[static_cast<size_t>(pos - seg.begin)]);
        for (int t = 0; t < kD; ++t)  // the key as stored
          ASSERT_EQ(index.exact_keys(h)[static_cast<size_t>(x) * kD + t],
                    keys[static_cast<size_t>((pos - seg.begin) * kD + t)]);
      }
      for (int64_t i = 0; i < len; ++i) {
        if (!is_exact[static_cast<size_t>(i)]) {
          ASSERT_GE(cos[static_cast<size_t>(i)], worst_exact - 1e-6) << "head " << h << " position " << seg.begin + i;
        }
      }
    }
  }
  expect_layout(index, kH);
}

// Rare, sharp keys planted among clustered ones (16 of them, each along its own axis): a query that points at one
// selects it with a budget of one token in every head when the index keeps exact singletons; without them the
// cluster that absorbs a needle (its mean) rarely ranks first, and its earliest position is rarely the needle.
TEST(Cluster, AnExactSingletonKeepsARareSharpKey) {
  const int64_t n = 2000;
  constexpr int kNeedles = 16;
  F32 k({n, kH, kD}), v({n, kH, kD});
  test::clustered_kv(n, kH, kD, 43, k, v);
  const auto needle = [](int a) { return int64_t{100} + 113 * a; };
  for (int a = 0; a < kNeedles; ++a)
    for (int h = 0; h < kH; ++h) {  // 3x the key's norm along axis a
      float* key = k.data.data() + (needle(a) * kH + h) * kD;
      double norm = 0;
      for (int t = 0; t < kD; ++t) norm += static_cast<double>(key[t]) * key[t];
      std::fill_n(key, kD, 0.0f);
      key[a] = static_cast<float>(3.0 * std::sqrt(norm));
    }
  HostKvStore store{kH, kD, DType::F32};
  store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), n, true);
  for (const float fraction : {0.0f, 0.05f}) {
    ClusterRetriever::Params p;
    p.exact_fraction = fraction;
    ClusterRetriever index(kH, kD, p);
    index.extend(store, 16, n - 64, true, 2);
    for (const kvret_gqa_fold fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
      int found = 0;
      for (int a = 0; a < kNeedles; ++a) {
        std::vector<float> q(static_cast<size_t>(kQ * kD), 0.0f);
        for (int g = 0; g < kQ; ++g) q[static_cast<size_t>(g * kD + a)] = 4.0f;
        const Selection s = select_direct(index, store, q, 1, fold);
        for (int h = 0; h < kH; ++h) found += s.rows[static_cast<size_t>(h)][0] == needle(a);
      }
      if (fraction > 0) {
        EXPECT_EQ(found, kNeedles * kH) << "fold " << fold;
      } else {
        EXPECT_LT(found, kNeedles * kH / 2) << "fold " << fold;
      }
    }
  }
}

// ---- config -------------------------------------------------------------------------------------------------------

TEST(Cluster, BadConfigValuesAreRefused) {
  for (const char* field : {"cluster_tokens", "cluster_decode_interval", "cluster_decode_k", "cluster_segment_tokens",
                            "cluster_exact_fraction"}) {
    kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
    if (std::string(field) == "cluster_tokens") c.cluster_tokens = 0;
    if (std::string(field) == "cluster_decode_interval") c.cluster_decode_interval = -3;
    if (std::string(field) == "cluster_decode_k") c.cluster_decode_k = 0;
    if (std::string(field) == "cluster_segment_tokens") c.cluster_segment_tokens = -1;
    if (std::string(field) == "cluster_exact_fraction") c.cluster_exact_fraction = 0.6f;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << field;
    EXPECT_NE(std::string(kvret_last_error()).find(field), std::string::npos) << kvret_last_error();
    EXPECT_EQ(ctx, nullptr);
  }
  kvret_config ok = test::small_config(KVRET_INDEX_CLUSTER);
  test::ContextPtr ctx = test::make_context(ok);
  EXPECT_NE(ctx, nullptr);
}

}  // namespace
}  // namespace kvret
