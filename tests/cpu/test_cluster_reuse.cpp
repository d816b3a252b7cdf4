// ClusterKV's reuse between steps (config.cluster_reuse_steps): the clusters a layer's last R fetches took stay
// resident and serve the next fetch's selected rows. The working set is bit-identical with and without reuse (f32
// and f16 KV, decode steps, truncate, fork); the hit rate is 0 at the first step, exactly 1 for a repeated query,
// 0 with R = 0; the copy stays bounded. A workload test prints the hit rate and the fetch time with `[ cluster ]`.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvret.h"
#include "test_util.hpp"
#ifdef KVRET_HAVE_WORKLOAD
#include "workload.hpp"
#endif

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int kHeads = 2, kQHeads = 8, kDim = 64;
constexpr int64_t kTokens = 2000;
constexpr int32_t kBudget = 120;

kvret_config reuse_config(int32_t steps, int32_t kv_dtype = KVRET_KV_F32) {
  kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
  c.n_layers = 1;
  c.kv_dtype = kv_dtype;
  c.cluster_tokens = 40;
  c.cluster_decode_interval = 16;  // decode steps cluster new tokens often
  c.cluster_decode_k = 2;
  c.cluster_reuse_steps = steps;
  return c;
}

kvret_stats seq_stats(const kvret_seq* seq) {
  kvret_stats s;
  kvret_stats_init(&s);
  EXPECT_EQ(kvret_seq_stats(seq, &s), KVRET_OK) << kvret_last_error();
  return s;
}

/// One sequence on its own context.
struct SeqRun {
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  explicit SeqRun(const kvret_config& c) : ctx(test::make_context(c)) {
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK) << kvret_last_error();
  }
  ~SeqRun() {
    if (seq != nullptr) kvret_seq_close(seq);
  }
  SeqRun(const SeqRun&) = delete;
  SeqRun& operator=(const SeqRun&) = delete;
};

/// A working set as raw bytes: keys, values (f32) and positions.
struct Fetched {
  std::vector<float> k, v;
  std::vector<int32_t> positions;
  int64_t rows = 0;
  bool operator==(const Fetched&) const = default;
};

/// select + fetch of layer 0 with q at `budget`, into f32 buffers.
Fetched step(kvret_seq* seq, const F32& q, int32_t budget = kBudget) {
  I32 sel({kHeads, budget});
  int32_t count = 0;
  EXPECT_EQ(kvret_select(seq, 0, &q.t, budget, &sel.t, &count), KVRET_OK) << kvret_last_error();
  test::WorkingSetBuffers ws(seq, 0, count, kHeads, kDim);
  Fetched f;
  EXPECT_EQ(kvret_fetch_async(seq, 0, &sel.t, count, &ws.ws, &f.rows, nullptr), KVRET_OK) << kvret_last_error();
  f.k.assign(ws.k.data.begin(), ws.k.data.end());
  f.v.assign(ws.v.data.begin(), ws.v.data.end());
  f.positions.assign(ws.positions.data.begin(), ws.positions.data.end());
  return f;
}

F32 query(uint64_t seed) {
  F32 q({kQHeads, kDim});
  const std::vector<float> x = test::random_vector(kQHeads * kDim, seed);
  q.data.assign(x.begin(), x.end());
  q.refresh();
  return q;
}

/// A query of an AR(1) process: rho * previous + sqrt(1 - rho^2) * noise.
F32 next_query(const F32& previous, double rho, uint64_t seed) {
  F32 q = query(seed);
  for (size_t i = 0; i < q.data.size(); ++i)
    q.data[i] = static_cast<float>(rho * previous.data[i] + std::sqrt(1.0 - rho * rho) * q.data[i]);
  q.refresh();
  return q;
}

void prefill(kvret_seq* seq, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  test::clustered_kv(tokens, kHeads, kDim, seed, k, v);
  ASSERT_EQ(kvret_append_prefill(seq, 0, &k.t, &v.t), KVRET_OK) << kvret_last_error();
}

void decode(kvret_seq* seq, uint64_t seed) {
  F32 k({kHeads, kDim}), v({kHeads, kDim});
  const std::vector<float> x = test::random_vector(2 * kHeads * kDim, seed, 2.0f);
  std::copy(x.begin(), x.begin() + kHeads * kDim, k.data.begin());
  std::copy(x.begin() + kHeads * kDim, x.end(), v.data.begin());
  ASSERT_EQ(kvret_append_decode(seq, 0, &k.t, &v.t), KVRET_OK) << kvret_last_error();
}

TEST(ClusterReuse, DefaultIsOneAndBadValuesAreRefusedByName) {
  kvret_config c;
  kvret_config_init(&c);
  EXPECT_EQ(c.cluster_reuse_steps, 1);
  for (const int32_t bad : {-1, 1025, INT32_MIN}) {
    c.cluster_reuse_steps = bad;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(kvret_last_error()).find("cluster_reuse_steps"), std::string::npos) << kvret_last_error();
  }
  for (const int32_t good : {0, 1, 1024}) {
    c = reuse_config(good);
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_OK) << kvret_last_error();
    kvret_destroy(ctx);
  }
}

/// Decode steps with a drifting query (decode tokens appended between them, so pending tokens and new decode
/// clusters come and go): every working set equals the one fetched without reuse, bit for bit.
class ReuseBitExact : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {};

TEST_P(ReuseBitExact, FetchedBytesEqualThoseWithoutReuse) {
  const auto [steps, dtype] = GetParam();
  SeqRun off(reuse_config(0, dtype)), on(reuse_config(steps, dtype));
  prefill(off.seq, kTokens, 3);
  prefill(on.seq, kTokens, 3);
  F32 q = query(10);
  for (int t = 0; t < 40; ++t) {
    q = next_query(q, 0.9, 100 + static_cast<uint64_t>(t));
    const Fetched a = step(off.seq, q), b = step(on.seq, q);
    ASSERT_EQ(a.rows, b.rows);
    ASSERT_TRUE(a == b) << "step " << t;
    decode(off.seq, 1000 + static_cast<uint64_t>(t));
    decode(on.seq, 1000 + static_cast<uint64_t>(t));
  }
  const kvret_stats s = seq_stats(on.seq);
  EXPECT_GT(s.cluster_reuse_hits, 0);
  EXPECT_EQ(s.cluster_reuse_rows, int64_t{40} * kBudget * kHeads);
  EXPECT_EQ(seq_stats(off.seq).cluster_reuse_rows, s.cluster_reuse_rows);
  EXPECT_EQ(seq_stats(off.seq).cluster_reuse_hits, 0);
  std::printf("[ cluster ] R = %d, kv_dtype %d, drifting query (rho 0.9): hit rate %.3f\n", steps, dtype,
              static_cast<double>(s.cluster_reuse_hits) / static_cast<double>(s.cluster_reuse_rows));
}

/// The f16 store's rows into f16 outputs (the store's own dtype: no conversion on either path).
TEST(ClusterReuse, F16OutputsAreTheStoresBytes) {
  SeqRun off(reuse_config(0, KVRET_KV_F16)), on(reuse_config(2, KVRET_KV_F16));
  prefill(off.seq, kTokens, 4);
  prefill(on.seq, kTokens, 4);
  F32 q = query(20);
  for (int t = 0; t < 12; ++t) {
    q = next_query(q, 0.8, 200 + static_cast<uint64_t>(t));
    std::vector<std::vector<uint16_t>> out;
    for (kvret_seq* seq : {off.seq, on.seq}) {
      I32 sel({kHeads, kBudget});
      int32_t count = 0;
      test::expect_ok(kvret_select(seq, 0, &q.t, kBudget, &sel.t, &count));
      int64_t capacity = 0, rows = 0;
      test::expect_ok(kvret_working_set_capacity(seq, 0, count, &capacity));
      test::Buffer<uint16_t> k({kHeads, capacity, kDim}), v({kHeads, capacity, kDim});
      I32 p({kHeads, capacity});
      const kvret_working_set ws{k.t, v.t, p.t};
      test::expect_ok(kvret_fetch_async(seq, 0, &sel.t, count, &ws, &rows, nullptr));
      out.emplace_back(k.data.begin(), k.data.end());
      out.back().insert(out.back().end(), v.data.begin(), v.data.end());
    }
    ASSERT_EQ(out[0], out[1]) << "step " << t;
  }
  EXPECT_GT(seq_stats(on.seq).cluster_reuse_hits, 0);
}

INSTANTIATE_TEST_SUITE_P(StepsAndDtypes, ReuseBitExact,
                         ::testing::Combine(::testing::Values(1, 3), ::testing::Values(KVRET_KV_F32, KVRET_KV_F16)));

TEST(ClusterReuse, HitRateIsZeroFirstThenOneForARepeatedQueryAndZeroWithReuseOff) {
  for (const int32_t steps : {0, 1, 4}) {
    kvret_config c = reuse_config(steps);
    c.cache_capacity_tokens = 0;  // no CUDA block cache: its hits count in cache_hits too (with reuse off)
    SeqRun r(c);
    prefill(r.seq, kTokens, 5);
    const F32 q = query(30);
    const Fetched first = step(r.seq, q);
    kvret_stats s = seq_stats(r.seq);
    EXPECT_EQ(s.cluster_reuse_rows, int64_t{kBudget} * kHeads);
    EXPECT_EQ(s.cluster_reuse_hits, 0) << "nothing is resident before the first fetch";
    for (int t = 0; t < 3; ++t) {
      const int64_t hits = seq_stats(r.seq).cluster_reuse_hits;
      const int64_t cache_hits = seq_stats(r.seq).cache_hits;
      const Fetched again = step(r.seq, q);
      ASSERT_TRUE(again == first);
      s = seq_stats(r.seq);
      EXPECT_EQ(s.cluster_reuse_hits - hits, steps > 0 ? int64_t{kBudget} * kHeads : 0)
          << "R = " << steps << ": the same query takes the same clusters, all resident";
      EXPECT_EQ(s.cache_hits - cache_hits, s.cluster_reuse_hits - hits) << "reuse hits count as cache hits";
    }
    EXPECT_EQ(s.cluster_reuse_rows, int64_t{4} * kBudget * kHeads);
    if (steps == 0) {
      EXPECT_EQ(s.cluster_reuse_bytes, 0);
    } else {
      EXPECT_GT(s.cluster_reuse_bytes, 0);
    }
  }
}

TEST(ClusterReuse, OnlyTheLastRStepsStayResident) {
  const F32 a = query(40), b = query(41), c = query(42), d = query(43);
  const int64_t all = int64_t{kBudget} * kHeads;
  for (const int32_t steps : {1, 2, 3}) {
    SeqRun r(reuse_config(steps));
    prefill(r.seq, kTokens, 6);
    const auto hits_of = [&](const F32& q) {
      const int64_t before = seq_stats(r.seq).cluster_reuse_hits;
      step(r.seq, q);
      return seq_stats(r.seq).cluster_reuse_hits - before;
    };
    EXPECT_EQ(hits_of(a), 0);
    hits_of(b);
    const int64_t two_ago = hits_of(a);  // a's clusters were fetched 2 steps before
    hits_of(b);
    hits_of(c);
    hits_of(d);
    const int64_t four_ago = hits_of(a);  // 4 steps before (b, c and d may share some of them)
    if (steps >= 2) {
      EXPECT_EQ(two_ago, all) << "R = " << steps;
    } else {
      EXPECT_LT(two_ago, all) << "R = 1: only the clusters b took too";
    }
    EXPECT_LT(four_ago, all) << "R = " << steps;
  }
}

TEST(ClusterReuse, TheCopyStaysBounded) {
  SeqRun r(reuse_config(1));
  prefill(r.seq, kTokens, 7);
  int64_t largest = 0;
  for (int t = 0; t < 60; ++t) {
    step(r.seq, query(500 + static_cast<uint64_t>(t)));  // unrelated queries: the clusters change every step
    largest = std::max(largest, seq_stats(r.seq).cluster_reuse_bytes);
  }
  // at most the rows of one step's clusters (with growth slack) plus the per-position maps
  const int64_t row_bytes = 2 * kDim * static_cast<int64_t>(sizeof(float));
  const int64_t maps = kHeads * kTokens * 8;
  EXPECT_LT(largest, kHeads * (4 * kBudget * row_bytes) + 4 * maps) << largest;
  EXPECT_LT(largest, kHeads * kTokens * row_bytes / 2) << "far below a copy of the whole layer";
}

TEST(ClusterReuse, TruncateAndForkKeepTheBytesRight) {
  SeqRun off(reuse_config(0)), on(reuse_config(1));
  for (SeqRun* r : {&off, &on}) prefill(r->seq, kTokens, 8);
  F32 q = query(60);
  for (int t = 0; t < 6; ++t) {
    q = next_query(q, 0.95, 600 + static_cast<uint64_t>(t));
    ASSERT_TRUE(step(off.seq, q) == step(on.seq, q));
    for (SeqRun* r : {&off, &on}) decode(r->seq, 700 + static_cast<uint64_t>(t));
  }
  // truncate into the middle, then new tokens at the same positions: the copy must not serve the old ones
  for (SeqRun* r : {&off, &on}) ASSERT_EQ(kvret_seq_truncate(r->seq, kTokens - 300), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(seq_stats(on.seq).cluster_reuse_bytes, 0) << "truncate drops the layer's copy";
  for (int t = 0; t < 200; ++t)
    for (SeqRun* r : {&off, &on}) decode(r->seq, 900 + static_cast<uint64_t>(t));
  for (int t = 0; t < 6; ++t) {
    q = next_query(q, 0.95, 800 + static_cast<uint64_t>(t));
    ASSERT_TRUE(step(off.seq, q) == step(on.seq, q)) << "after truncate, step " << t;
  }
  EXPECT_GT(seq_stats(on.seq).cluster_reuse_hits, 0);
  // forks go their own ways; each keeps fetching the bytes its store holds
  kvret_seq *off_fork = nullptr, *on_fork = nullptr;
  ASSERT_EQ(kvret_seq_fork(off.seq, &off_fork), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(kvret_seq_fork(on.seq, &on_fork), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(seq_stats(on_fork).cluster_reuse_bytes, 0) << "a fork starts without a copy";
  for (int t = 0; t < 8; ++t) {
    q = next_query(q, 0.95, 1100 + static_cast<uint64_t>(t));
    decode(off.seq, 1200 + static_cast<uint64_t>(t));
    decode(on.seq, 1200 + static_cast<uint64_t>(t));
    decode(off_fork, 1300 + static_cast<uint64_t>(t));
    decode(on_fork, 1300 + static_cast<uint64_t>(t));
    ASSERT_TRUE(step(off.seq, q) == step(on.seq, q)) << "source, step " << t;
    ASSERT_TRUE(step(off_fork, q) == step(on_fork, q)) << "fork, step " << t;
  }
  EXPECT_GT(seq_stats(on_fork).cluster_reuse_hits, 0);
  kvret_seq_close(off_fork);
  kvret_seq_close(on_fork);
  // closing keeps the counts in the context's stats, not the copy's bytes
  kvret_stats cs;
  kvret_stats_init(&cs);
  ASSERT_EQ(kvret_context_stats(on.ctx.get(), &cs), KVRET_OK);
  EXPECT_EQ(cs.cluster_reuse_bytes, seq_stats(on.seq).cluster_reuse_bytes);
  EXPECT_GT(cs.cluster_reuse_hits, seq_stats(on.seq).cluster_reuse_hits);
}

TEST(ClusterReuse, AttendUsesItAndOtherKindsCountNothing) {
  SeqRun r(reuse_config(1));
  prefill(r.seq, kTokens, 9);
  const F32 q = query(70);
  F32 out({kQHeads, kDim});
  for (int t = 0; t < 3; ++t) test::expect_ok(kvret_seq_attend(r.seq, 0, &q.t, kBudget, 0.0f, &out.t, nullptr));
  kvret_stats s = seq_stats(r.seq);
  EXPECT_EQ(s.cluster_reuse_rows, int64_t{3} * kBudget * kHeads);
  EXPECT_EQ(s.cluster_reuse_hits, int64_t{2} * kBudget * kHeads);

  kvret_config c = reuse_config(1);
  c.index_kind = KVRET_INDEX_PAGE;
  SeqRun page(c);
  prefill(page.seq, kTokens, 9);
  step(page.seq, q);
  step(page.seq, q);
  s = seq_stats(page.seq);
  EXPECT_EQ(s.cluster_reuse_rows, 0);
  EXPECT_EQ(s.cluster_reuse_hits, 0);
  EXPECT_EQ(s.cluster_reuse_bytes, 0);
}

/// A caller's older, smaller kvret_stats (without the reuse fields) is left alone past its end.
TEST(ClusterReuse, OlderStatsStructsGetNoReuseFields) {
  SeqRun r(reuse_config(1));
  prefill(r.seq, kTokens, 10);
  step(r.seq, query(80));
  kvret_stats s;
  kvret_stats_init(&s);
  s.struct_size = offsetof(kvret_stats, cluster_reuse_rows);
  s.cluster_reuse_rows = -7;
  ASSERT_EQ(kvret_seq_stats(r.seq, &s), KVRET_OK);
  EXPECT_EQ(s.cluster_reuse_rows, -7);
  EXPECT_GT(s.fetched_rows, 0);
}

#ifdef KVRET_HAVE_WORKLOAD
/// The figure: on the demo's synthetic workload (RoPE keys, topics, AR(1) queries with correlation 0.9), decode
/// steps of one layer at budget 1/10, with the hit rate and the fetch time (median of the steps) per R.
/// KVRET_REUSE_TOKENS sets the prefill length (default 8192), KVRET_REUSE_THREADS config.n_threads (default 0: all
/// cores).
TEST(ClusterReuse, WorkloadHitRateAndFetchTime) {
  namespace workload = kvret::workload;
  workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = 32;
  wc.n_kv_heads = 8;
  wc.head_dim = 128;
  const char* env = std::getenv("KVRET_REUSE_TOKENS");
  wc.n_prefill = env != nullptr ? std::atoll(env) : 8192;
  wc.n_decode = 64;
  const workload::Workload w(wc);
  const int64_t n = wc.n_prefill + wc.n_decode;
  std::vector<float> k(static_cast<size_t>(n * wc.n_kv_heads * wc.head_dim)), v(k.size());
  w.keys_values(0, 0, n, k.data(), v.data());
  std::vector<float> qs(static_cast<size_t>(wc.n_decode * wc.n_q_heads * wc.head_dim));
  w.queries(0, wc.n_decode, qs.data());
  const size_t token = static_cast<size_t>(wc.n_kv_heads * wc.head_dim);
  for (const int32_t steps : {0, 1, 2, 4}) {
    kvret_config c;
    test::init_config(&c);
    c.n_layers = 1;
    c.n_q_heads = wc.n_q_heads;
    c.n_kv_heads = wc.n_kv_heads;
    c.head_dim = wc.head_dim;
    c.kv_dtype = KVRET_KV_F16;
    c.index_kind = KVRET_INDEX_CLUSTER;
    c.background_build = 0;
    c.cluster_reuse_steps = steps;
    const char* threads = std::getenv("KVRET_REUSE_THREADS");
    if (threads != nullptr) c.n_threads = std::atoi(threads);
    SeqRun r(c);
    {
      const std::vector<int64_t> shape{wc.n_prefill, wc.n_kv_heads, wc.head_dim};
      test::F32 kt({wc.n_prefill, wc.n_kv_heads, wc.head_dim}), vt({wc.n_prefill, wc.n_kv_heads, wc.head_dim});
      std::copy(k.begin(), k.begin() + static_cast<std::ptrdiff_t>(wc.n_prefill * token), kt.data.begin());
      std::copy(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(wc.n_prefill * token), vt.data.begin());
      test::expect_ok(kvret_append_prefill(r.seq, 0, &kt.t, &vt.t));
    }
    const int32_t budget = static_cast<int32_t>((n + 9) / 10);
    std::vector<double> ms;
    for (int s = 0; s < wc.n_decode; ++s) {
      F32 q({wc.n_q_heads, wc.head_dim});
      std::copy(qs.begin() + static_cast<std::ptrdiff_t>(s) * wc.n_q_heads * wc.head_dim,
                qs.begin() + static_cast<std::ptrdiff_t>(s + 1) * wc.n_q_heads * wc.head_dim, q.data.begin());
      I32 sel({wc.n_kv_heads, budget});
      int32_t count = 0;
      test::expect_ok(kvret_select(r.seq, 0, &q.t, budget, &sel.t, &count));
      int64_t capacity = 0, rows = 0;
      test::expect_ok(kvret_working_set_capacity(r.seq, 0, count, &capacity));
      test::Buffer<uint16_t> wk({wc.n_kv_heads, capacity, wc.head_dim}), wv({wc.n_kv_heads, capacity, wc.head_dim});
      I32 wp({wc.n_kv_heads, capacity});
      const kvret_working_set ws{wk.t, wv.t, wp.t};
      const auto t0 = std::chrono::steady_clock::now();
      test::expect_ok(kvret_fetch_async(r.seq, 0, &sel.t, count, &ws, &rows, nullptr));
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      F32 dk({wc.n_kv_heads, wc.head_dim}), dv({wc.n_kv_heads, wc.head_dim});
      const auto at = static_cast<std::ptrdiff_t>((wc.n_prefill + s) * static_cast<int64_t>(token));
      std::copy(k.begin() + at, k.begin() + at + static_cast<std::ptrdiff_t>(token), dk.data.begin());
      std::copy(v.begin() + at, v.begin() + at + static_cast<std::ptrdiff_t>(token), dv.data.begin());
      test::expect_ok(kvret_append_decode(r.seq, 0, &dk.t, &dv.t));
    }
    std::sort(ms.begin(), ms.end());
    const kvret_stats s = seq_stats(r.seq);
    const double rate = static_cast<double>(s.cluster_reuse_hits) / static_cast<double>(s.cluster_reuse_rows);
    std::printf(
        "[ cluster ] workload %lld tokens, budget %d, %d decode steps, R = %d: hit rate %.3f (first step 0), "
        "fetch median %.3f ms (min %.3f), resident copy %.2f MiB, rows read from the store %lld of %lld\n",
        static_cast<long long>(wc.n_prefill), budget, wc.n_decode, steps, rate, ms[ms.size() / 2], ms[0],
        static_cast<double>(s.cluster_reuse_bytes) / (1 << 20), static_cast<long long>(s.cache_misses),
        static_cast<long long>(s.fetched_rows));
    if (steps == 0) {
      EXPECT_EQ(rate, 0.0);
    } else {
      EXPECT_GT(rate, 0.3) << "correlated queries take many of the last step's clusters again";
    }
  }
}
#endif

}  // namespace
