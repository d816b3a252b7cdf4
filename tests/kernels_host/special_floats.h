#pragma once
// Floats every bit-exact comparison goes over: zeros, infinities, NaNs of both signs with several payloads,
// denormals, the extremes of the normal range, and seeded random bit patterns.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace kvret_test {

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline std::vector<float> special_floats(int n_random = 4096, uint64_t seed = 12) {
  const uint32_t bits[] = {0x00000000u, 0x80000000u,                            // +0, -0
                           0x7f800000u, 0xff800000u,                            // +inf, -inf
                           0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u,  // quiet and signalling NaNs, both signs
                           0x7fffffffu, 0xffffffffu, 0x7fa5a5a5u, 0xffc0ffeeu,  // NaN payloads
                           0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu, 0x00400000u,  // denormals
                           0x00800000u, 0x80800000u, 0x7f7fffffu, 0xff7fffffu,  // smallest and largest normals
                           0x3f800000u, 0xbf800000u, 0x3f800001u, 0xbf800001u, 0x42ae0000u, 0xc2ae0000u, 0xc2b00000u};
  std::vector<float> out;
  for (uint32_t b : bits) out.push_back(from_bits(b));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < n_random; ++i) out.push_back(from_bits(static_cast<uint32_t>(rng())));
  return out;
}

}  // namespace kvret_test
