// PQ index properties: the lookup-table score is q . (reconstructed key); codes are the nearest centroids;
// selection is the top of the approximate folded score; recall rises with the budget.
#include <gtest/gtest.h>

#include "core/sequence.hpp"
#include "core/vec_math.hpp"
#include "index/pq_retriever.hpp"
#include "select/gqa_fold.hpp"
#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;
using test::I32;

struct PqFixture {
  kvret_config config;
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  F32 k, v;
  int64_t tokens;

  PqFixture(int64_t n, int m, int bits, uint64_t seed = 1)
      : config(test::small_config()), k({n, 2, 64}), v({n, 2, 64}), tokens(n) {
    config.pq_m = m;
    config.pq_bits = bits;
    config.n_layers = 1;
    ctx = test::make_context(config);
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    test::clustered_kv(n, 2, 64, seed, k, v);
    EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK) << kvret_last_error();
  }
  Sequence& sequence() { return *reinterpret_cast<Sequence*>(seq); }
  const PqRetriever& pq() { return dynamic_cast<const PqRetriever&>(sequence().index(0)); }
};

class PqShapes : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(PqShapes, ScoreIsQueryDotReconstructedKey) {
  const auto [m, bits] = GetParam();
  PqFixture f(2000, m, bits);
  const PqRetriever& pq = f.pq();
  ASSERT_TRUE(pq.trained());
  ASSERT_EQ(pq.base(), f.config.n_sink);
  ASSERT_EQ(pq.size(), 2000 - f.config.n_sink - f.config.n_local);
  const auto q = test::random_vector(64, 11);
  for (int h = 0; h < 2; ++h) {
    std::vector<float> approx(static_cast<size_t>(pq.size()));
    pq.approximate_logits(h, q.data(), approx.data());
    for (int64_t t = 0; t < pq.size(); ++t) {
      std::vector<float> recon(64);
      for (int j = 0; j < pq.m(); ++j) {
        const float* c = pq.centroids(h, j) + pq.codes(h)[t * pq.m() + j] * pq.sub_dim();
        std::copy_n(c, pq.sub_dim(), recon.data() + j * pq.sub_dim());
      }
      double expect = 0;
      for (int i = 0; i < 64; ++i)
        expect += static_cast<double>(q[static_cast<size_t>(i)]) * recon[static_cast<size_t>(i)];
      ASSERT_NEAR(approx[static_cast<size_t>(t)], expect, 1e-4 * (1 + std::fabs(expect))) << "token " << t;
    }
  }
}

TEST_P(PqShapes, CodesAreNearestCentroids) {
  const auto [m, bits] = GetParam();
  PqFixture f(1500, m, bits, 3);
  const PqRetriever& pq = f.pq();
  const int k = pq.k(), ds = pq.sub_dim();
  for (int h = 0; h < 2; ++h)
    for (int64_t t = 0; t < pq.size(); ++t) {
      const float* key = f.k.data.data() + ((pq.base() + t) * 2 + h) * 64;
      for (int j = 0; j < pq.m(); ++j) {
        float best = INFINITY;
        for (int c = 0; c < k; ++c)
          best = std::min(best, squared_distance(key + j * ds, pq.centroids(h, j) + c * ds, ds));
        const float got = squared_distance(key + j * ds, pq.centroids(h, j) + pq.codes(h)[t * pq.m() + j] * ds, ds);
        ASSERT_LE(got, best * (1 + 1e-5f) + 1e-5f) << "head " << h << " token " << t << " sub " << j;
      }
    }
}

TEST_P(PqShapes, SelectionIsTheTopOfTheApproximateFoldedScore) {
  const auto [m, bits] = GetParam();
  {
    PqFixture f(3000, m, bits, 5);
    const PqRetriever& pq = f.pq();
    const auto q = test::random_vector(8 * 64, 21);
    I32 out({2, 300});
    int32_t count = 0;
    F32 qt({8, 64});
    qt.data = q;
    qt.refresh();
    test::expect_ok(kvret_select(f.seq, 0, &qt, 300, &out, &count));
    ASSERT_EQ(count, 300);
    const float scale = 1.0f / 8.0f;
    for (int h = 0; h < 2; ++h) {
      std::vector<float> logits(static_cast<size_t>(4 * pq.size()));
      for (int g = 0; g < 4; ++g) {
        pq.approximate_logits(h, q.data() + (h * 4 + g) * 64, logits.data() + g * pq.size());
        for (int64_t t = 0; t < pq.size(); ++t) logits[static_cast<size_t>(g * pq.size() + t)] *= scale;
      }
      std::vector<float> folded(static_cast<size_t>(pq.size()));
      fold_logits(logits.data(), 4, pq.size(), KVRET_FOLD_SUM_PROB, folded.data());
      std::set<int32_t> chosen(out.data.begin() + h * 300, out.data.begin() + (h + 1) * 300);
      ASSERT_EQ(chosen.size(), 300u);
      float min_in = INFINITY, max_out = -INFINITY;
      for (int64_t t = 0; t < pq.size(); ++t) {
        const float s = folded[static_cast<size_t>(t)];
        if (chosen.count(static_cast<int32_t>(pq.base() + t)))
          min_in = std::min(min_in, s);
        else
          max_out = std::max(max_out, s);
      }
      EXPECT_GE(min_in, max_out * (1 - 1e-4f)) << "head " << h;
      EXPECT_TRUE(std::is_sorted(out.data.begin() + h * 300, out.data.begin() + (h + 1) * 300));
    }
  }
}

// m=2,b=6 and m=1,b=8 take the cell path; m=4,b=6 and m=2,b=8... (16 bits) too; m=4,b=8 scores per token.
INSTANTIATE_TEST_SUITE_P(Shapes, PqShapes,
                         ::testing::Values(std::make_pair(2, 6), std::make_pair(1, 8), std::make_pair(4, 4),
                                           std::make_pair(4, 8), std::make_pair(8, 5)));

TEST(Pq, DecodeTokensGetCodesAsTheyLeaveTheLocalWindow) {
  PqFixture f(1000, 2, 6);
  F32 k1({1, 2, 64}), v1({1, 2, 64});
  for (int step = 0; step < 40; ++step) {
    k1.data = test::random_vector(128, 100 + static_cast<uint64_t>(step), 2.0f);
    k1.refresh();
    test::expect_ok(kvret_append_decode(f.seq, 0, &k1, &v1));
    const PqRetriever& pq = f.pq();
    ASSERT_EQ(pq.base() + pq.size(), 1000 + step + 1 - f.config.n_local);
  }
  // the 40 decoded keys entered the local window; the first 24 of them have left it and carry nearest codes
  const PqRetriever& pq = f.pq();
  F32 all_k({1040, 2, 64}), all_v({1040, 2, 64});
  test::expect_ok(kvret_seq_read(f.seq, 0, 0, 1040, &all_k, &all_v));
  for (int64_t pos = 1000; pos < 1040 - f.config.n_local; ++pos)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j) {
        const float* key = all_k.data.data() + (pos * 2 + h) * 64 + j * 32;
        float best = INFINITY;
        for (int c = 0; c < 64; ++c) best = std::min(best, squared_distance(key, pq.centroids(h, j) + c * 32, 32));
        const uint8_t code = pq.codes(h)[(pos - pq.base()) * 2 + j];
        EXPECT_LE(squared_distance(key, pq.centroids(h, j) + code * 32, 32), best * (1 + 1e-5f) + 1e-5f);
      }
}

TEST(Pq, ChunkedPrefillRetrainsWhenTheMiddleDoubles) {
  kvret_config c = test::small_config();
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  F32 k({500, 2, 64}), v({500, 2, 64});
  test::clustered_kv(500, 2, 64, 9, k, v);
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
  auto index = [&]() -> const PqRetriever& {  // waits for the background build
    return dynamic_cast<const PqRetriever&>(reinterpret_cast<Sequence*>(seq)->index(0));
  };
  const PqRetriever& pq = index();
  const std::vector<float> first(pq.centroids(0, 0), pq.centroids(0, 0) + 64 * 32);
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));  // 480 -> 980 middle tokens: doubled, retrain
  index();
  const std::vector<float> second(pq.centroids(0, 0), pq.centroids(0, 0) + 64 * 32);
  EXPECT_NE(first, second);
  EXPECT_EQ(pq.size(), 1000 - 4 - 16);
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));  // 980 -> 1480: not doubled, encode only
  index();
  const std::vector<float> third(pq.centroids(0, 0), pq.centroids(0, 0) + 64 * 32);
  EXPECT_EQ(second, third);
  EXPECT_EQ(pq.size(), 1500 - 4 - 16);
}

}  // namespace
}  // namespace kvret
