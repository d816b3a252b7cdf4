#pragma once
// Scalar conversions between f32 and the 16-bit float formats the KV cache may use. f16 -> f32 goes through a
// 64 Ki-entry table (exact, branch-free, portable); f32 -> f16/bf16 rounds to nearest even.
#include <cstdint>
#include <cstring>

namespace kvret {

float f16_to_f32_slow(uint16_t h) noexcept;
extern const float* const kF16Table;  // kF16Table[h] == f16_to_f32_slow(h)

inline float f16_to_f32(uint16_t h) noexcept { return kF16Table[h]; }

inline float bf16_to_f32(uint16_t h) noexcept {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// f32 -> IEEE half and bfloat16, nearest even (kernels/math/half_math.h: the same bits as the device's).
uint16_t f32_to_f16(float f) noexcept;
uint16_t f32_to_bf16(float f) noexcept;

}  // namespace kvret
