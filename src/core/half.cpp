#include "core/half.hpp"

#include <cmath>
#include <vector>

#include "math/half_math.h"

namespace kvret {

float f16_to_f32_slow(uint16_t h) noexcept {
  const uint32_t sign = (h >> 15) & 1u;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  } else if (exponent == 31) {
    value = mantissa ? std::nanf("") : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

namespace {
const float* make_f16_table() {
  static std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = f16_to_f32_slow(static_cast<uint16_t>(h));
    return t;
  }();
  return table.data();
}
}  // namespace

const float* const kF16Table = make_f16_table();

uint16_t f32_to_f16(float f) noexcept { return cuda::math::f32_to_f16_bits(f); }

uint16_t f32_to_bf16(float f) noexcept { return cuda::math::f32_to_bf16_bits(f); }

}  // namespace kvret
