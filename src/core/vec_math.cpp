#include "core/vec_math.hpp"

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVRET_VEC_AVX2 1
#endif

namespace kvret {

int resolve_threads(int32_t n_threads) noexcept { return n_threads > 0 ? n_threads : omp_get_max_threads(); }

namespace {

void scaled_dots_scalar(const float* q, int64_t q_stride, int nq, const float* keys, int64_t key_stride, int64_t n_keys,
                        int64_t len, float scale, float* out, int64_t out_stride) noexcept {
  for (int64_t e = 0; e < n_keys; ++e)
    for (int g = 0; g < nq; ++g) out[g * out_stride + e] = scale * dot(q + g * q_stride, keys + e * key_stride, len);
}

#ifdef KVRET_VEC_AVX2
// AVX without FMA on purpose: lane l of an accumulator is acc[l] of dot() (a multiply, then an add), and the
// reduction below is dot()'s ((0+4)+(1+5))+((2+6)+(3+7)), so the results are dot()'s bits.

/// The sum of the eight lanes in dot()'s order.
__attribute__((target("avx2"))) inline float reduce_like_dot(__m256 acc) noexcept {
  const __m128 w = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // w_l = a_l + a_(l+4)
  const __m128 h = _mm_hadd_ps(w, w);                                                       // w0 + w1, w2 + w3
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));                                  // (w0+w1) + (w2+w3)
}

/// NQ queries x NK keys, every accumulator in a register (NQ * NK <= 8).
template <int NQ, int NK>
__attribute__((target("avx2"))) void dots_block_avx2(const float* q, int64_t q_stride, const float* keys,
                                                     int64_t key_stride, int64_t len, float scale, float* out,
                                                     int64_t out_stride) noexcept {
  __m256 acc[NQ][NK];
  for (int g = 0; g < NQ; ++g)
    for (int e = 0; e < NK; ++e) acc[g][e] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 k[NK];
    for (int e = 0; e < NK; ++e) k[e] = _mm256_loadu_ps(keys + e * key_stride + i);
    for (int g = 0; g < NQ; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * q_stride + i);
      for (int e = 0; e < NK; ++e) acc[g][e] = _mm256_add_ps(acc[g][e], _mm256_mul_ps(qv, k[e]));
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int e = 0; e < NK; ++e) {
      const float* a = q + g * q_stride;
      const float* b = keys + e * key_stride;
      float s = reduce_like_dot(acc[g][e]);
      for (int64_t t = i; t < len; ++t) s += a[t] * b[t];
      out[g * out_stride + e] = scale * s;
    }
}

template <int NQ>
__attribute__((target("avx2"))) void dots_rows_avx2(const float* q, int64_t q_stride, const float* keys,
                                                    int64_t key_stride, int64_t n_keys, int64_t len, float scale,
                                                    float* out, int64_t out_stride) noexcept {
  constexpr int kKeys = NQ <= 2 ? 4 : 2;
  int64_t e = 0;
  for (; e + kKeys <= n_keys; e += kKeys)
    dots_block_avx2<NQ, kKeys>(q, q_stride, keys + e * key_stride, key_stride, len, scale, out + e, out_stride);
  for (; e < n_keys; ++e)
    dots_block_avx2<NQ, 1>(q, q_stride, keys + e * key_stride, key_stride, len, scale, out + e, out_stride);
}

__attribute__((target("avx2"))) void scaled_dots_avx2(const float* q, int64_t q_stride, int nq, const float* keys,
                                                      int64_t key_stride, int64_t n_keys, int64_t len, float scale,
                                                      float* out, int64_t out_stride) noexcept {
  int g = 0;
  for (; g + 4 <= nq; g += 4)
    dots_rows_avx2<4>(q + g * q_stride, q_stride, keys, key_stride, n_keys, len, scale, out + g * out_stride,
                      out_stride);
  const float* qr = q + g * q_stride;
  float* o = out + g * out_stride;
  switch (nq - g) {
    case 3:
      dots_rows_avx2<3>(qr, q_stride, keys, key_stride, n_keys, len, scale, o, out_stride);
      break;
    case 2:
      dots_rows_avx2<2>(qr, q_stride, keys, key_stride, n_keys, len, scale, o, out_stride);
      break;
    case 1:
      dots_rows_avx2<1>(qr, q_stride, keys, key_stride, n_keys, len, scale, o, out_stride);
      break;
    default:
      break;
  }
}
#endif

bool detect_avx2() noexcept {
#ifdef KVRET_VEC_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

}  // namespace

bool cpu_has_avx2() noexcept {
  static const bool ok = detect_avx2();
  return ok;
}

void scaled_dots(const float* q, int64_t q_stride, int nq, const float* keys, int64_t key_stride, int64_t n_keys,
                 int64_t len, float scale, float* out, int64_t out_stride) noexcept {
#ifdef KVRET_VEC_AVX2
  if (cpu_has_avx2()) {
    scaled_dots_avx2(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
    return;
  }
#endif
  scaled_dots_scalar(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
}

}  // namespace kvret
