// Keys stored before RoPE (config.rope_keys = 1, docs/rope.md): the rotation against a long-double reference and
// known values (identity at position 0, norms, the relative-position property, the layouts' pairs, Llama 3's scaled
// frequencies), and a sequence given pre-RoPE keys against one given the same keys rotated by the test: the same
// keys read back, selections, scores, working sets, attention and retained sets, for every index kind.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "core/rope.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

/// A straightforward reference: every step in long double, the pairs by their definition.
std::vector<long double> reference_rotation(const std::vector<float>& x, int64_t pos, int dims, bool gptj,
                                            long double theta, const std::vector<long double>* inv = nullptr) {
  std::vector<long double> out(x.begin(), x.end());
  for (int i = 0; i < dims / 2; ++i) {
    const long double f = inv ? (*inv)[static_cast<size_t>(i)] : powl(theta, -2.0L * i / dims);
    const long double angle = static_cast<long double>(pos) * f;
    const int a = gptj ? 2 * i : i, b = gptj ? 2 * i + 1 : i + dims / 2;
    out[static_cast<size_t>(a)] = x[static_cast<size_t>(a)] * cosl(angle) - x[static_cast<size_t>(b)] * sinl(angle);
    out[static_cast<size_t>(b)] = x[static_cast<size_t>(a)] * sinl(angle) + x[static_cast<size_t>(b)] * cosl(angle);
  }
  return out;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

TEST(RopeMath, MatchesALongDoubleReferenceUpToLargePositions) {
  for (const bool gptj : {false, true})
    for (const int dims : {64, 32, 128})
      for (const double theta : {10000.0, 500000.0}) {
        const int d = 128;
        const rope::Rope r(dims, gptj ? rope::kGptj : rope::kNeox, theta);
        const std::vector<float> x = random_vector(d, static_cast<uint64_t>(dims));
        for (const int64_t pos :
             {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{4095}, int64_t{100000}, int64_t{131071}, int64_t{1} << 20}) {
          std::vector<float> got = x;
          r.rotate_at(got.data(), pos);
          const std::vector<long double> want = reference_rotation(x, pos, dims, gptj, theta);
          for (int i = 0; i < d; ++i) {
            // one float rounding of the exact rotation (half an ulp: 2^-24 relative), and a little for the angle
            const auto w = static_cast<double>(want[static_cast<size_t>(i)]);
            EXPECT_NEAR(got[static_cast<size_t>(i)], w, std::ldexp(std::fabs(w), -24) + 1e-9)
                << "dims " << dims << " theta " << theta << " pos " << pos << " dim " << i << (gptj ? " gptj" : "");
            if (i >= dims) {
              EXPECT_EQ(got[static_cast<size_t>(i)], x[static_cast<size_t>(i)]) << "unrotated dim " << i;
            }
          }
        }
      }
}

TEST(RopeMath, KnownValues) {
  const int d = 64;
  const std::vector<float> x = random_vector(d, 5);
  for (const int32_t layout : {rope::kNeox, rope::kGptj}) {
    const rope::Rope r(d, layout, 10000.0);
    // position 0 is the identity, bit for bit
    std::vector<float> y = x;
    r.rotate_at(y.data(), 0);
    EXPECT_EQ(y, x);
    // a rotation keeps the norm
    for (const int64_t pos : {int64_t{3}, int64_t{99999}}) {
      std::vector<float> z(x.begin(), x.end());
      r.rotate_at(z.data(), pos);
      EXPECT_NEAR(dot(z, z), dot(x, x), 1e-5 * dot(x, x));
    }
    // the pairs: a unit vector along dimension 0 turns towards dimension d/2 (NeoX) or 1 (GPT-J) by pos radians
    std::vector<float> e(d, 0.0f);
    e[0] = 1.0f;
    r.rotate_at(e.data(), 2);
    const size_t partner = layout == rope::kNeox ? d / 2 : 1;
    EXPECT_FLOAT_EQ(e[0], static_cast<float>(std::cos(2.0)));
    EXPECT_FLOAT_EQ(e[partner], static_cast<float>(std::sin(2.0)));
    for (size_t i = 1; i < e.size(); ++i) {
      if (i != partner) {
        EXPECT_EQ(e[i], 0.0f) << i;
      }
    }
    // the last pair of a theta of 10000 at 64 dimensions turns by pos * 10000^(-62/64)
    std::fill(e.begin(), e.end(), 0.0f);
    const size_t last = layout == rope::kNeox ? d / 2 - 1 : d - 2;
    e[last] = 1.0f;
    r.rotate_at(e.data(), 1000);
    EXPECT_FLOAT_EQ(e[last], static_cast<float>(std::cos(1000.0 * std::pow(10000.0, -62.0 / 64.0))));
  }
}

// q rotated at m and k at n: their dot product depends on m - n only, also 100000 positions on.
TEST(RopeMath, DotProductsDependOnRelativePositionOnly) {
  const int d = 128;
  for (const int32_t layout : {rope::kNeox, rope::kGptj}) {
    const rope::Rope r(d, layout, 500000.0);
    const std::vector<float> q = random_vector(d, 1), k = random_vector(d, 2);
    for (const int64_t gap : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
      double first = 0;
      for (const int64_t n : {int64_t{0}, int64_t{5}, int64_t{4096}, int64_t{100000}}) {
        std::vector<float> qm = q, kn = k;
        r.rotate_at(qm.data(), n + gap);
        r.rotate_at(kn.data(), n);
        const double s = dot(qm, kn);
        if (n == 0) first = s;
        EXPECT_NEAR(s, first, 1e-4) << "gap " << gap << " n " << n;
      }
    }
  }
}

// Llama 3's scaled frequencies (Hugging Face's _compute_llama3_parameters; Llama 3.1's parameters: theta 500000,
// factor 8, low 1, high 4, 8192 original positions, 128 dimensions): the values of that formula, in double.
TEST(RopeMath, Llama3ScaledFrequencies) {
  rope::Llama3Scaling s;
  s.factor = 8.0;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_positions = 8192.0;
  const rope::Rope r(128, rope::kNeox, 500000.0, s);
  EXPECT_DOUBLE_EQ(r.inv_freq()[0], 1.0);                     // high frequency: kept
  EXPECT_DOUBLE_EQ(r.inv_freq()[20], 0.016560440080994446);   // kept
  EXPECT_DOUBLE_EQ(r.inv_freq()[31], 0.0008567514129196324);  // medium: blended
  EXPECT_DOUBLE_EQ(r.inv_freq()[34], 0.00017850781276799638);
  EXPECT_DOUBLE_EQ(r.inv_freq()[40], 3.428102195952591e-05);  // low frequency: divided by 8
  EXPECT_DOUBLE_EQ(r.inv_freq()[63], 3.068925988914511e-07);
  // and the rotation uses them
  const std::vector<float> x = random_vector(128, 9);
  std::vector<long double> inv(64);
  for (int i = 0; i < 64; ++i) inv[static_cast<size_t>(i)] = r.inv_freq()[i];
  std::vector<float> y = x;
  r.rotate_at(y.data(), 70000);
  const std::vector<long double> want = reference_rotation(x, 70000, 128, false, 0, &inv);
  for (int i = 0; i < 128; ++i)
    EXPECT_NEAR(y[static_cast<size_t>(i)], static_cast<double>(want[static_cast<size_t>(i)]), 3e-6);
  // factor 0: no scaling
  const rope::Rope plain(128, rope::kNeox, 500000.0);
  EXPECT_DOUBLE_EQ(plain.inv_freq()[63], 1.0 / std::pow(500000.0, 126.0 / 128.0));
}

// ---- sequences ----

constexpr int64_t kTokens = 1500, kPrefill = 1400;

/// The keys rotated at their positions as a test would: [T, H, D] with rope at row t.
std::vector<float> rotated(const std::vector<float>& k, const rope::Rope& r, int64_t first_position = 0) {
  std::vector<float> out = k;
  const size_t row = static_cast<size_t>(kDim);
  for (size_t at = 0; at < out.size(); at += row) {
    const auto t = static_cast<int64_t>(at / (row * kHeads));
    r.rotate_at(out.data() + at, first_position + t);
  }
  return out;
}

std::vector<float> read_keys(kvret_seq* s, int32_t layer) {
  int64_t n = 0;
  expect_ok(kvret_seq_length(s, layer, &n));
  F32 k({n, kHeads, kDim}), v({n, kHeads, kDim});
  expect_ok(kvret_seq_read(s, layer, 0, n, &k, &v));
  return k.data;
}

struct PrePost : ::testing::TestWithParam<int> {
  kvret_config config = small_config(GetParam());
  F32 k{{kTokens, kHeads, kDim}}, v{{kTokens, kHeads, kDim}};
  PrePost() { clustered_kv(kTokens, kHeads, kDim, 11, k, v); }

  /// Fills `s` with prefill [0, kPrefill) and decode steps up to kTokens of keys `keys`.
  void fill(kvret_seq* s, const std::vector<float>& keys) {
    F32 kk({kTokens, kHeads, kDim});
    kk.data = keys;
    kk.refresh();
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      prefill(s, layer, kk, v, 0, kPrefill);
      decode(s, layer, kk, v, kPrefill, kTokens);
    }
  }
  /// A pre-RoPE sequence and a post-RoPE one of the same keys: everything but the host bytes alike.
  void expect_same(const kvret_config& pre_config, const kvret_config& post_config, const std::vector<float>& pre_keys,
                   const rope::Rope& r) {
    auto pre_ctx = make_context(pre_config);
    auto post_ctx = make_context(post_config);
    Seq pre(pre_ctx.get()), post(post_ctx.get());
    fill(pre.s, pre_keys);
    fill(post.s, rotated(pre_keys, r));
    Observed a = observe(pre.s), b = observe(post.s);
    EXPECT_EQ(a.host_bytes * 2, b.host_bytes * 3) << "a page keeps the pre-RoPE keys too";
    a.host_bytes = b.host_bytes = 0;
    EXPECT_EQ(a, b);
    EXPECT_FALSE(a.selections.empty());
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      // the keys read back are the rotated ones, as the post-RoPE sequence stores them
      EXPECT_EQ(read_keys(pre.s, layer), read_keys(post.s, layer));
      // scores and attention
      F32 q({kQHeads, kDim});
      q.data = random_vector(static_cast<size_t>(kQHeads * kDim), 77 + static_cast<uint64_t>(layer));
      q.refresh();
      I32 pa({kHeads, 100}), pb({kHeads, 100});
      F32 sa({kHeads, 100}), sb({kHeads, 100});
      int32_t ca = 0, cb = 0;
      expect_ok(kvret_select_scored(pre.s, layer, &q, 100, &pa, &sa, &ca));
      expect_ok(kvret_select_scored(post.s, layer, &q, 100, &pb, &sb, &cb));
      EXPECT_EQ(ca, cb);
      EXPECT_EQ(pa.data, pb.data);
      EXPECT_EQ(sa.data, sb.data);
      F32 oa({kQHeads, kDim}), ob({kQHeads, kDim});
      expect_ok(kvret_seq_attend(pre.s, layer, &q, 100, 0.0f, &oa, nullptr));
      expect_ok(kvret_seq_attend(post.s, layer, &q, 100, 0.0f, &ob, nullptr));
      EXPECT_EQ(oa.data, ob.data);
      I32 ra({kHeads, 64}), rb({kHeads, 64});
      int32_t na = 0, nb = 0;
      expect_ok(kvret_seq_retained_set(pre.s, layer, 64, &ra, &na));
      expect_ok(kvret_seq_retained_set(post.s, layer, 64, &rb, &nb));
      EXPECT_EQ(ra.data, rb.data);
    }
  }
};

kvret_config with_rope(kvret_config c, int32_t layout = KVRET_ROPE_NEOX, int32_t dims = 0) {
  c.rope_keys = 1;
  c.rope_layout = layout;
  c.rope_dims = dims;
  c.rope_theta = 10000.0f;
  return c;
}

rope::Rope rope_like(const kvret_config& c) {
  return rope::Rope(c.rope_dims == 0 ? c.head_dim : c.rope_dims, c.rope_layout, c.rope_theta);
}

// The must-show: pre-RoPE storage selects exactly what post-RoPE storage of the same keys rotated selects.
TEST_P(PrePost, SelectsAsKeysGivenRotated) {
  const kvret_config pre = with_rope(config);
  expect_same(pre, config, k.data, rope_like(pre));
}

TEST_P(PrePost, GptjLayoutAndPartialRotation) {
  const kvret_config pre = with_rope(config, KVRET_ROPE_GPTJ, 32);
  expect_same(pre, config, k.data, rope_like(pre));
}

// An f16 store: keys that f16 holds exactly are rotated from the same values either way.
TEST_P(PrePost, F16Store) {
  config.kv_dtype = KVRET_KV_F16;
  std::vector<float> keys = k.data;
  for (float& x : keys) x = f16_to_f32(f32_to_f16(x));
  const kvret_config pre = with_rope(config);
  expect_same(pre, config, keys, rope_like(pre));
}

// KVCrush's signatures and the quantized attention read the rotated keys too.
TEST_P(PrePost, KvCrushAndQuantAttention) {
  config.hamming_fraction = 0.25f;
  if (GetParam() == KVRET_INDEX_QUANT) config.quant_attention = 1;
  const kvret_config pre = with_rope(config);
  expect_same(pre, config, k.data, rope_like(pre));
}

INSTANTIATE_TEST_SUITE_P(Kinds, PrePost,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                                           KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT),
                         [](const ::testing::TestParamInfo<int>& i) { return kind_name(i.param); });

// Not the test's own rotation only: the keys kvret keeps are within rounding of the long-double reference, with
// Llama 3 scaling, and a decode step is rotated at its own position.
TEST(RopeSequence, StoredKeysMatchTheReference) {
  kvret_config c = with_rope(small_config(KVRET_INDEX_EXACT), KVRET_ROPE_GPTJ);
  c.rope_theta = 500000.0f;
  c.rope_scale_factor = 8.0f;
  c.rope_original_max_positions = 1024;
  auto ctx = make_context(c);
  Seq s(ctx.get());
  F32 k({300, kHeads, kDim}), v({300, kHeads, kDim});
  clustered_kv(300, kHeads, kDim, 3, k, v);
  prefill(s.s, 0, k, v, 0, 200);
  decode(s.s, 0, k, v, 200, 300);
  const std::vector<float> got = read_keys(s.s, 0);
  const rope::Rope r = [&] {
    rope::Llama3Scaling sc;
    sc.factor = 8.0;
    sc.original_max_positions = 1024.0;
    return rope::Rope(kDim, rope::kGptj, 500000.0, sc);
  }();
  std::vector<long double> inv(kDim / 2);
  for (int i = 0; i < kDim / 2; ++i) inv[static_cast<size_t>(i)] = r.inv_freq()[i];
  for (int64_t t = 0; t < 300; ++t)
    for (int h = 0; h < kHeads; ++h) {
      const size_t at = static_cast<size_t>((t * kHeads + h) * kDim);
      const std::vector<float> x(k.data.begin() + static_cast<std::ptrdiff_t>(at),
                                 k.data.begin() + static_cast<std::ptrdiff_t>(at + kDim));
      const std::vector<long double> want = reference_rotation(x, t, kDim, true, 0, &inv);
      for (int i = 0; i < kDim; ++i)
        ASSERT_NEAR(got[at + static_cast<size_t>(i)], static_cast<double>(want[static_cast<size_t>(i)]), 1e-5)
            << "token " << t << " head " << h << " dim " << i;
    }
}

// The rotary parameters are checked, and pre-RoPE keys are accepted.
TEST(RopeSequence, ConfigValidation) {
  kvret_config c = with_rope(small_config(KVRET_INDEX_EXACT));
  kvret_context* ctx = nullptr;
  ASSERT_EQ(kvret_create(&c, &ctx), KVRET_OK) << kvret_last_error();
  kvret_destroy(ctx);
  const auto refused = [](kvret_config bad, const char* field) {
    kvret_context* x = nullptr;
    EXPECT_EQ(kvret_create(&bad, &x), KVRET_ERR_INVALID_ARGUMENT) << field;
    EXPECT_NE(std::string(kvret_last_error()).find(field), std::string::npos) << kvret_last_error();
    EXPECT_EQ(x, nullptr);
  };
  kvret_config bad = c;
  bad.rope_dims = 33;
  refused(bad, "rope_dims");
  bad = c;
  bad.rope_dims = 2 * kDim;
  refused(bad, "rope_dims");
  bad = c;
  bad.rope_layout = 7;
  refused(bad, "rope_layout");
  bad = c;
  bad.rope_theta = 0.0f;
  refused(bad, "rope_theta");
  bad = c;
  bad.rope_scale_factor = 0.5f;
  refused(bad, "rope_scale_factor");
}

}  // namespace
