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

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "select/gqa_fold.hpp"
#include "select/topk.hpp"
#include "test_util.hpp"

using namespace kvret;

namespace {

/// The normalizer of the unweighted fold: eight double lanes (u mod 8 over whole blocks) added in order, then the tail.
double lane_sum(const std::vector<float>& e, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0}, z = 0;
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    for (int i = 0; i < 8; ++i) lane[i] += e[static_cast<size_t>(u + i)];
  for (const double x : lane) z += x;
  for (; u < n; ++u) z += e[static_cast<size_t>(u)];
  return z;
}

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
      z = lane_sum(e, n);
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

/// pq4_softmax_fold's definition, scalar (see gqa_fold.hpp).
std::vector<float> scalar_pq4_fold(const std::vector<float>& lut, int group, int k, const std::vector<uint8_t>& codes,
                                   int64_t n, const std::vector<int64_t>& exact,
                                   const std::vector<float>& exact_logits) {
  const auto n_exact = static_cast<int64_t>(exact.size());
  const auto max_of = [](const float* x, int64_t len) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < len; ++i) mx = std::max(mx, x[i]);
    return mx;
  };
  std::vector<float> folded(static_cast<size_t>(n), 0.0f), e(static_cast<size_t>(n));
  for (int g = 0; g < group; ++g) {
    const float* l = lut.data() + g * 4 * k;
    float mx[4], sum = 0;
    for (int j = 0; j < 4; ++j) sum += mx[j] = max_of(l + j * k, k);
    const float ref = std::max(sum, max_of(exact_logits.data() + g * n_exact, n_exact));
    const float shift = ref - sum;
    std::vector<float> ej(static_cast<size_t>(4 * k));
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < k; ++c)
        ej[static_cast<size_t>(j * k + c)] = exp_nonpositive(j == 0 ? (l[c] - mx[0]) - shift : l[j * k + c] - mx[j]);
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* c = codes.data() + t * 4;
      e[static_cast<size_t>(t)] = (ej[c[0]] * ej[static_cast<size_t>(k + c[1])]) *
                                  (ej[static_cast<size_t>(2 * k + c[2])] * ej[static_cast<size_t>(3 * k + c[3])]);
    }
    for (int64_t i = 0; i < n_exact; ++i)
      e[static_cast<size_t>(exact[static_cast<size_t>(i)])] =
          exp_nonpositive(exact_logits[static_cast<size_t>(g * n_exact + i)] - ref);
    const double z = lane_sum(e, n);
    if (z <= 0) continue;
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t t = 0; t < n; ++t) folded[static_cast<size_t>(t)] += e[static_cast<size_t>(t)] * inv;
  }
  return folded;
}

// Every vector width (sixteen tokens with AVX-512, eight with AVX2 from the pair tables, then one at a time: n
// from 1 to past 16 with remainders of each), exact tokens anywhere, NaN table entries, and logits spread over
// e^-87 are the scalar definition's bits.
TEST(VecMath, Pq4SoftmaxFoldIsItsScalarDefinitionBitForBit) {
  for (const int k : {4, 13, 16, 64})
    for (const int group : {1, 4, 5})
      for (const int64_t n : {1, 7, 8, 15, 16, 17, 30, 1000, 4123})
        for (const double exact_share : {0.0, 0.05, 1.0}) {
          auto lut = test::random_vector(static_cast<size_t>(group * 4 * k), static_cast<uint64_t>(n + k), 8.0f);
          for (size_t i = 9; i < lut.size(); i += 61) lut[i] = std::nanf("");
          std::vector<uint8_t> codes(static_cast<size_t>(n * 4));
          uint64_t state = static_cast<uint64_t>(n * 31 + k);
          for (auto& c : codes) c = static_cast<uint8_t>(splitmix64(state) % static_cast<uint64_t>(k));
          std::vector<int64_t> exact;
          for (int64_t t = 0; t < n; ++t)
            if (static_cast<double>(splitmix64(state) % 1000) < exact_share * 1000.0) exact.push_back(t);
          auto exact_logits = test::random_vector(static_cast<size_t>(group) * exact.size(), 5, 30.0f);
          const auto want = scalar_pq4_fold(lut, group, k, codes, n, exact, exact_logits);
          std::vector<float> got(static_cast<size_t>(n), -7.0f);
          ASSERT_TRUE(pq4_softmax_fold(lut.data(), group, k, codes.data(), n, exact.data(), exact_logits.data(),
                                       static_cast<int64_t>(exact.size()), got.data()));
          for (int64_t u = 0; u < n; ++u)
            ASSERT_TRUE(same_bits(got[static_cast<size_t>(u)], want[static_cast<size_t>(u)]))
                << "k " << k << " group " << group << " n " << n << " exact " << exact.size() << " u " << u << ": "
                << got[static_cast<size_t>(u)] << " vs " << want[static_cast<size_t>(u)];
        }
}

// Up to rounding it is fold_logits of the per-token logits; where it does not apply it says so and writes nothing.
TEST(VecMath, Pq4SoftmaxFoldIsTheFoldOfTheLogits) {
  const int k = 64, group = 4;
  const int64_t n = 3000;
  auto lut = test::random_vector(static_cast<size_t>(group * 4 * k), 3, 2.0f);
  std::vector<uint8_t> codes(static_cast<size_t>(n * 4));
  uint64_t state = 9;
  for (auto& c : codes) c = static_cast<uint8_t>(splitmix64(state) % k);
  const std::vector<int64_t> exact = {5, 700, 2999};
  const auto exact_logits = test::random_vector(static_cast<size_t>(group) * exact.size(), 4, 6.0f);
  std::vector<float> logits(static_cast<size_t>(group * n));
  pq_token_logits(lut.data(), group, 4, k, codes.data(), n, logits.data());
  for (int g = 0; g < group; ++g)
    for (size_t i = 0; i < exact.size(); ++i)
      logits[static_cast<size_t>(g * n + exact[i])] = exact_logits[static_cast<size_t>(g) * exact.size() + i];
  std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
  fold_logits(logits.data(), group, n, KVRET_FOLD_SUM_PROB, want.data());
  ASSERT_TRUE(
      pq4_softmax_fold(lut.data(), group, k, codes.data(), n, exact.data(), exact_logits.data(), 3, got.data()));
  for (int64_t u = 0; u < n; ++u)
    ASSERT_NEAR(got[static_cast<size_t>(u)], want[static_cast<size_t>(u)],
                1e-5f * want[static_cast<size_t>(u)] + 1e-30f)
        << u;

  std::vector<float> untouched(static_cast<size_t>(n), -7.0f);
  EXPECT_FALSE(pq4_softmax_fold(lut.data(), group, 65, codes.data(), n, exact.data(), exact_logits.data(), 3,
                                untouched.data()));  // k > 64
  auto huge = lut;
  for (int j = 0; j < 4; ++j) huge[static_cast<size_t>(4 * k + j * k)] = 3e38f;  // head 1: the sum of maxima is +inf
  EXPECT_FALSE(
      pq4_softmax_fold(huge.data(), group, k, codes.data(), n, exact.data(), exact_logits.data(), 3, untouched.data()));
  for (const float x : untouched) ASSERT_EQ(x, -7.0f) << "written though it does not apply";
}

// Key rows in f16 or bf16 score as the same rows converted to f32, bit for bit (every vector and tail path).
TEST(VecMath, ScaledDotsOfHalfKeysAreThoseOfTheirF32Values) {
  for (const DType dtype : {DType::F16, DType::BF16, DType::F32})
    for (const int64_t len : {7, 13, 64, 128})
      for (const int nq : {1, 2, 3, 4, 5})
        for (const int64_t n_keys : {1, 3, 9}) {
          const int64_t stride = len + 3;
          auto q = test::random_vector(static_cast<size_t>(nq * len), 2);
          auto wide = test::random_vector(static_cast<size_t>(n_keys * stride), 3, 4.0f);
          std::vector<uint16_t> half(wide.size());
          for (size_t i = 0; i < wide.size(); ++i) {
            half[i] = dtype == DType::BF16 ? f32_to_bf16(wide[i]) : f32_to_f16(wide[i]);
            if (dtype != DType::F32) wide[i] = dtype == DType::BF16 ? bf16_to_f32(half[i]) : f16_to_f32(half[i]);
          }
          const void* keys = dtype == DType::F32 ? static_cast<const void*>(wide.data()) : half.data();
          std::vector<float> want(static_cast<size_t>(nq * n_keys)), got(want.size(), -7.0f);
          scaled_dots(q.data(), len, nq, wide.data(), stride, n_keys, len, 0.125f, want.data(), n_keys);
          scaled_dots(q.data(), len, nq, keys, dtype, stride, n_keys, len, 0.125f, got.data(), n_keys);
          for (size_t i = 0; i < want.size(); ++i)
            ASSERT_TRUE(same_bits(got[i], want[i]))
                << dtype_name(dtype) << " len " << len << " nq " << nq << " i " << i;
        }
  float out = 0;
  const int32_t ints[4] = {};
  EXPECT_THROW(scaled_dots(&out, 4, 1, ints, DType::I32, 4, 1, 4, 1.0f, &out, 1), Error);
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
