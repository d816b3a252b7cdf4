// KIVI quantization (core/kivi_quant): codes in range; reconstruction error within half a step (2-bit) and a
// quarter of the group's range (improved 1-bit); a group's min and max reconstructed exactly (2-bit); keys laid out
// per channel along tokens, values per token along channels; resident bytes per token (bits + 32 / group) / 16 of
// f16 plus the residual window; appending in pieces and truncating give the state of appending at once; logits from
// the codes equal the dot products with the reconstructed keys.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/kivi_quant.hpp"
#include "core/vec_math.hpp"
#include "test_util.hpp"

namespace kvret {
namespace {

struct Setting {
  int bits, group;
};
std::string setting_name(const ::testing::TestParamInfo<Setting>& i) {
  return "Bits" + std::to_string(i.param.bits) + "Group" + std::to_string(i.param.group);
}

/// n tokens of d channels: heavy-tailed, with a different offset and spread per channel (keys' outlier channels).
std::vector<float> rows(int64_t n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n) * d);
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      const float spread = 0.2f + static_cast<float>(i % 7);
      const float v = n01(rng);
      x[static_cast<size_t>(t * d + i)] =
          (static_cast<float>(i % 5) - 2.0f) + spread * v * (std::fabs(v) > 2.0f ? 3.0f : 1.0f);
    }
  return x;
}

KiviHead head_of(const std::vector<float>& k, const std::vector<float>& v, int d, const KiviParams& p) {
  KiviHead h(d, p);
  const auto n = static_cast<int64_t>(k.size()) / d;
  h.reserve(n);
  h.append(k.data(), v.data(), n);
  return h;
}

class Kivi : public ::testing::TestWithParam<Setting> {
 protected:
  KiviParams params(int residual = 64) const { return {GetParam().bits, GetParam().group, residual}; }
};

TEST_P(Kivi, CodesStayInRange) {
  const int bits = GetParam().bits, top = (1 << bits) - 1;
  const float lo = -1.5f, hi = 2.25f;
  int seen_top = 0, seen_zero = 0;
  for (int s = -200; s <= 200; ++s) {  // inside the group and far outside it
    const float x = lo + (hi - lo) * static_cast<float>(s) / 100.0f;
    const int c = kivi_code(x, lo, hi, bits);
    EXPECT_GE(c, 0) << x;
    EXPECT_LE(c, top) << x;
    seen_top += c == top;
    seen_zero += c == 0;
  }
  EXPECT_GT(seen_top, 0);
  EXPECT_GT(seen_zero, 0);
  EXPECT_EQ(kivi_code(NAN, lo, hi, bits), 0);
  EXPECT_EQ(kivi_code(1.0f, 1.0f, 1.0f, bits), 0);  // a constant group
}

// Every element of keys (per channel over a block of tokens) and values (per token over a group of channels) comes
// back within half a step (2-bit: (hi - lo) / 6) or a quarter of the range (1-bit); 2-bit gives min and max exactly.
TEST_P(Kivi, ReconstructionErrorIsBoundedAndTwoBitKeepsMinAndMax) {
  constexpr int d = 128;
  const KiviParams p = params(0);
  const int64_t n = 4 * p.group;
  const auto k = rows(n, d, 1), v = rows(n, d, 2);
  const KiviHead h = head_of(k, v, d, p);
  ASSERT_EQ(h.quantized(), n);
  std::vector<float> kr(static_cast<size_t>(n) * d), vr(static_cast<size_t>(n) * d);
  for (int64_t t = 0; t < n; ++t) h.reconstruct(t, kr.data() + t * d, vr.data() + t * d);
  const double bound = p.bits == 2 ? 1.0 / 6.0 : 1.0 / 4.0;
  int64_t exact_ends = 0;
  const auto check_group = [&](const std::vector<float>& x, const std::vector<float>& xr, int64_t first, int64_t stride,
                               const char* what) {
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < p.group; ++j) {
      const float r = kivi_round(x[static_cast<size_t>(first + j * stride)]);
      lo = std::min(lo, r);
      hi = std::max(hi, r);
    }
    for (int j = 0; j < p.group; ++j) {
      const auto at = static_cast<size_t>(first + j * stride);
      const float r = kivi_round(x[at]);
      EXPECT_LE(std::fabs(xr[at] - r), bound * (hi - lo) * (1.0 + 1e-5) + 1e-6) << what << " at " << at;
      if (p.bits == 2 && (r == lo || r == hi)) {
        EXPECT_EQ(xr[at], r) << what << " at " << at << ": the group's " << (r == lo ? "min" : "max");
        ++exact_ends;
      }
    }
  };
  for (int64_t b = 0; b < n / p.group; ++b)
    for (int i = 0; i < d; ++i) check_group(k, kr, b * p.group * d + i, d, "key");  // channel i over the block
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < d / p.group; ++j) check_group(v, vr, t * d + j * p.group, 1, "value");
  if (p.bits == 2) {
    EXPECT_GE(exact_ends, 2 * (n / p.group * d + n * (d / p.group)));
  }
}

// Keys: block b's codes are [channel][token]; each channel has its own (lo, hi). Values: token t's codes run along
// the channels; each channel group has its own (lo, hi).
TEST_P(Kivi, KeysArePackedPerChannelAndValuesPerToken) {
  constexpr int d = 64;
  const KiviParams p = params(0);
  const int top = (1 << p.bits) - 1;
  const int64_t n = 2 * p.group;
  std::vector<float> k(static_cast<size_t>(n) * d), v(static_cast<size_t>(n) * d);
  // every channel of every key block, and every channel group of every value, spans all codes 0..top
  const auto key_code = [&](int64_t t, int i) { return static_cast<int>((t * 3 + i) % (top + 1)); };
  const auto value_code = [&](int64_t t, int i) { return static_cast<int>((t + i * 5) % (top + 1)); };
  const auto key_lo = [](int i) { return 0.0f - 0.5f * static_cast<float>(i); };
  const auto key_step = [](int i) { return 0.25f * static_cast<float>(i + 1); };
  const auto value_lo = [](int64_t t) { return 0.125f * static_cast<float>(t); };
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      // 1-bit levels sit at a quarter and three quarters of [lo, hi]: put the values at lo and hi
      k[static_cast<size_t>(t * d + i)] =
          key_lo(i) + key_step(i) * static_cast<float>(key_code(t, i) * (p.bits == 2 ? 1 : 3));
      v[static_cast<size_t>(t * d + i)] = value_lo(t) + 0.5f * static_cast<float>(value_code(t, i));
    }
  const KiviHead h = head_of(k, v, d, p);
  ASSERT_EQ(h.quantized(), n);
  const size_t per_channel = static_cast<size_t>(p.group) * p.bits / 8;
  ASSERT_EQ(h.key_block_codes(), per_channel * d);
  for (int64_t b = 0; b < n / p.group; ++b) {
    const uint8_t* codes = h.key_codes(b);
    const uint16_t* params = h.key_params(b);
    for (int i = 0; i < d; ++i) {
      EXPECT_EQ(params[2 * i], f32_to_f16(key_lo(i))) << "block " << b << " channel " << i;
      EXPECT_EQ(params[2 * i + 1], f32_to_f16(key_lo(i) + key_step(i) * 3.0f));
      for (int t = 0; t < p.group; ++t)
        ASSERT_EQ(kivi_unpack(codes + per_channel * i, t, p.bits), key_code(b * p.group + t, i))
            << "block " << b << " channel " << i << " token " << t;
    }
  }
  ASSERT_EQ(h.value_row_codes(), static_cast<size_t>(d) * p.bits / 8);
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* params = h.value_params(t);
    for (int j = 0; j < d / p.group; ++j) {
      EXPECT_EQ(params[2 * j], f32_to_f16(value_lo(t)));
      EXPECT_EQ(params[2 * j + 1], f32_to_f16(value_lo(t) + 0.5f * static_cast<float>(top)));
    }
    for (int i = 0; i < d; ++i) ASSERT_EQ(kivi_unpack(h.value_codes(t), i, p.bits), value_code(t, i)) << t << " " << i;
  }
}

// The residual window: at least `residual` most recent tokens stay in f16 (plus those that do not fill a key group),
// and the resident bytes are (bits + 32 / group) / 16 of f16 per quantized token plus the residual in f16.
TEST_P(Kivi, ResidentBytesAreTheFormulaPlusTheResidualWindow) {
  constexpr int d = 128;
  const KiviParams p = params(64);
  const double ratio = (p.bits + 32.0 / p.group) / 16.0;
  const int64_t f16_token = 2 * 2 * d;  // keys and values
  for (const int64_t n : {int64_t{0}, int64_t{40}, int64_t{64}, int64_t{65}, int64_t{64} + p.group,
                          int64_t{64} + p.group + 7, int64_t{1000}, int64_t{20000}}) {
    const auto k = rows(n, d, 3), v = rows(n, d, 4);
    const KiviHead h = head_of(k, v, d, p);
    const int64_t q = n < 64 ? 0 : (n - 64) / p.group * p.group;
    EXPECT_EQ(h.quantized(), q) << n;
    EXPECT_EQ(h.size(), n);
    EXPECT_EQ(h.residual_tokens(), n - q);
    if (n >= 64) {
      EXPECT_GE(h.residual_tokens(), 64);
      EXPECT_LT(h.residual_tokens(), 64 + p.group);
    }
    EXPECT_EQ(static_cast<double>(h.quantized_token_bytes()), ratio * f16_token);
    EXPECT_EQ(static_cast<double>(h.bytes()),
              static_cast<double>(q) * ratio * f16_token + static_cast<double>(n - q) * f16_token)
        << n;
    if (n == 20000) {  // long contexts: the ratio approaches the formula (0.094 for 1-bit g64, 0.156 for 2-bit g64)
      EXPECT_NEAR(static_cast<double>(h.bytes()) / static_cast<double>(n * f16_token), ratio, 0.01);
    }
  }
}

// The state is a function of the tokens: appended one at a time, in uneven pieces, or truncated and appended
// again, it is what appending them at once gives.
TEST_P(Kivi, PiecesAndTruncationGiveTheSameState) {
  constexpr int d = 64;
  const KiviParams p = params(48);
  const int64_t n = 7 * p.group + 13;
  const auto k = rows(n, d, 5), v = rows(n, d, 6);
  const auto same = [&](const KiviHead& a, const KiviHead& b, const char* what) {
    EXPECT_EQ(a.size(), b.size()) << what;
    EXPECT_EQ(a.quantized(), b.quantized()) << what;
    EXPECT_EQ(a.key_code_array(), b.key_code_array()) << what;
    EXPECT_EQ(a.key_param_array(), b.key_param_array()) << what;
    EXPECT_EQ(a.value_code_array(), b.value_code_array()) << what;
    EXPECT_EQ(a.value_param_array(), b.value_param_array()) << what;
    EXPECT_EQ(a.residual_key_array(), b.residual_key_array()) << what;
    EXPECT_EQ(a.residual_value_array(), b.residual_value_array()) << what;
  };
  const KiviHead whole = head_of(k, v, d, p);
  KiviHead ones(d, p), pieces(d, p);
  for (int64_t t = 0; t < n; ++t) {
    ones.reserve(1);
    ones.append(k.data() + t * d, v.data() + t * d, 1);
  }
  same(whole, ones, "one token at a time");
  for (int64_t t = 0, step = 1; t < n; t += step, step = step * 3 % 97 + 1) {
    const int64_t m = std::min(step, n - t);
    pieces.reserve(m);
    pieces.append(k.data() + t * d, v.data() + t * d, m);
  }
  same(whole, pieces, "uneven pieces");
  const auto load = [&](int64_t t, float* kr, float* vr) {
    std::copy_n(k.data() + t * d, d, kr);
    std::copy_n(v.data() + t * d, d, vr);
  };
  for (const int64_t cut : {n - 1, n - p.group - 5, int64_t{100}, int64_t{47}, int64_t{0}}) {
    KiviHead copy(whole);
    copy.truncate(cut, load);
    const std::vector<float> kp(k.begin(), k.begin() + cut * d), vp(v.begin(), v.begin() + cut * d);
    same(head_of(kp, vp, d, p), copy, "truncated");
    copy.reserve(n - cut);  // and appended again
    copy.append(k.data() + cut * d, v.data() + cut * d, n - cut);
    same(whole, copy, "truncated and appended again");
  }
}

// Logits from the codes (no key reconstructed) are q . k_hat with k_hat the reconstructed key, for quantized and
// residual tokens.
TEST_P(Kivi, LogitsFromCodesAreDotsWithTheReconstructedKeys) {
  constexpr int d = 128, nq = 3;
  const KiviParams p = params(64);
  const int64_t n = 5 * p.group + 64 + 9;
  const auto k = rows(n, d, 7), v = rows(n, d, 8);
  const KiviHead h = head_of(k, v, d, p);
  ASSERT_GT(h.quantized(), 0);
  const auto q = test::random_vector(nq * d, 9);
  std::vector<float> out(static_cast<size_t>(nq) * (n + 3), NAN);
  h.logits(q.data(), nq, 0.25f, out.data(), n + 3);
  std::vector<float> kr(d), vr(d);
  for (int64_t t = 0; t < n; ++t) {
    h.reconstruct(t, kr.data(), vr.data());
    for (int g = 0; g < nq; ++g) {
      double ref = 0, mag = 0;
      for (int i = 0; i < d; ++i) {
        ref += static_cast<double>(q[static_cast<size_t>(g * d + i)]) * kr[static_cast<size_t>(i)];
        mag += std::fabs(static_cast<double>(q[static_cast<size_t>(g * d + i)]) * kr[static_cast<size_t>(i)]);
      }
      EXPECT_NEAR(out[static_cast<size_t>(g * (n + 3) + t)], 0.25 * ref, 1e-5 * mag + 1e-6) << t << " " << g;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Kivi, ::testing::Values(Setting{2, 32}, Setting{2, 64}, Setting{1, 32}, Setting{1, 64}),
                         setting_name);

// The residual's room grows with the tokens, up to residual + group - 1 rows: a large window costs nothing until
// it fills, and a copy or a truncation never needs more.
TEST(KiviHead, ResidualRoomFollowsTheTokens) {
  constexpr int d = 64;
  const KiviParams p{2, 32, 65536};
  const auto k = rows(100, d, 11), v = rows(100, d, 12);
  KiviHead h(d, p);
  for (int64_t t = 0; t < 100; t += 10) {
    h.reserve(10);
    h.append(k.data() + t * d, v.data() + t * d, 10);
    EXPECT_LE(h.residual_key_array().capacity(), static_cast<size_t>(2 * (t + 10) * d));
  }
  EXPECT_EQ(h.quantized(), 0);
  EXPECT_EQ(h.residual_tokens(), 100);
  const KiviHead copy(h);
  EXPECT_EQ(copy.residual_key_array().capacity(), static_cast<size_t>(100 * d));
  EXPECT_EQ(copy.residual_value_array(), h.residual_value_array());
}

TEST(KiviParams, BadParametersAreRefused) {
  EXPECT_THROW(KiviHead(128, KiviParams{3, 64, 64}), Error);
  EXPECT_THROW(KiviHead(128, KiviParams{2, 48, 64}), Error);
  EXPECT_THROW(KiviHead(128, KiviParams{2, 64, -1}), Error);
  EXPECT_THROW(KiviHead(32, KiviParams{2, 64, 64}), Error);
  EXPECT_NO_THROW(KiviHead(64, KiviParams{1, 32, 0}));
}

}  // namespace
}  // namespace kvret
