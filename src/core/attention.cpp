#include "core/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/dot_avx2.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/parallel.hpp"
#include "core/vec_math.hpp"
#include "math/attend_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVRET_ATTEND_X86 1
#endif

namespace kvret {

void check_attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                  int64_t rows, float scale, const TensorView& out) {
  require(rows >= 1, KVRET_ERR_INVALID_ARGUMENT, "rows must be >= 1, got " + std::to_string(rows));
  q.expect_dim(0, config.n_q_heads, "n_q_heads");
  q.expect_dim(1, config.head_dim, "head_dim");
  for (const auto* t : {&k, &v}) {
    t->expect_dim(0, config.n_kv_heads, "n_kv_heads");
    t->expect_dim_at_least(1, rows, "rows");
    t->expect_dim(2, config.head_dim, "head_dim");
  }
  out.expect_dim(0, config.n_q_heads, "n_q_heads");
  out.expect_dim(1, config.head_dim, "head_dim");
  require(std::isfinite(scale), KVRET_ERR_INVALID_ARGUMENT, "scale is not finite");
}

float attend_scale(const kvret_config& config, float scale) noexcept {
  return scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(config.head_dim));
}

AttendIsa attend_isa() noexcept {
  if (!cpu_has_avx2() || !cpu_has_f16c()) return AttendIsa::kScalar;
  return cpu_has_avx512f() ? AttendIsa::kAvx512 : AttendIsa::kAvx2;
}

int64_t attend_span_rows(int64_t rows) noexcept { return cuda::math::attend_span_rows(rows); }

namespace {

namespace am = cuda::math;

// The arithmetic every path shares (kernels/math/attend_math.h, which the CUDA backend's quantized attention runs),
// element by element, so that all of them give the same bits:
// - a score is scale * (q . k) with q . k summed as dot() does: eight lanes (lane l takes the elements i = l mod 8
//   of the multiple-of-8 prefix, each a multiply then an add, no FMA), reduced as ((0+4)+(1+5))+((2+6)+(3+7)),
//   then the tail elements in order;
// - a block's weights are exp_nonpositive(score - running max), computed by the same scalar loop on every path;
// - an accumulator element is multiplied by the block's rescale factor (when it is not 1), then gets
//   weight * value added row by row in row order (a multiply, then an add).

/// A row of dtype T at element offset `offset`.
template <DType T>
inline const std::byte* row_at(const std::byte* base, int64_t offset) noexcept {
  return base + offset * static_cast<int64_t>(dtype_size(T));
}

/// Element i of a row of dtype T as f32 (exact).
template <DType T>
inline float elem_f32(const std::byte* row, int64_t i) noexcept {
  if constexpr (T == DType::F32) {
    float f;
    std::memcpy(&f, row + 4 * i, sizeof f);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, sizeof h);
    if constexpr (T == DType::F16) return f16_to_f32(h);
    return bf16_to_f32(h);
  }
}

/// What one work item needs: its query heads in f32, the geometry, and its scratch.
struct Block {
  const float* q;  // [group, d]
  int group, d;
  float scale;
  float* p;            // [group, kAttendBlockRows]: scores, then weights
  const float* alpha;  // [group]: the rescale factor of each head's accumulator for this block
  float* acc;          // [group, d]
};

// ---- scalar ----

template <DType T>
void scores_scalar(const Block& b, const std::byte* k0, int64_t k_stride, int64_t n, float* row) noexcept {
  const int d = b.d;
  for (int64_t r = 0; r < n; ++r) {
    const std::byte* kr = row_at<T>(k0, r * k_stride);
    for (int i = 0; i < d; ++i) row[i] = elem_f32<T>(kr, i);
    for (int j = 0; j < b.group; ++j) b.p[j * kAttendBlockRows + r] = b.scale * dot(b.q + j * d, row, d);
  }
}

template <DType T>
void values_scalar(const Block& b, const std::byte* v0, int64_t v_stride, int64_t n, float* row) noexcept {
  const int d = b.d;
  for (int j = 0; j < b.group; ++j)
    if (b.alpha[j] != 1.0f)
      for (int t = 0; t < d; ++t) b.acc[j * d + t] *= b.alpha[j];
  for (int64_t r = 0; r < n; ++r) {
    const std::byte* vr = row_at<T>(v0, r * v_stride);
    for (int t = 0; t < d; ++t) row[t] = elem_f32<T>(vr, t);
    for (int j = 0; j < b.group; ++j) {
      const float w = b.p[j * kAttendBlockRows + r];
      float* a = b.acc + j * d;
      for (int t = 0; t < d; ++t) a[t] = am::attend_accumulate(a[t], w, row[t]);
    }
  }
}

#ifdef KVRET_ATTEND_X86
// ---- AVX2 (with F16C), no FMA: lane l of a dot accumulator is dot()'s acc[l] ----

/// Eight elements of a row of dtype T from element i, as f32.
template <DType T>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const std::byte* row, int64_t i) noexcept {
  if constexpr (T == DType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + i));
    if constexpr (T == DType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

/// Scores of NQ query heads (from head j0) against NK rows (from row r0): every accumulator in a register.
template <int NQ, int NK, DType T>
__attribute__((target("avx2,f16c"))) inline void scores_tile_avx2(const Block& b, int j0, const std::byte* k0,
                                                                  int64_t k_stride, int64_t r0) noexcept {
  const int d = b.d;
  __m256 acc[NQ][NK];
#pragma GCC unroll 8
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 8
    for (int e = 0; e < NK; ++e) acc[j][e] = _mm256_setzero_ps();
  const std::byte* row[NK];
#pragma GCC unroll 8
  for (int e = 0; e < NK; ++e) row[e] = row_at<T>(k0, (r0 + e) * k_stride);
  const float* q = b.q + j0 * d;
  int i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 k[NK];
#pragma GCC unroll 8
    for (int e = 0; e < NK; ++e) k[e] = load8<T>(row[e], i);
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) {
      const __m256 qv = _mm256_loadu_ps(q + j * d + i);
#pragma GCC unroll 8
      for (int e = 0; e < NK; ++e) acc[j][e] = _mm256_add_ps(acc[j][e], _mm256_mul_ps(qv, k[e]));
    }
  }
  if constexpr (NQ * NK == 8) {
    if (i == d) {  // no tail: the eight sums at once
      alignas(32) float sums[8];
      _mm256_store_ps(sums, _mm256_mul_ps(_mm256_set1_ps(b.scale), reduce8_like_dot(&acc[0][0])));
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 8
        for (int e = 0; e < NK; ++e) b.p[(j0 + j) * kAttendBlockRows + r0 + e] = sums[j * NK + e];
      return;
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 8
    for (int e = 0; e < NK; ++e) {
      float s = reduce_like_dot(acc[j][e]);
      for (int t = i; t < d; ++t) s += q[j * d + t] * elem_f32<T>(row[e], t);
      b.p[(j0 + j) * kAttendBlockRows + r0 + e] = b.scale * s;
    }
}

template <int NQ, DType T>
__attribute__((target("avx2,f16c"))) void scores_heads_avx2(const Block& b, int j0, const std::byte* k0,
                                                            int64_t k_stride, int64_t n) noexcept {
  constexpr int kRows = NQ <= 2 ? 4 : 2;
  int64_t r = 0;
  for (; r + kRows <= n; r += kRows) scores_tile_avx2<NQ, kRows, T>(b, j0, k0, k_stride, r);
  for (; r < n; ++r) scores_tile_avx2<NQ, 1, T>(b, j0, k0, k_stride, r);
}

template <DType T>
__attribute__((target("avx2,f16c"))) void scores_avx2(const Block& b, const std::byte* k0, int64_t k_stride,
                                                      int64_t n) noexcept {
  int j = 0;
  for (; j + 4 <= b.group; j += 4) scores_heads_avx2<4, T>(b, j, k0, k_stride, n);
  switch (b.group - j) {
    case 3:
      scores_heads_avx2<3, T>(b, j, k0, k_stride, n);
      break;
    case 2:
      scores_heads_avx2<2, T>(b, j, k0, k_stride, n);
      break;
    case 1:
      scores_heads_avx2<1, T>(b, j, k0, k_stride, n);
      break;
    default:
      break;
  }
}

/// The value rows of a block into the accumulators of NQ heads (from j0), W vectors of eight elements from t0.
template <int NQ, int W, DType T>
__attribute__((target("avx2,f16c"))) inline void values_tile_avx2(const Block& b, int j0, const std::byte* v0,
                                                                  int64_t v_stride, int64_t n, int t0) noexcept {
  const int d = b.d;
  __m256 a[NQ][W];
#pragma GCC unroll 8
  for (int j = 0; j < NQ; ++j) {
    const float alpha = b.alpha[j0 + j];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      a[j][w] = _mm256_loadu_ps(b.acc + (j0 + j) * d + t0 + 8 * w);
      if (alpha != 1.0f) a[j][w] = _mm256_mul_ps(a[j][w], _mm256_set1_ps(alpha));
    }
  }
  const float* p = b.p + j0 * kAttendBlockRows;
  for (int64_t r = 0; r < n; ++r) {
    const std::byte* vr = row_at<T>(v0, r * v_stride);
    __m256 v[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) v[w] = load8<T>(vr, t0 + 8 * w);
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) {
      const __m256 pj = _mm256_broadcast_ss(p + j * kAttendBlockRows + r);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) a[j][w] = _mm256_add_ps(a[j][w], _mm256_mul_ps(pj, v[w]));
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(b.acc + (j0 + j) * d + t0 + 8 * w, a[j][w]);
}

/// The elements from t0 on (fewer than eight) of NQ heads' accumulators, as the scalar path computes them.
template <DType T>
inline void values_tail(const Block& b, int j0, int nq, const std::byte* v0, int64_t v_stride, int64_t n,
                        int t0) noexcept {
  const int d = b.d;
  for (int j = j0; j < j0 + nq; ++j)
    if (b.alpha[j] != 1.0f)
      for (int t = t0; t < d; ++t) b.acc[j * d + t] *= b.alpha[j];
  for (int64_t r = 0; r < n; ++r) {
    const std::byte* vr = row_at<T>(v0, r * v_stride);
    for (int j = j0; j < j0 + nq; ++j) {
      const float w = b.p[j * kAttendBlockRows + r];
      for (int t = t0; t < d; ++t) b.acc[j * d + t] += w * elem_f32<T>(vr, t);
    }
  }
}

template <int NQ, DType T>
__attribute__((target("avx2,f16c"))) void values_heads_avx2(const Block& b, int j0, const std::byte* v0,
                                                            int64_t v_stride, int64_t n) noexcept {
  constexpr int kW = NQ <= 2 ? 4 : 2;  // at most 8 accumulators
  int t = 0;
  for (; t + 8 * kW <= b.d; t += 8 * kW) values_tile_avx2<NQ, kW, T>(b, j0, v0, v_stride, n, t);
  for (; t + 8 <= b.d; t += 8) values_tile_avx2<NQ, 1, T>(b, j0, v0, v_stride, n, t);
  if (t < b.d) values_tail<T>(b, j0, NQ, v0, v_stride, n, t);
}

template <DType T>
__attribute__((target("avx2,f16c"))) void values_avx2(const Block& b, const std::byte* v0, int64_t v_stride,
                                                      int64_t n) noexcept {
  int j = 0;
  for (; j + 4 <= b.group; j += 4) values_heads_avx2<4, T>(b, j, v0, v_stride, n);
  switch (b.group - j) {
    case 3:
      values_heads_avx2<3, T>(b, j, v0, v_stride, n);
      break;
    case 2:
      values_heads_avx2<2, T>(b, j, v0, v_stride, n);
      break;
    case 1:
      values_heads_avx2<1, T>(b, j, v0, v_stride, n);
      break;
    default:
      break;
  }
}

// ---- AVX-512F: the value rows sixteen elements at a time (the same per-element arithmetic); scores as AVX2 ----

template <DType T>
__attribute__((target("avx512f"))) inline __m512 load16(const std::byte* row, int64_t i) noexcept {
  if constexpr (T == DType::F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + i));
    // the zero-masked forms throughout: GCC 12 warns that the unmasked ones read an undefined register
    if constexpr (T == DType::F16) return _mm512_maskz_cvtph_ps(0xffff, h);
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
  }
}

template <int NQ, int W, DType T>
__attribute__((target("avx512f"))) inline void values_tile_avx512(const Block& b, int j0, const std::byte* v0,
                                                                  int64_t v_stride, int64_t n, int t0) noexcept {
  const int d = b.d;
  __m512 a[NQ][W];
#pragma GCC unroll 8
  for (int j = 0; j < NQ; ++j) {
    const float alpha = b.alpha[j0 + j];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      a[j][w] = _mm512_loadu_ps(b.acc + (j0 + j) * d + t0 + 16 * w);
      if (alpha != 1.0f) a[j][w] = _mm512_mul_ps(a[j][w], _mm512_set1_ps(alpha));
    }
  }
  const float* p = b.p + j0 * kAttendBlockRows;
  for (int64_t r = 0; r < n; ++r) {
    const std::byte* vr = row_at<T>(v0, r * v_stride);
    __m512 v[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) v[w] = load16<T>(vr, t0 + 16 * w);
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j * kAttendBlockRows + r]);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) a[j][w] = _mm512_add_ps(a[j][w], _mm512_mul_ps(pj, v[w]));
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NQ; ++j)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(b.acc + (j0 + j) * d + t0 + 16 * w, a[j][w]);
}

template <int NQ, DType T>
__attribute__((target("avx512f"))) void values_heads_avx512(const Block& b, int j0, const std::byte* v0,
                                                            int64_t v_stride, int64_t n) noexcept {
  constexpr int kW = NQ <= 2 ? 4 : 2;
  int t = 0;
  for (; t + 16 * kW <= b.d; t += 16 * kW) values_tile_avx512<NQ, kW, T>(b, j0, v0, v_stride, n, t);
  for (; t + 16 <= b.d; t += 16) values_tile_avx512<NQ, 1, T>(b, j0, v0, v_stride, n, t);
  if (t + 8 <= b.d) {
    values_tile_avx2<NQ, 1, T>(b, j0, v0, v_stride, n, t);
    t += 8;
  }
  if (t < b.d) values_tail<T>(b, j0, NQ, v0, v_stride, n, t);
}

template <DType T>
__attribute__((target("avx512f"))) void values_avx512(const Block& b, const std::byte* v0, int64_t v_stride,
                                                      int64_t n) noexcept {
  int j = 0;
  for (; j + 4 <= b.group; j += 4) values_heads_avx512<4, T>(b, j, v0, v_stride, n);
  switch (b.group - j) {
    case 3:
      values_heads_avx512<3, T>(b, j, v0, v_stride, n);
      break;
    case 2:
      values_heads_avx512<2, T>(b, j, v0, v_stride, n);
      break;
    case 1:
      values_heads_avx512<1, T>(b, j, v0, v_stride, n);
      break;
    default:
      break;
  }
}
#endif

#ifdef KVRET_ATTEND_X86
/// exp_nonpositive of eight lanes: its operations in its order, so its bits.
__attribute__((target("avx2"))) inline __m256 exp_nonpositive8(__m256 x) noexcept {
  const __m256 zero = _mm256_setzero_ps(), low = _mm256_set1_ps(-87.0f);
  x = _mm256_blendv_ps(x, zero, _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
  x = _mm256_blendv_ps(x, low, _mm256_cmp_ps(x, low, _CMP_LT_OQ));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 t_or_0 = _mm256_blendv_ps(zero, t, _mm256_cmp_ps(t, t, _CMP_EQ_OQ));
  const __m256i n = _mm256_cvttps_epi32(_mm256_sub_ps(t_or_0, _mm256_set1_ps(0.5f)));
  const __m256 fn = _mm256_cvtepi32_ps(n);
  const __m256 f = _mm256_sub_ps(t, fn);
  const __m256 y = _mm256_mul_ps(f, _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_blendv_ps(_mm256_mul_ps(p, scale), zero, _mm256_cmp_ps(x, low, _CMP_LE_OQ));
}

__attribute__((target("avx2"))) inline float block_max_avx2(const float* p, int64_t n) noexcept {
  __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    const __m256 x = _mm256_loadu_ps(p + r);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  const float tail = am::attend_block_max(p + r, n - r);
  if (_mm256_movemask_ps(nan) != 0 || tail != tail) return std::numeric_limits<float>::quiet_NaN();
  float m = tail;
  for (const float x : lanes) m = x > m ? x : m;
  return m;
}

__attribute__((target("avx2"))) inline float block_weights_avx2(float* p, int64_t n, float mx) noexcept {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 lane = _mm256_setzero_ps();
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    const __m256 w = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + r), m));
    _mm256_storeu_ps(p + r, w);
    lane = _mm256_add_ps(lane, w);
  }
  float sum = reduce_like_dot(lane);
  for (; r < n; ++r) sum += (p[r] = exp_nonpositive(p[r] - mx));
  return sum;
}
#endif

/// Asks for the cache lines of n rows of `bytes` bytes each (every path: a prefetch changes no result).
inline void prefetch_rows(const std::byte* row, int64_t stride_bytes, int64_t n, int64_t bytes) noexcept {
  for (int64_t r = 0; r < n; ++r, row += stride_bytes)
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
}

/// One work item: `rows` rows from row r0 of one KV head, for its group of query heads. On return m, l and acc hold
/// each head's running maximum score, its sum of exp(score - m) and its sum of exp(score - m) * value.
template <DType TK, DType TV>
void attend_span(Block b, const std::byte* k0, int64_t k_stride, const std::byte* v0, int64_t v_stride, int64_t rows,
                 AttendIsa isa, float* m, double* l, float* alpha, float* row) noexcept {
  const int g = b.group;
  std::fill(b.acc, b.acc + static_cast<int64_t>(g) * b.d, 0.0f);
  for (int j = 0; j < g; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0;
  }
  b.alpha = alpha;
  for (int64_t r0 = 0; r0 < rows; r0 += kAttendBlockRows) {
    const int64_t n = std::min<int64_t>(kAttendBlockRows, rows - r0);
    const std::byte* kb = row_at<TK>(k0, r0 * k_stride);
    const std::byte* vb = row_at<TV>(v0, r0 * v_stride);
    const int64_t k_row_bytes = k_stride * static_cast<int64_t>(dtype_size(TK));
    const int64_t v_row_bytes = v_stride * static_cast<int64_t>(dtype_size(TV));
    const int64_t d_bytes_k = b.d * static_cast<int64_t>(dtype_size(TK));
    const int64_t d_bytes_v = b.d * static_cast<int64_t>(dtype_size(TV));
    prefetch_rows(vb, v_row_bytes, n, d_bytes_v);  // the value rows arrive while the scores are computed
#ifdef KVRET_ATTEND_X86
    if (isa != AttendIsa::kScalar)
      scores_avx2<TK>(b, kb, k_stride, n);
    else
#endif
      scores_scalar<TK>(b, kb, k_stride, n, row);
    for (int j = 0; j < g; ++j) {
      float* p = b.p + j * kAttendBlockRows;
#ifdef KVRET_ATTEND_X86
      if (isa != AttendIsa::kScalar) {
        alpha[j] = am::attend_block_step(
            p, n, &m[j], &l[j], [](const float* x, int64_t c) { return block_max_avx2(x, c); },
            [](float* x, int64_t c, float mx) { return block_weights_avx2(x, c, mx); });
        continue;
      }
#endif
      alpha[j] = am::attend_block_step(p, n, &m[j], &l[j]);
    }
    const int64_t next = std::min<int64_t>(kAttendBlockRows, rows - r0 - n);
    if (next > 0) prefetch_rows(kb + n * k_row_bytes, k_row_bytes, next, d_bytes_k);  // the next block's keys
#ifdef KVRET_ATTEND_X86
    if (isa == AttendIsa::kAvx512)
      values_avx512<TV>(b, vb, v_stride, n);
    else if (isa == AttendIsa::kAvx2)
      values_avx2<TV>(b, vb, v_stride, n);
    else
#endif
      values_scalar<TV>(b, vb, v_stride, n, row);
  }
}

using SpanFn = void (*)(Block, const std::byte*, int64_t, const std::byte*, int64_t, int64_t, AttendIsa, float*,
                        double*, float*, float*) noexcept;

template <DType TK>
SpanFn span_fn_for(DType tv) noexcept {
  switch (tv) {
    case DType::F16:
      return attend_span<TK, DType::F16>;
    case DType::BF16:
      return attend_span<TK, DType::BF16>;
    default:
      return attend_span<TK, DType::F32>;
  }
}

SpanFn span_fn(DType tk, DType tv) noexcept {
  switch (tk) {
    case DType::F16:
      return span_fn_for<DType::F16>(tv);
    case DType::BF16:
      return span_fn_for<DType::BF16>(tv);
    default:
      return span_fn_for<DType::F32>(tv);
  }
}

/// A work item's scratch, kept by its thread between calls: bounded by the group size and head_dim.
struct SpanScratch {
  std::vector<float> q, p, row, alpha, part_acc, part_m;
  std::vector<double> part_l;
};

/// Merges one query head's n_spans span results (maximum m[s * stride], sum l[s * stride], accumulator
/// acc + s * acc_stride [d]) in span order, in double (attend_math.h's merge): *total the normaliser and sum [d, zeroed
/// by the caller] the output times it, relative to the largest maximum, which is returned; *nan when a span's maximum
/// is NaN.
double merge_spans(const float* m, const double* l, int64_t stride, const float* acc, size_t acc_stride,
                   int64_t n_spans, int d, double* total, double* sum, bool* nan) noexcept {
  const double mx = am::attend_merge_max(m, n_spans, stride, nan);
  for (int64_t sp = 0; sp < n_spans && !*nan; ++sp) {
    const float mi = m[sp * stride];
    if (mi == -INFINITY) continue;  // no weight in this span
    const double w = am::attend_span_weight(mi, mx);
    *total = am::attend_merge_add(*total, w, l[sp * stride]);
    const float* a = acc + static_cast<size_t>(sp) * acc_stride;
    for (int t = 0; t < d; ++t) sum[t] = am::attend_merge_add(sum[t], w, static_cast<double>(a[t]));
  }
  return mx;
}

}  // namespace

void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
            float scale, const TensorView& out, int n_threads) {
  attend(config, q, k, v, rows, scale, out, n_threads, attend_isa());
}

void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
            float scale, const TensorView& out, int n_threads, AttendIsa isa) {
  check_attend(config, q, k, v, rows, scale, out);
  require(out.dtype() != DType::I32, KVRET_ERR_DTYPE, "out must be f32, f16 or bf16");
  isa = std::min(isa, attend_isa());
  const int d = config.head_dim;
  const int group = config.n_q_heads / config.n_kv_heads;
  const float s = attend_scale(config, scale);
  const int64_t span = attend_span_rows(rows);
  const int64_t n_spans = (rows + span - 1) / span;
  const int64_t items = config.n_kv_heads * n_spans;
  const size_t gd = static_cast<size_t>(group) * static_cast<size_t>(d);
  // each work item's result, merged below in span order: at most kAttendMaxSpans per query head
  std::vector<float> part_acc(static_cast<size_t>(items) * gd), part_m(static_cast<size_t>(items * group));
  std::vector<double> part_l(static_cast<size_t>(items * group));
  const SpanFn fn = span_fn(k.dtype(), v.dtype());
  const bool parallel = rows * config.n_q_heads * d >= (int64_t{1} << 16);
  parallel_for(items, n_threads, parallel, Schedule::kDynamic, [&](int64_t item) {
    const auto kv = static_cast<int>(item / n_spans);
    const int64_t r0 = (item % n_spans) * span;
    thread_local SpanScratch scratch;
    scratch.q.resize(gd);
    scratch.p.resize(static_cast<size_t>(group) * kAttendBlockRows);
    scratch.row.resize(static_cast<size_t>(d));
    scratch.alpha.resize(static_cast<size_t>(group));
    for (int j = 0; j < group; ++j)
      q.load_f32(q.at({kv * group + j}), static_cast<size_t>(d), scratch.q.data() + static_cast<size_t>(j) * d);
    Block b{scratch.q.data(), group, d, s, scratch.p.data(), nullptr, part_acc.data() + static_cast<size_t>(item) * gd};
    fn(b, k.at({kv, r0}), k.stride(1), v.at({kv, r0}), v.stride(1), std::min(span, rows - r0), isa,
       part_m.data() + item * group, part_l.data() + item * group, scratch.alpha.data(), scratch.row.data());
  });
  // merge each query head's spans in order, in double
  parallel_for(config.n_q_heads, n_threads, parallel, Schedule::kStatic, [&](int64_t h) {
    const int64_t kv = h / group, j = h % group;
    thread_local std::vector<double> sum;
    thread_local std::vector<float> result;
    sum.assign(static_cast<size_t>(d), 0.0);
    result.resize(static_cast<size_t>(d));
    double total = 0.0;
    bool nan = false;
    merge_spans(part_m.data() + kv * n_spans * group + j, part_l.data() + kv * n_spans * group + j, group,
                part_acc.data() + static_cast<size_t>(kv * n_spans * group + j) * d, gd, n_spans, d, &total, sum.data(),
                &nan);
    for (int t = 0; t < d; ++t)
      result[static_cast<size_t>(t)] =
          nan ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(sum[static_cast<size_t>(t)] / total);
    convert_row(reinterpret_cast<const std::byte*>(result.data()), DType::F32, out.at({h}), out.dtype(),
                static_cast<size_t>(d));
  });
}

void attend_head(const float* q, int group, int d, float scale, const std::byte* k, DType tk, const std::byte* v,
                 DType tv, int64_t rows, AttendIsa isa, double* max, double* total, double* sum, bool* nan) {
  isa = std::min(isa, attend_isa());
  const size_t gd = static_cast<size_t>(group) * static_cast<size_t>(d);
  std::fill(sum, sum + gd, 0.0);
  std::fill(total, total + group, 0.0);
  std::fill(nan, nan + group, false);
  std::fill(max, max + group, -static_cast<double>(INFINITY));
  if (rows <= 0) return;
  const int64_t span = attend_span_rows(rows);
  const int64_t n_spans = (rows + span - 1) / span;
  thread_local SpanScratch scratch;  // bounded by kAttendMaxSpans, the group and head_dim
  scratch.p.resize(static_cast<size_t>(group) * kAttendBlockRows);
  scratch.row.resize(static_cast<size_t>(d));
  scratch.alpha.resize(static_cast<size_t>(group));
  scratch.part_acc.resize(static_cast<size_t>(n_spans) * gd);
  scratch.part_m.resize(static_cast<size_t>(n_spans * group));
  scratch.part_l.resize(static_cast<size_t>(n_spans * group));
  const SpanFn fn = span_fn(tk, tv);
  const auto row_bytes = [d](DType t) { return static_cast<int64_t>(d) * static_cast<int64_t>(dtype_size(t)); };
  for (int64_t sp = 0; sp < n_spans; ++sp) {
    const int64_t r0 = sp * span;
    Block b{q, group, d, scale, scratch.p.data(), nullptr, scratch.part_acc.data() + static_cast<size_t>(sp) * gd};
    fn(b, k + r0 * row_bytes(tk), d, v + r0 * row_bytes(tv), d, std::min(span, rows - r0), isa,
       scratch.part_m.data() + sp * group, scratch.part_l.data() + sp * group, scratch.alpha.data(),
       scratch.row.data());
  }
  for (int j = 0; j < group; ++j)
    max[j] = merge_spans(scratch.part_m.data() + j, scratch.part_l.data() + j, group,
                         scratch.part_acc.data() + static_cast<size_t>(j) * d, gd, n_spans, d, total + j,
                         sum + static_cast<size_t>(j) * d, nan + j);
}

}  // namespace kvret
