// f16/bf16 conversions: exact round trips and round-to-nearest-even.
#include <gtest/gtest.h>

#include <cmath>

#include "core/half.hpp"

namespace kvret {
namespace {

TEST(Half, EveryF16RoundTripsExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << "h=" << h;
  }
}

TEST(Half, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);                          // rounds up to Inf
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // halfway, even stays
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // halfway, odd rounds up
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);             // smallest subnormal
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  // Random values: the result is one of the two neighbours and the nearer one.
  for (int i = 1; i < 20000; ++i) {
    const float f = std::ldexp(static_cast<float>(i) / 20000.0f, (i % 35) - 20);
    const uint16_t h = f32_to_f16(f);
    const float back = f16_to_f32(h);
    const float up = f16_to_f32(static_cast<uint16_t>(h + 1));
    const float down = h > 0 ? f16_to_f32(static_cast<uint16_t>(h - 1)) : 0.0f;
    EXPECT_LE(std::fabs(back - f), std::fabs(up - f));
    EXPECT_LE(std::fabs(back - f), std::fabs(down - f));
  }
}

TEST(Half, Bf16) {
  for (uint32_t h = 0; h < 65536; h += 7) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(f32_to_bf16(f), h);
    }
  }
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
}

}  // namespace
}  // namespace kvret
