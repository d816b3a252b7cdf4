// PQ index properties: the lookup-table score is q . (reconstructed key); codes are the nearest centroids;
// selection is the top of the approximate folded score; recall rises with the budget. Exact outliers: the exact
// set is the top fraction by reconstruction error, a planted sharp key survives every seed and budget, selection
// with exact tokens matches a per-token reference, and decode extension adds outliers with the strong guarantee.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <new>

#include "c_api/handles.hpp"
#include "core/half.hpp"
#include "core/vec_math.hpp"
#include "engine/sequence.hpp"
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

  PqFixture(int64_t n, int m, int bits, uint64_t seed = 1, float exact_fraction = 0.0f, int fold = KVRET_FOLD_SUM_PROB,
            int kv_dtype = KVRET_KV_F32)
      : config(test::small_config()), k({n, 2, 64}), v({n, 2, 64}), tokens(n) {
    config.kv_dtype = kv_dtype;
    config.pq_m = m;
    config.pq_bits = bits;
    config.pq_exact_fraction = exact_fraction;
    config.gqa_fold = fold;
    config.n_layers = 1;
    ctx = test::make_context(config);
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    test::clustered_kv(n, 2, 64, seed, k, v);
    EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK) << kvret_last_error();
  }
  Sequence& sequence() { return *sequence_from_handle(seq); }
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

// m=2,b=6, m=1,b=8 and m=4,b=4 (16 bits) take the cell path; m=4,b=6 (the default: pair tables), m=4,b=8 and
// m=8,b=5 score per token.
INSTANTIATE_TEST_SUITE_P(Shapes, PqShapes,
                         ::testing::Values(std::make_pair(2, 6), std::make_pair(1, 8), std::make_pair(4, 4),
                                           std::make_pair(4, 6), std::make_pair(4, 8), std::make_pair(8, 5)));

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
    return dynamic_cast<const PqRetriever&>(sequence_from_handle(seq)->index(0));
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

// ---- exact outliers ----------------------------------------------------------------------------------------------

/// Squared reconstruction error ||k - k_hat||^2 of every indexed token of `head`, from centroids() and codes().
/// keys: [T, heads, d] row-major.
std::vector<double> reconstruction_errors(const PqRetriever& pq, const std::vector<float>& keys, int heads, int d,
                                          int head) {
  std::vector<double> err(static_cast<size_t>(pq.size()));
  for (int64_t t = 0; t < pq.size(); ++t) {
    const float* key = keys.data() + ((pq.base() + t) * heads + head) * d;
    double e = 0;
    for (int j = 0; j < pq.m(); ++j) {
      const float* c = pq.centroids(head, j) + pq.codes(head)[t * pq.m() + j] * pq.sub_dim();
      for (int i = 0; i < pq.sub_dim(); ++i) {
        const double diff = static_cast<double>(key[j * pq.sub_dim() + i]) - c[i];
        e += diff * diff;
      }
    }
    err[static_cast<size_t>(t)] = e;
  }
  return err;
}

/// The top `count` positions by error (ties: the lower position), ascending.
std::vector<int64_t> top_by_error(const std::vector<double>& err, int64_t count, int64_t base) {
  std::vector<int64_t> order(err.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return err[static_cast<size_t>(a)] > err[static_cast<size_t>(b)]; });
  order.resize(static_cast<size_t>(count));
  std::sort(order.begin(), order.end());
  for (auto& t : order) t += base;
  return order;
}

/// The selection of one KV head computed per token from scratch: the PQ logit for normal tokens, the exact q.k
/// for exact ones, folded over the group in double; items are the code cells (of their non-exact tokens) and the
/// exact tokens, taken whole best first (ties: cells by id, then exact tokens by position), the one crossing the
/// budget trimmed to its earliest tokens. Without cells (k^m > 65536) every token is an item (ties: lower
/// position). keys: [T, heads, d]; q: [n_q, d].
std::vector<int32_t> reference_select(const PqRetriever& pq, const std::vector<float>& keys, int heads, int d,
                                      const std::vector<float>& q, int group, int head, int64_t budget,
                                      bool max_logit) {
  const int64_t n = pq.size();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto& exact = pq.exact_positions(head);
  std::vector<char> is_exact(static_cast<size_t>(n), 0);
  for (int64_t p : exact) is_exact[static_cast<size_t>(p - pq.base())] = 1;
  // per token logits [group][n]
  std::vector<double> logit(static_cast<size_t>(group * n));
  for (int g = 0; g < group; ++g) {
    const float* qg = q.data() + (head * group + g) * d;
    for (int64_t t = 0; t < n; ++t) {
      double s = 0;
      if (is_exact[static_cast<size_t>(t)]) {
        const float* key = keys.data() + ((pq.base() + t) * heads + head) * d;
        for (int i = 0; i < d; ++i) s += static_cast<double>(qg[i]) * key[i];
      } else {
        for (int j = 0; j < pq.m(); ++j) {
          const float* c = pq.centroids(head, j) + pq.codes(head)[t * pq.m() + j] * pq.sub_dim();
          for (int i = 0; i < pq.sub_dim(); ++i) s += static_cast<double>(qg[j * pq.sub_dim() + i]) * c[i];
        }
      }
      logit[static_cast<size_t>(g * n + t)] = s * scale;
    }
  }
  std::vector<double> folded(static_cast<size_t>(n), max_logit ? -1e300 : 0.0);
  for (int g = 0; g < group; ++g) {
    const double* l = logit.data() + g * n;
    if (max_logit) {
      for (int64_t t = 0; t < n; ++t) folded[static_cast<size_t>(t)] = std::max(folded[static_cast<size_t>(t)], l[t]);
      continue;
    }
    const double mx = *std::max_element(l, l + n);
    double z = 0;
    for (int64_t t = 0; t < n; ++t) z += std::exp(l[t] - mx);
    for (int64_t t = 0; t < n; ++t) folded[static_cast<size_t>(t)] += std::exp(l[t] - mx) / z;
  }
  // items: (score, kind, id) with the tokens of each, ascending
  const bool cells = std::pow(static_cast<double>(pq.k()), pq.m()) <= 65536.0;
  std::map<std::pair<int, int64_t>, std::vector<int64_t>> items;  // (0, cell) or (1, position) -> tokens
  for (int64_t t = 0; t < n; ++t) {
    int64_t cell = 0;
    for (int j = pq.m() - 1; j >= 0; --j) cell = cell * pq.k() + pq.codes(head)[t * pq.m() + j];
    const bool own = is_exact[static_cast<size_t>(t)] || !cells;
    items[own ? std::make_pair(1, t) : std::make_pair(0, cell)].push_back(t);
  }
  struct Item {
    double score;
    std::pair<int, int64_t> key;
    const std::vector<int64_t>* tokens;
  };
  std::vector<Item> order;
  for (const auto& [key, tokens] : items) order.push_back({folded[static_cast<size_t>(tokens[0])], key, &tokens});
  std::stable_sort(order.begin(), order.end(), [](const Item& a, const Item& b) { return a.score > b.score; });
  std::vector<int32_t> out;
  for (const Item& item : order) {
    for (int64_t t : *item.tokens) {
      if (static_cast<int64_t>(out.size()) == budget) break;
      out.push_back(static_cast<int32_t>(pq.base() + t));
    }
    if (static_cast<int64_t>(out.size()) == budget) break;
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(PqExact, CountIsTheCeilingOfTheFraction) {
  EXPECT_EQ(PqRetriever::exact_count(0.0f, 1000), 0);
  EXPECT_EQ(PqRetriever::exact_count(0.02f, 1000), 20);
  EXPECT_EQ(PqRetriever::exact_count(0.02f, 1001), 21);
  EXPECT_EQ(PqRetriever::exact_count(0.1f, 1000), 100);  // 0.1f * 1000 = 100.0000015 must not round to 101
  EXPECT_EQ(PqRetriever::exact_count(0.02f, 1), 1);
  EXPECT_EQ(PqRetriever::exact_count(0.5f, 3), 2);
  EXPECT_EQ(PqRetriever::exact_count(0.5f, 0), 0);
}

TEST_P(PqShapes, ExactSetIsTheTopFractionByReconstructionError) {
  const auto [m, bits] = GetParam();
  PqFixture f(2000, m, bits, 7, 0.05f);
  PqFixture off(2000, m, bits, 7, 0.0f);
  const PqRetriever& pq = f.pq();
  const int64_t count = PqRetriever::exact_count(0.05f, pq.size());
  ASSERT_EQ(count, 99);
  int64_t exact_bytes = 0;
  for (int h = 0; h < 2; ++h) {
    const auto err = reconstruction_errors(pq, f.k.data, 2, 64, h);
    const auto expected = top_by_error(err, count, pq.base());
    const auto& got = pq.exact_positions(h);
    ASSERT_EQ(std::vector<int64_t>(got.begin(), got.end()), expected) << "head " << h;
    double smallest = INFINITY;
    for (int64_t e = 0; e < count; ++e) {
      const int64_t pos = pq.exact_positions(h)[static_cast<size_t>(e)];
      smallest = std::min(smallest, err[static_cast<size_t>(pos - pq.base())]);
      for (int i = 0; i < 64; ++i)
        ASSERT_EQ(pq.exact_keys_f32(h)[static_cast<size_t>(e * 64 + i)],
                  f.k.data[static_cast<size_t>((pos * 2 + h) * 64 + i)]);
    }
    EXPECT_NEAR(pq.exact_threshold(h), smallest, 1e-4 * smallest);
    EXPECT_TRUE(off.pq().exact_positions(h).empty());
    EXPECT_EQ(off.pq().exact_threshold(h), INFINITY);
    exact_bytes += count * static_cast<int64_t>(sizeof(int64_t) + 64 * sizeof(float));
  }
  EXPECT_EQ(pq.bytes(), off.pq().bytes() + exact_bytes);
}

class PqExactSelect : public ::testing::TestWithParam<std::tuple<std::pair<int, int>, int, float>> {};

// Selection with exact tokens (and without: fraction 0 is the old cell / per-token behaviour) equals the per-token
// reference, token for token, at budgets that split cells.
TEST_P(PqExactSelect, MatchesThePerTokenReference) {
  const auto [shape, fold, fraction] = GetParam();
  const auto [m, bits] = shape;
  PqFixture f(3000, m, bits, 5, fraction, fold);
  const PqRetriever& pq = f.pq();
  ASSERT_EQ(pq.exact_positions(0).size(), static_cast<size_t>(PqRetriever::exact_count(fraction, pq.size())));
  int exact_selected = 0;
  for (uint64_t qseed : {21u, 22u, 23u}) {
    F32 qt({8, 64});
    qt.data = test::random_vector(8 * 64, qseed);
    qt.refresh();
    for (int32_t budget : {1, 7, 37, 300, 1000}) {
      I32 out({2, budget});
      int32_t count = 0;
      test::expect_ok(kvret_select(f.seq, 0, &qt, budget, &out, &count));
      ASSERT_EQ(count, budget);
      for (int h = 0; h < 2; ++h) {
        const std::vector<int32_t> got(out.data.begin() + h * budget, out.data.begin() + (h + 1) * budget);
        const auto want = reference_select(pq, f.k.data, 2, 64, qt.data, 4, h, budget, fold == KVRET_FOLD_MAX_LOGIT);
        ASSERT_EQ(got, want) << "head " << h << " budget " << budget << " query " << qseed;
        for (int32_t p : got)
          exact_selected += std::binary_search(pq.exact_positions(h).begin(), pq.exact_positions(h).end(), p);
      }
    }
  }
  if (fraction > 0) {
    EXPECT_GT(exact_selected, 0) << "the exact tokens never competed";
  }
}

// Ties and NaN: a zero query gives every token the same score, a NaN query a NaN one (ranked lowest, so equal
// again); the take then goes by item id (cells, then exact tokens by position) exactly as the reference does.
TEST_P(PqExactSelect, TiesAndNaNFollowTheReference) {
  const auto [shape, fold, fraction] = GetParam();
  const auto [m, bits] = shape;
  PqFixture f(3000, m, bits, 5, fraction, fold);
  const PqRetriever& pq = f.pq();
  for (const float fill : {0.0f, std::nanf("")}) {
    F32 qt({8, 64});
    qt.data.assign(8 * 64, fill);
    qt.refresh();
    for (int32_t budget : {1, 37, 1000}) {
      I32 out({2, budget});
      int32_t count = 0;
      if (kvret_select(f.seq, 0, &qt, budget, &out, &count) != KVRET_OK) {
        ASSERT_TRUE(fill != fill) << kvret_last_error();  // a NaN query may be refused; a zero one may not
        continue;
      }
      for (int h = 0; h < 2; ++h) {
        const std::vector<int32_t> got(out.data.begin() + h * budget, out.data.begin() + (h + 1) * budget);
        ASSERT_EQ(got, reference_select(pq, f.k.data, 2, 64, qt.data, 4, h, budget, fold == KVRET_FOLD_MAX_LOGIT))
            << "head " << h << " budget " << budget << " fill " << fill;
      }
    }
  }
}

// An f16 or bf16 store keeps its exact keys in its own dtype: half the bytes of f32, the same keys, and a selection
// that is the reference's on the keys as stored.
TEST(PqExact, KeysKeepTheStoreDtype) {
  for (const int dtype : {KVRET_KV_F16, KVRET_KV_BF16}) {
    PqFixture wide(3000, 4, 6, 5, 0.05f, KVRET_FOLD_SUM_PROB, KVRET_KV_F32);
    PqFixture f(3000, 4, 6, 5, 0.05f, KVRET_FOLD_SUM_PROB, dtype);
    const PqRetriever& pq = f.pq();
    std::vector<float> stored = f.k.data;  // the keys as the store holds them
    for (float& x : stored) x = dtype == KVRET_KV_F16 ? f16_to_f32(f32_to_f16(x)) : bf16_to_f32(f32_to_bf16(x));
    int64_t exact_rows = 0;
    for (int h = 0; h < 2; ++h) {
      const auto keys = pq.exact_keys_f32(h);
      const auto& pos = pq.exact_positions(h);
      exact_rows += static_cast<int64_t>(pos.size());
      for (size_t e = 0; e < pos.size(); ++e)
        for (int i = 0; i < 64; ++i)
          ASSERT_EQ(keys[e * 64 + i], stored[static_cast<size_t>((pos[e] * 2 + h) * 64 + i)]);
    }
    int64_t wide_rows = 0;
    for (int h = 0; h < 2; ++h) wide_rows += static_cast<int64_t>(wide.pq().exact_positions(h).size());
    ASSERT_EQ(exact_rows, wide_rows);
    const int64_t codes_and_tables = wide.pq().bytes() - wide_rows * 64 * 4;
    EXPECT_EQ(pq.bytes(), codes_and_tables + exact_rows * 64 * 2) << "dtype " << dtype;
    F32 qt({8, 64});
    qt.data = test::random_vector(8 * 64, 31);
    qt.refresh();
    for (int32_t budget : {7, 300}) {
      I32 out({2, budget});
      int32_t count = 0;
      test::expect_ok(kvret_select(f.seq, 0, &qt, budget, &out, &count));
      for (int h = 0; h < 2; ++h) {
        const std::vector<int32_t> got(out.data.begin() + h * budget, out.data.begin() + (h + 1) * budget);
        ASSERT_EQ(got, reference_select(pq, stored, 2, 64, qt.data, 4, h, budget, false))
            << "dtype " << dtype << " head " << h << " budget " << budget;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PqExactSelect,
                         ::testing::Combine(::testing::Values(std::make_pair(2, 6), std::make_pair(4, 4),
                                                              std::make_pair(4, 6), std::make_pair(4, 8)),
                                            ::testing::Values(KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT),
                                            ::testing::Values(0.0f, 0.02f, 0.1f)));

// A rare, sharp key and a query aligned with it. The bulk is Gaussian (every centroid serves many keys, as on a real
// model); the outlier adds a component of norm 12 along a direction no other key has, about 4x the median squared
// reconstruction error. Exact scoring ranks it first; PQ folds it into a centroid shared with dozens of ordinary
// keys, so its score depends on the k-means seed. With the default fraction it is kept exact and selected at every
// seed and budget.
TEST(PqExact, PlantedSharpKeyIsSelectedAtEverySeedAndBudget) {
  constexpr float kSharpNorm = 12.0f;
  constexpr int64_t kTokens = 2000, kOutlier = 1234;
  F32 k({kTokens, 2, 64}), v({kTokens, 2, 64});
  k.data = test::random_vector(static_cast<size_t>(kTokens * 2 * 64), 77);
  k.refresh();
  std::vector<float> w = test::random_vector(64, 78);
  double norm = 0;
  for (float x : w) norm += static_cast<double>(x) * x;
  for (float& x : w) x = static_cast<float>(x / std::sqrt(norm));
  for (int64_t t = 0; t < kTokens; ++t)  // no key but the outlier has a component along w
    for (int h = 0; h < 2; ++h) {
      float* key = k.data.data() + (t * 2 + h) * 64;
      double along = 0;
      for (int i = 0; i < 64; ++i) along += static_cast<double>(key[i]) * w[static_cast<size_t>(i)];
      for (int i = 0; i < 64; ++i) key[i] -= static_cast<float>(along) * w[static_cast<size_t>(i)];
    }
  for (int i = 0; i < 64; ++i)
    k.data[static_cast<size_t>((kOutlier * 2 + 0) * 64 + i)] += kSharpNorm * w[static_cast<size_t>(i)];
  F32 q({8, 64});
  const auto noise = test::random_vector(8 * 64, 79, 0.3f);
  for (int hq = 0; hq < 8; ++hq)
    for (int i = 0; i < 64; ++i)
      q.data[static_cast<size_t>(hq * 64 + i)] = w[static_cast<size_t>(i)] + noise[static_cast<size_t>(hq * 64 + i)];
  const int32_t budgets[] = {1, 4, 16, 64, 200, 500};

  for (const float fraction : {0.0f, kDefaultPqExactFraction}) {
    int kept_everywhere = 0;
    std::string report;
    for (uint64_t seed = 1; seed <= 12; ++seed) {
      kvret_config c = test::small_config();
      c.n_layers = 1;
      c.seed = seed;
      c.pq_exact_fraction = fraction;
      auto ctx = test::make_context(c);
      kvret_seq* seq = nullptr;
      test::expect_ok(kvret_seq_open(ctx.get(), &seq));
      test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
      int selected_at = 0;
      for (int32_t budget : budgets) {
        I32 out({2, budget});
        int32_t count = 0;
        test::expect_ok(kvret_select(seq, 0, &q, budget, &out, &count));
        const bool selected = std::binary_search(out.data.begin(), out.data.begin() + count, int32_t{kOutlier});
        selected_at += selected;
        if (fraction > 0) {
          EXPECT_TRUE(selected) << "seed " << seed << " budget " << budget;
        }
      }
      kept_everywhere += selected_at == static_cast<int>(std::size(budgets));
      report.append(" ").append(std::to_string(selected_at));
    }
    std::cout << "[ planted ] fraction " << fraction << ": the outlier is selected at every budget for "
              << kept_everywhere << " of 12 seeds; budgets (of " << std::size(budgets)
              << ") where selected, per seed:" << report << "\n";
    if (fraction > 0) {
      EXPECT_EQ(kept_everywhere, 12);
    }
  }
}

/// A PQ index over a store, driven directly (decode extension, fault injection).
struct DirectPqIndex {
  HostKvStore store{2, 64, DType::F32};
  PqRetriever index;
  F32 k{{1200, 2, 64}}, v{{1200, 2, 64}};
  static PqRetriever::Params params() {
    PqRetriever::Params p;
    p.exact_fraction = 0.05f;
    return p;
  }
  DirectPqIndex() : index(2, 64, params()) {
    test::clustered_kv(1200, 2, 64, 31, k, v);
    store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), 1000, true);
  }
  struct State {
    std::vector<std::vector<uint8_t>> codes;
    std::vector<std::vector<int64_t>> exact;
    std::vector<std::vector<float>> keys;
    int64_t size, bytes;
    bool operator==(const State& o) const {
      return codes == o.codes && exact == o.exact && keys == o.keys && size == o.size && bytes == o.bytes;
    }
  };
  State state() const {
    State s{{}, {}, {}, index.size(), index.bytes()};
    for (int h = 0; h < 2; ++h) {
      s.codes.emplace_back(index.codes(h), index.codes(h) + index.size() * index.m());
      const auto& exact = index.exact_positions(h);
      s.exact.emplace_back(exact.begin(), exact.end());
      s.keys.push_back(index.exact_keys_f32(h));
    }
    return s;
  }
};

// Decode tokens that all quantize worse than the training ones (a shift after a short prefill) do not all become
// exact: a head's exact set stops at twice its share of the tokens (first come, first kept).
TEST(PqExact, DecodeExactSetStopsAtTwiceItsShare) {
  DirectPqIndex f;
  f.index.extend(f.store, 4, 1000, true, 2);
  const auto thresholds = std::vector<float>{f.index.exact_threshold(0), f.index.exact_threshold(1)};
  F32 far_k({200, 2, 64}), far_v({200, 2, 64});
  far_k.data = test::random_vector(200 * 2 * 64, 77, 8.0f);  // every key far from every centroid
  far_k.refresh();
  for (int chunk = 0; chunk < 10; ++chunk) {
    const int64_t begin = f.store.size();
    f.store.append(TensorView::from(&far_k, "k", kFloatTypes, {3}), TensorView::from(&far_v, "v", kFloatTypes, {3}),
                   200, true);
    for (int64_t t = begin; t < begin + 200; ++t) f.index.extend(f.store, t, t + 1, false, 1);  // decode steps
  }
  const int64_t n = f.index.size();
  const int64_t cap = 2 * PqRetriever::exact_count(0.05f, n);
  for (int h = 0; h < 2; ++h) {
    const auto& exact = f.index.exact_positions(h);
    EXPECT_LE(static_cast<int64_t>(exact.size()), cap) << "head " << h;
    EXPECT_GE(static_cast<int64_t>(exact.size()), cap - 2) << "head " << h << ": the far tokens filled it";
    EXPECT_EQ(f.index.exact_threshold(h), thresholds[static_cast<size_t>(h)]);
    // the first decode tokens (all above the threshold) filled the room there was: up to twice the trained share
    const int64_t room = 2 * PqRetriever::exact_count(0.05f, 997) - PqRetriever::exact_count(0.05f, 996);
    for (int64_t t = 1000; t < 1000 + room; ++t)
      EXPECT_TRUE(std::binary_search(exact.begin(), exact.end(), t)) << "head " << h << " token " << t;
  }
}

TEST(PqExact, DecodeAddsOutliersAboveTheThresholdWithTheStrongGuarantee) {
  DirectPqIndex f;
  f.index.extend(f.store, 4, 1000, true, 2);  // trains on 996 tokens
  const int64_t trained_exact = PqRetriever::exact_count(0.05f, 996);
  ASSERT_EQ(f.index.exact_positions(0).size(), static_cast<size_t>(trained_exact));
  // the decode tokens: copies of non-exact prefill keys, and every 5th a far outlier
  std::vector<int64_t> outliers;
  for (int64_t t = 1000; t < 1200; ++t)
    for (int h = 0; h < 2; ++h) {
      float* key = f.k.data.data() + (t * 2 + h) * 64;
      int64_t src = t - 900;
      while (std::binary_search(f.index.exact_positions(h).begin(), f.index.exact_positions(h).end(), src)) ++src;
      std::copy_n(f.k.data.data() + (src * 2 + h) * 64, 64, key);
      if (t % 5 == 0) {
        const auto far = test::random_vector(64, static_cast<uint64_t>(t * 2 + h), 6.0f);
        for (int i = 0; i < 64; ++i) key[i] += far[static_cast<size_t>(i)];
        if (h == 0) outliers.push_back(t);
      }
    }
  F32 tail_k({200, 2, 64}), tail_v({200, 2, 64});
  std::copy(f.k.data.begin() + 1000 * 128, f.k.data.end(), tail_k.data.begin());
  f.store.append(TensorView::from(&tail_k, "k", kFloatTypes, {3}), TensorView::from(&tail_v, "v", kFloatTypes, {3}),
                 200, true);
  const std::vector<float> thresholds = {f.index.exact_threshold(0), f.index.exact_threshold(1)};

  // single decode steps, then a chunk; every allocation of each may fail
  const std::pair<int64_t, int64_t> steps[] = {{1000, 1001}, {1001, 1002}, {1002, 1003}, {1003, 1010}, {1010, 1200}};
  for (const auto& step : steps) {
    const int64_t begin = step.first, end = step.second;  // plain locals: lambdas capture them (clang 14)
    const auto before = f.state();
    const int failures = test::fail_each_allocation(
        [&] { f.index.extend(f.store, begin, end, false, 1); },
        [&](int64_t fail_at) {
          ASSERT_TRUE(f.state() == before) << "failure " << fail_at << " at [" << begin << ", " << end << ")";
        });
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_GT(failures, 0);
    ASSERT_EQ(f.index.base() + f.index.size(), end);
  }
  // the thresholds did not move, and the new exact tokens are the new ones above them
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(f.index.exact_threshold(h), thresholds[static_cast<size_t>(h)]);
    const auto err = reconstruction_errors(f.index, f.k.data, 2, 64, h);
    const auto& exact = f.index.exact_positions(h);
    ASSERT_TRUE(std::is_sorted(exact.begin(), exact.end()));
    ASSERT_EQ(std::count_if(exact.begin(), exact.end(), [](int64_t p) { return p < 1000; }), trained_exact);
    int added = 0;
    for (int64_t t = 1000; t < 1200; ++t) {
      const double e = err[static_cast<size_t>(t - f.index.base())];
      const bool is_exact = std::binary_search(exact.begin(), exact.end(), t);
      added += is_exact;
      const double th = thresholds[static_cast<size_t>(h)];
      if (e > th * (1 + 1e-4)) {
        EXPECT_TRUE(is_exact) << "head " << h << " token " << t;
      }
      if (e < th * (1 - 1e-4)) {
        EXPECT_FALSE(is_exact) << "head " << h << " token " << t;
      }
      if (t % 5 == 0) {
        EXPECT_TRUE(is_exact) << "the planted outlier " << t << " of head " << h;
      }
      if (t % 5 != 0) {
        EXPECT_FALSE(is_exact) << "the copy " << t << " of head " << h;
      }
      if (is_exact) {
        const auto at = static_cast<size_t>(std::lower_bound(exact.begin(), exact.end(), t) - exact.begin());
        for (int i = 0; i < 64; ++i)
          ASSERT_EQ(f.index.exact_keys_f32(h)[at * 64 + i], f.k.data[static_cast<size_t>((t * 2 + h) * 64 + i)]);
      }
    }
    EXPECT_EQ(added, 40);
  }
  // the index grown step by step equals one extended in a single chunk, and selects like the reference
  PqRetriever whole(2, 64, DirectPqIndex::params());
  whole.extend(f.store, 4, 1000, true, 2);
  whole.extend(f.store, 1000, 1200, false, 2);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(whole.exact_positions(h), f.index.exact_positions(h));
    EXPECT_TRUE(std::equal(whole.codes(h), whole.codes(h) + whole.size() * 2, f.index.codes(h)));
  }
  EXPECT_EQ(whole.bytes(), f.index.bytes());
  const auto q = test::random_vector(8 * 64, 91);
  for (int64_t budget : {1, 20, 150}) {
    SelectRequest r;
    r.q = q.data();
    r.n_q_heads = 8;
    r.group = 4;
    r.scale = 0.125f;
    r.mid_begin = 4;
    r.mid_end = 1200;
    r.budget = budget;
    std::vector<int32_t> rows(static_cast<size_t>(2 * budget));
    int32_t* out[2] = {rows.data(), rows.data() + budget};
    f.index.select(f.store, r, out, nullptr);
    for (int h = 0; h < 2; ++h)
      EXPECT_EQ(std::vector<int32_t>(out[h], out[h] + budget),
                reference_select(f.index, f.k.data, 2, 64, q, 4, h, budget, false))
          << "head " << h << " budget " << budget;
  }
}

// pq4_softmax_fold works on four query heads at a time and on blocks of tokens; its result is still the per-head
// definition (gqa_fold.hpp), bit for bit, whatever the group size (padded to four), n (block edges, tails) and the
// place of the exact tokens (block edges included), on every instruction set the CPU and KVRET_MAX_CPU_ISA allow.
TEST(PqFold, FourHeadBlocksGiveThePerHeadDefinitionsBits) {
  const auto bits = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  };
  for (const int k : {37, 64})
    for (const int group : {2, 3, 8, 9})
      for (const int64_t n : {1023, 1024, 1025, 2061}) {
        auto lut = test::random_vector(static_cast<size_t>(group * 4 * k), static_cast<uint64_t>(n * 7 + group), 6.0f);
        std::vector<uint8_t> codes(static_cast<size_t>(n * 4));
        uint64_t state = static_cast<uint64_t>(n + k);
        for (auto& c : codes) {
          state = state * 6364136223846793005ull + 1442695040888963407ull;
          c = static_cast<uint8_t>((state >> 33) % static_cast<uint64_t>(k));
        }
        std::vector<int64_t> exact;
        for (int64_t t = 0; t < n; ++t) {
          state = state * 6364136223846793005ull + 1442695040888963407ull;
          if (t == 0 || t == 1023 || t == 1024 || t == n - 1 || (state >> 33) % 20 == 0) exact.push_back(t);
        }
        const auto n_exact = static_cast<int64_t>(exact.size());
        const auto exact_logits = test::random_vector(static_cast<size_t>(group * n_exact), 11, 20.0f);
        // the definition, head by head
        std::vector<float> want(static_cast<size_t>(n), 0.0f), e(static_cast<size_t>(n));
        for (int g = 0; g < group; ++g) {
          const float* l = lut.data() + g * 4 * k;
          float mx[4], sum = 0, ref = -INFINITY;
          for (int j = 0; j < 4; ++j) {
            mx[j] = -INFINITY;
            for (int c = 0; c < k; ++c) mx[j] = std::max(mx[j], l[j * k + c]);
            sum += mx[j];
          }
          ref = sum;
          for (int64_t x = 0; x < n_exact; ++x) ref = std::max(ref, exact_logits[static_cast<size_t>(g * n_exact + x)]);
          const float shift = ref - sum;
          const auto ej = [&](int j, int c) {
            return exp_nonpositive(j == 0 ? (l[c] - mx[0]) - shift : l[j * k + c] - mx[j]);
          };
          for (int64_t t = 0; t < n; ++t) {
            const uint8_t* c = codes.data() + t * 4;
            e[static_cast<size_t>(t)] = (ej(0, c[0]) * ej(1, c[1])) * (ej(2, c[2]) * ej(3, c[3]));
          }
          for (int64_t x = 0; x < n_exact; ++x)
            e[static_cast<size_t>(exact[static_cast<size_t>(x)])] =
                exp_nonpositive(exact_logits[static_cast<size_t>(g * n_exact + x)] - ref);
          double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0}, z = 0;
          int64_t u = 0;
          for (; u + 8 <= n; u += 8)
            for (int i = 0; i < 8; ++i) lane[i] += e[static_cast<size_t>(u + i)];
          for (const double y : lane) z += y;
          for (; u < n; ++u) z += e[static_cast<size_t>(u)];
          if (z <= 0) continue;
          const auto inv = static_cast<float>(1.0 / z);
          for (int64_t t = 0; t < n; ++t) want[static_cast<size_t>(t)] += e[static_cast<size_t>(t)] * inv;
        }
        std::vector<float> got(static_cast<size_t>(n), -1.0f);
        ASSERT_TRUE(pq4_softmax_fold(lut.data(), group, k, codes.data(), n, exact.data(), exact_logits.data(), n_exact,
                                     got.data()));
        for (int64_t t = 0; t < n; ++t)
          ASSERT_EQ(bits(got[static_cast<size_t>(t)]), bits(want[static_cast<size_t>(t)]))
              << "k " << k << " group " << group << " n " << n << " t " << t;
      }
}

}  // namespace
}  // namespace kvret
