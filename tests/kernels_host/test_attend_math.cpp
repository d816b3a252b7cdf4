// The blocked decode attention's arithmetic (kernels/math/attend_math.h), composed as the CUDA backend's quantized
// attention composes it (one query head at a time: scores, each span's online-softmax steps, each span's weighted
// values, the merge in double), against the CPU's attend (core/attention.cpp) on every SIMD path: the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/attention.hpp"
#include "core/half.hpp"
#include "core/tensor_view.hpp"
#include "math/attend_math.h"
#include "special_floats.h"

namespace {

namespace am = kvret::cuda::math;
using kvret_test::to_bits;

/// attend's output for query head hq, from attend_math.h's functions alone. k and v: [n_kv, rows, d] f32.
std::vector<float> composed(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                            int64_t rows, int d, int group, float scale, int hq) {
  const int64_t h = hq / group;
  const float* qh = q.data() + static_cast<size_t>(hq) * d;
  const int64_t span = am::attend_span_rows(rows), n_spans = (rows + span - 1) / span;
  std::vector<float> m(static_cast<size_t>(n_spans)), acc(static_cast<size_t>(n_spans * d));
  std::vector<double> l(static_cast<size_t>(n_spans));
  std::vector<float> p(static_cast<size_t>(rows)), alpha(static_cast<size_t>((rows + 63) / 64));
  for (int64_t r = 0; r < rows; ++r)
    p[static_cast<size_t>(r)] = am::attend_score(qh, k.data() + (h * rows + r) * d, d, scale);
  for (int64_t s = 0; s < n_spans; ++s) {
    float ms = am::neg_inf();
    double ls = 0;
    for (int64_t b = s * span; b < std::min(rows, (s + 1) * span); b += am::kAttendBlockRows) {
      const int64_t n = std::min<int64_t>(am::kAttendBlockRows, std::min(rows, (s + 1) * span) - b);
      alpha[static_cast<size_t>(b / am::kAttendBlockRows)] = am::attend_block_step(p.data() + b, n, &ms, &ls);
    }
    m[static_cast<size_t>(s)] = ms;
    l[static_cast<size_t>(s)] = ls;
    for (int c = 0; c < d; ++c) {
      float a = 0;
      for (int64_t b = s * span; b < std::min(rows, (s + 1) * span); b += am::kAttendBlockRows) {
        const float f = alpha[static_cast<size_t>(b / am::kAttendBlockRows)];
        if (f != 1.0f) a = am::mul_rn(a, f);
        for (int64_t r = b; r < std::min({rows, (s + 1) * span, b + am::kAttendBlockRows}); ++r)
          a = am::attend_accumulate(a, p[static_cast<size_t>(r)], v[static_cast<size_t>((h * rows + r) * d + c)]);
      }
      acc[static_cast<size_t>(s * d + c)] = a;
    }
  }
  bool nan = false;
  const double mx = am::attend_merge_max(m.data(), n_spans, 1, &nan);
  std::vector<float> out(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) {
    double total = 0, sum = 0;
    for (int64_t s = 0; s < n_spans && !nan; ++s) {
      if (m[static_cast<size_t>(s)] == am::neg_inf()) continue;
      const double w = am::attend_span_weight(m[static_cast<size_t>(s)], mx);
      total = am::attend_merge_add(total, w, l[static_cast<size_t>(s)]);
      sum = am::attend_merge_add(sum, w, static_cast<double>(acc[static_cast<size_t>(s * d + c)]));
    }
    out[static_cast<size_t>(c)] = nan ? std::nanf("") : static_cast<float>(sum / total);
  }
  return out;
}

struct Case {
  int group, d;
  int64_t rows;
};

/// Runs attend on the path `isa` over k, v stored as `dtype` (f32 values exact in it) and compares every element.
void expect_same(const Case& c, kvret_dtype dtype, const std::vector<float>& q, const std::vector<float>& k,
                 const std::vector<float>& v, float scale, kvret::AttendIsa isa, const std::string& where) {
  const int n_kv = 2;
  kvret_config config{};
  config.n_q_heads = n_kv * c.group;
  config.n_kv_heads = n_kv;
  config.head_dim = c.d;
  const bool half = dtype.bits == 16;
  std::vector<uint16_t> kh(k.size()), vh(v.size());
  for (size_t i = 0; half && i < k.size(); ++i) {
    kh[i] = dtype.code == KVRET_DTYPE_BFLOAT ? kvret::f32_to_bf16(k[i]) : kvret::f32_to_f16(k[i]);
    vh[i] = dtype.code == KVRET_DTYPE_BFLOAT ? kvret::f32_to_bf16(v[i]) : kvret::f32_to_f16(v[i]);
  }
  const kvret_dtype f32{KVRET_DTYPE_FLOAT, 32, 1};
  const int64_t q_shape[] = {config.n_q_heads, c.d}, kv_shape[] = {n_kv, c.rows, c.d};
  std::vector<float> out(q.size());
  std::vector<float> qc = q;
  kvret_tensor tq{qc.data(), {KVRET_DEVICE_CPU, 0}, 2, f32, q_shape, nullptr, 0};
  kvret_tensor tk{half ? static_cast<void*>(kh.data()) : const_cast<float*>(k.data()),
                  {KVRET_DEVICE_CPU, 0},
                  3,
                  dtype,
                  kv_shape,
                  nullptr,
                  0};
  kvret_tensor tv{half ? static_cast<void*>(vh.data()) : const_cast<float*>(v.data()),
                  {KVRET_DEVICE_CPU, 0},
                  3,
                  dtype,
                  kv_shape,
                  nullptr,
                  0};
  kvret_tensor to{out.data(), {KVRET_DEVICE_CPU, 0}, 2, f32, q_shape, nullptr, 0};
  const kvret::DTypeSet types = kvret::kFloatTypes;
  kvret::attend(config, kvret::TensorView::from(&tq, "q", types, {2}), kvret::TensorView::from(&tk, "k", types, {3}),
                kvret::TensorView::from(&tv, "v", types, {3}), c.rows, scale,
                kvret::TensorView::from(&to, "out", types, {2}), 2, isa);
  const float s = kvret::attend_scale(config, scale);
  for (int hq = 0; hq < config.n_q_heads; ++hq) {
    const std::vector<float> want = composed(q, k, v, c.rows, c.d, c.group, s, hq);
    for (int e = 0; e < c.d; ++e) {
      const float got = out[static_cast<size_t>(hq * c.d + e)];
      if (std::isnan(want[static_cast<size_t>(e)])) {
        ASSERT_TRUE(std::isnan(got)) << where << " head " << hq << " element " << e;
      } else {
        ASSERT_EQ(to_bits(got), to_bits(want[static_cast<size_t>(e)]))
            << where << " head " << hq << " element " << e << ": " << got << " vs " << want[static_cast<size_t>(e)];
      }
    }
  }
}

/// Values exactly representable in `dtype` (so that the f32 copy the composition reads is the stored row).
std::vector<float> random_values(size_t n, uint32_t seed, float spread, kvret_dtype dtype) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, spread);
  std::vector<float> x(n);
  for (float& e : x) {
    e = g(rng);
    if (dtype.bits == 16)
      e = dtype.code == KVRET_DTYPE_BFLOAT ? kvret::bf16_to_f32(kvret::f32_to_bf16(e))
                                           : kvret::f16_to_f32(kvret::f32_to_f16(e));
  }
  return x;
}

TEST(AttendMath, ComposedIsTheCpuAttentionOnEveryPath) {
  const kvret_dtype types[] = {{KVRET_DTYPE_FLOAT, 32, 1}, {KVRET_DTYPE_FLOAT, 16, 1}, {KVRET_DTYPE_BFLOAT, 16, 1}};
  const Case cases[] = {{1, 64, 1},   {4, 64, 63},   {4, 128, 64},   {2, 100, 65},
                        {8, 64, 700}, {3, 256, 513}, {1, 64, 40000}, {16, 64, 1500}};
  uint32_t seed = 1;
  for (const Case& c : cases)
    for (const kvret_dtype& t : types)
      for (const float scale : {0.0f, 0.3f}) {
        const size_t kv = static_cast<size_t>(2 * c.rows * c.d);
        const std::vector<float> q = random_values(static_cast<size_t>(2 * c.group * c.d), seed++, 2.0f, types[0]);
        const std::vector<float> k = random_values(kv, seed++, 1.0f, t), v = random_values(kv, seed++, 1.0f, t);
        for (const auto isa : {kvret::AttendIsa::kScalar, kvret::AttendIsa::kAvx2, kvret::AttendIsa::kAvx512})
          expect_same(c, t, q, k, v, scale, isa,
                      "group " + std::to_string(c.group) + " d " + std::to_string(c.d) + " rows " +
                          std::to_string(c.rows) + " bits " + std::to_string(t.bits) + " isa " +
                          std::to_string(static_cast<int>(isa)));
      }
}

TEST(AttendMath, NonFiniteInputsGiveTheCpuAttentionsResult) {
  const kvret_dtype f32{KVRET_DTYPE_FLOAT, 32, 1};
  const Case c{4, 64, 900};
  const size_t kv = static_cast<size_t>(2 * c.rows * c.d);
  for (int variant = 0; variant < 4; ++variant) {
    std::vector<float> q = random_values(static_cast<size_t>(2 * c.group * c.d), 70, 1.0f, f32);
    std::vector<float> k = random_values(kv, 71, 1.0f, f32), v = random_values(kv, 72, 1.0f, f32);
    if (variant == 0) q[5] = std::nanf("");                                  // one head NaN
    if (variant == 1) k[static_cast<size_t>(600 * c.d + 3)] = INFINITY;      // +-inf scores in one group
    if (variant == 2) v[static_cast<size_t>(10 * c.d + 7)] = std::nanf("");  // one element of a group
    if (variant == 3) q[static_cast<size_t>(c.d)] = 1e30f;                   // scores overflow to +-inf
    for (const auto isa : {kvret::AttendIsa::kScalar, kvret::AttendIsa::kAvx2})
      expect_same(c, f32, q, k, v, 0.0f, isa, "variant " + std::to_string(variant));
  }
}

}  // namespace
