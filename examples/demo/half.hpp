// half.hpp — f32 <-> f16 / bf16 conversions for kvret-demo (round to nearest even; NaN and Inf preserved).
// The demo converts the workload's f32 keys and values to the KV dtype itself, so that its exact-attention
// reference sees exactly the values kvret stores.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define KVRET_DEMO_F16C 1
#endif

namespace kvret_demo {

inline uint32_t f32_bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f = 0.f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // Inf or NaN (keep NaN quiet and non-zero)
    return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (ax < 0x38800000u) {  // below the smallest normal f16 (2^-14): a subnormal m * 2^-24, m rounded to even
    const float scaled = bits_f32(ax) * 16777216.0f;  // exact: a power-of-two scaling
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  // normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits
  const uint32_t base = ax - 0x38000000u;  // exponent - 112
  const uint32_t r = base >> 13;
  const uint32_t rem = base & 0x1fffu;
  const uint32_t out = r + ((rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ? 1u : 0u);
  return static_cast<uint16_t>(sign | out);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

inline float bf16_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// ---- bulk conversions (F16C where the CPU has it) ----
#if defined(KVRET_DEMO_F16C)
__attribute__((target("avx,f16c"))) inline void f32_to_f16_f16c(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

__attribute__((target("avx,f16c"))) inline void f16_to_f32_f16c(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

/// F16C and AVX with the YMM state enabled by the OS (CPUID leaf 1, XGETBV; clang has no "f16c" for
/// __builtin_cpu_supports).
inline bool have_f16c() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    constexpr unsigned kNeed = (1u << 27) | (1u << 28) | (1u << 29);  // OSXSAVE, AVX, F16C
    if ((c & kNeed) != kNeed) return false;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 6u) == 6u;
  }();
  return yes;
}
#endif

/// dst[i] = f16(src[i]) for i < n.
inline void f32_to_f16_n(const float* src, uint16_t* dst, size_t n) {
#if defined(KVRET_DEMO_F16C)
  if (have_f16c()) return f32_to_f16_f16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

/// dst[i] = f32(src[i]) for i < n.
inline void f16_to_f32_n(const uint16_t* src, float* dst, size_t n) {
#if defined(KVRET_DEMO_F16C)
  if (have_f16c()) return f16_to_f32_f16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

}  // namespace kvret_demo
