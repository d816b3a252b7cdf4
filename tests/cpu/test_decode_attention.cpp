// The CPU decode attention (core/attention.hpp): against a double-precision reference over f32, f16 and bf16 keys
// and values, GQA groups 1 to 16, head_dim 64/128/256, rows from 1 to 128k (block and span edges included), the
// default and an explicit scale; the same bits for 1 and 2 threads and on every SIMD path this CPU runs; f16 and
// bf16 outputs equal to the f32 output rounded; non-finite inputs as the header documents; kvret_attend's output
// dtypes through the C API.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/attention.hpp"
#include "core/half.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;

namespace {

// The reference is computed in double from the very values the kernel reads (f16/bf16 already rounded), so the
// difference is the kernel's own f32 rounding: scores (head_dim products), exp_nonpositive (2e-7 relative), the
// f32 accumulation within a span and the division. Stated tolerance: |out - ref| <= kTol * max|v| of the KV head.
constexpr double kTol = 1e-5;

/// A host tensor of a float dtype, row-major, its elements kept as bytes.
struct Tensor {
  DType type;
  std::vector<int64_t> shape;
  std::vector<uint64_t> storage;  // 8-byte aligned
  kvret_tensor t{};

  Tensor(DType ty, std::vector<int64_t> s) : type(ty), shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    storage.assign(static_cast<size_t>((n * static_cast<int64_t>(dtype_size(type)) + 7) / 8), 0);
    t.device = {KVRET_DEVICE_CPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = type == DType::F32   ? kvret_dtype{KVRET_DTYPE_FLOAT, 32, 1}
              : type == DType::F16 ? kvret_dtype{KVRET_DTYPE_FLOAT, 16, 1}
                                   : kvret_dtype{KVRET_DTYPE_BFLOAT, 16, 1};
    t.strides = nullptr;
    t.byte_offset = 0;
    point();
  }
  Tensor(const Tensor& o) : type(o.type), shape(o.shape), storage(o.storage), t(o.t) { point(); }
  Tensor& operator=(const Tensor&) = delete;
  /// t at this object's own shape and storage.
  void point() {
    t.data = storage.data();
    t.shape = shape.data();
  }
  int64_t size() const {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    return n;
  }
  std::byte* bytes() { return reinterpret_cast<std::byte*>(storage.data()); }
  const std::byte* bytes() const { return reinterpret_cast<const std::byte*>(storage.data()); }
  /// Stores x rounded to the dtype; get() then returns the stored value.
  void set(int64_t i, float x) {
    if (type == DType::F32) {
      std::memcpy(bytes() + 4 * i, &x, 4);
    } else {
      const uint16_t h = type == DType::F16 ? f32_to_f16(x) : f32_to_bf16(x);
      std::memcpy(bytes() + 2 * i, &h, 2);
    }
  }
  float get(int64_t i) const {
    if (type == DType::F32) {
      float f;
      std::memcpy(&f, bytes() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, bytes() + 2 * i, 2);
    return type == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
  }
  TensorView view(const char* name) const { return TensorView::from(&t, name, kFloatTypes, {t.ndim}); }
  std::vector<uint8_t> raw() const {
    const auto* p = reinterpret_cast<const uint8_t*>(storage.data());
    return {p, p + size() * static_cast<int64_t>(dtype_size(type))};
  }
};

uint64_t next(uint64_t& state) { return splitmix64(state); }
/// Uniform in [-a, a).
float uniform(uint64_t& state, float a) {
  return a * (static_cast<float>(next(state) >> 40) / static_cast<float>(1 << 23) - 1.0f);
}

struct Problem {
  kvret_config config{};
  int64_t rows = 0;
  Tensor q, k, v;
  Problem(DType kv_type, int n_kv, int group, int d, int64_t rows_, int64_t capacity, uint64_t seed)
      : rows(rows_),
        q(DType::F32, {n_kv * group, d}),
        k(kv_type, {n_kv, capacity, d}),
        v(kv_type, {n_kv, capacity, d}) {
    kvret_config_init(&config);
    config.n_q_heads = n_kv * group;
    config.n_kv_heads = n_kv;
    config.head_dim = d;
    uint64_t state = seed;
    for (int64_t i = 0; i < q.size(); ++i) q.set(i, uniform(state, 2.0f));
    for (int64_t i = 0; i < k.size(); ++i) k.set(i, uniform(state, 1.0f));
    for (int64_t i = 0; i < v.size(); ++i) v.set(i, uniform(state, 1.0f));
  }
  int group() const { return config.n_q_heads / config.n_kv_heads; }
  int d() const { return config.head_dim; }

  /// The kernel's output, in `out_type`.
  Tensor run(float scale, int threads, AttendIsa isa, DType out_type = DType::F32) const {
    Tensor out(out_type, {config.n_q_heads, config.head_dim});
    attend(config, q.view("q"), k.view("k"), v.view("v"), rows, scale, out.view("out"), threads, isa);
    return out;
  }

  /// softmax(s q k^T) v in double, over rows whose `skip` is false.
  std::vector<double> reference(float scale, const std::vector<bool>& skip = {}) const {
    const int d = this->d(), g = group();
    const int64_t cap = k.shape[1];
    const double s = attend_scale(config, scale);
    std::vector<double> out(static_cast<size_t>(config.n_q_heads) * d, 0.0), p(static_cast<size_t>(rows));
    for (int h = 0; h < config.n_q_heads; ++h) {
      const int64_t kv = h / g;
      double mx = -INFINITY;
      for (int64_t r = 0; r < rows; ++r) {
        double dotp = 0;
        for (int t = 0; t < d; ++t)
          dotp += static_cast<double>(q.get(h * d + t)) * static_cast<double>(k.get((kv * cap + r) * d + t));
        p[static_cast<size_t>(r)] = s * dotp;
        if (skip.empty() || !skip[static_cast<size_t>(r)]) mx = std::max(mx, p[static_cast<size_t>(r)]);
      }
      double z = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const bool skipped = !skip.empty() && skip[static_cast<size_t>(r)];
        z += (p[static_cast<size_t>(r)] = skipped ? 0.0 : std::exp(p[static_cast<size_t>(r)] - mx));
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int t = 0; t < d; ++t)
          out[static_cast<size_t>(h) * d + t] +=
              p[static_cast<size_t>(r)] / z * static_cast<double>(v.get((kv * cap + r) * d + t));
    }
    return out;
  }

  double max_abs_v(int64_t kv) const {
    const int64_t cap = v.shape[1];
    double m = 0;
    for (int64_t i = kv * cap * d(); i < (kv * cap + rows) * d(); ++i)
      m = std::max(m, static_cast<double>(std::fabs(v.get(i))));
    return m;
  }
};

std::vector<AttendIsa> paths() {
  std::vector<AttendIsa> out{AttendIsa::kScalar};
  if (attend_isa() >= AttendIsa::kAvx2) out.push_back(AttendIsa::kAvx2);
  if (attend_isa() >= AttendIsa::kAvx512) out.push_back(AttendIsa::kAvx512);
  return out;
}

const char* isa_name(AttendIsa isa) {
  return isa == AttendIsa::kScalar ? "scalar" : isa == AttendIsa::kAvx2 ? "avx2" : "avx512";
}

/// Checks `out` against the reference within kTol * max|v|, and returns the largest error in those units.
double expect_near_reference(const Problem& p, const Tensor& out, const std::vector<double>& ref,
                             const std::string& what) {
  const int d = p.d();
  double worst = 0;
  for (int h = 0; h < p.config.n_q_heads; ++h) {
    const double bound = p.max_abs_v(h / p.group());
    for (int t = 0; t < d; ++t) {
      const double got = out.get(h * d + t), want = ref[static_cast<size_t>(h) * d + t];
      const double err = std::fabs(got - want) / bound;
      worst = std::max(worst, err);
      if (!(err <= kTol)) {
        ADD_FAILURE() << what << ": head " << h << " element " << t << ": " << got << " vs " << want;
        return worst;
      }
    }
  }
  return worst;
}

const char* dtype_label(DType t) { return dtype_name(t); }

}  // namespace

TEST(DecodeAttention, SpansDependOnRowsOnly) {
  EXPECT_EQ(attend_span_rows(1), kAttendMinSpanRows);
  EXPECT_EQ(attend_span_rows(32768), kAttendMinSpanRows);
  EXPECT_EQ(attend_span_rows(131072), 2048);
  for (const int64_t rows : {int64_t{1}, int64_t{1000}, int64_t{32769}, int64_t{131072}, int64_t{1} << 24}) {
    const int64_t span = attend_span_rows(rows);
    EXPECT_EQ(span % kAttendBlockRows, 0);
    EXPECT_LE((rows + span - 1) / span, kAttendMaxSpans) << rows;
  }
}

// Every dtype, group, head_dim and row count of the matrix against the reference; on each case every SIMD path and
// 1 or 2 threads give the same bits.
TEST(DecodeAttention, MatchesDoubleReferenceAndIsBitExactAcrossPathsAndThreads) {
  double worst = 0;
  uint64_t seed = 1;
  for (const DType type : {DType::F32, DType::F16, DType::BF16})
    for (const int group : {1, 2, 4, 8, 16})
      for (const int d : {64, 128, 256})
        for (const int64_t rows : {int64_t{1}, int64_t{7}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{1000}}) {
          const int n_kv = group >= 8 ? 1 : 2;
          const Problem p(type, n_kv, group, d, rows, rows + 3, ++seed);
          const float scale = seed % 2 == 0 ? 0.0f : 0.3f;
          const std::string what = std::string(dtype_label(type)) + " group " + std::to_string(group) + " d " +
                                   std::to_string(d) + " rows " + std::to_string(rows) + " scale " +
                                   std::to_string(scale);
          const Tensor base = p.run(scale, 1, AttendIsa::kScalar);
          worst = std::max(worst, expect_near_reference(p, base, p.reference(scale), what));
          for (const AttendIsa isa : paths())
            for (const int threads : {1, 2})
              EXPECT_EQ(p.run(scale, threads, isa).raw(), base.raw())
                  << what << ": " << isa_name(isa) << ", " << threads << " threads";
          if (HasFailure()) return;
        }
  RecordProperty("worst_error_in_max_abs_v", std::to_string(worst));
}

// 128k rows (64 spans of 2048 rows) and head_dims off the vector widths.
TEST(DecodeAttention, LongContextAndOddHeadDims) {
  {
    const Problem p(DType::F16, 1, 4, 128, 131072, 131072, 77);
    const Tensor base = p.run(0.0f, 1, AttendIsa::kScalar);
    expect_near_reference(p, base, p.reference(0.0f), "f16 128k rows");
    for (const AttendIsa isa : paths()) EXPECT_EQ(p.run(0.0f, 2, isa).raw(), base.raw()) << isa_name(isa);
  }
  for (const int d : {8, 20, 72, 100})
    for (const DType type : {DType::F32, DType::F16, DType::BF16}) {
      const Problem p(type, 2, 3, d, 700, 700, static_cast<uint64_t>(d));
      const Tensor base = p.run(0.0f, 1, AttendIsa::kScalar);
      expect_near_reference(p, base, p.reference(0.0f), "d " + std::to_string(d));
      for (const AttendIsa isa : paths())
        for (const int threads : {1, 2})
          EXPECT_EQ(p.run(0.0f, threads, isa).raw(), base.raw()) << "d " << d << " " << isa_name(isa);
    }
}

// A peaked softmax (scores up to ~80 apart) whose maximum moves from span to span and block to block.
TEST(DecodeAttention, RescalesWhenTheMaximumGrows) {
  Problem p(DType::F32, 1, 4, 64, 5000, 5000, 9);
  for (int64_t r = 0; r < p.rows; ++r)
    for (int t = 0; t < 64; ++t) p.k.set(r * 64 + t, p.k.get(r * 64 + t) * static_cast<float>(1 + r % 97) * 0.05f);
  const Tensor base = p.run(1.0f, 1, AttendIsa::kScalar);
  expect_near_reference(p, base, p.reference(1.0f), "peaked");
  for (const AttendIsa isa : paths()) EXPECT_EQ(p.run(1.0f, 2, isa).raw(), base.raw()) << isa_name(isa);
}

TEST(DecodeAttention, HalfOutputsAreTheF32OutputRounded) {
  for (const DType type : {DType::F32, DType::F16, DType::BF16}) {
    const Problem p(type, 2, 4, 128, 777, 800, 5);
    const Tensor f32 = p.run(0.0f, 2, attend_isa());
    const Tensor f16 = p.run(0.0f, 2, attend_isa(), DType::F16);
    const Tensor bf16 = p.run(0.0f, 2, attend_isa(), DType::BF16);
    for (int64_t i = 0; i < f32.size(); ++i) {
      uint16_t h, b;
      std::memcpy(&h, f16.bytes() + 2 * i, 2);
      std::memcpy(&b, bf16.bytes() + 2 * i, 2);
      ASSERT_EQ(h, f32_to_f16(f32.get(i))) << i;
      ASSERT_EQ(b, f32_to_bf16(f32.get(i))) << i;
    }
  }
}

// The documented non-finite behaviour, on every path.
TEST(DecodeAttention, NonFiniteInputs) {
  constexpr int d = 64, group = 2;
  constexpr int64_t rows = 1500;  // three spans
  const auto all_nan = [&](const Tensor& out, int h) {
    for (int t = 0; t < d; ++t)
      if (!std::isnan(out.get(h * d + t))) return false;
    return true;
  };
  const auto same_head = [&](const Tensor& a, const Tensor& b, int h) {
    return std::memcmp(a.bytes() + 4 * h * d, b.bytes() + 4 * h * d, 4 * d) == 0;
  };
  for (const AttendIsa isa : paths()) {
    SCOPED_TRACE(isa_name(isa));
    const Problem clean(DType::F32, 2, group, d, rows, rows, 3);
    const Tensor base = clean.run(0.0f, 2, isa);
    {  // NaN in q: that head only
      Problem p = clean;
      p.q.set(1 * d + 5, NAN);
      const Tensor out = p.run(0.0f, 2, isa);
      EXPECT_TRUE(all_nan(out, 1));
      for (const int h : {0, 2, 3}) EXPECT_TRUE(same_head(out, base, h)) << h;
    }
    {  // NaN in a key row of KV head 1: both of its heads
      Problem p = clean;
      p.k.set((1 * rows + 1234) * d + 7, NAN);
      const Tensor out = p.run(0.0f, 2, isa);
      EXPECT_TRUE(all_nan(out, 2));
      EXPECT_TRUE(all_nan(out, 3));
      EXPECT_TRUE(same_head(out, base, 0));
      EXPECT_TRUE(same_head(out, base, 1));
    }
    {  // +inf in a key element: +inf score (NaN head) where q is positive, -inf (row skipped) where negative
      Problem p = clean;
      const int64_t r = 700;
      p.q.set(0 * d + 3, 0.5f);
      p.q.set(1 * d + 3, -0.5f);
      p.k.set(r * d + 3, INFINITY);
      const Tensor out = p.run(0.0f, 2, isa);
      EXPECT_TRUE(all_nan(out, 0));
      std::vector<bool> skip(static_cast<size_t>(rows), false);
      skip[static_cast<size_t>(r)] = true;
      const std::vector<double> ref = p.reference(0.0f, skip);
      for (int t = 0; t < d; ++t) EXPECT_NEAR(out.get(d + t), ref[static_cast<size_t>(d + t)], kTol) << t;
    }
    {  // every score -inf for head 0: NaN; head 1 (q negative there) sees ordinary scores... of -inf keys
      Problem p = clean;
      p.q.set(0 * d + 9, 1.0f);
      for (int64_t r = 0; r < rows; ++r) p.k.set(r * d + 9, -INFINITY);
      p.q.set(1 * d + 9, 0.0f);  // 0 * -inf = NaN: head 1 is NaN too
      const Tensor out = p.run(0.0f, 2, isa);
      EXPECT_TRUE(all_nan(out, 0));
      EXPECT_TRUE(all_nan(out, 1));
      EXPECT_TRUE(same_head(out, base, 2));
    }
    {  // rows whose score is -inf are skipped: the others still attend
      Problem p = clean;
      p.q.set(0 * d + 11, 1.0f);
      p.q.set(1 * d + 11, 1.0f);
      std::vector<bool> skip(static_cast<size_t>(rows), false);
      for (int64_t r = 0; r < rows; r += 3) {
        p.k.set(r * d + 11, -INFINITY);
        skip[static_cast<size_t>(r)] = true;
      }
      const Tensor out = p.run(0.0f, 2, isa);
      const std::vector<double> ref = p.reference(0.0f, skip);
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < d; ++t)
          ASSERT_NEAR(out.get(h * d + t), ref[static_cast<size_t>(h * d + t)], kTol) << h << " " << t;
    }
    {  // NaN in a value element: that element of both heads of the group
      Problem p = clean;
      p.v.set((0 * rows + 1111) * d + 13, NAN);
      const Tensor out = p.run(0.0f, 2, isa);
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < d; ++t) EXPECT_EQ(std::isnan(out.get(h * d + t)), t == 13) << h << " " << t;
      EXPECT_TRUE(same_head(out, base, 2));
      EXPECT_TRUE(same_head(out, base, 3));
    }
  }
}

// Through the C API on a CPU context: f16 and bf16 out accepted (the f32 result rounded), the default scale equal
// to an explicit 1/sqrt(head_dim), an integer out refused with KVRET_ERR_DTYPE.
TEST(DecodeAttention, CApiAttendWritesEveryFloatOutput) {
  kvret_config c;
  kvret_config_init(&c);
  c.device_type = KVRET_DEVICE_CPU;
  c.n_layers = 1;
  c.n_q_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 128;
  c.kv_dtype = KVRET_KV_F16;
  c.n_threads = 2;
  kvret_context* ctx = nullptr;
  ASSERT_EQ(kvret_create(&c, &ctx), KVRET_OK) << kvret_last_error();
  const Problem p(DType::F16, 2, 4, 128, 3000, 3000, 21);
  Tensor f32(DType::F32, {8, 128}), f16(DType::F16, {8, 128}), bf16(DType::BF16, {8, 128}),
      explicit_scale(DType::F32, {8, 128});
  EXPECT_EQ(kvret_attend(ctx, &p.q.t, &p.k.t, &p.v.t, p.rows, 0.0f, &f32.t, nullptr), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(kvret_attend(ctx, &p.q.t, &p.k.t, &p.v.t, p.rows, 0.0f, &f16.t, nullptr), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(kvret_attend(ctx, &p.q.t, &p.k.t, &p.v.t, p.rows, 0.0f, &bf16.t, nullptr), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(kvret_attend(ctx, &p.q.t, &p.k.t, &p.v.t, p.rows, 1.0f / std::sqrt(128.0f), &explicit_scale.t, nullptr),
            KVRET_OK);
  EXPECT_EQ(explicit_scale.raw(), f32.raw());
  expect_near_reference(p, f32, p.reference(0.0f), "C API");
  for (int64_t i = 0; i < f32.size(); ++i) {
    ASSERT_EQ(f16.get(i), f16_to_f32(f32_to_f16(f32.get(i)))) << i;
    ASSERT_EQ(bf16.get(i), bf16_to_f32(f32_to_bf16(f32.get(i)))) << i;
  }
  std::vector<int32_t> ints(8 * 128, 7);
  kvret_tensor int_out = f32.t;
  int_out.data = ints.data();
  int_out.dtype = {KVRET_DTYPE_INT, 32, 1};
  EXPECT_EQ(kvret_attend(ctx, &p.q.t, &p.k.t, &p.v.t, p.rows, 0.0f, &int_out, nullptr), KVRET_ERR_DTYPE);
  EXPECT_EQ(ints, std::vector<int32_t>(8 * 128, 7));
  kvret_destroy(ctx);
}

// On the backend under test (KVRET_TEST_DEVICE): an f16 and a bf16 out are the f32 out rounded, bit for bit.
TEST(DecodeAttention, HalfOutputOnTheBackendUnderTest) {
  kvret_config c = test::small_config();
  const test::ContextPtr ctx = test::make_context(c);
  ASSERT_NE(ctx, nullptr);
  const int64_t rows = 40;
  test::F32 q({c.n_q_heads, c.head_dim}, 0.25f), k({c.n_kv_heads, rows, c.head_dim}, 0.5f),
      v({c.n_kv_heads, rows, c.head_dim}, 1.5f);
  test::F32 want({c.n_q_heads, c.head_dim});
  for (size_t i = 0; i < q.data.size(); ++i) q.data[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
  for (size_t i = 0; i < v.data.size(); ++i) v.data[i] = 0.003f * static_cast<float>(i % 389) - 0.5f;
  ASSERT_EQ(kvret_attend(ctx.get(), &q, &k, &v, rows, 0.0f, &want, nullptr), KVRET_OK) << kvret_last_error();
  test::Buffer<uint16_t> f16({c.n_q_heads, c.head_dim}, 7), bf16({c.n_q_heads, c.head_dim}, 7);
  bf16.t.dtype = {KVRET_DTYPE_BFLOAT, 16, 1};
  ASSERT_EQ(kvret_attend(ctx.get(), &q, &k, &v, rows, 0.0f, &f16, nullptr), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(kvret_attend(ctx.get(), &q, &k, &v, rows, 0.0f, &bf16, nullptr), KVRET_OK) << kvret_last_error();
  for (size_t i = 0; i < want.data.size(); ++i) {
    ASSERT_EQ(f16.data[i], f32_to_f16(want.data[i])) << i;
    ASSERT_EQ(bf16.data[i], f32_to_bf16(want.data[i])) << i;
  }
}
