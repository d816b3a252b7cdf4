// kernels/math/quant_math.h, the QUANT index's single-source math (the CPU core calls it; the CUDA backend compiles
// it for the device), against the CPU's own computations, bit for bit: the levels, codes and affine form against
// the rule's plain float expressions over random and awkward groups (a constant group, signed zeros, f16
// subnormals, f16's largest values, NaN and infinite inputs); the low-bit logit of one token from the packed codes
// against KiviHead::logits (the blocked scaled_dots path of the CPU's instruction set) over random heads with a
// constant channel and extreme values; the dequantized elements against KiviHead::reconstruct; the double-precision
// pieces of quantized attention's output rule against the plain double expressions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.hpp"
#include "core/kivi_quant.hpp"
#include "math/quant_math.h"

namespace kvret {
namespace {

namespace qm = cuda::math;

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
uint64_t bits_of(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// The rule as plain float expressions (the library is built without FMA contraction).
void ref_affine(float lo, float hi, int bits, float* zero, float* step) {
  if (bits == 2) {
    *zero = lo;
    *step = (hi - lo) / 3.0f;
  } else {
    *zero = (3.0f * lo + hi) / 4.0f;
    *step = (hi - lo) / 2.0f;
  }
}
int ref_code(float x, float lo, float hi, int bits) {
  if (!(hi > lo)) return 0;
  if (bits == 2) {
    const float t = (x - lo) / (hi - lo) * 3.0f;
    return (t >= 0.5f) + (t >= 1.5f) + (t >= 2.5f);
  }
  float zero, step;
  ref_affine(lo, hi, 1, &zero, &step);
  return (x - zero) / step >= 0.5f ? 1 : 0;
}
float ref_value(int c, float lo, float hi, int bits) {
  if (bits == 2) return (static_cast<float>(3 - c) * lo + static_cast<float>(c) * hi) / 3.0f;
  return (static_cast<float>(3 - 2 * c) * lo + static_cast<float>(1 + 2 * c) * hi) / 4.0f;
}

/// f16 values as f32: random ones over many magnitudes, and the awkward ones.
std::vector<float> f16_values(std::mt19937_64& rng, int n) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          f16_to_f32(0x0001),  // smallest subnormal
                          -f16_to_f32(0x0001),
                          f16_to_f32(0x03ff),  // largest subnormal
                          f16_to_f32(0x0400),  // smallest normal
                          65504.0f,
                          -65504.0f,
                          65472.0f,
                          1.0f,
                          -1.0f,
                          0.333251953125f};
  std::uniform_int_distribution<int> exponent(-24, 15);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  while (static_cast<int>(v.size()) < n) v.push_back(kivi_round(std::ldexp(mantissa(rng), exponent(rng))));
  return v;
}

TEST(QuantMath, LevelsCodesAndAffineFormAreTheRulesFloatBits) {
  std::mt19937_64 rng(7);
  const std::vector<float> vals = f16_values(rng, 120);
  const std::vector<float> extra = {NAN, INFINITY, -INFINITY, 1e30f, -1e30f, 1e-30f};
  int64_t checked = 0;
  for (const int bits : {1, 2})
    for (const float a : vals)
      for (const float b : vals) {
        const float lo = std::min(a, b), hi = std::max(a, b);
        float z0, s0, z1, s1;
        ref_affine(lo, hi, bits, &z0, &s0);
        qm::kivi_affine(lo, hi, bits, &z1, &s1);
        ASSERT_EQ(bits_of(z0), bits_of(z1)) << lo << " " << hi << " bits " << bits;
        ASSERT_EQ(bits_of(s0), bits_of(s1)) << lo << " " << hi << " bits " << bits;
        for (int c = 0; c < (1 << bits); ++c) {
          const float want = ref_value(c, lo, hi, bits);
          ASSERT_EQ(bits_of(want), bits_of(qm::kivi_value(c, lo, hi, bits))) << lo << " " << hi << " code " << c;
          ASSERT_EQ(bits_of(want), bits_of(kivi_value(c, lo, hi, bits)));
        }
        // inputs: the group's ends, its levels, the values, and the non-finite and far-away ones
        std::vector<float> xs = {lo, hi, z1, z1 + s1, z1 + 0.5f * s1, z1 + 1.5f * s1};
        xs.push_back(vals[static_cast<size_t>(checked % static_cast<int64_t>(vals.size()))]);
        xs.insert(xs.end(), extra.begin(), extra.end());
        for (const float x : xs) {
          const int want = ref_code(x, lo, hi, bits);
          ASSERT_EQ(want, qm::kivi_code(x, lo, hi, bits)) << x << " in [" << lo << ", " << hi << "] bits " << bits;
          ASSERT_EQ(want, kivi_code(x, lo, hi, bits));
          ++checked;
        }
      }
  EXPECT_GT(checked, 2 * 120 * 120 * 10);
}

/// n tokens of d channels: normal values, channel 3 constant, a few at f16's extremes.
std::vector<float> awkward_rows(int64_t n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n) * d);
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      float v = (static_cast<float>(i % 5) - 2.0f) + (0.2f + static_cast<float>(i % 7)) * n01(rng);
      if (i == 3) v = 0.75f;
      if ((t * d + i) % 997 == 0) v = (t % 2 == 0 ? 1.0f : -1.0f) * 7e4f;  // clamped to +-65504
      if ((t * d + i) % 1009 == 0) v = 3e-7f;                              // an f16 subnormal
      x[static_cast<size_t>(t * d + i)] = v;
    }
  return x;
}

struct Setting {
  int bits, group, d;
};

class QuantMathHead : public ::testing::TestWithParam<Setting> {};

// The device scores a token with kivi_low_bit_logit; the CPU scores a block with kivi_key_block_logits (scaled_dots
// on the instruction set it dispatches to). The same bits, and the dequantized elements are reconstruct's.
TEST_P(QuantMathHead, LowBitLogitAndElementsAreTheHeadsBits) {
  const auto [bits, group, d] = GetParam();
  const KiviParams p{bits, group, 8};
  const int64_t n = 3 * group + p.residual + 5;  // three quantized blocks, a residual
  const auto k = awkward_rows(n, d, 11), v = awkward_rows(n, d, 12);
  KiviHead head(d, p);
  head.reserve(n);
  head.append(k.data(), v.data(), n);
  ASSERT_EQ(head.quantized(), 3 * group);
  for (const int nq : {1, 3, 5}) {
    std::mt19937_64 rng(static_cast<uint64_t>(nq * 100 + d));
    std::normal_distribution<float> n01(0.0f, 2.0f);
    std::vector<float> q(static_cast<size_t>(nq) * d);
    for (auto& x : q) x = n01(rng);
    q[0] = 1e-40f;  // a subnormal query element
    for (const float scale : {1.0f / std::sqrt(static_cast<float>(d)), 0.37f}) {
      std::vector<float> got(static_cast<size_t>(nq) * n);
      head.logits(q.data(), nq, scale, got.data(), n);
      std::vector<float> zero(static_cast<size_t>(d)), step(static_cast<size_t>(d)), w(static_cast<size_t>(d));
      for (int64_t b = 0; b < head.quantized() / group; ++b) {
        const uint16_t* kp = head.key_params(b);
        for (int i = 0; i < d; ++i)
          qm::kivi_affine(f16_to_f32(kp[2 * i]), f16_to_f32(kp[2 * i + 1]), bits, &zero[static_cast<size_t>(i)],
                          &step[static_cast<size_t>(i)]);
        for (int g = 0; g < nq; ++g) {
          const float* qg = q.data() + static_cast<size_t>(g) * d;
          for (int i = 0; i < d; ++i) w[static_cast<size_t>(i)] = qm::mul_rn(qg[i], step[static_cast<size_t>(i)]);
          const float base = qm::kivi_logit_base(scale, qg, zero.data(), d);
          for (int t = 0; t < group; ++t) {
            const float want = got[static_cast<size_t>(g * n + b * group + t)];
            const float mine = qm::kivi_low_bit_logit(scale, w.data(), base, head.key_codes(b), group, bits, t, d);
            ASSERT_EQ(bits_of(want), bits_of(mine)) << "block " << b << " token " << t << " head " << g;
          }
        }
      }
    }
  }
  std::vector<float> key(static_cast<size_t>(d)), value(static_cast<size_t>(d));
  for (int64_t t = 0; t < head.quantized(); ++t) {
    head.reconstruct(t, key.data(), value.data());
    const int64_t b = t / group;
    const uint16_t* kp = head.key_params(b);
    const uint16_t* vp = head.value_params(t);
    for (int i = 0; i < d; ++i) {
      const float ke = qm::kivi_key_element(head.key_codes(b), group, bits, i, static_cast<int>(t % group),
                                            f16_to_f32(kp[2 * i]), f16_to_f32(kp[2 * i + 1]));
      const int j = i / group;
      const float ve =
          qm::kivi_value_element(head.value_codes(t), bits, i, f16_to_f32(vp[2 * j]), f16_to_f32(vp[2 * j + 1]));
      ASSERT_EQ(bits_of(key[static_cast<size_t>(i)]), bits_of(ke)) << t << " " << i;
      ASSERT_EQ(bits_of(value[static_cast<size_t>(i)]), bits_of(ve)) << t << " " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, QuantMathHead,
                         ::testing::Values(Setting{2, 32, 64}, Setting{2, 64, 128}, Setting{1, 32, 96},
                                           Setting{1, 64, 64}, Setting{2, 32, 256}),
                         [](const ::testing::TestParamInfo<Setting>& i) {
                           return "Bits" + std::to_string(i.param.bits) + "Group" + std::to_string(i.param.group) +
                                  "Dim" + std::to_string(i.param.d);
                         });

// The output rule's double-precision pieces are the plain double expressions, in channel order.
TEST(QuantMath, OutputRulePiecesAreThePlainDoubleExpressions) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-140, 40);
  for (const int d : {1, 7, 64, 256}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> q(static_cast<size_t>(d)), k(static_cast<size_t>(d));
      for (int i = 0; i < d; ++i) {
        q[static_cast<size_t>(i)] = std::ldexp(n01(rng), trial % 5 == 0 ? exponent(rng) : 0);
        k[static_cast<size_t>(i)] = std::ldexp(n01(rng), trial % 7 == 0 ? exponent(rng) : 0);
      }
      const float scale = 1.0f / std::sqrt(static_cast<float>(d)) * (1.0f + 0.01f * static_cast<float>(trial));
      double s = 0;
      for (int i = 0; i < d; ++i) s += static_cast<double>(q[static_cast<size_t>(i)]) * k[static_cast<size_t>(i)];
      ASSERT_EQ(bits_of(s * scale), bits_of(qm::quant_exact_logit(q.data(), k.data(), d, scale))) << d << " " << trial;
      const float select_scale = 1.0f / std::sqrt(static_cast<float>(d));
      const double rescale = static_cast<double>(scale) / select_scale;
      ASSERT_EQ(bits_of(rescale), bits_of(qm::quant_rescale(scale, select_scale)));
      const float low = q[0];
      ASSERT_EQ(bits_of(rescale * low), bits_of(qm::quant_low_logit(rescale, low)));
      const double l = s * scale, m = l + std::fabs(static_cast<double>(k[0]));
      const double w = std::exp(l - m);
      ASSERT_EQ(bits_of(w), bits_of(qm::quant_weight(l, m)));
      const double acc = static_cast<double>(n01(rng)) * 3.0;
      ASSERT_EQ(bits_of(acc + w * k[1 % d]), bits_of(qm::quant_accumulate(acc, w, k[1 % d])));
      const double z = 1.0 + w;
      ASSERT_EQ(bits_of(static_cast<float>(acc / z)), bits_of(qm::quant_output(acc, z)));
    }
  }
}

}  // namespace
}  // namespace kvret
