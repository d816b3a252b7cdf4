// kvret_seq_retained_set, KVCrush's eviction-only mode: the static set of middle tokens per KV head that an engine
// dropping KV keeps after the prefill, SnapKV's base (importance from the window of the layer's last keys) plus
// bucket representatives. Properties: count = budget, distinct ascending middle positions; share 0 is SnapKV's top
// tokens (checked against a reference computed here); with a share, the important part is the share-0 set of its
// size and the representatives lie outside it; every index kind gives the same set; the call changes nothing;
// bad input is refused by name with nothing written. On the synthetic workload, the attention mass of decode
// queries over the retained set with and without representatives is reported ("[ kvcrush ]").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "kvret.h"
#include "select/kvcrush.hpp"
#include "sequence_observer.hpp"
#include "test_util.hpp"
#ifdef KVRET_HAVE_WORKLOAD
#include "workload.hpp"
#endif

using namespace kvret::test;

namespace {

constexpr int64_t kTokens = 1300, kMidBegin = 4, kMidEnd = kTokens - 16;  // small_config: 4 sink, 16 local
constexpr int64_t kMiddle = kMidEnd - kMidBegin;

struct Fixture {
  ContextPtr ctx;
  std::unique_ptr<Seq> seq;
  F32 k{{kTokens, kHeads, kDim}}, v{{kTokens, kHeads, kDim}};
  explicit Fixture(float share, int kind = KVRET_INDEX_EXACT, int32_t buckets = 0, int threads = 2) {
    kvret_config c = small_config(kind);
    c.hamming_fraction = share;
    c.hamming_buckets = buckets;
    c.n_threads = threads;
    ctx = make_context(c);
    seq = std::make_unique<Seq>(ctx.get());
    clustered_kv(kTokens, kHeads, kDim, 5, k, v);
    prefill(seq->s, 0, k, v, 0, kTokens);
  }
};

/// The retained set of layer 0 as rows per head (asserting the call succeeds and count == expected).
std::vector<std::vector<int32_t>> retained(kvret_seq* s, int32_t budget, int64_t expected) {
  I32 out({kHeads, std::max<int64_t>(expected, 1)}, -7);
  int32_t count = -1;
  EXPECT_EQ(kvret_seq_retained_set(s, 0, budget, &out, &count), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(count, expected);
  std::vector<std::vector<int32_t>> rows;
  for (int h = 0; h < kHeads; ++h) {
    const auto at = out.data.begin() + h * out.shape[1];
    rows.emplace_back(at, at + std::max(count, 0));
  }
  return rows;
}

/// SnapKV's importance of every token of head h, in double: the window is the last min(32, length) keys, each a
/// query; a token's importance is the sum over the window of its softmax probability over all `length` tokens.
std::vector<double> snapkv_reference(const std::vector<float>& k, int64_t length, int h) {
  const int64_t w = std::min<int64_t>(32, length);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  std::vector<double> imp(static_cast<size_t>(length), 0.0), logit(static_cast<size_t>(length));
  for (int64_t j = length - w; j < length; ++j) {
    const float* q = k.data() + (j * kHeads + h) * kDim;
    for (int64_t t = 0; t < length; ++t) {
      const float* kt = k.data() + (t * kHeads + h) * kDim;
      double s = 0;
      for (int i = 0; i < kDim; ++i) s += static_cast<double>(q[i]) * kt[i];
      logit[static_cast<size_t>(t)] = s * scale;
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0;
    for (const double l : logit) z += std::exp(l - mx);
    for (int64_t t = 0; t < length; ++t)
      imp[static_cast<size_t>(t)] += std::exp(logit[static_cast<size_t>(t)] - mx) / z;
  }
  return imp;
}

void expect_well_formed(const std::vector<int32_t>& row, int64_t count, int64_t mid_begin, int64_t mid_end) {
  ASSERT_EQ(static_cast<int64_t>(row.size()), count);
  EXPECT_TRUE(std::is_sorted(row.begin(), row.end()));
  EXPECT_EQ(std::set<int32_t>(row.begin(), row.end()).size(), row.size()) << "duplicate position";
  for (const int32_t p : row) EXPECT_TRUE(p >= mid_begin && p < mid_end) << p << " is not a middle position";
}

TEST(KvCrushRetained, CountDistinctAscendingMiddle) {
  for (const float share : {0.0f, 0.25f, 0.5f}) {
    Fixture f(share);
    for (const int32_t budget : {1, 2, 7, 40, 256, static_cast<int32_t>(kMiddle)}) {
      const auto rows = retained(f.seq->s, budget, budget);
      for (const auto& r : rows) expect_well_formed(r, budget, kMidBegin, kMidEnd);
    }
    // above the middle (up to the length): the whole middle, as kvret_select clamps
    const auto all = retained(f.seq->s, static_cast<int32_t>(kTokens), kMiddle);
    std::vector<int32_t> middle(static_cast<size_t>(kMiddle));
    std::iota(middle.begin(), middle.end(), static_cast<int32_t>(kMidBegin));
    for (const auto& r : all) EXPECT_EQ(r, middle);
    // KVRET_BUDGET_DEFAULT: kvret_seq_budget's
    int32_t dflt = 0;
    expect_ok(kvret_seq_budget(f.seq->s, 0, &dflt));
    for (const auto& r : retained(f.seq->s, KVRET_BUDGET_DEFAULT, dflt))
      expect_well_formed(r, dflt, kMidBegin, kMidEnd);
  }
}

TEST(KvCrushRetained, ShareZeroIsSnapKvsTopTokens) {
  Fixture f(0.0f);
  for (const int32_t budget : {1, 33, 300}) {
    const auto rows = retained(f.seq->s, budget, budget);
    for (int h = 0; h < kHeads; ++h) {
      const std::vector<double> imp = snapkv_reference(f.k.data, kTokens, h);
      std::vector<double> middle(imp.begin() + kMidBegin, imp.begin() + kMidEnd);
      std::vector<double> sorted = middle;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const double cutoff = sorted[static_cast<size_t>(budget - 1)];
      const double tol = 1e-5 * sorted[0];  // float accumulation in the library against double here
      std::set<int32_t> kept(rows[static_cast<size_t>(h)].begin(), rows[static_cast<size_t>(h)].end());
      for (int64_t p = kMidBegin; p < kMidEnd; ++p) {
        const double x = imp[static_cast<size_t>(p)];
        if (kept.count(static_cast<int32_t>(p)))
          EXPECT_GE(x, cutoff - tol) << "head " << h << " kept " << p << " below the top " << budget;
        else
          EXPECT_LE(x, cutoff + tol) << "head " << h << " left out " << p << " of the top " << budget;
      }
    }
  }
}

TEST(KvCrushRetained, RepresentativesAddToTheSnapKvBase) {
  Fixture plain(0.0f);
  for (const float share : {0.1f, 0.25f, 0.5f}) {
    Fixture crushed(share);
    for (const int32_t budget : {4, 9, 10, 64, 300}) {
      const auto reps = static_cast<int64_t>(std::floor(static_cast<double>(share) * budget));
      const auto base = retained(plain.seq->s, static_cast<int32_t>(budget - reps), budget - reps);
      const auto rows = retained(crushed.seq->s, budget, budget);
      if (reps == 0) {
        EXPECT_EQ(rows, base) << "share " << share << ", budget " << budget;
      }
      for (int h = 0; h < kHeads; ++h) {
        const auto& r = rows[static_cast<size_t>(h)];
        const auto& b = base[static_cast<size_t>(h)];
        expect_well_formed(r, budget, kMidBegin, kMidEnd);
        // the important part is exactly SnapKV's set of its size; the representatives are the others
        EXPECT_TRUE(std::includes(r.begin(), r.end(), b.begin(), b.end())) << "head " << h;
        std::vector<int32_t> others;
        std::set_difference(r.begin(), r.end(), b.begin(), b.end(), std::back_inserter(others));
        EXPECT_EQ(static_cast<int64_t>(others.size()), reps) << "head " << h;
        for (const int32_t p : others) EXPECT_FALSE(std::binary_search(b.begin(), b.end(), p));
      }
    }
  }
}

TEST(KvCrushRetained, BucketsCapTheRepresentatives) {
  Fixture plain(0.0f), capped(0.5f, KVRET_INDEX_EXACT, 3);
  const auto rows = retained(capped.seq->s, 40, 40);
  const auto base = retained(plain.seq->s, 37, 37);
  for (int h = 0; h < kHeads; ++h) {
    const auto& r = rows[static_cast<size_t>(h)];
    const auto& b = base[static_cast<size_t>(h)];
    EXPECT_TRUE(std::includes(r.begin(), r.end(), b.begin(), b.end()));
  }
}

TEST(KvCrushRetained, EveryIndexKindGivesTheSameSet) {
  // the index is not used: STREAMING, which builds none, is the natural context of an evicting engine
  Fixture exact(0.25f);
  const auto want = retained(exact.seq->s, 100, 100);
  for (const int kind :
       {KVRET_INDEX_PQ, KVRET_INDEX_STREAMING, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT}) {
    Fixture f(0.25f, kind);
    EXPECT_EQ(retained(f.seq->s, 100, 100), want) << kind_name(kind);
  }
}

TEST(KvCrushRetained, ThreadsDoNotChangeTheSet) {
  // a layer large enough for the parallel paths (middle x query heads >= SelectRequest::kParallelLogits)
  constexpr int64_t tokens = 4500;
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  clustered_kv(tokens, kHeads, kDim, 23, k, v);
  std::vector<std::vector<std::vector<int32_t>>> sets;
  for (const int threads : {1, 2}) {
    kvret_config c = small_config(KVRET_INDEX_STREAMING);
    c.hamming_fraction = 0.25f;
    c.n_threads = threads;
    auto ctx = make_context(c);
    Seq s(ctx.get());
    prefill(s.s, 0, k, v, 0, tokens);
    sets.push_back(retained(s.s, 500, 500));
  }
  EXPECT_EQ(sets[0], sets[1]);
}

TEST(KvCrushRetained, ChangesNothing) {
  // two sequences brought to the same state; the retained set asked of one (before and between its selects)
  // changes neither its stats nor what its selects (with their own KVCrush step), fetches and lengths give
  for (const float share : {0.0f, 0.25f}) {
    Fixture a(share), b(share);
    F32 extra({20, kHeads, kDim}), extra_v({20, kHeads, kDim});
    clustered_kv(20, kHeads, kDim, 8, extra, extra_v);
    for (Fixture* f : {&a, &b}) prefill(f->seq->s, 1, f->k, f->v, 0, 200);
    kvret_stats before, after;
    kvret_stats_init(&before);
    kvret_stats_init(&after);
    expect_ok(kvret_wait_index(a.seq->s, -1));
    expect_ok(kvret_seq_stats(a.seq->s, &before));
    const auto first = retained(a.seq->s, 64, 64);
    expect_ok(kvret_seq_stats(a.seq->s, &after));
    EXPECT_EQ(std::memcmp(&before, &after, sizeof before), 0) << "stats changed";
    // decode a few tokens into both: a later select's KVCrush window is the one it would have been without us
    decode(a.seq->s, 0, extra, extra_v, 0, 20);
    decode(b.seq->s, 0, extra, extra_v, 0, 20);
    EXPECT_EQ(observe(a.seq->s), observe(b.seq->s));
    (void)retained(a.seq->s, 64, 64);
    EXPECT_EQ(observe(a.seq->s), observe(b.seq->s));
    // and the retained set itself is a function of the state: the same for both, the same when asked again
    EXPECT_EQ(retained(a.seq->s, 64, 64), retained(b.seq->s, 64, 64));
    EXPECT_EQ(retained(a.seq->s, 64, 64), retained(a.seq->s, 64, 64));
    EXPECT_NE(retained(a.seq->s, 64, 64), first);  // 20 more tokens, a new window
  }
}

TEST(KvCrushRetained, ForkAndTruncateGiveTheSetOfTheirState) {
  Fixture f(0.25f);
  const auto before = retained(f.seq->s, 80, 80);
  kvret_seq* child = nullptr;
  expect_ok(kvret_seq_fork(f.seq->s, &child));
  Seq c(child);
  EXPECT_EQ(retained(c.s, 80, 80), before);
  F32 k2({10, kHeads, kDim}), v2({10, kHeads, kDim});
  clustered_kv(10, kHeads, kDim, 9, k2, v2);
  decode(f.seq->s, 0, k2, v2, 0, 10);
  expect_ok(kvret_seq_truncate(f.seq->s, kTokens));
  EXPECT_EQ(retained(f.seq->s, 80, 80), before);
}

/// Runs the call with bad arguments and checks its status, that the message names `what`, and that neither the
/// output nor the count was written.
void expect_refused(kvret_status want, const std::string& what, kvret_seq* s, int32_t layer, int32_t budget,
                    const kvret_tensor* out, bool with_count = true) {
  int32_t count = -3;
  const auto* buffer = out != nullptr ? static_cast<const int32_t*>(out->data) : nullptr;
  std::vector<int32_t> held;
  if (buffer != nullptr && out->ndim >= 1) {
    int64_t n = 1;
    for (int i = 0; i < out->ndim; ++i) n *= out->shape[i];
    if (out->dtype.code == KVRET_DTYPE_INT && out->dtype.bits == 32) held.assign(buffer, buffer + n);
  }
  const kvret_status got = kvret_seq_retained_set(s, layer, budget, out, with_count ? &count : nullptr);
  EXPECT_EQ(got, want) << kvret_status_string(got) << ": " << kvret_last_error();
  EXPECT_NE(std::string(kvret_last_error()).find(what), std::string::npos)
      << "message does not name '" << what << "': " << kvret_last_error();
  EXPECT_EQ(count, -3);
  if (!held.empty()) {
    EXPECT_TRUE(std::equal(held.begin(), held.end(), buffer)) << "output written";
  }
}

TEST(KvCrushRetained, BadInputIsRefusedAndChangesNothing) {
  Fixture f(0.25f);
  kvret_seq* s = f.seq->s;
  I32 out({kHeads, 64}, -7);
  expect_refused(KVRET_ERR_INVALID_HANDLE, "NULL", nullptr, 0, 64, &out);
  expect_refused(KVRET_ERR_INVALID_ARGUMENT, "out_count", s, 0, 64, &out, false);
  expect_refused(KVRET_ERR_INVALID_ARGUMENT, "out_positions", s, 0, 64, nullptr);
  expect_refused(KVRET_ERR_OUT_OF_RANGE, "layer -1", s, -1, 64, &out);
  expect_refused(KVRET_ERR_OUT_OF_RANGE, "layer 2", s, kLayers, 64, &out);
  expect_refused(KVRET_ERR_BUDGET, "budget", s, 0, 0, &out);
  expect_refused(KVRET_ERR_BUDGET, "budget", s, 0, -5, &out);
  expect_refused(KVRET_ERR_BUDGET, "above the context length", s, 0, static_cast<int32_t>(kTokens + 1), &out);
  expect_refused(KVRET_ERR_STATE, "observation window", s, 1, 64, &out);  // layer 1: never prefilled
  I32 narrow({kHeads, 63}, -7), heads({kHeads + 1, 64}, -7), flat({kHeads * 64}, -7);
  expect_refused(KVRET_ERR_SHAPE, "out_positions", s, 0, 64, &narrow);
  expect_refused(KVRET_ERR_SHAPE, "n_kv_heads", s, 0, 64, &heads);
  expect_refused(KVRET_ERR_SHAPE, "out_positions", s, 0, 64, &flat);
  F32 floats({kHeads, 64}, -7.0f);
  expect_refused(KVRET_ERR_DTYPE, "out_positions", s, 0, 64, &floats);
  I32 foreign({kHeads, 64}, -7);
  foreign.t.device = foreign_device();
  expect_refused(KVRET_ERR_DEVICE, "out_positions", s, 0, 64, &foreign);
  kvret_seq* closed = nullptr;
  expect_ok(kvret_seq_open(f.ctx.get(), &closed));
  expect_ok(kvret_seq_close(closed));
  expect_refused(KVRET_ERR_INVALID_HANDLE, "closed", closed, 0, 64, &out);
  // still the same answer afterwards
  EXPECT_EQ(retained(s, 64, 64), retained(s, 64, 64));
}

TEST(KvCrushRetained, NoMiddleGivesNothing) {
  kvret_config c = small_config(KVRET_INDEX_STREAMING);
  c.hamming_fraction = 0.25f;
  auto ctx = make_context(c);
  Seq s(ctx.get());
  F32 k({15, kHeads, kDim}), v({15, kHeads, kDim});
  clustered_kv(15, kHeads, kDim, 2, k, v);
  prefill(s.s, 0, k, v, 0, 15);  // 15 tokens: all sink and local
  I32 out({kHeads, 1}, -7);
  int32_t count = -1;
  expect_ok(kvret_seq_retained_set(s.s, 0, 5, &out, &count));
  EXPECT_EQ(count, 0);
  EXPECT_EQ(out.data, std::vector<int32_t>(kHeads, -7));
}

#ifdef KVRET_HAVE_WORKLOAD
/// One retained set per KV head over the prefill (membership), and what decode queries' attention gives it.
struct Retained {
  std::string label;
  int64_t budget = 0;
  std::vector<std::vector<char>> member;  ///< [n_kv_heads][n]: 1 for a retained middle token
  double kept = 0, middle = 0;            ///< summed over (step, query head)
};

/// Attention mass of decode queries over retained sets, on the synthetic workload: per query head, the share of
/// its full softmax (over every prefill token) that the kept tokens (sink, retained middle, local) hold, and the
/// share of its middle mass that the retained middle tokens hold, averaged over query heads and steps. Decode
/// steps [0, 32) stand for the prompt's last 32 queries (the window SnapKV uses: given to kvret_seq_observe, or
/// their full softmax handed in as accumulated attention); steps [32, 96) are the queries measured.
void report_eviction_mass(int n_q_heads, int n_kv_heads) {
  kvret::workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = n_q_heads;
  wc.n_kv_heads = n_kv_heads;
  wc.head_dim = 128;
  wc.n_prefill = 8192;
  constexpr int kWindow = 32, kSteps = 64;
  wc.n_decode = kWindow + kSteps;
  wc.seed = 3;
  const kvret::workload::Workload w(wc);
  const int64_t n = wc.n_prefill, d = wc.head_dim, mb = 16, me = n - 64, m = me - mb;
  const int group = n_q_heads / n_kv_heads;
  Buffer<float> k({n, n_kv_heads, d}), v({n, n_kv_heads, d});
  w.keys_values(0, 0, n, k.data.data(), v.data.data());
  std::vector<float> qs(static_cast<size_t>(wc.n_decode * n_q_heads * d));
  w.queries(0, wc.n_decode, qs.data());
  const float* measured = qs.data() + static_cast<size_t>(kWindow * n_q_heads * d);

  const int32_t budgets[] = {static_cast<int32_t>(n / 10), static_cast<int32_t>(n / 5)};
  const float shares[] = {0.0f, 0.1f, 0.25f, 0.5f};
  // the window steps as a query window [kWindow, n_q_heads, d] (kvret_seq_observe), and as observed decode steps:
  // each step's full softmax over the prefill, per query head (kvret_seq_observe_attention)
  Buffer<float> q_window({kWindow, n_q_heads, d});
  std::copy_n(qs.data(), q_window.data.size(), q_window.data.begin());
  std::vector<Buffer<float>> steps;
  for (int s = 0; s < kWindow; ++s) {
    Buffer<float> p({n_q_heads, n});
    for (int i = 0; i < n_q_heads; ++i) {
      const float* q = qs.data() + (static_cast<int64_t>(s) * n_q_heads + i) * d;
      std::vector<double> l(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = k.data.data() + (t * n_kv_heads + i / group) * d;
        double dot = 0;
        for (int64_t x = 0; x < d; ++x) dot += static_cast<double>(q[x]) * kt[x];
        l[static_cast<size_t>(t)] = dot / std::sqrt(static_cast<double>(d));
      }
      const double mx = *std::max_element(l.begin(), l.end());
      double z = 0;
      for (double& x : l) z += (x = std::exp(x - mx));
      for (int64_t t = 0; t < n; ++t)
        p.data[static_cast<size_t>(i * n + t)] = static_cast<float>(l[static_cast<size_t>(t)] / z);
    }
    steps.push_back(std::move(p));
  }
  enum class Source { kKeys, kQueries, kAccumulated };
  std::vector<Retained> sets;
  for (const int32_t budget : budgets) {
    // kvret_seq_retained_set: the window of the layer's last 32 keys; the window steps given to kvret_seq_observe;
    // the window steps' attention accumulated (H2O)
    for (const Source source : {Source::kKeys, Source::kQueries, Source::kAccumulated})
      for (const float share : shares) {
        if (source != Source::kKeys && share != 0.0f && share != 0.25f) continue;
        kvret_config c;
        init_config(&c);
        c.n_layers = 1;
        c.n_q_heads = n_q_heads;
        c.n_kv_heads = n_kv_heads;
        c.head_dim = static_cast<int32_t>(d);
        c.kv_dtype = KVRET_KV_F32;
        c.n_sink = static_cast<int32_t>(mb);
        c.n_local = static_cast<int32_t>(n - me);
        c.index_kind = KVRET_INDEX_STREAMING;
        c.hamming_fraction = share;
        if (source == Source::kAccumulated) c.hamming_importance = KVRET_IMPORTANCE_ACCUMULATED;
        auto ctx = make_context(c);
        Seq seq(ctx.get());
        expect_ok(kvret_append_prefill(seq.s, 0, &k, &v));
        if (source == Source::kQueries) expect_ok(kvret_seq_observe(seq.s, 0, &q_window));
        if (source == Source::kAccumulated)
          for (const auto& p : steps) expect_ok(kvret_seq_observe_attention(seq.s, 0, &p));
        I32 out({n_kv_heads, budget});
        int32_t count = 0;
        expect_ok(kvret_seq_retained_set(seq.s, 0, budget, &out, &count));
        EXPECT_EQ(count, budget);
        Retained r;
        r.label = source == Source::kKeys      ? "key window"
                  : source == Source::kQueries ? "query window (observe)"
                                               : "accumulated (H2O)";
        r.label += share == 0.0f ? ", base" : ", + " + std::to_string(std::lround(share * 100)) + "% reps";
        r.budget = budget;
        r.member.assign(static_cast<size_t>(n_kv_heads), std::vector<char>(static_cast<size_t>(n), 0));
        for (int h = 0; h < n_kv_heads; ++h)
          for (int i = 0; i < count; ++i)
            r.member[static_cast<size_t>(h)][static_cast<size_t>(out.data[static_cast<size_t>(h * count + i)])] = 1;
        sets.push_back(std::move(r));
      }
    // the same composition from a window of real queries (each KV head's group over the 32 window steps), with
    // the library's own SnapKV importance, signatures and grouping (select/kvcrush.hpp)
    std::vector<float> importance(static_cast<size_t>(n_kv_heads * n));
    for (int h = 0; h < n_kv_heads; ++h) {
      std::vector<float> window(static_cast<size_t>(kWindow * group * d)), keys(static_cast<size_t>(n * d));
      for (int s = 0; s < kWindow; ++s)
        for (int g = 0; g < group; ++g)
          std::copy_n(qs.data() + (static_cast<int64_t>(s) * n_q_heads + h * group + g) * d, d,
                      window.data() + (static_cast<int64_t>(s) * group + g) * d);
      for (int64_t t = 0; t < n; ++t) std::copy_n(k.data.data() + (t * n_kv_heads + h) * d, d, keys.data() + t * d);
      kvret::snapkv_importance(window.data(), kWindow * group, keys.data(), n, static_cast<int>(d),
                               1.0f / std::sqrt(static_cast<float>(d)), importance.data() + h * n);
    }
    std::vector<uint64_t> bits(static_cast<size_t>(n * kvret::signature_words(n_kv_heads)));
    kvret::signatures(importance.data(), n_kv_heads, n, 0.5f, bits.data());
    std::vector<uint64_t> anchor(static_cast<size_t>(kvret::signature_words(n_kv_heads)));
    kvret::make_anchor(kvret::Anchor::kAlternating, n_kv_heads, 0, nullptr, nullptr, 0, anchor.data());
    for (const float share : {0.0f, 0.25f}) {
      Retained r;
      r.label = share == 0.0f ? "query window (test), snapkv" : "query window (test), + 25% reps";
      r.budget = budget;
      r.member.assign(static_cast<size_t>(n_kv_heads), std::vector<char>(static_cast<size_t>(n), 0));
      std::vector<int32_t> out(static_cast<size_t>(budget));
      for (int h = 0; h < n_kv_heads; ++h) {
        const float* imp = importance.data() + h * n + mb;
        kvret::crush_topk(imp, m, budget, share, 0, bits.data() + mb * kvret::signature_words(n_kv_heads), n_kv_heads,
                          anchor.data(), out.data());
        for (const int32_t p : out) r.member[static_cast<size_t>(h)][static_cast<size_t>(p + mb)] = 1;
      }
      sets.push_back(std::move(r));
    }
    // the last `budget` middle tokens: a longer local window
    Retained recent;
    recent.label = "most recent middle tokens";
    recent.budget = budget;
    recent.member.assign(static_cast<size_t>(n_kv_heads), std::vector<char>(static_cast<size_t>(n), 0));
    for (auto& row : recent.member) std::fill(row.begin() + (me - budget), row.begin() + me, 1);
    sets.push_back(std::move(recent));
  }
  // H2O over the window steps' full softmax sums the same probabilities as SnapKV over those queries: the same sets
  // but for float round-off at the cut
  for (const Retained& a : sets)
    for (const Retained& b : sets) {
      if (a.budget != b.budget || a.label.rfind("query window (observe)", 0) != 0 ||
          b.label != "accumulated (H2O)" + a.label.substr(std::string("query window (observe)").size()))
        continue;
      int64_t same = 0, total = 0;
      for (int h = 0; h < n_kv_heads; ++h)
        for (int64_t t = 0; t < n; ++t) {
          const char x = a.member[static_cast<size_t>(h)][static_cast<size_t>(t)];
          total += x;
          same += x && b.member[static_cast<size_t>(h)][static_cast<size_t>(t)];
        }
      EXPECT_GE(static_cast<double>(same), 0.99 * static_cast<double>(total)) << a.label << " vs " << b.label;
    }
  // per step, the top of the exact folded scores: what a per-step select over an offloaded cache holds (no
  // retained set can: it is chosen once for every query)
  double oracle_kept[2] = {0, 0}, oracle_middle[2] = {0, 0}, random_kept[2] = {0, 0};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> folded(static_cast<size_t>(m));
  std::vector<std::vector<double>> probs(static_cast<size_t>(group), std::vector<double>(static_cast<size_t>(n)));
  for (int step = 0; step < kSteps; ++step)
    for (int kv = 0; kv < n_kv_heads; ++kv) {
      std::fill(folded.begin(), folded.end(), 0.0);
      for (int g = 0; g < group; ++g) {
        const float* q = measured + (static_cast<int64_t>(step) * n_q_heads + kv * group + g) * d;
        auto& pr = probs[static_cast<size_t>(g)];
        for (int64_t t = 0; t < n; ++t) {
          const float* kt = k.data.data() + (t * n_kv_heads + kv) * d;
          double s = 0;
          for (int64_t i = 0; i < d; ++i) s += static_cast<double>(q[i]) * kt[i];
          pr[static_cast<size_t>(t)] = s * scale;
        }
        const double mx = *std::max_element(pr.begin(), pr.end());
        double z = 0;
        for (double& x : pr) z += (x = std::exp(x - mx));
        for (double& x : pr) x /= z;
        for (int64_t t = mb; t < me; ++t) folded[static_cast<size_t>(t - mb)] += pr[static_cast<size_t>(t)];
      }
      for (int g = 0; g < group; ++g) {
        const auto& pr = probs[static_cast<size_t>(g)];
        double ends = 0, mid = 0;
        for (int64_t t = 0; t < n; ++t) (t < mb || t >= me ? ends : mid) += pr[static_cast<size_t>(t)];
        for (Retained& r : sets) {
          const auto& in_set = r.member[static_cast<size_t>(kv)];
          double in = 0;
          for (int64_t t = mb; t < me; ++t)
            if (in_set[static_cast<size_t>(t)]) in += pr[static_cast<size_t>(t)];
          r.kept += ends + in;
          r.middle += in / mid;
        }
        for (int b = 0; b < 2; ++b)
          random_kept[b] += ends + mid * static_cast<double>(budgets[b]) / static_cast<double>(m);
      }
      for (int b = 0; b < 2; ++b) {
        const int64_t budget = budgets[b];
        std::vector<int32_t> order(static_cast<size_t>(m));
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + budget, order.end(), [&](int32_t x, int32_t y) {
          return folded[static_cast<size_t>(x)] > folded[static_cast<size_t>(y)] ||
                 (folded[static_cast<size_t>(x)] == folded[static_cast<size_t>(y)] && x < y);
        });
        for (int g = 0; g < group; ++g) {
          const auto& pr = probs[static_cast<size_t>(g)];
          double ends = 0, mid = 0, in = 0;
          for (int64_t t = 0; t < n; ++t) (t < mb || t >= me ? ends : mid) += pr[static_cast<size_t>(t)];
          for (int64_t i = 0; i < budget; ++i) in += pr[static_cast<size_t>(order[static_cast<size_t>(i)] + mb)];
          oracle_kept[b] += ends + in;
          oracle_middle[b] += in / mid;
        }
      }
    }
  const double norm = static_cast<double>(kSteps) * n_q_heads;
  // needle tokens held (every needle, every KV head)
  const auto& needles = w.needle_positions();
  const double needle_tokens = static_cast<double>(needles.size()) * wc.needle_tokens * n_kv_heads;
  for (int b = 0; b < 2; ++b) {
    std::printf(
        "[ kvcrush ] eviction-only, workload 8k, %d query / %d KV heads, budget %d (1/%d) + 16 sink + 64 local, "
        "%d decode queries\n",
        n_q_heads, n_kv_heads, budgets[b], b == 0 ? 10 : 5, kSteps);
    std::printf("[ kvcrush ]   %-36s %10s %12s %8s\n", "retained middle", "kept mass", "middle mass", "needles");
    for (const Retained& r : sets) {
      if (r.budget != budgets[b]) continue;
      double held = 0;
      for (int h = 0; h < n_kv_heads; ++h)
        for (const int64_t at : needles)
          for (int64_t t = at; t < at + wc.needle_tokens && t < n; ++t)
            held += r.member[static_cast<size_t>(h)][static_cast<size_t>(t)];
      std::printf("[ kvcrush ]   %-36s %10.4f %12.4f %8.3f\n", r.label.c_str(), r.kept / norm, r.middle / norm,
                  held / needle_tokens);
      EXPECT_GT(r.middle, 0.0);
      EXPECT_LE(r.kept / norm, 1.0 + 1e-6);
      // the per-step top of the exact scores is the most any set of this size holds for each query group
      EXPECT_LE(r.kept, oracle_kept[b] * (1 + 1e-9)) << r.label;
    }
    std::printf("[ kvcrush ]   %-36s %10.4f %12.4f %8.3f\n", "uniform random (expected)", random_kept[b] / norm,
                static_cast<double>(budgets[b]) / static_cast<double>(m),
                static_cast<double>(budgets[b]) / static_cast<double>(m));
    std::printf("[ kvcrush ]   %-36s %10.4f %12.4f\n", "per-step exact top (offload)", oracle_kept[b] / norm,
                oracle_middle[b] / norm);
  }
}

TEST(KvCrushRetained, AttentionMassOnTheSyntheticWorkload2KvHeads) { report_eviction_mass(8, 2); }
TEST(KvCrushRetained, AttentionMassOnTheSyntheticWorkload8KvHeads) { report_eviction_mass(32, 8); }
#endif

}  // namespace
