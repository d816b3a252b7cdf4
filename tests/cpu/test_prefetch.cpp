// kvret_prefetch_async: a select with a guessed query whose positions the layer's next fetch counts as prefetch
// hits. The hit rate is exactly 1 when the guess is the query, rises with the guess's correlation with the query,
// and a refused prefetch keeps the last one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int kHeads = 2, kQHeads = 8, kDim = 64;
constexpr int32_t kBudget = 40;

class Prefetch : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    ctx_ = test::make_context(test::small_config(GetParam()));
    test::expect_ok(kvret_seq_open(ctx_.get(), &seq_));
    F32 k({2000, kHeads, kDim}), v({2000, kHeads, kDim});
    test::clustered_kv(2000, kHeads, kDim, 3, k, v);
    test::expect_ok(kvret_append_prefill(seq_, 0, &k.t, &v.t));
  }
  void TearDown() override { kvret_seq_close(seq_); }

  int64_t hits() {
    kvret_stats s;
    kvret_stats_init(&s);
    test::expect_ok(kvret_seq_stats(seq_, &s));
    return s.prefetch_hits;
  }
  /// select + fetch with q; returns the middle rows fetched over all heads.
  int64_t step(const F32& q) {
    I32 sel({kHeads, kBudget});
    int32_t count = 0;
    test::expect_ok(kvret_select(seq_, 0, &q.t, kBudget, &sel.t, &count));
    int64_t capacity = 0, rows = 0;
    test::expect_ok(kvret_working_set_capacity(seq_, 0, count, &capacity));
    F32 wk({kHeads, capacity, kDim}), wv({kHeads, capacity, kDim});
    I32 wp({kHeads, capacity});
    const kvret_working_set ws{wk.t, wv.t, wp.t};
    test::expect_ok(kvret_fetch_async(seq_, 0, &sel.t, count, &ws, &rows, nullptr));
    return int64_t{count} * kHeads;
  }
  static F32 query(const std::vector<float>& x) {
    F32 q({kQHeads, kDim});
    q.data = x;
    q.refresh();
    return q;
  }

  test::ContextPtr ctx_;
  kvret_seq* seq_ = nullptr;
};

TEST_P(Prefetch, TheTrueQueryHitsEveryRowAndOnlyTheNextFetchCounts) {
  const F32 q = query(test::random_vector(kQHeads * kDim, 5));
  test::expect_ok(kvret_prefetch_async(seq_, 0, &q.t, kBudget, nullptr));
  EXPECT_EQ(hits(), 0) << "a prefetch alone hits nothing";
  const int64_t rows = step(q);
  EXPECT_EQ(hits(), rows) << "the guess was the query: every selected row was prefetched";
  (void)step(q);
  EXPECT_EQ(hits(), rows) << "a prefetch serves the next fetch only";
}

TEST_P(Prefetch, TheHitRateRisesWithTheGuesssCorrelation) {
  std::vector<double> rate;
  for (const double rho : {0.0, 0.6, 0.9, 1.0}) {
    int64_t hit = 0, total = 0;
    for (uint64_t s = 0; s < 8; ++s) {
      const std::vector<float> x = test::random_vector(kQHeads * kDim, 100 + s);
      const std::vector<float> noise = test::random_vector(kQHeads * kDim, 500 + s);
      std::vector<float> guess(x.size());
      for (size_t i = 0; i < x.size(); ++i)
        guess[i] = static_cast<float>(rho * x[i] + std::sqrt(1.0 - rho * rho) * noise[i]);
      const F32 q = query(x), g = query(guess);
      const int64_t before = hits();
      test::expect_ok(kvret_prefetch_async(seq_, 0, &g.t, kBudget, nullptr));
      total += step(q);
      hit += hits() - before;
    }
    rate.push_back(static_cast<double>(hit) / static_cast<double>(total));
  }
  std::printf("[ prefetch ] kind %d: hit rate at correlation 0, 0.6, 0.9, 1: %.3f %.3f %.3f %.3f\n", GetParam(),
              rate[0], rate[1], rate[2], rate[3]);
  EXPECT_LT(rate[0], rate[1]);
  EXPECT_LT(rate[1], rate[2]);
  EXPECT_LE(rate[2], rate[3]);
  EXPECT_EQ(rate[3], 1.0);
}

TEST_P(Prefetch, ARefusedPrefetchKeepsTheLastOne) {
  const F32 q = query(test::random_vector(kQHeads * kDim, 7));
  test::expect_ok(kvret_prefetch_async(seq_, 0, &q.t, kBudget, nullptr));
  F32 bad({kQHeads + 1, kDim});
  EXPECT_EQ(kvret_prefetch_async(seq_, 0, &bad.t, kBudget, nullptr), KVRET_ERR_SHAPE);
  EXPECT_EQ(kvret_prefetch_async(seq_, 0, &q.t, 0, nullptr), KVRET_ERR_BUDGET);
  EXPECT_EQ(kvret_prefetch_async(seq_, 5, &q.t, kBudget, nullptr), KVRET_ERR_OUT_OF_RANGE);
  const int64_t rows = step(q);
  EXPECT_EQ(hits(), rows);
}

INSTANTIATE_TEST_SUITE_P(Kinds, Prefetch,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_QUANT));

}  // namespace
