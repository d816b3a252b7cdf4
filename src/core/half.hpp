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

uint16_t f32_to_f16(float f) noexcept;

inline uint16_t f32_to_bf16(float f) noexcept {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace kvret
