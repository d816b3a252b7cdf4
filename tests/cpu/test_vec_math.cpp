// The vectorized kernels behind select give the bits of the scalar code they replace, whichever path the CPU
// takes: fold_weighted_logits against a scalar fold written here on exp_nonpositive (the function the library
// shares), scaled_dots against scale * dot, pq_token_logits against the per-token loop, over awkward sizes and
// special values; topk_positions against a full sort.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/vec_math.hpp"
#include "select/gqa_fold.hpp"
#include "select/topk.hpp"
#include "test_util.hpp"

using namespace kvret;

namespace {

/// The sum-of-probabilities fold in its scalar form (the library's definition).
std::vector<float> scalar_fold(const std::vector<float>& logits, const int32_t* weight, int group, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  std::vector<float> folded(static_cast<size_t>(n), 0.0f), e(static_cast<size_t>(n));
  for (int g = 0; g < group; ++g) {
    const float* l = logits.data() + g * n;
    float mx = lowest;
    for (int64_t u = 0; u < n; ++u) mx = std::max(mx, !weight || weight[u] > 0 ? l[u] : lowest);
    if (!(mx > lowest)) continue;
    for (int64_t u = 0; u < n; ++u) e[static_cast<size_t>(u)] = exp_nonpositive(l[u] - mx);
    double z = 0;
    if (weight) {
      float zf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t u = 0;
      for (; u + 8 <= n; u += 8)
        for (int i = 0; i < 8; ++i) zf[i] += static_cast<float>(weight[u + i]) * e[static_cast<size_t>(u + i)];
      for (float x : zf) z += x;
      for (; u < n; ++u) z += static_cast<double>(weight[u]) * e[static_cast<size_t>(u)];
    } else {
      double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t u = 0;
      for (; u + 8 <= n; u += 8)
        for (int i = 0; i < 8; ++i) lane[i] += e[static_cast<size_t>(u + i)];
      for (const double x : lane) z += x;
      for (; u < n; ++u) z += e[static_cast<size_t>(u)];
    }
    if (z <= 0) continue;
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t u = 0; u < n; ++u) folded[static_cast<size_t>(u)] += e[static_cast<size_t>(u)] * inv;
  }
  return folded;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST(VecMath, FoldIsTheScalarFoldBitForBit) {
  for (const int64_t n : {1, 7, 8, 13, 64, 1000, 4123})
    for (const int group : {1, 3, 4, 5, 8}) {
      std::vector<float> logits = test::random_vector(static_cast<size_t>(group * n), static_cast<uint64_t>(n));
      for (size_t i = 0; i < logits.size(); ++i) {
        logits[i] *= 40.0f;  // spans e^-87 (clamped to 0) and beyond
        if (i % 97 == 3) logits[i] = std::nanf("");
        if (i % 89 == 5) logits[i] = -std::numeric_limits<float>::infinity();
        if (i % 83 == 7) logits[i] = -200.0f;
      }
      if (group >= 3)  // a head with no finite logit (skipped) between two others
        for (int64_t u = 0; u < n; ++u) logits[static_cast<size_t>(n + u)] = u % 2 ? std::nanf("") : -INFINITY;
      std::vector<int32_t> weight(static_cast<size_t>(n));
      for (int64_t u = 0; u < n; ++u) weight[static_cast<size_t>(u)] = static_cast<int32_t>((u * 7919) % 5);
      for (const bool weighted : {false, true}) {
        const int32_t* w = weighted ? weight.data() : nullptr;
        const auto want = scalar_fold(logits, w, group, n);
        std::vector<float> got(static_cast<size_t>(n));
        fold_weighted_logits(logits.data(), w, group, n, KVRET_FOLD_SUM_PROB, got.data());
        for (int64_t u = 0; u < n; ++u)
          ASSERT_TRUE(same_bits(got[static_cast<size_t>(u)], want[static_cast<size_t>(u)]))
              << "n " << n << " group " << group << " weighted " << weighted << " u " << u << ": "
              << got[static_cast<size_t>(u)] << " vs " << want[static_cast<size_t>(u)];
      }
    }
}

TEST(VecMath, PqTokenLogitsAreThePerTokenSumBitForBit) {
  for (const int m : {3, 4, 8, 16})
    for (const int k : {16, 64, 256})
      for (const int nq : {1, 3, 4, 5})
        for (const int64_t n : {1, 7, 8, 29, 1000}) {
          auto lut = test::random_vector(static_cast<size_t>(nq * m * k), 11);
          for (size_t i = 0; i < lut.size(); i += 37) lut[i] = -0.0f;  // the sum starts from +0, as the loop does
          for (size_t i = 5; i < lut.size(); i += 101) lut[i] = std::nanf("");
          std::vector<uint8_t> codes(static_cast<size_t>(n * m));
          uint64_t state = 7;
          for (auto& c : codes) c = static_cast<uint8_t>(splitmix64(state) % static_cast<uint64_t>(k));
          if (n > 3)
            for (int j = 0; j < m; ++j) codes[static_cast<size_t>(3 * m + j)] = 0;  // all -0 entries (lut[0] is -0)
          std::vector<float> out(static_cast<size_t>(nq * n));
          pq_token_logits(lut.data(), nq, m, k, codes.data(), n, out.data());
          for (int g = 0; g < nq; ++g)
            for (int64_t t = 0; t < n; ++t) {
              const auto entry = [&](int j) {
                return lut[static_cast<size_t>((g * m + j) * k + codes[static_cast<size_t>(t * m + j)])];
              };
              float want = 0;
              if (m == 4) {  // two pairs
                want = ((0.0f + entry(0)) + entry(1)) + (entry(2) + entry(3));
              } else {
                for (int j = 0; j < m; ++j) want += entry(j);
              }
              ASSERT_TRUE(same_bits(out[static_cast<size_t>(g * n + t)], want))
                  << "m " << m << " k " << k << " nq " << nq << " n " << n << " g " << g << " t " << t;
            }
        }
}

TEST(VecMath, TopkPositionsAreTheSortedTop) {
  for (const int64_t n : {1, 5, 17, 100, 5000, 40000})
    for (const int variant : {0, 1, 2, 3}) {
      std::vector<float> scores = test::random_vector(static_cast<size_t>(n), static_cast<uint64_t>(n + variant));
      for (size_t i = 0; i < scores.size(); ++i) {
        if (variant == 1) scores[i] = std::round(scores[i] * 3.0f);  // many ties
        if (variant == 2) scores[i] = 0.0f;                          // all tied
        if (i % 13 == 2) scores[i] = std::nanf("");
        if (i % 17 == 4) scores[i] = -0.0f;
        if (i % 19 == 6) scores[i] = -INFINITY;
      }
      if (variant == 3)  // the 1024 scores topk_positions samples are the highest: its bound keeps fewer than k
        for (int64_t s = 0; s < std::min<int64_t>(n, 1024); ++s) scores[static_cast<size_t>(s * n / 1024)] = 10.0f;
      const auto rank = [](float s) { return s == s ? s : -INFINITY; };
      std::vector<int32_t> order(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return rank(scores[static_cast<size_t>(a)]) > rank(scores[static_cast<size_t>(b)]);
      });
      for (const int64_t k : {int64_t{0}, int64_t{1}, n / 3, n - 1, n}) {
        std::vector<int32_t> want(order.begin(), order.begin() + k);
        for (auto& p : want) p += 100;
        std::sort(want.begin(), want.end());
        std::vector<int32_t> got(static_cast<size_t>(k) + 1, -7);
        topk_positions(scores.data(), n, k, 100, got.data());
        ASSERT_EQ(got.back(), -7) << "wrote past k";
        got.pop_back();
        ASSERT_EQ(got, want) << "n " << n << " variant " << variant << " k " << k;
      }
    }
}

TEST(VecMath, ExpNonpositiveOfEveryRegion) {
  // the scalar function itself, through a fold of one entry per head: e^(x - x) = 1 and a lone entry gets 1
  const std::vector<float> one = {-3.0f};
  float out = 0;
  fold_weighted_logits(one.data(), nullptr, 1, 1, KVRET_FOLD_SUM_PROB, &out);
  EXPECT_EQ(out, 1.0f);
  EXPECT_EQ(exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(exp_nonpositive(-90.0f), 0.0f);
  EXPECT_NEAR(exp_nonpositive(-1.0f), std::exp(-1.0f), 2e-7f);
  // positive input (a weight-0 entry above the weighted maximum) is taken as 0, NaN stays NaN
  EXPECT_EQ(exp_nonpositive(1.0f), 1.0f);
  EXPECT_EQ(exp_nonpositive(4.2e28f), 1.0f);
  EXPECT_TRUE(std::isnan(exp_nonpositive(std::nanf(""))));
  // and the vectorized fold agrees: weight-0 entries far above the maximum of the weighted ones
  std::vector<float> logits(37, -1.0f);
  std::vector<int32_t> weight(37, 1);
  for (int u = 0; u < 37; u += 3) {
    logits[static_cast<size_t>(u)] = 4.2e28f;
    weight[static_cast<size_t>(u)] = 0;
  }
  std::vector<float> got(37), want = scalar_fold(logits, weight.data(), 1, 37);
  fold_weighted_logits(logits.data(), weight.data(), 1, 37, KVRET_FOLD_SUM_PROB, got.data());
  for (size_t u = 0; u < 37; ++u) EXPECT_TRUE(same_bits(got[u], want[u])) << u;
}

TEST(VecMath, ScaledDotsAreScaleTimesDotBitForBit) {
  for (const int len : {1, 8, 13, 64, 128}) {
    for (const int nq : {1, 2, 3, 4, 5, 7, 8}) {
      const int64_t n_keys = 11;
      const int64_t q_stride = len + 3, key_stride = len + 5, out_stride = n_keys + 2;
      const auto q = test::random_vector(static_cast<size_t>(nq * q_stride), 3);
      const auto keys = test::random_vector(static_cast<size_t>(n_keys * key_stride), 4);
      std::vector<float> out(static_cast<size_t>(nq * out_stride), -1.0f);
      const float scale = 0.125f * 1.1f;
      scaled_dots(q.data(), q_stride, nq, keys.data(), key_stride, n_keys, len, scale, out.data(), out_stride);
      for (int g = 0; g < nq; ++g)
        for (int64_t e = 0; e < n_keys; ++e) {
          const float want = scale * dot(q.data() + g * q_stride, keys.data() + e * key_stride, len);
          ASSERT_TRUE(same_bits(out[static_cast<size_t>(g * out_stride + e)], want))
              << "len " << len << " nq " << nq << " g " << g << " e " << e;
        }
      for (int g = 0; g < nq; ++g)
        for (int64_t e = n_keys; e < out_stride; ++e) ASSERT_EQ(out[static_cast<size_t>(g * out_stride + e)], -1.0f);
    }
  }
}
