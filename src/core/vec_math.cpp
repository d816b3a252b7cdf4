#include "core/vec_math.hpp"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/dot_avx2.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/parallel.hpp"
#include "core/pq4_avx2.hpp"
#include "core/tensor_view.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define KVRET_VEC_AVX2 1
#endif

namespace kvret {

int resolve_threads(int32_t n_threads) noexcept { return n_threads > 0 ? n_threads : default_threads(); }

namespace {

/// Element `offset` of rows of dtype T.
template <DType T>
inline const void* key_row(const void* keys, int64_t offset) noexcept {
  return static_cast<const char*>(keys) + offset * static_cast<int64_t>(dtype_size(T));
}

/// Element i of a row of dtype T, as f32 (exact).
template <DType T>
inline float key_f32(const void* row, int64_t i) noexcept {
  if constexpr (T == DType::F32) return static_cast<const float*>(row)[i];
  if constexpr (T == DType::F16) return f16_to_f32(static_cast<const uint16_t*>(row)[i]);
  return bf16_to_f32(static_cast<const uint16_t*>(row)[i]);
}

/// scaled_dots of key rows of dtype T, one row converted to f32 at a time.
template <DType T>
void scaled_dots_typed_scalar(const float* q, int64_t q_stride, int nq, const void* keys, int64_t key_stride,
                              int64_t n_keys, int64_t len, float scale, float* out, int64_t out_stride) {
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(len));
  for (int64_t e = 0; e < n_keys; ++e) {
    const void* r = key_row<T>(keys, e * key_stride);
    for (int64_t i = 0; i < len; ++i) row[static_cast<size_t>(i)] = key_f32<T>(r, i);
    for (int g = 0; g < nq; ++g) out[g * out_stride + e] = scale * dot(q + g * q_stride, row.data(), len);
  }
}

void scaled_dots_scalar(const float* q, int64_t q_stride, int nq, const float* keys, int64_t key_stride, int64_t n_keys,
                        int64_t len, float scale, float* out, int64_t out_stride) noexcept {
  for (int64_t e = 0; e < n_keys; ++e)
    for (int g = 0; g < nq; ++g) out[g * out_stride + e] = scale * dot(q + g * q_stride, keys + e * key_stride, len);
}

/// The m = 4 logit: the sum of two pairs, ((0 + l0) + l1) + (l2 + l3).
inline float pq4_logit(const float* l, int k, const uint8_t* c) noexcept {
  return ((0.0f + l[c[0]]) + l[k + c[1]]) + (l[2 * k + c[2]] + l[3 * k + c[3]]);
}

void pq_token_logits_scalar(const float* lut, int nq, int m, int k, const uint8_t* codes, int64_t t0, int64_t n,
                            float* out) noexcept {
  for (int g = 0; g < nq; ++g) {
    const float* l = lut + static_cast<int64_t>(g) * m * k;
    for (int64_t t = t0; t < n; ++t) {
      float s = 0;
      if (m == 4) {
        s = pq4_logit(l, k, codes + t * 4);
      } else {
        for (int j = 0; j < m; ++j) s += l[j * k + codes[t * m + j]];
      }
      out[g * n + t] = s;
    }
  }
}

#ifdef KVRET_VEC_AVX2
/// pq_token_logits for m = M (a multiple of 4), eight tokens at a time: the codes of a block are decoded once into
/// M vectors of table offsets (byte b of the 32-bit word q of each token is code 4q + b), then every head sums its
/// M gathered entries lane by lane from +0 in j order (for M = 4 as two pairs, pq4_logit's order), as the scalar
/// loop does. For M = 4 it serves k > kPairTableMaxK only.
template <int M>
__attribute__((target("avx2"))) void pq_token_logits_avx2(const float* lut, int nq, int k, const uint8_t* codes,
                                                          int64_t n, float* out) noexcept {
  static_assert(M % 4 == 0 && M <= 16);
  const __m256i low_byte = _mm256_set1_epi32(0xff);
  const __m256i token_stride = _mm256_setr_epi32(0, M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 7 * M);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256i idx[M];
    for (int q = 0; q < M / 4; ++q) {
      const uint8_t* c = codes + t * M + 4 * q;
      const __m256i w = M == 4 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c))
                               : _mm256_i32gather_epi32(reinterpret_cast<const int*>(c), token_stride, 1);
      idx[4 * q] = _mm256_add_epi32(_mm256_and_si256(w, low_byte), _mm256_set1_epi32(4 * q * k));
      idx[4 * q + 1] =
          _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(w, 8), low_byte), _mm256_set1_epi32((4 * q + 1) * k));
      idx[4 * q + 2] =
          _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(w, 16), low_byte), _mm256_set1_epi32((4 * q + 2) * k));
      idx[4 * q + 3] = _mm256_add_epi32(_mm256_srli_epi32(w, 24), _mm256_set1_epi32((4 * q + 3) * k));
    }
    for (int g = 0; g < nq; ++g) {
      const float* l = lut + static_cast<int64_t>(g) * M * k;
      __m256 s = _mm256_setzero_ps();
      if constexpr (M == 4) {  // pq4_logit's order
        s = _mm256_add_ps(_mm256_add_ps(s, _mm256_i32gather_ps(l, idx[0], 4)), _mm256_i32gather_ps(l, idx[1], 4));
        s = _mm256_add_ps(s, _mm256_add_ps(_mm256_i32gather_ps(l, idx[2], 4), _mm256_i32gather_ps(l, idx[3], 4)));
      } else {
        for (int j = 0; j < M; ++j) s = _mm256_add_ps(s, _mm256_i32gather_ps(l, idx[j], 4));
      }
      _mm256_storeu_ps(out + g * n + t, s);
    }
  }
  pq_token_logits_scalar(lut, nq, M, k, codes, t, n, out);
}

/// Largest k of the pair-table path: its two tables of k^2 floats stay in L1 (32 KiB at k = 64).
constexpr int kPairTableMaxK = 64;

/// pq_token_logits for m = 4 and k <= kPairTableMaxK, head by head: the head's tables of the two code pairs,
/// A[c0 + k c1] = (0 + l0[c0]) + l1[c1] and B[c2 + k c3] = l2[c2] + l3[c3], make every logit A + B (pq4_logit's
/// bits) from two gathers instead of four.
__attribute__((target("avx2"))) void pq4_pair_logits_avx2(const float* lut, int nq, int k, const uint8_t* codes,
                                                          int64_t n, float* out) noexcept {
  alignas(32) float a[kPairTableMaxK * kPairTableMaxK];
  alignas(32) float b[kPairTableMaxK * kPairTableMaxK];
  for (int g = 0; g < nq; ++g) {
    const float* l = lut + static_cast<int64_t>(g) * 4 * k;
    for (int c1 = 0; c1 < k; ++c1)
      for (int c0 = 0; c0 < k; ++c0) {
        a[c0 + k * c1] = (0.0f + l[c0]) + l[k + c1];
        b[c0 + k * c1] = l[2 * k + c0] + l[3 * k + c1];
      }
    float* o = out + g * n;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      __m256i ia, ib;
      pq4_pair_offsets_avx2(codes + t * 4, k, &ia, &ib);
      _mm256_storeu_ps(o + t, _mm256_add_ps(_mm256_i32gather_ps(a, ia, 4), _mm256_i32gather_ps(b, ib, 4)));
    }
    for (; t < n; ++t) {
      const uint8_t* c = codes + t * 4;
      o[t] = a[c[0] + k * c[1]] + b[c[2] + k * c[3]];
    }
  }
}

// AVX without FMA on purpose: lane l of an accumulator is acc[l] of dot() (a multiply, then an add), and the
// reduction below is dot()'s ((0+4)+(1+5))+((2+6)+(3+7)), so the results are dot()'s bits.

/// Eight keys of a row from element i, converted to f32 (exactly: f16 and bf16 hold f32 values).
template <DType T>
__attribute__((target("avx2,f16c"))) inline __m256 load_keys8(const void* row, int64_t i) noexcept {
  if constexpr (T == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    if constexpr (T == DType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

/// NQ queries x NK keys (rows of dtype T), every accumulator in a register (NQ * NK <= 8).
template <int NQ, int NK, DType T>
__attribute__((target("avx2,f16c"))) void dots_block_avx2(const float* q, int64_t q_stride, const void* keys,
                                                          int64_t key_stride, int64_t len, float scale, float* out,
                                                          int64_t out_stride) noexcept {
  __m256 acc[NQ][NK];
  for (int g = 0; g < NQ; ++g)
    for (int e = 0; e < NK; ++e) acc[g][e] = _mm256_setzero_ps();
  const void* row[NK];
  for (int e = 0; e < NK; ++e) row[e] = key_row<T>(keys, e * key_stride);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 k[NK];
    for (int e = 0; e < NK; ++e) k[e] = load_keys8<T>(row[e], i);
    for (int g = 0; g < NQ; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * q_stride + i);
      for (int e = 0; e < NK; ++e) acc[g][e] = _mm256_add_ps(acc[g][e], _mm256_mul_ps(qv, k[e]));
    }
  }
  if constexpr (NQ * NK == 8) {
    if (i == len) {  // no tail: the eight sums at once
      alignas(32) float s[8];
      _mm256_store_ps(s, _mm256_mul_ps(_mm256_set1_ps(scale), reduce8_like_dot(&acc[0][0])));
      for (int g = 0; g < NQ; ++g)
        for (int e = 0; e < NK; ++e) out[g * out_stride + e] = s[g * NK + e];
      return;
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int e = 0; e < NK; ++e) {
      const float* a = q + g * q_stride;
      float s = reduce_like_dot(acc[g][e]);
      for (int64_t t = i; t < len; ++t) s += a[t] * key_f32<T>(row[e], t);
      out[g * out_stride + e] = scale * s;
    }
}

template <int NQ, DType T>
__attribute__((target("avx2,f16c"))) void dots_rows_avx2(const float* q, int64_t q_stride, const void* keys,
                                                         int64_t key_stride, int64_t n_keys, int64_t len, float scale,
                                                         float* out, int64_t out_stride) noexcept {
  constexpr int kKeys = NQ <= 2 ? 4 : 2;
  int64_t e = 0;
  for (; e + kKeys <= n_keys; e += kKeys)
    dots_block_avx2<NQ, kKeys, T>(q, q_stride, key_row<T>(keys, e * key_stride), key_stride, len, scale, out + e,
                                  out_stride);
  for (; e < n_keys; ++e)
    dots_block_avx2<NQ, 1, T>(q, q_stride, key_row<T>(keys, e * key_stride), key_stride, len, scale, out + e,
                              out_stride);
}

template <DType T>
__attribute__((target("avx2,f16c"))) void scaled_dots_avx2(const float* q, int64_t q_stride, int nq, const void* keys,
                                                           int64_t key_stride, int64_t n_keys, int64_t len, float scale,
                                                           float* out, int64_t out_stride) noexcept {
  int g = 0;
  for (; g + 4 <= nq; g += 4)
    dots_rows_avx2<4, T>(q + g * q_stride, q_stride, keys, key_stride, n_keys, len, scale, out + g * out_stride,
                         out_stride);
  const float* qr = q + g * q_stride;
  float* o = out + g * out_stride;
  switch (nq - g) {
    case 3:
      dots_rows_avx2<3, T>(qr, q_stride, keys, key_stride, n_keys, len, scale, o, out_stride);
      break;
    case 2:
      dots_rows_avx2<2, T>(qr, q_stride, keys, key_stride, n_keys, len, scale, o, out_stride);
      break;
    case 1:
      dots_rows_avx2<1, T>(qr, q_stride, keys, key_stride, n_keys, len, scale, o, out_stride);
      break;
    default:
      break;
  }
}
#endif

/// The widest instruction set the environment allows: KVRET_MAX_CPU_ISA=scalar (0), avx2 (1) or avx512 (2, the
/// default; any other value is ignored).
int allowed_isa() noexcept {
  const char* cap = std::getenv("KVRET_MAX_CPU_ISA");
  if (cap == nullptr) return 2;
  if (std::strcmp(cap, "scalar") == 0) return 0;
  if (std::strcmp(cap, "avx2") == 0) return 1;
  return 2;
}

bool detect_avx2() noexcept {
#ifdef KVRET_VEC_AVX2
  __builtin_cpu_init();
  return allowed_isa() >= 1 && __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

bool detect_avx512f() noexcept {
#ifdef KVRET_VEC_AVX2
  __builtin_cpu_init();
  return allowed_isa() >= 2 && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

}  // namespace

bool cpu_has_avx2() noexcept {
  static const bool ok = detect_avx2();
  return ok;
}

bool cpu_has_avx512f() noexcept {
  static const bool ok = detect_avx512f();
  return ok;
}

namespace {

bool detect_f16c() noexcept {
#ifdef KVRET_VEC_AVX2
  if (allowed_isa() < 1) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  constexpr unsigned kOsxsave = 1u << 27, kAvx = 1u << 28, kF16c = 1u << 29;
  if ((c & (kOsxsave | kAvx | kF16c)) != (kOsxsave | kAvx | kF16c)) return false;
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 6u) == 6u;  // XMM and YMM state enabled
#else
  return false;
#endif
}

}  // namespace

/// CPUID leaf 1 (F16C, AVX, OSXSAVE) and XGETBV (the OS saves the YMM state): what __builtin_cpu_supports("f16c")
/// answers in GCC, which clang does not accept. Asked once per process (CPUID traps to the hypervisor in a VM).
bool cpu_has_f16c() noexcept {
  static const bool ok = detect_f16c();
  return ok;
}

void pq_token_logits(const float* lut, int nq, int m, int k, const uint8_t* codes, int64_t n, float* out) noexcept {
#ifdef KVRET_VEC_AVX2
  if (cpu_has_avx2()) {
    switch (m) {
      case 4:
        if (k <= kPairTableMaxK)
          pq4_pair_logits_avx2(lut, nq, k, codes, n, out);
        else
          pq_token_logits_avx2<4>(lut, nq, k, codes, n, out);
        return;
      case 8:
        pq_token_logits_avx2<8>(lut, nq, k, codes, n, out);
        return;
      case 12:
        pq_token_logits_avx2<12>(lut, nq, k, codes, n, out);
        return;
      case 16:
        pq_token_logits_avx2<16>(lut, nq, k, codes, n, out);
        return;
      default:
        break;
    }
  }
#endif
  pq_token_logits_scalar(lut, nq, m, k, codes, 0, n, out);
}

void scaled_dots(const float* q, int64_t q_stride, int nq, const float* keys, int64_t key_stride, int64_t n_keys,
                 int64_t len, float scale, float* out, int64_t out_stride) noexcept {
#ifdef KVRET_VEC_AVX2
  if (cpu_has_avx2()) {
    scaled_dots_avx2<DType::F32>(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
    return;
  }
#endif
  scaled_dots_scalar(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
}

void scaled_dots(const float* q, int64_t q_stride, int nq, const void* keys, DType key_dtype, int64_t key_stride,
                 int64_t n_keys, int64_t len, float scale, float* out, int64_t out_stride) {
  switch (key_dtype) {
    case DType::F32:
      scaled_dots(q, q_stride, nq, static_cast<const float*>(keys), key_stride, n_keys, len, scale, out, out_stride);
      return;
    case DType::F16:
#ifdef KVRET_VEC_AVX2
      if (cpu_has_avx2() && cpu_has_f16c()) {
        scaled_dots_avx2<DType::F16>(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
        return;
      }
#endif
      scaled_dots_typed_scalar<DType::F16>(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
      return;
    case DType::BF16:
#ifdef KVRET_VEC_AVX2
      if (cpu_has_avx2()) {
        scaled_dots_avx2<DType::BF16>(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
        return;
      }
#endif
      scaled_dots_typed_scalar<DType::BF16>(q, q_stride, nq, keys, key_stride, n_keys, len, scale, out, out_stride);
      return;
    case DType::I32:
      break;
  }
  throw Error(KVRET_ERR_INTERNAL, "scaled_dots: keys of an integer dtype");
}

}  // namespace kvret
