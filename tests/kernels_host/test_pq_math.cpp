// The PQ kernels' math (kernels/math/pq_math.h, pq_scores_layout.h) against the CPU core (core/vec_math.hpp).
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <vector>

#include "core/vec_math.hpp"
#include "math/pq_math.h"
#include "math/pq_scores_layout.h"
#include "special_floats.h"

namespace {

using namespace kvret::cuda::math;
using kvret_test::to_bits;

std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -2.0f, float hi = 2.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST(PqMath, LutEntryIsTheCpuTableBitForBit) {
  // sub-vector lengths of every head_dim / pq_m the kernels take, including tails that are not multiples of 8
  for (int sub : {1, 2, 3, 4, 8, 12, 16, 21, 32, 64, 128, 256}) {
    const auto q = random_floats(static_cast<size_t>(sub), 100 + static_cast<uint64_t>(sub));
    const auto c = random_floats(static_cast<size_t>(sub) * 64, 200 + static_cast<uint64_t>(sub));
    for (float scale : {1.0f, 0.0883883476f, 0.125f}) {
      for (int code = 0; code < 64; ++code) {
        const float* cv = c.data() + static_cast<size_t>(code) * static_cast<size_t>(sub);
        ASSERT_EQ(to_bits(pq_lut_entry(q.data(), cv, sub, scale)), to_bits(scale * kvret::dot(q.data(), cv, sub)))
            << "sub " << sub << " code " << code;
        // the CPU index's select builds its tables with scaled_dots (AVX2 where the CPU has it): the same bits
        float scaled = 0.0f;
        kvret::scaled_dots(q.data(), sub, 1, cv, sub, 1, sub, scale, &scaled, 1);
        ASSERT_EQ(to_bits(pq_lut_entry(q.data(), cv, sub, scale)), to_bits(scaled));
      }
    }
  }
}

TEST(PqMath, TokenLogitIsTheCpuCodeLookupBitForBit) {
  std::mt19937 rng(5);
  for (int m : {1, 2, 3, 4, 8, 16}) {
    for (int bits : {1, 4, 6, 8}) {
      const int k = 1 << bits;
      const int n = 257;
      auto lut = random_floats(static_cast<size_t>(m) * k, 300 + static_cast<uint64_t>(m * 10 + bits), -30.0f, 30.0f);
      lut[0] = -0.0f;  // a -0 entry: 0 + -0 is +0 in the CPU's sum
      std::vector<uint8_t> codes(static_cast<size_t>(n) * m);
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % static_cast<uint32_t>(k));
      for (int j = 0; j < m; ++j) codes[static_cast<size_t>(j)] = 0;
      std::vector<float> cpu(static_cast<size_t>(n));
      kvret::pq_token_logits(lut.data(), 1, m, k, codes.data(), n, cpu.data());
      for (int t = 0; t < n; ++t) {
        ASSERT_EQ(to_bits(pq_token_logit(lut.data(), codes.data() + static_cast<size_t>(t) * m, m, k)),
                  to_bits(cpu[static_cast<size_t>(t)]))
            << "m " << m << " bits " << bits << " token " << t;
      }
    }
  }
}

TEST(PqMath, EncoderDistanceIsTheCpuSquaredDistanceBitForBit) {
  for (int sub : {1, 5, 8, 16, 24, 32, 64, 128, 256}) {
    const auto x = random_floats(static_cast<size_t>(sub), 400 + static_cast<uint64_t>(sub));
    const auto c = random_floats(static_cast<size_t>(sub) * 32, 500 + static_cast<uint64_t>(sub));
    for (int code = 0; code < 32; ++code) {
      const float* cv = c.data() + static_cast<size_t>(code) * static_cast<size_t>(sub);
      ASSERT_EQ(to_bits(pq_squared_distance(x.data(), cv, sub)), to_bits(kvret::squared_distance(x.data(), cv, sub)));
    }
  }
}

TEST(PqMath, NearestCentroidRule) {
  EXPECT_TRUE(nearer_centroid(1.0f, 5, 2.0f, 0));
  EXPECT_FALSE(nearer_centroid(2.0f, 0, 1.0f, 5));
  EXPECT_TRUE(nearer_centroid(1.0f, 2, 1.0f, 3));  // exact tie: the lower code
  EXPECT_FALSE(nearer_centroid(1.0f, 3, 1.0f, 2));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(nearer_centroid(nan, 0, std::numeric_limits<float>::infinity(), 256));  // a NaN never wins
  // argmin over duplicated centroids picks the first copy, as the CPU's nearest does
  const std::vector<float> x = {0.5f, -1.0f, 2.0f, 0.25f};
  const std::vector<float> cents = {9, 9, 9, 9, 0.5f, -1, 2, 0.2f, 0.5f, -1, 2, 0.2f, 0, 0, 0, 0};
  float best = std::numeric_limits<float>::infinity();
  int best_code = 4;
  for (int c = 0; c < 4; ++c) {
    const float d = pq_squared_distance(x.data(), cents.data() + 4 * c, 4);
    if (nearer_centroid(d, c, best, best_code)) {
      best = d;
      best_code = c;
    }
  }
  EXPECT_EQ(best_code, 1);
}

TEST(PqMath, KmeansDistanceIsNotContracted) {
  const auto v = random_floats(3000, 600, -100.0f, 100.0f);
  for (size_t i = 0; i + 2 < v.size(); i += 3) {
    const float x_norm = v[i] * v[i], cross = v[i + 1], c_norm = v[i + 2] * v[i + 2];
    volatile float twice = 2.0f * cross;  // a separately rounded product
    volatile float diff = x_norm - twice;
    EXPECT_EQ(to_bits(kmeans_distance(x_norm, cross, c_norm)), to_bits(diff + c_norm));
  }
}

TEST(PqMath, ClampTokensToTheLaunchBound) {
  EXPECT_EQ(pq_scores_clamp_tokens(100, 4096), 100);
  EXPECT_EQ(pq_scores_clamp_tokens(5000, 4096), 4096);  // past max_tokens: no chunk or score beyond the bound
  EXPECT_EQ(pq_scores_clamp_tokens(-1, 4096), 0);
  EXPECT_EQ(pq_scores_clamp_tokens(3, 0), 0);
}

TEST(PqScoresLayout, TablesOncePerHeadThenPartials) {
  // 2 sequences, 32 query heads, m = 2, 6 bits, 5000 tokens: ceil(5000 / kPqChunkTokens) chunks
  const PqScoresLayout sum = pq_scores_layout(2, 32, 2, 6, 5000, true);
  const int32_t chunks = (5000 + kPqChunkTokens - 1) / kPqChunkTokens;
  EXPECT_EQ(sum.n_chunks, chunks);
  EXPECT_EQ(sum.lut_offset, 0u);
  EXPECT_EQ(sum.lut_bytes, size_t{2} * 32 * 2 * 64 * sizeof(float));
  EXPECT_EQ(sum.partials_offset % kPqWorkspaceAlign, 0u);
  EXPECT_GE(sum.partials_offset, sum.lut_offset + sum.lut_bytes);
  EXPECT_EQ(sum.partials_bytes, size_t{2} * 32 * static_cast<size_t>(chunks) * sizeof(SoftmaxPartial));
  EXPECT_GE(sum.total, sum.partials_offset + sum.partials_bytes);
  EXPECT_EQ(sum.total % kPqWorkspaceAlign, 0u);
  // the max-logit fold needs the tables too, but no partials
  const PqScoresLayout max = pq_scores_layout(2, 32, 2, 6, 5000, false);
  EXPECT_EQ(max.lut_bytes, sum.lut_bytes);
  EXPECT_EQ(max.partials_bytes, 0u);
  EXPECT_GT(max.total, 0u);
  EXPECT_LT(max.total, sum.total);
  // the tables do not grow with the sequence length; only the partials do
  const PqScoresLayout longer = pq_scores_layout(2, 32, 2, 6, 128 * 1024, true);
  EXPECT_EQ(longer.lut_bytes, sum.lut_bytes);
  EXPECT_EQ(longer.partials_bytes,
            size_t{2} * 32 * static_cast<size_t>(128 * 1024 / kPqChunkTokens) * sizeof(SoftmaxPartial));
  // nothing to score: no workspace
  EXPECT_EQ(pq_scores_layout(0, 32, 2, 6, 5000, true).total, 0u);
  EXPECT_EQ(pq_scores_layout(2, 32, 2, 6, 0, true).total, 0u);
}

TEST(PqScoresLayout, SharedMemoryOfTheKernels) {
  // scoring: the group's tables and two floats per head; the queries are no longer staged
  EXPECT_EQ(pq_score_smem_floats(4, 2, 6), size_t{4} * 2 * 64 + 8);
  EXPECT_EQ(pq_score_smem_floats(4, 4, 6) * sizeof(float), size_t{4128});
  // the table kernel: the group's sub-vectors and a tile of padded centroid rows within kPqLutTileFloats
  for (int sub : {1, 16, 32, 64, 128, 256}) {
    for (int bits : {1, 6, 8}) {
      const int tile = pq_lut_tile_centroids(sub, 1 << bits);
      EXPECT_GE(tile, 1);
      EXPECT_LE(tile, 1 << bits);
      EXPECT_LE(static_cast<int64_t>(tile) * (sub + 1), kPqLutTileFloats);
      EXPECT_EQ(pq_lut_smem_floats(4, sub, 1 << bits),
                size_t{4} * static_cast<size_t>(sub) + static_cast<size_t>(tile) * (static_cast<size_t>(sub) + 1));
    }
  }
}

}  // namespace
