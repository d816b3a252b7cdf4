// The vectorized kernels behind select give the bits of the scalar code they replace, whichever path the CPU
// takes: fold_weighted_logits against a scalar fold written here on exp_nonpositive (the function the library
// shares), and scaled_dots against scale * dot, over awkward sizes and special values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/vec_math.hpp"
#include "select/gqa_fold.hpp"
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
      for (int64_t u = 0; u < n; ++u) z += e[static_cast<size_t>(u)];
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
  for (const int64_t n : {1, 7, 8, 13, 64, 1000, 4123}) {
    const int group = 4;
    std::vector<float> logits = test::random_vector(static_cast<size_t>(group * n), static_cast<uint64_t>(n));
    for (size_t i = 0; i < logits.size(); ++i) {
      logits[i] *= 40.0f;  // spans e^-87 (clamped to 0) and beyond
      if (i % 97 == 3) logits[i] = std::nanf("");
      if (i % 89 == 5) logits[i] = -std::numeric_limits<float>::infinity();
      if (i % 83 == 7) logits[i] = -200.0f;
    }
    std::vector<int32_t> weight(static_cast<size_t>(n));
    for (int64_t u = 0; u < n; ++u) weight[static_cast<size_t>(u)] = static_cast<int32_t>((u * 7919) % 5);
    for (const bool weighted : {false, true}) {
      const int32_t* w = weighted ? weight.data() : nullptr;
      const auto want = scalar_fold(logits, w, group, n);
      std::vector<float> got(static_cast<size_t>(n));
      fold_weighted_logits(logits.data(), w, group, n, KVRET_FOLD_SUM_PROB, got.data());
      for (int64_t u = 0; u < n; ++u)
        ASSERT_TRUE(same_bits(got[static_cast<size_t>(u)], want[static_cast<size_t>(u)]))
            << "n " << n << " weighted " << weighted << " u " << u << ": " << got[static_cast<size_t>(u)] << " vs "
            << want[static_cast<size_t>(u)];
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
