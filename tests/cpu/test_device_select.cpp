// The PAGE index's select on the CUDA backend's device (docs/cuda_backend.md) and the single-source math it shares
// with the CPU retriever (kernels/math/page_math.h); the CLUSTER index's math likewise (kernels/math/cluster_math.h:
// its logits, fold, order and take against scaled_dots, fold_weighted_logits and grouped_take, and the CPU
// ClusterRetriever's selection against a model built from the header):
// - the header's functions against the CPU core's own code (exp_nonpositive, dot, fold_weighted_logits,
//   grouped_take, descending_key) and the CPU retriever's selection against a model built from them, bit for bit;
// - where the suite runs on the CUDA backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's OpenMP host
//   system): positions and scores bit for bit equal to the CPU backend's over appends, truncates, drop_fronts,
//   forks and saved sessions (f32 and f16 stores, both folds, budgets up to and past the middle, partial pages);
//   device_bytes counting the device's copy of the bounds; config.device_bytes_limit; kvret_select_batch;
// - CLUSTER's select on the device likewise (the equality and batch tests run over PAGE and CLUSTER; the copy of
//   the clusters in device_bytes, renewed by decode intervals, and the limit).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "cpu_select.hpp"
#include "device_twin.hpp"
#include "engine/sequence.hpp"
#include "index/cluster_retriever.hpp"
#include "index/pq_retriever.hpp"
#include "kvret.h"
#include "math/cluster_math.h"
#include "math/page_math.h"
#include "select/gqa_fold.hpp"
#include "select/grouped_take.hpp"
#include "select/topk.hpp"
#include "store/host_kv_store.hpp"
#include "test_util.hpp"

using namespace kvret;
namespace pm = kvret::cuda::math;

namespace {

using namespace test::twin;  // the twin sequences, their selects and the shared checks

/// The special values awkward_floats mixes in (zeros, the exponential's cut-off at -87 and its neighbours, NaN, a
/// subnormal, -Inf).
const std::vector<float> kAwkward = {0.0f,       -0.0f,      -87.0f,
                                     -86.99999f, -87.00001f, std::numeric_limits<float>::quiet_NaN(),
                                     -1e-40f,    1e-30f,     -std::numeric_limits<float>::infinity(),
                                     0.5f};

TEST(PageMath, BoundIsTheCpuDotOfTheSplitQuery) {
  std::mt19937_64 rng(2);
  for (const int d : {1, 3, 4, 7, 8, 9, 64, 100, 128, 256}) {
    for (int trial = 0; trial < 50; ++trial) {
      const std::vector<float> q = awkward_floats(static_cast<size_t>(d), rng(), -3.0f, 3.0f, kAwkward);
      std::vector<float> row = test::random_vector(2 * static_cast<size_t>(d), rng(), 2.0f);
      std::vector<float> split(2 * static_cast<size_t>(d));
      for (int i = 0; i < d; ++i) {
        split[static_cast<size_t>(i)] = std::min(q[static_cast<size_t>(i)], 0.0f);
        split[static_cast<size_t>(d + i)] = std::max(q[static_cast<size_t>(i)], 0.0f);
      }
      std::vector<float> header_split(2 * static_cast<size_t>(d));
      pm::page_split(q.data(), d, header_split.data());
      for (size_t i = 0; i < split.size(); ++i) ASSERT_TRUE(same_bits(header_split[i], split[i])) << i;
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      ASSERT_TRUE(same_bits(pm::page_bound(header_split.data(), row.data(), d), dot(split.data(), row.data(), 2 * d)))
          << d;
      ASSERT_TRUE(same_bits(pm::page_logit(scale, pm::page_bound(header_split.data(), row.data(), d)),
                            scale * dot(split.data(), row.data(), 2 * d)));
    }
  }
}

/// The header's fold of logits [group, n] of n pages holding `tokens` tokens (page_size each, the last fewer).
std::vector<float> header_fold(const std::vector<float>& logits, int group, int64_t n, int64_t tokens,
                               int32_t page_size, kvret_gqa_fold fold) {
  return test::header_fold(logits, group, n, fold,
                           [&](float* l) { return pm::page_softmax_terms(l, n, tokens, page_size); });
}

TEST(PageMath, FoldIsTheCpuWeightedFold) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 400; ++trial) {
    const int group = 1 + static_cast<int>(rng() % 8);
    const int64_t n = 1 + static_cast<int64_t>(rng() % 300);
    const int32_t page_size = 1 + static_cast<int32_t>(rng() % 32);
    const int64_t tokens = (n - 1) * page_size + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(page_size));
    const bool awkward = trial % 4 == 0;
    const std::vector<float> logits =
        awkward ? awkward_floats(static_cast<size_t>(group * n), rng(), -30.0f, 30.0f, kAwkward)
                : test::random_vector(static_cast<size_t>(group * n), rng(), 8.0f);
    std::vector<int32_t> weight(static_cast<size_t>(n));
    for (int64_t p = 0; p < n; ++p) weight[static_cast<size_t>(p)] = pm::page_weight(p, n, tokens, page_size);
    EXPECT_EQ(weight.back(), tokens - (n - 1) * page_size);
    for (const kvret_gqa_fold fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
      std::vector<float> cpu(static_cast<size_t>(n));
      fold_weighted_logits(logits.data(), weight.data(), group, n, fold, cpu.data());
      const std::vector<float> header = header_fold(logits, group, n, tokens, page_size, fold);
      for (int64_t p = 0; p < n; ++p)
        ASSERT_TRUE(same_bits(header[static_cast<size_t>(p)], cpu[static_cast<size_t>(p)]))
            << "trial " << trial << " fold " << fold << " page " << p << ": " << header[static_cast<size_t>(p)]
            << " vs " << cpu[static_cast<size_t>(p)];
    }
  }
}

TEST(PageMath, OrderAndTakeAreTheCpuGroupedTake) {
  std::mt19937_64 rng(4);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 200);
    const int32_t page_size = 1 + static_cast<int32_t>(rng() % 20);
    const int64_t tokens = (n - 1) * page_size + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(page_size));
    const int64_t budget = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(tokens));
    std::vector<float> scores = awkward_floats(static_cast<size_t>(n), rng(), -2.0f, 2.0f, kAwkward);
    for (auto& s : scores)
      if (rng() % 4 == 0) s = static_cast<float>(rng() % 3);  // ties
    std::vector<int32_t> weight(static_cast<size_t>(n));
    for (int64_t p = 0; p < n; ++p) weight[static_cast<size_t>(p)] = pm::page_weight(p, n, tokens, page_size);
    std::vector<uint64_t> scratch;
    std::vector<uint8_t> state(static_cast<size_t>(n));
    const int64_t quota = grouped_take(scores.data(), weight.data(), n, budget, scratch, state.data());
    // the header: sort by the order key, take while it fits, looking at the first page_pages_needed only
    std::vector<uint64_t> keys(static_cast<size_t>(n));
    for (int64_t p = 0; p < n; ++p) {
      keys[static_cast<size_t>(p)] = pm::page_order_key(scores[static_cast<size_t>(p)], static_cast<uint32_t>(p));
      ASSERT_EQ(keys[static_cast<size_t>(p)], descending_key(scores[static_cast<size_t>(p)], static_cast<uint32_t>(p)));
    }
    std::sort(keys.begin(), keys.end());
    const int64_t needed = pm::page_pages_needed(budget, page_size, n);
    std::vector<int64_t> taken(static_cast<size_t>(n), 0);
    int64_t before = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto p = static_cast<size_t>(keys[static_cast<size_t>(i)] & 0xffffffffu);
      taken[p] = pm::page_take(before, weight[p], budget);
      if (i >= needed) {
        ASSERT_EQ(taken[p], 0) << "a page past page_pages_needed is taken";
      }
      before += taken[p];
    }
    EXPECT_EQ(before, budget);
    for (size_t p = 0; p < static_cast<size_t>(n); ++p) {
      const int64_t expected = state[p] == kTake ? weight[p] : state[p] == kTrim ? quota : 0;
      ASSERT_EQ(taken[p], expected) << "trial " << trial << " page " << p;
    }
  }
}

// --- CLUSTER's math ----------------------------------------------------------------------------------------------

TEST(ClusterMath, LogitIsTheCpuScaledDots) {
  std::mt19937_64 rng(11);
  for (const int d : {1, 5, 8, 13, 64, 100, 128}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int group = 1 + static_cast<int>(rng() % 8);
      const int64_t n = 1 + static_cast<int64_t>(rng() % 40);
      const std::vector<float> q = awkward_floats(static_cast<size_t>(group * d), rng(), -3.0f, 3.0f, kAwkward);
      const std::vector<float> rows = trial % 3 == 0
                                          ? awkward_floats(static_cast<size_t>(n * d), rng(), -2.0f, 2.0f, kAwkward)
                                          : test::random_vector(static_cast<size_t>(n * d), rng(), 2.0f);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      std::vector<float> cpu(static_cast<size_t>(group * n));
      scaled_dots(q.data(), d, group, rows.data(), d, n, d, scale, cpu.data(), n);
      for (int g = 0; g < group; ++g)
        for (int64_t u = 0; u < n; ++u)
          ASSERT_TRUE(same_bits(pm::cluster_logit(scale, q.data() + g * d, rows.data() + u * d, d),
                                cpu[static_cast<size_t>(g * n + u)]))
              << "d " << d << " head " << g << " row " << u;
    }
  }
}

/// Cluster sizes (some 0: an emptied cluster) followed by `singles` groups of one token.
std::vector<int32_t> cluster_weights(int64_t clusters, int64_t singles, std::mt19937_64& rng) {
  std::vector<int32_t> w(static_cast<size_t>(clusters + singles), 1);
  for (int64_t c = 0; c < clusters; ++c)
    w[static_cast<size_t>(c)] = rng() % 6 == 0 ? 0 : 1 + static_cast<int32_t>(rng() % 90);
  return w;
}

/// The header's fold of logits [group, n] over groups of the given weights (clusters first, then singletons).
std::vector<float> cluster_header_fold(const std::vector<float>& logits, int group, int64_t n,
                                       const std::vector<int32_t>& weight, int64_t clusters, kvret_gqa_fold fold) {
  return test::header_fold(
      logits, group, n, fold, [&](float* l) { return pm::cluster_softmax_terms(l, n, weight.data(), clusters); },
      [](float acc, float l) { return pm::cluster_max_step(acc, l); },
      [](float acc, float l, const pm::PageSoftmax& s) { return pm::cluster_sum_prob_step(acc, l, s); });
}

TEST(ClusterMath, FoldIsTheCpuWeightedFold) {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 400; ++trial) {
    const int group = 1 + static_cast<int>(rng() % 8);
    const int64_t clusters = static_cast<int64_t>(rng() % 200);
    const int64_t singles = (clusters == 0 ? 1 : 0) + static_cast<int64_t>(rng() % 60);
    const int64_t n = clusters + singles;
    const std::vector<int32_t> weight = cluster_weights(clusters, singles, rng);
    for (int64_t u = 0; u < n; ++u)
      ASSERT_EQ(pm::cluster_weight(weight.data(), clusters, u), weight[static_cast<size_t>(u)]);
    const std::vector<float> logits =
        trial % 4 == 0 ? awkward_floats(static_cast<size_t>(group * n), rng(), -30.0f, 30.0f, kAwkward)
                       : test::random_vector(static_cast<size_t>(group * n), rng(), 8.0f);
    for (const kvret_gqa_fold fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
      std::vector<float> cpu(static_cast<size_t>(n));
      fold_weighted_logits(logits.data(), weight.data(), group, n, fold, cpu.data());
      const std::vector<float> header = cluster_header_fold(logits, group, n, weight, clusters, fold);
      for (int64_t u = 0; u < n; ++u) {
        if (weight[static_cast<size_t>(u)] == 0) continue;  // never taken, never reported
        ASSERT_TRUE(same_bits(header[static_cast<size_t>(u)], cpu[static_cast<size_t>(u)]))
            << "trial " << trial << " fold " << fold << " group " << u << ": " << header[static_cast<size_t>(u)]
            << " vs " << cpu[static_cast<size_t>(u)];
      }
    }
  }
}

/// The header's take: every group's tokens, in the order of cluster_order_key.
std::vector<int64_t> header_take(const std::vector<float>& scores, const std::vector<int32_t>& weight, int64_t budget) {
  const auto n = static_cast<int64_t>(scores.size());
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (int64_t u = 0; u < n; ++u)
    keys[static_cast<size_t>(u)] = pm::cluster_order_key(scores[static_cast<size_t>(u)], static_cast<uint32_t>(u));
  std::sort(keys.begin(), keys.end());
  std::vector<int64_t> taken(static_cast<size_t>(n), 0);
  int64_t before = 0;
  for (const uint64_t key : keys) {
    const auto u = static_cast<size_t>(key & 0xffffffffu);
    taken[u] = pm::cluster_take(before, weight[u], budget);
    before += taken[u];
  }
  return taken;
}

TEST(ClusterMath, OrderAndTakeAreTheCpuGroupedTake) {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t clusters = static_cast<int64_t>(rng() % 120);
    const int64_t singles = (clusters == 0 ? 1 : 0) + static_cast<int64_t>(rng() % 40);
    const int64_t n = clusters + singles;
    const std::vector<int32_t> weight = cluster_weights(clusters, singles, rng);
    int64_t tokens = 0;
    for (const int32_t w : weight) tokens += w;
    if (tokens == 0) continue;
    const int64_t budget = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(tokens));
    std::vector<float> scores = awkward_floats(static_cast<size_t>(n), rng(), -2.0f, 2.0f, kAwkward);
    for (auto& s : scores)
      if (rng() % 4 == 0) s = static_cast<float>(rng() % 3);  // ties
    for (int64_t u = 0; u < n; ++u)
      ASSERT_EQ(pm::cluster_order_key(scores[static_cast<size_t>(u)], static_cast<uint32_t>(u)),
                descending_key(scores[static_cast<size_t>(u)], static_cast<uint32_t>(u)));
    std::vector<uint64_t> scratch;
    std::vector<uint8_t> state(static_cast<size_t>(n));
    const int64_t quota = grouped_take(scores.data(), weight.data(), n, budget, scratch, state.data());
    const std::vector<int64_t> taken = header_take(scores, weight, budget);
    int64_t total = 0;
    for (size_t u = 0; u < static_cast<size_t>(n); ++u) {
      const int64_t expected = state[u] == kTake ? weight[u] : state[u] == kTrim ? quota : 0;
      ASSERT_EQ(taken[u], expected) << "trial " << trial << " group " << u;
      total += taken[u];
    }
    EXPECT_EQ(total, budget);
  }
}

/// ClusterRetriever::select (CPU) equals a model of the select built from cluster_math.h alone, bit for bit: the
/// logits of centroids, exact singletons and pending tokens, the fold, the order and take, the trimmed cluster's
/// earliest positions, the positions ascending, a token's score its group's.
TEST(ClusterMath, CpuSelectIsTheHeaderModel) {
  constexpr int kH = 2, kD = 64, kQ = 8, kGroup = kQ / kH;
  const int64_t n = 1500;
  HostKvStore store{kH, kD, DType::F32};
  F32 k({n, kH, kD}), v({n, kH, kD});
  test::clustered_kv(n, kH, kD, 17, k, v);
  store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), n, true);
  ClusterRetriever::Params p;
  p.exact_fraction = 0.05f;
  p.segment_tokens = 500;
  p.decode_interval = 64;
  ClusterRetriever index(kH, kD, p);
  index.extend(store, 4, 1000, true, 2);
  index.extend(store, 1000, 1100, false, 2);  // one decode segment and a pending tail
  ASSERT_GT(index.pending(), 0);
  ASSERT_GT(index.exacts(), 0);
  const int64_t middle = index.indexed_end() - index.indexed_begin();
  std::mt19937_64 rng(18);
  for (int trial = 0; trial < 24; ++trial) {
    const auto fold = trial % 2 == 0 ? KVRET_FOLD_SUM_PROB : KVRET_FOLD_MAX_LOGIT;
    const int64_t budget = trial % 6 == 1 ? middle : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(middle));
    const std::vector<float> q = test::random_vector(static_cast<size_t>(kQ * kD), rng(), 2.0f);
    const test::HeadsSelected s =
        test::select_heads(index, store, q, kH, kD, kGroup, index.indexed_begin(), index.indexed_end(), budget, fold);
    ASSERT_EQ(s.count, budget);
    const SelectRequest& req = s.req;
    const auto& rows = s.rows;
    const auto& scores = s.scores;
    const int64_t clusters = index.clusters(), exacts = index.exacts(), pending = index.pending();
    const int64_t groups = clusters + exacts + pending;
    for (int h = 0; h < kH; ++h) {
      std::vector<float> pending_keys(static_cast<size_t>(pending * kD));
      store.keys_f32(h, index.clustered_end(), index.indexed_end(), pending_keys.data());
      std::vector<float> logits(static_cast<size_t>(kGroup * groups));
      for (int g = 0; g < kGroup; ++g) {
        const float* qg = q.data() + (h * kGroup + g) * kD;
        for (int64_t u = 0; u < groups; ++u) {
          const float* row = u < clusters            ? index.centroids(h).data() + u * kD
                             : u < clusters + exacts ? index.exact_keys(h).data() + (u - clusters) * kD
                                                     : pending_keys.data() + (u - clusters - exacts) * kD;
          logits[static_cast<size_t>(g * groups + u)] = pm::cluster_logit(req.scale, qg, row, kD);
        }
      }
      std::vector<int32_t> weight(static_cast<size_t>(groups));
      for (int64_t u = 0; u < groups; ++u)
        weight[static_cast<size_t>(u)] = pm::cluster_weight(index.sizes(h).data(), clusters, u);
      const std::vector<float> folded = cluster_header_fold(logits, kGroup, groups, weight, clusters, fold);
      const std::vector<int64_t> taken = header_take(folded, weight, budget);
      std::vector<std::pair<int32_t, float>> model;
      for (int64_t u = 0; u < groups; ++u)
        for (int64_t t = 0; t < taken[static_cast<size_t>(u)]; ++t) {
          const int32_t pos =
              u < clusters ? index.sorted_ids(h)[static_cast<size_t>(index.offsets(h)[static_cast<size_t>(u)] + t)]
              : u < clusters + exacts ? index.exact_positions(h)[static_cast<size_t>(u - clusters)]
                                      : static_cast<int32_t>(index.clustered_end() + (u - clusters - exacts));
          model.emplace_back(pos, folded[static_cast<size_t>(u)]);
        }
      std::sort(model.begin(), model.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      ASSERT_EQ(static_cast<int64_t>(model.size()), budget);
      for (size_t i = 0; i < model.size(); ++i) {
        ASSERT_EQ(rows[static_cast<size_t>(h)][i], model[i].first) << "trial " << trial << " head " << h;
        ASSERT_TRUE(same_bits(scores[static_cast<size_t>(h)][i], model[i].second))
            << "trial " << trial << " head " << h << " token " << i;
      }
    }
  }
}

// --- through the C ABI ------------------------------------------------------------------------------------------

kvret_config page_config(int32_t device_type, int kv, int fold, int32_t page_size) {
  kvret_config c = twin_config(KVRET_INDEX_PAGE, device_type, kv, fold);
  c.page_size = page_size;
  return c;
}

/// A CLUSTER config of small clusters, decode intervals of 24 tokens (decodes add clusters often) and exact
/// singletons when exact_fraction > 0.
kvret_config cluster_config(int32_t device_type, int kv, int fold, float exact_fraction) {
  kvret_config c = twin_config(KVRET_INDEX_CLUSTER, device_type, kv, fold);
  c.cluster_tokens = 12;
  c.cluster_decode_interval = 24;
  c.cluster_decode_k = 3;
  c.cluster_segment_tokens = 96;
  c.cluster_exact_fraction = exact_fraction;
  return c;
}

/// A PQ config of pq_m = m and pq_bits = bits (0: 12 / m, a select that scores 4096 code cells; m * bits > 16: per
/// token), with exact tokens when exact_fraction > 0.
kvret_config pq_config(int32_t device_type, int kv, int fold, int32_t m, float exact_fraction, int32_t bits = 0) {
  kvret_config c = twin_config(KVRET_INDEX_PQ, device_type, kv, fold);
  c.pq_m = m;
  c.pq_bits = bits > 0 ? bits : 12 / m;
  c.pq_exact_fraction = exact_fraction;
  return c;
}

/// The index variants the device selects for: PAGE with full and odd pages, CLUSTER without and with exact
/// singletons, PQ's cell path with m = 2 and m = 4 (page_size: pq_m), without and with exact tokens, and its
/// per-token path (pq_bits: the default m = 4 x 6 bits, and m = 8 x 4 bits).
struct IndexCase {
  int32_t index;
  int32_t page_size;
  float exact_fraction;
  int32_t pq_bits = 0;
  std::string name() const {
    if (index == KVRET_INDEX_PQ)
      return "pq m " + std::to_string(page_size) + " bits " + std::to_string(pq_bits) + " exact " +
             std::to_string(exact_fraction);
    return index == KVRET_INDEX_PAGE ? "page " + std::to_string(page_size)
                                     : "cluster exact " + std::to_string(exact_fraction);
  }
  kvret_config config(int32_t device_type, int kv, int fold) const {
    if (index == KVRET_INDEX_PQ) return pq_config(device_type, kv, fold, page_size, exact_fraction, pq_bits);
    return index == KVRET_INDEX_PAGE ? page_config(device_type, kv, fold, page_size)
                                     : cluster_config(device_type, kv, fold, exact_fraction);
  }
};
const IndexCase kIndexCases[] = {
    {KVRET_INDEX_PAGE, 16, 0.0f},   {KVRET_INDEX_PAGE, 5, 0.0f},   {KVRET_INDEX_CLUSTER, 0, 0.0f},
    {KVRET_INDEX_CLUSTER, 0, 0.1f}, {KVRET_INDEX_PQ, 2, 0.0f},     {KVRET_INDEX_PQ, 2, 0.1f},
    {KVRET_INDEX_PQ, 4, 0.05f},     {KVRET_INDEX_PQ, 4, 0.05f, 6}, {KVRET_INDEX_PQ, 8, 0.1f, 4}};

class DeviceSelect : public test::twin::OnDevice {};

/// Positions and scores of the device select equal, bit for bit, the CPU backend's over random steps with appends
/// (prefill and one-token decodes: partial last pages; CLUSTER: pending tails and new decode clusters), truncates,
/// drop_fronts, forks and sessions saved and opened; budgets from 1 to past the middle; and the device select did
/// run (its copy of the index is counted). PAGE and CLUSTER.
TEST_F(DeviceSelect, EqualsTheCpuBackendUnderEveryChange) {
  for (const int kv : {KVRET_KV_F32, KVRET_KV_F16}) {
    for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
      for (const IndexCase& index : kIndexCases) {
        const std::string where = "kv " + std::to_string(kv) + " fold " + std::to_string(fold) + " " + index.name();
        SCOPED_TRACE(where);
        const kvret_config dc = index.config(KVRET_DEVICE_CUDA, kv, fold);
        const kvret_config cc = index.config(KVRET_DEVICE_CPU, kv, fold);
        const int32_t page_size = index.index == KVRET_INDEX_PAGE ? index.page_size : 0;
        const uint64_t rng_seed = 7 + static_cast<uint64_t>(kv * 4 + fold * 2 + page_size) +
                                  static_cast<uint64_t>(index.exact_fraction * 100.0f);
        const int selects = walk_twins(dc, cc, 150 + page_size, 21, rng_seed, {90, 40, 30, "devsel"}, where);
        ASSERT_FALSE(HasFatalFailure());
        EXPECT_GT(selects, 20);
      }
    }
  }
}

/// device_bytes counts the device's copy of the page bounds: at least [n_kv_heads, pages, 2, head_dim] f32 per
/// selected layer, whole pages of it; a copy that would pass config.device_bytes_limit is not made, and that
/// select runs on the host with the same result.
TEST_F(DeviceSelect, DeviceBytesCountTheBoundsAndTheLimitHolds) {
  const int32_t page_size = 16;
  const int64_t tokens = 600;
  const kvret_config cc = page_config(KVRET_DEVICE_CPU, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, page_size);
  const int64_t middle = tokens - cc.n_sink - cc.n_local;
  const int64_t pages = (middle + page_size - 1) / page_size;
  const int64_t page_bytes = int64_t{kHeads} * 2 * kDim * static_cast<int64_t>(sizeof(float));
  const std::vector<float> q = test::random_vector(8 * kDim, 77, 2.0f);
  auto cpu_ctx = test::make_context(cc);
  kvret_seq* ref = nullptr;
  test::expect_ok(kvret_seq_open(cpu_ctx.get(), &ref));
  for (const int64_t limit : {int64_t{0}, pages * page_bytes * 3 / 2, pages * page_bytes / 2}) {
    SCOPED_TRACE(limit);
    kvret_config dc = page_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, page_size);
    dc.device_bytes_limit = limit;
    auto dev_ctx = test::make_context(dc);
    kvret_seq* a = nullptr;
    test::expect_ok(kvret_seq_open(dev_ctx.get(), &a));
    kvret_seq* b = nullptr;
    test::expect_ok(kvret_seq_open(cpu_ctx.get(), &b));
    append_both(a, b, dc.n_layers, tokens, 31);
    EXPECT_EQ(stats_of(a).device_bytes, 0);
    expect_same_select(a, b, 0, q, 100, 100, true, "layer 0");
    const int64_t one = stats_of(a).device_bytes;
    if (limit != 0 && limit < pages * page_bytes) {
      EXPECT_EQ(one, 0) << "no copy past the limit";
    } else {
      EXPECT_GE(one, pages * page_bytes);
      EXPECT_EQ(one % page_bytes, 0);
      if (limit != 0) {
        EXPECT_LE(one, limit);
      }
    }
    expect_same_select(a, b, 1, q, 100, 100, true, "layer 1");
    const int64_t two = stats_of(a).device_bytes;
    if (limit == 0) {
      EXPECT_EQ(two, 2 * one) << "one copy per layer";
    } else {
      EXPECT_EQ(two, one) << "a second layer's copy would pass the limit";
      EXPECT_LE(two, limit);
    }
    test::expect_ok(kvret_seq_close(a));  // frees its copies
    test::expect_ok(kvret_seq_close(b));
  }
  test::expect_ok(kvret_seq_close(ref));
}

/// The bytes of the device's copy of a CLUSTER index (kvret::ClusterRetriever's arrays, every head): f32 centroids
/// and singleton keys, i32 sizes, offsets, sorted ids and singleton positions.
int64_t cluster_mirror_bytes(kvret_seq* seq, int32_t layer) {
  EXPECT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
  const auto& c = dynamic_cast<const ClusterRetriever&>(sequence_from_handle(seq)->index(layer));
  const int64_t heads = c.n_kv_heads(), d = c.head_dim(), n = c.clusters(), e = c.exacts();
  const auto ids = static_cast<int64_t>(c.sorted_ids(0).size());
  return heads * (n * d + n + (n + 1) + ids + e + e * d) * 4;
}

/// device_bytes counts the device's copy of the clusters (at least the index's arrays, per selected layer); a copy
/// that would pass config.device_bytes_limit is not made, and that select runs on the host with the same result;
/// decode intervals that add clusters renew the copy, which still matches the CPU backend.
TEST_F(DeviceSelect, DeviceBytesCountTheClustersAndTheLimitHolds) {
  const int64_t tokens = 600;
  const kvret_config cc = cluster_config(KVRET_DEVICE_CPU, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 0.05f);
  const std::vector<float> q = test::random_vector(8 * kDim, 78, 2.0f);
  auto cpu_ctx = test::make_context(cc);
  int64_t index_bytes = 0;
  for (const int pass : {0, 1}) {
    kvret_config dc = cluster_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 0.05f);
    dc.device_bytes_limit = pass == 0 ? 0 : index_bytes - 1;
    SCOPED_TRACE(dc.device_bytes_limit);
    auto dev_ctx = test::make_context(dc);
    kvret_seq *a = nullptr, *b = nullptr;
    open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, dc.n_layers, tokens, 32);
    EXPECT_EQ(stats_of(a).device_bytes, 0);
    index_bytes = cluster_mirror_bytes(a, 0);
    ASSERT_GT(index_bytes, 0);
    for (int round = 0; round < 3; ++round) {
      expect_same_select(a, b, 0, q, 100, 100, true, "round " + std::to_string(round));
      const int64_t held = stats_of(a).device_bytes;
      if (pass == 0) {
        EXPECT_GE(held, cluster_mirror_bytes(a, 0)) << "round " << round;
      } else {
        EXPECT_EQ(held, 0) << "no copy past the limit";
      }
      for (int t = 0; t < 30; ++t) append_both(a, b, dc.n_layers, 1, 700 + static_cast<uint64_t>(round * 30 + t));
    }
    test::expect_ok(kvret_seq_close(a));  // frees its copies
    test::expect_ok(kvret_seq_close(b));
  }
}

/// The bytes of the PQ index's arrays the device needs (kvret::PqRetriever's, every head): the f32 codebook, i32
/// cell counts and exact count, an i32 item per token, the exact tokens' keys as f32 (the largest head's count),
/// and on the per-token path the codes.
int64_t pq_index_bytes(kvret_seq* seq, int32_t layer) {
  EXPECT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
  const auto& p = dynamic_cast<const PqRetriever&>(sequence_from_handle(seq)->index(layer));
  int64_t exacts = 0;
  for (int h = 0; h < p.n_kv_heads(); ++h)
    exacts = std::max<int64_t>(exacts, static_cast<int64_t>(p.exact_positions(h).size()));
  return int64_t{p.n_kv_heads()} *
         ((int64_t{p.m()} * p.k() * p.sub_dim() + p.n_cells() + 1 + p.size() + exacts * p.head_dim()) * 4 +
          (p.scores_cells() ? 0 : p.size() * p.m()));
}

/// device_bytes counts the device's copy of the PQ index (at least its arrays, per selected layer); decode appends
/// (codes sent after the copy's) keep the device select equal to the CPU backend's; a copy that would pass
/// config.device_bytes_limit is not made, and that select runs on the host with the same result.
void pq_index_bytes_and_limit(int32_t m, int32_t bits);

TEST_F(DeviceSelect, DeviceBytesCountThePqIndexAndTheLimitHolds) {
  for (const int32_t m : {2, 4}) pq_index_bytes_and_limit(m, 6);  // m = 2: 4096 cells; m = 4: per token (default)
}

void pq_index_bytes_and_limit(int32_t m, int32_t bits) {
  SCOPED_TRACE("pq m " + std::to_string(m) + " bits " + std::to_string(bits));
  const int64_t tokens = 600;
  const kvret_config cc = pq_config(KVRET_DEVICE_CPU, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, m, 0.05f, bits);
  const std::vector<float> q = test::random_vector(8 * kDim, 79, 2.0f);
  auto cpu_ctx = test::make_context(cc);
  int64_t index_bytes = 0;
  for (const int pass : {0, 1}) {
    kvret_config dc = pq_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, m, 0.05f, bits);
    dc.device_bytes_limit = pass == 0 ? 0 : index_bytes - 1;
    SCOPED_TRACE(dc.device_bytes_limit);
    auto dev_ctx = test::make_context(dc);
    kvret_seq *a = nullptr, *b = nullptr;
    open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, dc.n_layers, tokens, 33);
    EXPECT_EQ(stats_of(a).device_bytes, 0);
    index_bytes = pq_index_bytes(a, 0);
    ASSERT_GT(index_bytes, 0);
    for (int round = 0; round < 4; ++round) {
      const int32_t budget = round == 3 ? 1 : 100;
      expect_same_select(a, b, 0, q, budget, budget, true, "round " + std::to_string(round));
      const int64_t held = stats_of(a).device_bytes;
      if (pass == 0) {
        EXPECT_GE(held, pq_index_bytes(a, 0)) << "round " << round;
      } else {
        EXPECT_EQ(held, 0) << "no copy past the limit";
      }
      // decodes: one token at a time, no retraining (the codes of the new tokens only go to the device)
      for (int t = 0; t < 25; ++t) {
        F32 k({1, kHeads, kDim}), v({1, kHeads, kDim});
        k.data = test::random_vector(static_cast<size_t>(kHeads * kDim), 800 + static_cast<uint64_t>(round * 25 + t));
        v.data = k.data;
        k.refresh();
        v.refresh();
        for (int32_t l = 0; l < dc.n_layers; ++l) test::expect_ok(kvret_append_decode(a, l, &k.t, &v.t));
        label(k, KVRET_DEVICE_CPU);
        label(v, KVRET_DEVICE_CPU);
        for (int32_t l = 0; l < dc.n_layers; ++l) test::expect_ok(kvret_append_decode(b, l, &k.t, &v.t));
      }
    }
    test::expect_ok(kvret_seq_close(a));  // frees its copies
    test::expect_ok(kvret_seq_close(b));
  }
}

/// Under config.check_finite, a q with a NaN or an Inf is KVRET_ERR_NONFINITE on the device path too, and nothing
/// changes: the outputs keep their elements, the selection count stays.
void non_finite_query_changes_nothing(int32_t kind);

TEST_F(DeviceSelect, NonFiniteQueryChangesNothing) {
  for (const int32_t kind : {KVRET_INDEX_PAGE, KVRET_INDEX_PQ}) non_finite_query_changes_nothing(kind);
}

void non_finite_query_changes_nothing(int32_t kind) {
  SCOPED_TRACE(kind);
  kvret_config dc = kind == KVRET_INDEX_PQ ? pq_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 2, 0.05f)
                                           : page_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 16);
  dc.check_finite = 1;
  auto ctx = test::make_context(dc);
  kvret_seq* a = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &a));
  kvret_seq* unused = nullptr;
  auto cpu_ctx = test::make_context(page_config(KVRET_DEVICE_CPU, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 16));
  test::expect_ok(kvret_seq_open(cpu_ctx.get(), &unused));
  append_both(a, unused, dc.n_layers, 300, 5);
  const Selected good = select(a, KVRET_DEVICE_CUDA, 0, test::random_vector(8 * kDim, 6), 40, 40, true);
  ASSERT_EQ(good.count, 40);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    F32 q({8, kDim});
    q.data = test::random_vector(8 * kDim, 6);
    q.data[static_cast<size_t>(5 * kDim + 3)] = bad;
    q.refresh();
    I32 out({kHeads, 40}, -7);
    F32 sc({kHeads, 40}, -7.0f);
    int32_t count = -1;
    const int64_t selections = stats_of(a).selections;
    EXPECT_EQ(kvret_select_scored(a, 0, &q.t, 40, &out.t, &sc.t, &count), KVRET_ERR_NONFINITE);
    EXPECT_NE(std::string(kvret_last_error()).find("NaN or Inf"), std::string::npos) << kvret_last_error();
    EXPECT_EQ(count, -1);
    EXPECT_EQ(out.data, std::vector<int32_t>(2 * 40, -7));
    EXPECT_EQ(sc.data, std::vector<float>(2 * 40, -7.0f));
    EXPECT_EQ(stats_of(a).selections, selections);
  }
  test::expect_ok(kvret_seq_close(a));
  test::expect_ok(kvret_seq_close(unused));
}

/// kvret_select_batch over several sequences equals one select per sequence and the CPU backend's batch, and runs
/// the passes of one select (the backend fuses it).
void batch_equals_single_selects(const IndexCase& index, int fold = KVRET_FOLD_SUM_PROB, bool nan_first = false) {
  SCOPED_TRACE(index.name() + " fold " + std::to_string(fold));
  test::twin::Batch w;
  w.budget = 50;
  w.width = 52;
  w.fused = w.compare_backends = true;
  w.nan_first = nan_first;
  test::twin::batch_equals_single_selects(index.config(KVRET_DEVICE_CUDA, KVRET_KV_F16, fold),
                                          index.config(KVRET_DEVICE_CPU, KVRET_KV_F16, fold), w);
}

TEST_F(DeviceSelect, BatchEqualsSingleSelects) {
  batch_equals_single_selects({KVRET_INDEX_PAGE, 8, 0.0f});
  batch_equals_single_selects({KVRET_INDEX_PAGE, 5, 0.0f}, KVRET_FOLD_MAX_LOGIT);
  batch_equals_single_selects({KVRET_INDEX_CLUSTER, 0, 0.1f});
  batch_equals_single_selects({KVRET_INDEX_CLUSTER, 0, 0.0f}, KVRET_FOLD_MAX_LOGIT);
  batch_equals_single_selects({KVRET_INDEX_PQ, 2, 0.1f});
  batch_equals_single_selects({KVRET_INDEX_PQ, 2, 0.0f}, KVRET_FOLD_MAX_LOGIT);
  batch_equals_single_selects({KVRET_INDEX_PQ, 4, 0.05f});
  batch_equals_single_selects({KVRET_INDEX_PQ, 4, 0.05f, 6});
  batch_equals_single_selects({KVRET_INDEX_PQ, 8, 0.1f, 4}, KVRET_FOLD_MAX_LOGIT);
}

/// A fused PAGE, CLUSTER or PQ batch pads the shorter sequences' rows with groups of no tokens (logit -inf, weight
/// 0) and, for PQ's cell path, their token rows with entries never taken: with the first (shortest) sequence's q
/// all NaN the batch still equals the single selects and the CPU batch.
TEST_F(DeviceSelect, FusedBatchNeverSelectsThePadding) {
  for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
    for (const int32_t page_size : {8, 5}) batch_equals_single_selects({KVRET_INDEX_PAGE, page_size, 0.0f}, fold, true);
    batch_equals_single_selects({KVRET_INDEX_CLUSTER, 0, 0.1f}, fold, true);
    batch_equals_single_selects({KVRET_INDEX_PQ, 2, 0.1f}, fold, true);
    batch_equals_single_selects({KVRET_INDEX_PQ, 4, 0.0f}, fold, true);
    batch_equals_single_selects({KVRET_INDEX_PQ, 4, 0.05f, 6}, fold, true);
  }
}

}  // namespace
