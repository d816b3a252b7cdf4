// KVCrush through the C API (config.hamming_fraction > 0): every retriever selects the important part of the
// budget and the sequence adds bucket representatives of the middle tokens left out. Properties: distinct,
// ascending middle positions, count = budget, the retriever's own choice kept; a share whose floor is 0 is the
// plain selection bit for bit; kvret_select_scored gives representatives -infinity; select_batch and seq_attend
// see the same selection; bad configs are refused by field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kvcrush_fixture.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"
#include "workload_mass.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

// small_config: 4 sink, 16 local
constexpr int64_t kTokens = CrushFixture::kTokens, kMidBegin = 4, kMidEnd = kTokens - 16;
constexpr int kGroup = kQHeads / kHeads;

/// The fixture's sequence in a context of `kind` with KVCrush's share and hamming_buckets.
struct Fixture : CrushFixture {
  Fixture(int kind, float share, int32_t buckets = 0)
      : CrushFixture([&] {
          kvret_config c = small_config(kind);
          c.hamming_fraction = share;
          c.hamming_buckets = buckets;
          return c;
        }()) {}
};

std::vector<std::vector<int32_t>> select_rows(kvret_seq* s, const F32& q, int32_t budget,
                                              std::vector<std::vector<float>>* scores = nullptr) {
  I32 pos({kHeads, budget}, -1);
  F32 sc({kHeads, budget}, NAN);
  int32_t count = -1;
  if (scores) {
    expect_ok(kvret_select_scored(s, 0, &q, budget, &pos, &sc, &count));
  } else {
    expect_ok(kvret_select(s, 0, &q, budget, &pos, &count));
  }
  EXPECT_EQ(count, budget);
  std::vector<std::vector<int32_t>> rows;
  for (int h = 0; h < kHeads; ++h) {
    const auto at = static_cast<size_t>(h * budget);
    rows.emplace_back(pos.data.begin() + at, pos.data.begin() + at + count);
    if (scores) scores->emplace_back(sc.data.begin() + at, sc.data.begin() + at + count);
  }
  return rows;
}

const int kKinds[] = {KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT};

class KvCrushSelect : public ::testing::TestWithParam<int> {};

TEST_P(KvCrushSelect, DistinctAscendingMiddleAndTheBudget) {
  const int kind = GetParam();
  Fixture plain(kind, 0.0f), crushed(kind, 0.25f);
  for (const uint64_t seed : {1u, 2u})
    for (const int32_t budget : {1, 3, 4, 40, 257}) {
      const F32 q = query(seed);
      std::vector<std::vector<float>> scores;
      const auto rows = select_rows(crushed.seq->s, q, budget, &scores);
      const int64_t reps = static_cast<int64_t>(std::floor(0.25 * budget));
      const auto base = select_rows(plain.seq->s, q, static_cast<int32_t>(budget - reps));
      for (int h = 0; h < kHeads; ++h) {
        const auto& r = rows[static_cast<size_t>(h)];
        ASSERT_EQ(r.size(), static_cast<size_t>(budget));
        ASSERT_TRUE(std::is_sorted(r.begin(), r.end()));
        ASSERT_EQ(std::set<int32_t>(r.begin(), r.end()).size(), r.size()) << "duplicate";
        for (const int32_t p : r) ASSERT_TRUE(p >= kMidBegin && p < kMidEnd) << p;
        // the retriever's choice for the important part is kept, with its scores; the others score -inf
        const auto& b = base[static_cast<size_t>(h)];
        int64_t minus_inf = 0;
        for (size_t i = 0; i < r.size(); ++i) {
          const float s = scores[static_cast<size_t>(h)][i];
          const bool in_base = std::binary_search(b.begin(), b.end(), r[i]);
          EXPECT_EQ(in_base, !(std::isinf(s) && s < 0)) << "position " << r[i];
          minus_inf += std::isinf(s) && s < 0;
        }
        EXPECT_EQ(minus_inf, reps);
      }
    }
}

TEST_P(KvCrushSelect, ShareBelowOneRepresentativeIsThePlainSelection) {
  const int kind = GetParam();
  Fixture plain(kind, 0.0f), tiny(kind, 0.1f);  // floor(0.1 * budget) = 0 below 10
  for (const int32_t budget : {1, 5, 9}) {
    const F32 q = query(9);
    std::vector<std::vector<float>> ps, ts;
    EXPECT_EQ(select_rows(tiny.seq->s, q, budget, &ts), select_rows(plain.seq->s, q, budget, &ps));
    for (int h = 0; h < kHeads; ++h)
      EXPECT_EQ(std::memcmp(ts[static_cast<size_t>(h)].data(), ps[static_cast<size_t>(h)].data(),
                            sizeof(float) * static_cast<size_t>(budget)),
                0);
  }
}

TEST_P(KvCrushSelect, BatchAndAttendSeeTheSameSelection) {
  const int kind = GetParam();
  Fixture a(kind, 0.3f);
  Seq b(a.ctx.get());  // a second sequence of the same context, holding the same tokens
  prefill(b.s, 0, a.k, a.v, 0, kTokens - 3);
  decode(b.s, 0, a.k, a.v, kTokens - 3, kTokens);
  const int32_t budget = 50;
  const F32 q = query(4);
  const auto single = select_rows(a.seq->s, q, budget);
  F32 qs({2, kQHeads, kDim});
  std::copy(q.data.begin(), q.data.end(), qs.data.begin());
  std::copy(q.data.begin(), q.data.end(), qs.data.begin() + kQHeads * kDim);
  I32 out({2, kHeads, budget}, -1);
  int32_t counts[2] = {-1, -1};
  kvret_seq* seqs[2] = {a.seq->s, b.s};

  expect_ok(kvret_select_batch(a.ctx.get(), 2, seqs, 0, &qs, budget, &out, counts));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(counts[i], budget);
    for (int h = 0; h < kHeads; ++h) {
      const auto at = out.data.begin() + (i * kHeads + h) * budget;
      EXPECT_EQ(std::vector<int32_t>(at, at + budget), single[static_cast<size_t>(h)]) << "sequence " << i;
    }
  }
  // seq_attend attends over sink + this selection + local: the reference attention over the fetched rows
  F32 att({kQHeads, kDim}), ref({kQHeads, kDim});
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  expect_ok(kvret_seq_attend(b.s, 0, &q, budget, scale, &att, nullptr));
  I32 pos({kHeads, budget});
  for (int h = 0; h < kHeads; ++h)
    std::copy(single[static_cast<size_t>(h)].begin(), single[static_cast<size_t>(h)].end(),
              pos.data.begin() + h * budget);
  WorkingSetBuffers ws(b.s, 0, budget, kHeads, kDim);
  int64_t rows = 0;
  expect_ok(kvret_fetch_async(b.s, 0, &pos, budget, &ws.ws, &rows, nullptr));
  expect_ok(kvret_attend(a.ctx.get(), &q, &ws.ws.k, &ws.ws.v, rows, scale, &ref, nullptr));
  EXPECT_EQ(att.data, ref.data);
}

/// Attention mass of the exact folded scores on a head's selection (the share of each query head's softmax over
/// the middle that the selection holds, averaged over the group).
double mass(const std::vector<float>& k, const F32& q, int h, const std::vector<int32_t>& sel) {
  const auto folded = exact_folded(k, kHeads, kDim, q.data, kGroup, h, kMidBegin, kMidEnd, false);
  double m = 0;
  for (const int32_t p : sel) m += folded[static_cast<size_t>(p - kMidBegin)];
  return m / kGroup;
}

TEST(KvCrushSelect, AttentionMassWithAndWithoutRepresentatives) {
  // reported, not a quality claim: on random clustered keys representatives trade top tokens for coverage
  for (const int kind : kKinds) {
    Fixture plain(kind, 0.0f), crushed(kind, 0.25f);
    double with = 0, without = 0;
    int n = 0;
    for (const uint64_t seed : {11u, 12u, 13u, 14u}) {
      const F32 q = query(seed);
      const int32_t budget = 128;
      const auto p = select_rows(plain.seq->s, q, budget), c = select_rows(crushed.seq->s, q, budget);
      for (int h = 0; h < kHeads; ++h, ++n) {
        without += mass(plain.k.data, q, h, p[static_cast<size_t>(h)]);
        with += mass(crushed.k.data, q, h, c[static_cast<size_t>(h)]);
      }
    }
    with /= n;
    without /= n;
    std::printf(
        "[ KvCrush ] %s, budget 128 of %lld middle tokens: attention mass %.4f without, %.4f with 25%% "
        "representatives\n",
        kind_name(kind).c_str(), static_cast<long long>(kMidEnd - kMidBegin), without, with);
    // sanity: both hold real mass, and 75% of the budget from the retriever keeps most of it
    EXPECT_GT(without, 0.0);
    EXPECT_LE(without, 1.0 + 1e-6);
    EXPECT_GE(with, 0.5 * without);
  }
}

TEST(KvCrushSelect, TruncateAndForkKeepTheSelection) {
  Fixture f(KVRET_INDEX_EXACT, 0.25f);
  const F32 q = query(21);
  const auto before = select_rows(f.seq->s, q, 64);
  kvret_seq* child = nullptr;
  expect_ok(kvret_seq_fork(f.seq->s, &child));
  Seq c(child);
  EXPECT_EQ(select_rows(c.s, q, 64), before);
  // decode more, then truncate back: the same selection as before
  F32 k2({20, kHeads, kDim}), v2({20, kHeads, kDim});
  clustered_kv(20, kHeads, kDim, 8, k2, v2);
  decode(f.seq->s, 0, k2, v2, 0, 20);
  const auto grown = select_rows(f.seq->s, q, 64);
  for (const auto& r : grown)
    for (const int32_t p : r) EXPECT_LT(p, kMidEnd + 20);
  expect_ok(kvret_seq_truncate(f.seq->s, kTokens));
  EXPECT_EQ(select_rows(f.seq->s, q, 64), before);
}

TEST(KvCrushSelect, BadConfigIsRefusedByField) {
  for (const float share : {-0.1f, 1.0f, 1.5f, NAN}) {
    kvret_config c = small_config(KVRET_INDEX_EXACT);
    c.hamming_fraction = share;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << share;
    EXPECT_EQ(ctx, nullptr);
    EXPECT_NE(std::string(kvret_last_error()).find("hamming_fraction"), std::string::npos) << kvret_last_error();
  }
  kvret_config c = small_config(KVRET_INDEX_EXACT);
  c.hamming_fraction = 0.25f;
  c.hamming_buckets = -1;
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("hamming_buckets"), std::string::npos) << kvret_last_error();
}

TEST(KvCrushSelect, BucketsCapTheRepresentatives) {
  Fixture f(KVRET_INDEX_EXACT, 0.5f, 3), plain(KVRET_INDEX_EXACT, 0.0f);
  const F32 q = query(5);
  std::vector<std::vector<float>> scores;
  const auto rows = select_rows(f.seq->s, q, 40, &scores);
  const auto base = select_rows(plain.seq->s, q, 37);
  for (int h = 0; h < kHeads; ++h) {
    int64_t reps = 0;
    for (const float s : scores[static_cast<size_t>(h)]) reps += std::isinf(s) && s < 0;
    EXPECT_EQ(reps, 3);
    for (const int32_t p : base[static_cast<size_t>(h)])
      EXPECT_TRUE(std::binary_search(rows[static_cast<size_t>(h)].begin(), rows[static_cast<size_t>(h)].end(), p));
  }
}

TEST(KvCrushSelect, ThreadsDoNotChangeTheSelection) {
  // a layer large enough for the parallel paths (middle x query heads >= SelectRequest::kParallelLogits)
  constexpr int64_t tokens = 4500;
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  clustered_kv(tokens, kHeads, kDim, 23, k, v);
  std::vector<std::vector<std::vector<int32_t>>> rows;
  std::vector<std::vector<std::vector<float>>> scores;
  for (const int threads : {1, 2}) {
    kvret_config c = small_config(KVRET_INDEX_EXACT);
    c.hamming_fraction = 0.25f;
    c.n_threads = threads;
    auto ctx = make_context(c);
    Seq s(ctx.get());
    prefill(s.s, 0, k, v, 0, tokens - 2);
    decode(s.s, 0, k, v, tokens - 2, tokens);
    scores.emplace_back();
    rows.push_back(select_rows(s.s, query(31), 300, &scores.back()));
  }
  EXPECT_EQ(rows[0], rows[1]);
  EXPECT_EQ(scores[0], scores[1]);
}

#ifdef KVRET_HAVE_WORKLOAD
TEST(KvCrushSelect, AttentionMassOnTheSyntheticWorkload) {
  // reported, not a quality claim: the folded mass (of the middle) a budget holds, with and without 25%
  // representatives, on the synthetic workload (topics, recency, needles), 8k tokens, 4 decode queries
  const MassWorkload w;
  const int32_t budget = 410;  // 1/20 of the context
  for (const int kind : kKinds) {
    double mass[2] = {0, 0};
    for (int crushed = 0; crushed < 2; ++crushed) {
      kvret_config c = small_config(kind);
      c.hamming_fraction = crushed ? 0.25f : 0.0f;
      w.mass(c, budget, mass[crushed]);
      if (HasFatalFailure()) return;
    }
    std::printf(
        "[ KvCrush ] workload 8k, %s, budget 410: attention mass %.4f without, %.4f with 25%% "
        "representatives\n",
        kind_name(kind).c_str(), mass[0], mass[1]);
    EXPECT_GT(mass[0], 0.0);
    EXPECT_LE(mass[0], 1.0 + 1e-6);
    EXPECT_GE(mass[1], 0.5 * mass[0]);
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Kinds, KvCrushSelect, ::testing::ValuesIn(kKinds),
                         [](const ::testing::TestParamInfo<int>& i) { return kind_name(i.param); });

}  // namespace
