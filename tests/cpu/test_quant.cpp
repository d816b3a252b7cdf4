// The QUANT index (SpeCache's low-bit copy, index/quant_retriever): on clustered keys its selection holds most of
// EXACT's attention mass at 2 and 1 bits; decode extends the copy to the state a prefill of the same tokens gives;
// the index bytes in the stats are the resident copy's, (bits + 32 / group) / 16 of f16 plus the residual window;
// its scores are the dot products with the low-bit keys; bad quant settings are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "c_api/handles.hpp"
#include "engine/sequence.hpp"
#include "index/quant_retriever.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int kH = 2, kD = 64, kQ = 8, kGroup = kQ / kH;

struct Seq {
  kvret_seq* s = nullptr;
  explicit Seq(kvret_context* ctx) { EXPECT_EQ(kvret_seq_open(ctx, &s), KVRET_OK) << kvret_last_error(); }
  ~Seq() { kvret_seq_close(s); }
};

kvret_config quant_config(int bits, int group = 64, int residual = 64) {
  kvret_config c = test::small_config(KVRET_INDEX_QUANT);
  c.n_layers = 1;
  c.quant_bits = bits;
  c.quant_group_size = group;
  c.quant_residual = residual;
  return c;
}

struct Recall {
  double token = 0, mass = 0, relative = 0;
};

/// Mean over queries aimed at a token's key (plus noise) and KV heads: the share of EXACT's selected tokens the kind
/// selects, the share of the exact attention mass (summed softmax of the group) its selection holds, and that mass
/// relative to the mass of EXACT's selection.
Recall recall_vs_exact(const kvret_config& config, int64_t tokens, int64_t budget) {
  F32 k({tokens, kH, kD}), v({tokens, kH, kD});
  test::clustered_kv(tokens, kH, kD, 21, k, v);
  kvret_config exact_config = config;
  exact_config.index_kind = KVRET_INDEX_EXACT;
  auto ctx = test::make_context(config), exact_ctx = test::make_context(exact_config);
  Seq seq(ctx.get()), exact_seq(exact_ctx.get());
  EXPECT_EQ(kvret_append_prefill(seq.s, 0, &k, &v), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(kvret_append_prefill(exact_seq.s, 0, &k, &v), KVRET_OK) << kvret_last_error();
  const int64_t mb = config.n_sink, me = tokens - config.n_local;
  Recall r;
  int cases = 0;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    const int64_t target = mb + static_cast<int64_t>((seed * 7919) % static_cast<uint64_t>(me - mb));
    const auto noise = test::random_vector(static_cast<size_t>(kQ * kD), 400 + seed, 0.3f);
    F32 q({kQ, kD});
    for (int g = 0; g < kQ; ++g)
      for (int i = 0; i < kD; ++i)
        q.data[static_cast<size_t>(g * kD + i)] =
            0.5f * k.data[static_cast<size_t>((target * kH + g / kGroup) * kD + i)] +
            noise[static_cast<size_t>(g * kD + i)];
    I32 out({kH, budget}), exact_out({kH, budget});
    int32_t count = 0;
    EXPECT_EQ(kvret_select(seq.s, 0, &q, static_cast<int32_t>(budget), &out, &count), KVRET_OK);
    EXPECT_EQ(count, budget);
    EXPECT_EQ(kvret_select(exact_seq.s, 0, &q, static_cast<int32_t>(budget), &exact_out, &count), KVRET_OK);
    for (int h = 0; h < kH; ++h) {
      const auto folded = test::exact_folded(k.data, kH, kD, q.data, kGroup, h, mb, me, false);
      std::set<int32_t> exact_set;
      double total = 0, mass = 0, common = 0;
      for (const double f : folded) total += f;
      double exact_mass = 0;
      for (int64_t i = 0; i < budget; ++i) {
        const int32_t p = exact_out.data[static_cast<size_t>(h * budget + i)];
        exact_set.insert(p);
        exact_mass += folded[static_cast<size_t>(p - mb)];
      }
      for (int64_t i = 0; i < budget; ++i) {
        const int32_t p = out.data[static_cast<size_t>(h * budget + i)];
        mass += folded[static_cast<size_t>(p - mb)];
        common += static_cast<double>(exact_set.count(p));
      }
      r.token += common / static_cast<double>(budget);
      r.mass += mass / total;
      r.relative += mass / exact_mass;
      ++cases;
    }
  }
  r.token /= cases;
  r.mass /= cases;
  r.relative /= cases;
  return r;
}

// On clustered keys the low-bit keys keep which cluster a query aims at (most of EXACT's mass from a tenth of the
// middle on) but blur the order inside a cluster, whose keys differ by less than a quantization step; PQ's figures
// are printed next to them.
TEST(Quant, RecallAgainstExactOnClusteredKeys) {
  constexpr int64_t kTokens = 3000, kMiddle = kTokens - 20;
  for (const int64_t budget : {int64_t{32}, int64_t{128}, int64_t{300}}) {
    kvret_config pq = quant_config(2);
    pq.index_kind = KVRET_INDEX_PQ;
    const Recall p = recall_vs_exact(pq, kTokens, budget);
    std::printf("[ quant    ] budget %3lld of %lld: PQ         token recall vs EXACT %.3f, mass %.3f of EXACT's\n",
                static_cast<long long>(budget), static_cast<long long>(kMiddle), p.token, p.relative);
    for (const int bits : {2, 1}) {
      const Recall r = recall_vs_exact(quant_config(bits), kTokens, budget);
      std::printf("[ quant    ] budget %3lld of %lld: QUANT %d-bit token recall vs EXACT %.3f, mass %.3f of EXACT's\n",
                  static_cast<long long>(budget), static_cast<long long>(kMiddle), bits, r.token, r.relative);
      // far above a random pick's share of the mass at every budget
      EXPECT_GT(r.mass, 3.0 * static_cast<double>(budget) / kMiddle) << bits << "-bit, budget " << budget;
      if (budget >= kMiddle / 20) {
        EXPECT_GT(r.relative, bits == 2 ? 0.85 : 0.75) << bits << "-bit, budget " << budget;
      }
    }
  }
}

// Tokens decoded one at a time leave the index a prefill of the same tokens builds, byte for byte.
TEST(Quant, DecodeExtendsToThePrefillState) {
  for (const int bits : {1, 2}) {
    const kvret_config c = quant_config(bits, 32, 40);
    constexpr int64_t kPrefill = 700, kTotal = 900;
    F32 k({kTotal, kH, kD}), v({kTotal, kH, kD});
    test::clustered_kv(kTotal, kH, kD, 5, k, v);
    auto ctx = test::make_context(c);
    Seq a(ctx.get()), b(ctx.get());
    F32 kp({kPrefill, kH, kD}), vp({kPrefill, kH, kD});
    std::copy_n(k.data.begin(), kp.data.size(), kp.data.begin());
    std::copy_n(v.data.begin(), vp.data.size(), vp.data.begin());
    test::expect_ok(kvret_append_prefill(a.s, 0, &kp, &vp));
    test::expect_ok(kvret_wait_index(a.s, 0));
    for (int64_t t = kPrefill; t < kTotal; ++t) {
      F32 kt({kH, kD}), vt({kH, kD});
      std::copy_n(k.data.begin() + t * kH * kD, kH * kD, kt.data.begin());
      std::copy_n(v.data.begin() + t * kH * kD, kH * kD, vt.data.begin());
      test::expect_ok(kvret_append_decode(a.s, 0, &kt, &vt));
    }
    test::expect_ok(kvret_append_prefill(b.s, 0, &k, &v));
    test::expect_ok(kvret_wait_index(b.s, 0));
    const Retriever& ia = sequence_from_handle(a.s)->index(0);
    const Retriever& ib = sequence_from_handle(b.s)->index(0);
    EXPECT_EQ(ia.indexed_end(), kTotal - c.n_local);
    EXPECT_EQ(ia.save(), ib.save()) << bits << "-bit";
    const auto& qa = dynamic_cast<const QuantRetriever&>(ia);
    EXPECT_GT(qa.head(0).quantized(), 0);
    EXPECT_GE(qa.head(0).residual_tokens(), 40);
    EXPECT_LT(qa.head(0).residual_tokens(), 40 + 32);
  }
}

// kvret_stats.index_bytes is the resident copy: per KV head and layer, (bits + 32 / group) / 16 of the f16 keys and
// values of the quantized middle tokens, plus the residual window in f16. At long contexts that is 0.10 (1-bit g64)
// and 0.16 (2-bit g64) of the f16 KV.
TEST(Quant, IndexBytesAreTheResidentCopy) {
  for (const int bits : {1, 2})
    for (const int group : {32, 64}) {
      kvret_config c = quant_config(bits, group, 64);
      c.n_layers = 2;
      constexpr int64_t kTokens = 12000;
      F32 k({kTokens, kH, kD}), v({kTokens, kH, kD});
      test::clustered_kv(kTokens, kH, kD, 8, k, v);
      auto ctx = test::make_context(c);
      Seq seq(ctx.get());
      for (int32_t layer = 0; layer < 2; ++layer) test::expect_ok(kvret_append_prefill(seq.s, layer, &k, &v));
      test::expect_ok(kvret_wait_index(seq.s, -1));
      kvret_stats st;
      kvret_stats_init(&st);
      test::expect_ok(kvret_seq_stats(seq.s, &st));
      const int64_t middle = kTokens - c.n_sink - c.n_local;
      const int64_t quantized = (middle - 64) / group * group;
      const double ratio = (bits + 32.0 / group) / 16.0;
      const double f16_token = 2.0 * 2.0 * kD;  // keys and values
      const double expected =
          2.0 * kH *
          (ratio * f16_token * static_cast<double>(quantized) + f16_token * static_cast<double>(middle - quantized));
      EXPECT_EQ(static_cast<double>(st.index_bytes), expected) << bits << "-bit g" << group;
      const double share = static_cast<double>(st.index_bytes) / (2.0 * kH * f16_token * static_cast<double>(middle));
      std::printf("[ quant    ] %d-bit g%d: resident copy %.4f of the f16 KV at %lld middle tokens (formula %.4f)\n",
                  bits, group, share, static_cast<long long>(middle), ratio);
      EXPECT_NEAR(share, ratio, 0.01);
    }
}

// Without re-ranking, the score of a selected token (MAX_LOGIT fold) is the largest scaled dot product of the
// group's queries with the token's low-bit key, not with its exact key.
TEST(Quant, ScoresAreDotsWithTheLowBitKeys) {
  kvret_config c = quant_config(1, 64, 0);
  c.gqa_fold = KVRET_FOLD_MAX_LOGIT;
  c.quant_rerank = 1;
  constexpr int64_t kTokens = 1000;
  F32 k({kTokens, kH, kD}), v({kTokens, kH, kD});
  test::clustered_kv(kTokens, kH, kD, 9, k, v);
  auto ctx = test::make_context(c);
  Seq seq(ctx.get());
  test::expect_ok(kvret_append_prefill(seq.s, 0, &k, &v));
  F32 q({kQ, kD});
  q.data = test::random_vector(static_cast<size_t>(kQ * kD), 10);
  q.refresh();
  constexpr int32_t kBudget = 100;
  I32 out({kH, kBudget});
  F32 scores({kH, kBudget});
  int32_t count = 0;
  test::expect_ok(kvret_select_scored(seq.s, 0, &q, kBudget, &out, &scores, &count));
  ASSERT_EQ(count, kBudget);
  const auto& index = dynamic_cast<const QuantRetriever&>(sequence_from_handle(seq.s)->index(0));
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  double worst_exact_gap = 0;
  std::vector<float> key(kD), value(kD);
  for (int h = 0; h < kH; ++h)
    for (int32_t i = 0; i < kBudget; ++i) {
      const int32_t p = out.data[static_cast<size_t>(h * kBudget + i)];
      index.head(h).reconstruct(p - index.indexed_begin(), key.data(), value.data());
      double best = -1e300, best_exact = -1e300;
      for (int g = 0; g < kGroup; ++g) {
        double s = 0, e = 0;
        for (int j = 0; j < kD; ++j) {
          const double qj = q.data[static_cast<size_t>((h * kGroup + g) * kD + j)];
          s += qj * key[static_cast<size_t>(j)];
          e += qj * k.data[static_cast<size_t>((p * kH + h) * kD + j)];
        }
        best = std::max(best, s * scale);
        best_exact = std::max(best_exact, e * scale);
      }
      const float got = scores.data[static_cast<size_t>(h * kBudget + i)];
      EXPECT_NEAR(got, best, 1e-4 * (1 + std::fabs(best))) << "head " << h << " position " << p;
      worst_exact_gap = std::max(worst_exact_gap, std::fabs(got - best_exact));
    }
  EXPECT_GT(worst_exact_gap, 1e-2) << "1-bit scores should differ from the exact ones";
}

/// Positions and scores kvret_select_scored writes for `q` on a fresh context of `config` over k, v.
std::pair<std::vector<int32_t>, std::vector<float>> select_scored(const kvret_config& config, const F32& k,
                                                                  const F32& v, const F32& q, int32_t budget) {
  auto ctx = test::make_context(config);
  Seq seq(ctx.get());
  test::expect_ok(kvret_append_prefill(seq.s, 0, &k, &v));
  I32 out({kH, budget});
  F32 scores({kH, budget});
  int32_t count = 0;
  test::expect_ok(kvret_select_scored(seq.s, 0, &q, budget, &out, &scores, &count));
  EXPECT_EQ(count, budget);
  return {out.data, scores.data};
}

// Candidates that cover the whole middle make the re-ranked selection EXACT's, positions and scores bit for bit
// (the candidates' exact logits are EXACT's, folded over the same tokens in the same order), for both folds and
// both bit widths.
TEST(Quant, RerankingTheWholeMiddleIsExactSelection) {
  constexpr int64_t kTokens = 900;
  constexpr int32_t kBudget = 40;  // 64 x 40 candidates > the middle
  F32 k({kTokens, kH, kD}), v({kTokens, kH, kD});
  test::clustered_kv(kTokens, kH, kD, 31, k, v);
  F32 q({kQ, kD});
  q.data = test::random_vector(static_cast<size_t>(kQ * kD), 32);
  q.refresh();
  for (const auto fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT})
    for (const int bits : {1, 2}) {
      kvret_config c = quant_config(bits);
      c.gqa_fold = fold;
      c.quant_rerank = 64;
      kvret_config e = c;
      e.index_kind = KVRET_INDEX_EXACT;
      const auto got = select_scored(c, k, v, q, kBudget), want = select_scored(e, k, v, q, kBudget);
      EXPECT_EQ(got.first, want.first) << bits << " bits, fold " << fold;
      EXPECT_EQ(got.second, want.second) << bits << " bits, fold " << fold;
    }
}

// With r x budget candidates, the selection is drawn from the r x budget tokens the low-bit keys rank highest (the
// selection of quant_rerank = 1 at that budget), and holds the budget of them with the largest exact score (MAX_LOGIT:
// the largest scaled exact q.k of the group, independent of which tokens are candidates); the scores are exact.
TEST(Quant, RerankedSelectionIsTheExactTopOfTheLowBitCandidates) {
  constexpr int64_t kTokens = 2000;
  F32 k({kTokens, kH, kD}), v({kTokens, kH, kD});
  test::clustered_kv(kTokens, kH, kD, 41, k, v);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  for (uint64_t seed = 0; seed < 4; ++seed)
    for (const int r : {2, 4, 8}) {
      F32 q({kQ, kD});
      q.data = test::random_vector(static_cast<size_t>(kQ * kD), 50 + seed);
      q.refresh();
      constexpr int32_t kBudget = 24;
      kvret_config c = quant_config(1);
      c.gqa_fold = KVRET_FOLD_MAX_LOGIT;
      c.quant_rerank = 1;
      const auto candidates = select_scored(c, k, v, q, kBudget * r).first;
      c.quant_rerank = r;
      const auto [got, scores] = select_scored(c, k, v, q, kBudget);
      for (int h = 0; h < kH; ++h) {
        const auto exact_score = [&](int32_t p) {
          double best = -1e300;
          for (int g = 0; g < kGroup; ++g) {
            double s = 0;
            for (int j = 0; j < kD; ++j)
              s += static_cast<double>(q.data[static_cast<size_t>((h * kGroup + g) * kD + j)]) *
                   k.data[static_cast<size_t>((p * kH + h) * kD + j)];
            best = std::max(best, s * scale);
          }
          return best;
        };
        const std::set<int32_t> pool(candidates.begin() + h * kBudget * r, candidates.begin() + (h + 1) * kBudget * r);
        const std::set<int32_t> chosen(got.begin() + h * kBudget, got.begin() + (h + 1) * kBudget);
        ASSERT_EQ(chosen.size(), static_cast<size_t>(kBudget));
        double lowest_chosen = 1e300, highest_left = -1e300;
        for (int32_t i = 0; i < kBudget; ++i) {
          const int32_t p = got[static_cast<size_t>(h * kBudget + i)];
          EXPECT_TRUE(pool.count(p)) << "position " << p << " was not a candidate";
          if (i > 0) {
            EXPECT_LT(got[static_cast<size_t>(h * kBudget + i - 1)], p) << "ascending";
          }
          const double e = exact_score(p);
          EXPECT_NEAR(scores[static_cast<size_t>(h * kBudget + i)], e, 1e-4 * (1 + std::fabs(e)));
          lowest_chosen = std::min(lowest_chosen, e);
        }
        for (const int32_t p : pool) {
          if (!chosen.count(p)) highest_left = std::max(highest_left, exact_score(p));
        }
        EXPECT_GE(lowest_chosen, highest_left - 1e-5) << "head " << h << ", r " << r << ", seed " << seed;
      }
    }
}

// The re-ranking recovers what 1 bit loses: at a small budget its selection holds more of EXACT's tokens than the
// low-bit ranking alone.
TEST(Quant, RerankingRaisesOneBitRecall) {
  constexpr int64_t kTokens = 3000;
  kvret_config plain = quant_config(1), reranked = quant_config(1);
  plain.quant_rerank = 1;
  reranked.quant_rerank = 4;
  const Recall a = recall_vs_exact(plain, kTokens, 32), b = recall_vs_exact(reranked, kTokens, 32);
  std::printf("[ quant    ] budget 32: 1-bit token recall vs EXACT %.3f alone, %.3f re-ranked from 4x candidates\n",
              a.token, b.token);
  EXPECT_GT(b.token, a.token + 0.1);
  EXPECT_GE(b.relative, a.relative);
}

// Under quantized attention select re-ranks as it does without it (the selected rows are those that get exact
// values; the candidates get exact keys), and quant_rerank = 1 keeps the low-bit ranking there too.
TEST(Quant, QuantizedAttentionSelectsAsWithoutIt) {
  constexpr int64_t kTokens = 1500;
  constexpr int32_t kBudget = 30;
  F32 k({kTokens, kH, kD}), v({kTokens, kH, kD});
  test::clustered_kv(kTokens, kH, kD, 61, k, v);
  F32 q({kQ, kD});
  q.data = test::random_vector(static_cast<size_t>(kQ * kD), 62);
  q.refresh();
  kvret_config plain = quant_config(1), attention = quant_config(1);
  plain.quant_rerank = 8;
  attention.quant_attention = 1;
  attention.quant_rerank = 8;
  EXPECT_EQ(select_scored(attention, k, v, q, kBudget), select_scored(plain, k, v, q, kBudget));
  plain.quant_rerank = attention.quant_rerank = 1;
  EXPECT_EQ(select_scored(attention, k, v, q, kBudget), select_scored(plain, k, v, q, kBudget));
  attention.quant_rerank = 8;  // and the re-ranking changes the selection on these keys
  EXPECT_NE(select_scored(attention, k, v, q, kBudget).first, select_scored(plain, k, v, q, kBudget).first);
}

TEST(Quant, RerankOutsideItsRangeIsRefused) {
  for (const int32_t bad : {0, -1, 65}) {
    kvret_config c = quant_config(1);
    c.quant_rerank = bad;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(ctx, nullptr);
    EXPECT_NE(std::string(kvret_last_error()).find("quant_rerank"), std::string::npos) << kvret_last_error();
  }
}

}  // namespace
