// half.hpp — f32 <-> f16 / bf16 conversions for kvret-demo (round to nearest even; NaN and Inf preserved).
// The demo converts the workload's f32 keys and values to the KV dtype itself, so that its exact-attention
// reference sees exactly the values kvret stores.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace kvret_demo
