// The kernels' softmax math (kernels/math/softmax_math.h) against the CPU core: exp_nonpositive (core/vec_math.hpp)
// and the CPU attention (core/attention.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/attention.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "math/pq_math.h"
#include "math/softmax_math.h"
#include "special_floats.h"

namespace {

namespace km = kvret::cuda::math;
using kvret_test::to_bits;

TEST(SoftmaxMath, ExpIsTheCpuExpBitForBit) {
  for (float x : kvret_test::special_floats()) {
    const float a = km::exp_nonpositive(x), b = kvret::exp_nonpositive(x);
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(a)) << x;
    } else {
      ASSERT_EQ(to_bits(a), to_bits(b)) << x;
    }
  }
  for (float x = -90.0f; x <= 1.0f; x += 0.000731f)
    ASSERT_EQ(to_bits(km::exp_nonpositive(x)), to_bits(kvret::exp_nonpositive(x))) << x;
}

TEST(SoftmaxMath, CombineIsNeutralOnEmptyAndMatchesOnePass) {
  const km::SoftmaxPartial empty{km::neg_inf(), 0.0f};
  const km::SoftmaxPartial a{2.0f, 3.5f};
  EXPECT_EQ(km::softmax_combine(empty, a).max, 2.0f);
  EXPECT_EQ(km::softmax_combine(a, empty).sum, 3.5f);
  // statistics of two halves combined == statistics of the whole, to rounding
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-20.0f, 20.0f);
  std::vector<float> l(1000);
  for (float& x : l) x = u(rng);
  auto stats = [&](size_t b, size_t e) {
    float m = km::neg_inf();
    for (size_t i = b; i < e; ++i) m = std::max(m, l[i]);
    double s = 0;
    for (size_t i = b; i < e; ++i) s += kvret::exp_nonpositive(l[i] - m);
    return km::SoftmaxPartial{m, static_cast<float>(s)};
  };
  const km::SoftmaxPartial whole = stats(0, l.size());
  const km::SoftmaxPartial merged = km::softmax_combine(stats(0, 377), stats(377, l.size()));
  EXPECT_EQ(merged.max, whole.max);
  EXPECT_NEAR(merged.sum, whole.sum, 1e-5 * whole.sum);
}

TEST(SoftmaxMath, MergeWeightOfAnEmptyChunkIsZero) {
  EXPECT_EQ(km::merge_weight(km::neg_inf(), km::neg_inf()), 0.0f);  // not NaN: an all -inf sequence gives zeros
  EXPECT_EQ(km::merge_weight(km::neg_inf(), 3.0f), 0.0f);
  EXPECT_EQ(km::merge_weight(3.0f, 3.0f), 1.0f);
  EXPECT_EQ(to_bits(km::merge_weight(1.0f, 3.0f)), to_bits(kvret::exp_nonpositive(-2.0f)));
}

/// Decode attention of one query head on the host with the kernel's math: scores per 32-row tile, the online
/// softmax step per tile, the value rows accumulated with the tile's weights, chunks of rows_per_split rows merged
/// with merge_weight. The products and sums of dots and values run in plain float (the kernel's differ in order).
std::vector<float> emulate_attention(const std::vector<float>& q, const std::vector<float>& k,
                                     const std::vector<float>& v, int rows, int d, float scale, int rows_per_split) {
  struct Chunk {
    float max, sum;
    std::vector<float> out;
  };
  std::vector<Chunk> chunks;
  for (int begin = 0; begin < rows; begin += rows_per_split) {
    const int end = std::min(rows, begin + rows_per_split);
    Chunk c{km::neg_inf(), 0.0f, std::vector<float>(static_cast<size_t>(d), 0.0f)};
    for (int tile = begin; tile < end; tile += 32) {
      const int tile_end = std::min(end, tile + 32);
      std::vector<float> s(static_cast<size_t>(tile_end - tile));
      kvret::scaled_dots(q.data(), d, 1, k.data() + static_cast<size_t>(tile) * static_cast<size_t>(d), d,
                         tile_end - tile, d, scale, s.data(), tile_end - tile);  // scale * dot() per row
      float tile_max = km::neg_inf();
      for (float x : s) tile_max = km::max_f(tile_max, x);
      const km::OnlineSoftmaxStep step = km::online_softmax_step(c.max, tile_max);
      float tile_sum = 0.0f;
      for (float& x : s) tile_sum += (x = km::softmax_weight(x, step.new_max));
      c.max = step.new_max;
      c.sum = km::online_softmax_sum(c.sum, step.rescale, tile_sum);
      for (int e = 0; e < d; ++e) {
        float acc = c.out[static_cast<size_t>(e)] * step.rescale;
        for (int r = tile; r < tile_end; ++r)
          acc += s[static_cast<size_t>(r - tile)] * v[static_cast<size_t>(r) * d + e];
        c.out[static_cast<size_t>(e)] = acc;
      }
    }
    chunks.push_back(c);
  }
  float global = km::neg_inf();
  for (const Chunk& c : chunks) global = km::max_f(global, c.max);
  float total = 0.0f;
  for (const Chunk& c : chunks) total += c.sum * km::merge_weight(c.max, global);
  std::vector<float> out(static_cast<size_t>(d), 0.0f);
  for (int e = 0; e < d; ++e) {
    float x = 0.0f;
    for (const Chunk& c : chunks) x += c.out[static_cast<size_t>(e)] * km::merge_weight(c.max, global);
    out[static_cast<size_t>(e)] = total > 0.0f ? x * (1.0f / total) : 0.0f;
  }
  return out;
}

TEST(SoftmaxMath, OnlineSoftmaxAndMergeMatchTheCpuAttention) {
  const int d = 64;
  for (int rows : {1, 31, 33, 200, 1000}) {
    std::mt19937 rng(static_cast<uint32_t>(rows));
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> q(d), k(static_cast<size_t>(rows) * d), v(static_cast<size_t>(rows) * d);
    for (float& x : q) x = 3.0f * g(rng);  // peaked: weights far below the max
    for (float& x : k) x = g(rng);
    for (float& x : v) x = g(rng);
    kvret_config config{};  // attend reads only the head counts and head_dim
    config.n_q_heads = 1;
    config.n_kv_heads = 1;
    config.head_dim = d;
    const kvret_dtype f32{KVRET_DTYPE_FLOAT, 32, 1};
    const int64_t q_shape[] = {1, d}, kv_shape[] = {1, rows, d}, out_shape[] = {1, d};
    std::vector<float> out(d);
    kvret_tensor tq{q.data(), {KVRET_DEVICE_CPU, 0}, 2, f32, q_shape, nullptr, 0};
    kvret_tensor tk{k.data(), {KVRET_DEVICE_CPU, 0}, 3, f32, kv_shape, nullptr, 0};
    kvret_tensor tv{v.data(), {KVRET_DEVICE_CPU, 0}, 3, f32, kv_shape, nullptr, 0};
    kvret_tensor to{out.data(), {KVRET_DEVICE_CPU, 0}, 2, f32, out_shape, nullptr, 0};
    const kvret::DTypeSet types = kvret::kFloatTypes;
    kvret::attend(config, kvret::TensorView::from(&tq, "q", types, {2}), kvret::TensorView::from(&tk, "k", types, {3}),
                  kvret::TensorView::from(&tv, "v", types, {3}), rows, 0.0f,
                  kvret::TensorView::from(&to, "out", types, {2}), 1);
    for (int split : {32, 64, 96}) {
      const auto mine = emulate_attention(q, k, v, rows, d, 1.0f / std::sqrt(static_cast<float>(d)), split);
      for (int e = 0; e < d; ++e) {
        ASSERT_NEAR(mine[static_cast<size_t>(e)], out[static_cast<size_t>(e)],
                    2e-5f + 2e-5f * std::fabs(out[static_cast<size_t>(e)]))
            << "rows " << rows << " split " << split << " e " << e;
      }
    }
  }
}

TEST(SoftmaxMath, SingleTileWeightsAreTheCpuAttentionTerms) {
  // With the whole set in one tile, the running max is the final max and the kernel's weights are the CPU
  // attention's exp terms bit for bit (the CPU computes p = exp_nonpositive(s - max)).
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-40.0f, 40.0f);
  std::vector<float> s(32);
  for (float& x : s) x = u(rng);
  float m = km::neg_inf();
  for (float x : s) m = std::max(m, x);
  const km::OnlineSoftmaxStep step = km::online_softmax_step(km::neg_inf(), m);
  EXPECT_EQ(step.new_max, m);
  EXPECT_EQ(step.rescale, 0.0f);
  for (float x : s) EXPECT_EQ(to_bits(km::softmax_weight(x, step.new_max)), to_bits(kvret::exp_nonpositive(x - m)));
  // a later tile that does not raise the max leaves the state as is: rescale exactly 1
  EXPECT_EQ(km::online_softmax_step(m, m - 1.0f).rescale, 1.0f);
}

}  // namespace
