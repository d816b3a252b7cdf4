// KVCrush's grouping math (kernels/math/kvcrush_math.h) against plain bit loops and the CPU core
// (select/kvcrush.hpp, which calls it).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "math/kvcrush_math.h"
#include "select/kvcrush.hpp"

namespace {

using namespace kvret::cuda::math;

int bit_loop_distance(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  int d = 0;
  for (size_t w = 0; w < a.size(); ++w)
    for (int i = 0; i < 64; ++i) d += static_cast<int>(((a[w] >> i) & 1u) != ((b[w] >> i) & 1u));
  return d;
}

TEST(KvCrushMath, HammingIsTheCountOfDifferingBits) {
  std::mt19937_64 rng(5);
  for (int words : {1, 2, 3}) {
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<uint64_t> a(static_cast<size_t>(words)), b(static_cast<size_t>(words));
      for (auto& x : a) x = rng();
      for (auto& x : b) x = trial % 4 == 0 ? 0 : rng();  // also against zero
      const int d = kvcrush_hamming(a.data(), b.data(), words);
      ASSERT_EQ(d, bit_loop_distance(a, b));
      ASSERT_EQ(d, kvcrush_hamming(b.data(), a.data(), words));  // symmetric
      ASSERT_EQ(d, kvret::hamming_distance(a.data(), b.data(), words));
      ASSERT_EQ(kvcrush_hamming(a.data(), a.data(), words), 0);
    }
  }
  const uint64_t ones = ~uint64_t{0}, zero = 0;
  EXPECT_EQ(kvcrush_hamming(&ones, &zero, 1), 64);
}

TEST(KvCrushMath, AlternatingAnchorHasTheOddHeadsOnly) {
  for (int heads : {1, 2, 7, 63, 64, 65, 100, 128, 130}) {
    const int words = (heads + 63) / 64;
    std::vector<uint64_t> cpu(static_cast<size_t>(words));
    kvret::make_anchor(kvret::Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, cpu.data());
    for (int w = 0; w < words; ++w) {
      const uint64_t word = kvcrush_alternating_word(w, heads);
      EXPECT_EQ(word, cpu[static_cast<size_t>(w)]) << "heads " << heads << " word " << w;
      for (int i = 0; i < 64; ++i) {
        const int h = 64 * w + i;
        EXPECT_EQ((word >> i) & 1u, h < heads && h % 2 == 1 ? 1u : 0u) << "heads " << heads << " bit " << h;
        EXPECT_EQ((kvcrush_word_mask(w, heads) >> i) & 1u, h < heads ? 1u : 0u) << "heads " << heads << " bit " << h;
      }
    }
  }
}

TEST(KvCrushMath, BucketOfInvertsBucketBegin) {
  for (int64_t n : {1, 2, 5, 17, 100, 1003, 32768})
    for (int64_t buckets : {1, 2, 3, 7, 16, 100, 256}) {
      if (buckets > n) continue;  // every bucket non-empty: each entry has one bucket, each bucket a first entry
      ASSERT_EQ(kvcrush_bucket_begin(0, n, buckets), 0);
      ASSERT_EQ(kvcrush_bucket_begin(buckets, n, buckets), n);
      int64_t b = 0;
      for (int64_t k = 0; k < n; ++k) {
        while (kvcrush_bucket_begin(b + 1, n, buckets) <= k) ++b;  // the bucket holding k, by the boundaries
        ASSERT_EQ(kvcrush_bucket_of(k, n, buckets), b) << "n " << n << " buckets " << buckets << " k " << k;
        ASSERT_EQ(kvcrush_bucket_begin(b, n, buckets), kvret::bucket_begin(b, n, buckets));
      }
      ASSERT_EQ(b, buckets - 1);
    }
}

}  // namespace
