#pragma once
// f32 -> f16 and f32 -> bf16, rounding to nearest even, as bit patterns: the CPU core's conversions
// (core/half.hpp) and the device's (an f16 or bf16 attention output), one source for both.
#include "hd.h"

namespace kvret::cuda::math {

/// IEEE half of f: nearest even; NaN the quiet NaN of its sign; past the largest half (after rounding) infinity.
KVRET_HD uint16_t f32_to_f16_bits(float f) {
  const uint32_t bits = float_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (incl. rounding) -> Inf
  if (abs < 0x38800000u) {                                               // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);           // below half the smallest subnormal
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  // normal: rebias the exponent and round the mantissa to 10 bits, nearest even
  abs += 0xc8000000u;  // (15 - 127) << 23
  abs += 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | (abs >> 13));
}

/// bfloat16 of f: nearest even; a NaN stays a NaN (quieted).
KVRET_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t bits = float_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace kvret::cuda::math
