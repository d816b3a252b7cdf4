// The top-k kernel's math (kernels/math/topk_math.h) against the CPU selection (select/topk.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

#include "math/topk_math.h"
#include "select/topk.hpp"
#include "special_floats.h"

namespace {

using namespace kvret::cuda::math;
using kvret_test::from_bits;
using kvret_test::special_floats;

TEST(TopkMath, OrderKeyIsTheCpuRankBitForBit) {
  for (float f : special_floats()) {
    EXPECT_EQ(topk_order_key(f), ~kvret::descending_rank(f)) << "bits " << std::hex << kvret_test::to_bits(f);
  }
}

TEST(TopkMath, EveryNanIsTheLowestKeyAndZerosAreEqual) {
  const uint32_t lowest = topk_order_key(-std::numeric_limits<float>::infinity());
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu}) {
    EXPECT_EQ(topk_order_key(from_bits(nan)), lowest) << std::hex << nan;
  }
  EXPECT_EQ(topk_order_key(-0.0f), topk_order_key(0.0f));
  // the order of the non-NaN floats is the float order
  const float ascending[] = {
      -std::numeric_limits<float>::infinity(), -3.0e38f, -1.0f, -1.0e-45f, 0.0f, 1.0e-45f, 1.0f, 3.0e38f,
      std::numeric_limits<float>::infinity()};
  for (size_t i = 1; i < std::size(ascending); ++i)
    EXPECT_LT(topk_order_key(ascending[i - 1]), topk_order_key(ascending[i]));
}

TEST(TopkMath, DigitsOfTheThreePassesRebuildTheKey) {
  std::mt19937 rng(3);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t key = static_cast<uint32_t>(rng());
    uint32_t rebuilt = 0;
    int bits = 0;
    for (int pass = 0; pass < kTopkPasses; ++pass) {
      rebuilt |= topk_digit(key, pass) << topk_pass_shift(pass);
      bits += topk_pass_bits(pass);
    }
    EXPECT_EQ(rebuilt, key);
    EXPECT_EQ(bits, 32);
  }
}

TEST(TopkMath, ClampCountKeepsTheRow) {
  EXPECT_EQ(topk_clamp_count(10, 100), 10);
  EXPECT_EQ(topk_clamp_count(101, 100), 100);  // a device count past the row's stride reads only the row
  EXPECT_EQ(topk_clamp_count(-5, 100), 0);
  EXPECT_EQ(topk_clamp_count(7, 0), 0);
  EXPECT_EQ(topk_clamp_count(0x7fffffff, int64_t{1} << 40), 0x7fffffff);
}

/// The kernel's algorithm on the host with its math: radix select over the order keys (11 + 11 + 10 bits, the
/// digit of the kk-th largest key found by radix_bin_holds scanning the bins downwards), then the ascending
/// compaction that takes keys above the threshold and the first `need` keys equal to it.
std::vector<int32_t> emulate_topk(const float* scores, int32_t device_n, int64_t stride, int32_t k) {
  const int32_t n = topk_clamp_count(device_n, stride);
  const int32_t kk = std::min(k, n);
  std::vector<int32_t> out;
  if (kk <= 0) return out;
  uint32_t prefix = 0;
  uint32_t mask = 0;
  int64_t need = kk;
  for (int pass = 0; pass < kTopkPasses && kk < n; ++pass) {
    std::vector<int64_t> hist(size_t{1} << topk_pass_bits(pass), 0);
    for (int32_t i = 0; i < n; ++i) {
      const uint32_t key = topk_order_key(scores[i]);
      if ((key & mask) == prefix) ++hist[topk_digit(key, pass)];
    }
    int64_t at_or_above = 0;
    int64_t digit = -1, digit_count = 0, count_above = 0;
    for (int64_t bin = static_cast<int64_t>(hist.size()) - 1; bin >= 0; --bin) {
      at_or_above += hist[static_cast<size_t>(bin)];
      if (radix_bin_holds(at_or_above, hist[static_cast<size_t>(bin)], need)) {
        digit = bin;
        digit_count = hist[static_cast<size_t>(bin)];
        count_above = at_or_above - digit_count;
        break;
      }
    }
    EXPECT_GE(digit, 0);
    prefix |= static_cast<uint32_t>(digit) << topk_pass_shift(pass);
    mask |= topk_digit_mask(pass) << topk_pass_shift(pass);
    need -= count_above;
    if (digit_count == need) break;
  }
  int64_t equal_taken = 0;
  for (int32_t i = 0; i < n; ++i) {
    const uint32_t key = topk_order_key(scores[i]) & mask;
    if (key > prefix || (key == prefix && equal_taken++ < need)) out.push_back(i);
  }
  return out;
}

std::vector<int32_t> cpu_topk(const float* scores, int64_t n, int64_t k) {
  std::vector<int32_t> out(static_cast<size_t>(std::min(k, n)));
  kvret::topk_positions(scores, n, std::min(k, n), 0, out.data());
  return out;
}

TEST(TopkMath, KernelAlgorithmSelectsWhatTheCpuSelects) {
  std::mt19937 rng(7);
  const std::vector<float> specials = special_floats(0);
  for (int trial = 0; trial < 60; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 3000);
    std::vector<float> row(static_cast<size_t>(n));
    std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
    for (float& x : row) {
      const uint32_t pick = rng() % 8;
      if (pick == 0) {
        x = specials[rng() % specials.size()];  // NaNs of both signs, infinities, zeros, denormals
      } else if (pick == 1) {
        x = static_cast<float>(static_cast<int>(rng() % 5) - 2);  // heavy ties
      } else {
        x = uniform(rng);
      }
    }
    for (int32_t k : {0, 1, 7, n / 3, n - 1, n, n + 5}) {
      EXPECT_EQ(emulate_topk(row.data(), n, n, k), cpu_topk(row.data(), n, k)) << "trial " << trial << " k " << k;
    }
  }
}

TEST(TopkMath, NansAreNeverPreferredOverNumbers) {
  // A positive NaN used to be selected above +inf and a negative NaN below -inf.
  const std::vector<float> row = {from_bits(0x7fc00000u),
                                  1.0f,
                                  from_bits(0xffc00000u),
                                  -1.0f,
                                  -std::numeric_limits<float>::infinity(),
                                  -0.0f,
                                  0.0f};
  EXPECT_EQ(emulate_topk(row.data(), 7, 7, 2), (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(emulate_topk(row.data(), 7, 7, 5), (std::vector<int32_t>{0, 1, 3, 5, 6}));
  EXPECT_EQ(emulate_topk(row.data(), 7, 7, 5), cpu_topk(row.data(), 7, 5));
}

TEST(TopkMath, DeviceCountBeyondTheStrideReadsOnlyTheRow) {
  std::vector<float> rows = {1, 2, 3, 4, 100, 200};  // two rows of stride 3
  EXPECT_EQ(emulate_topk(rows.data(), 5, 3, 2), (std::vector<int32_t>{1, 2}));
}

}  // namespace
