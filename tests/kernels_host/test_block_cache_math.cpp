// The block cache's decision math (kernels/math/block_cache_math.h): the rules documented in block_cache.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "math/block_cache_math.h"

namespace {

using namespace kvret::cuda::math;
using kvret::cuda::CachePolicy;

TEST(BlockCacheMath, EvictionKeys) {
  EXPECT_EQ(block_cache_evict_key(-1, false, 77u), 0u);  // empty: first victim
  EXPECT_EQ(block_cache_evict_key(-1, true, 77u), 0u);
  EXPECT_EQ(block_cache_evict_key(3, true, 77u), kBlockCachePinned);  // used now: kept
  EXPECT_EQ(block_cache_evict_key(3, false, 77u), 78u);
  EXPECT_EQ(block_cache_evict_key(3, false, 0u), 1u);                               // never below an empty slot
  EXPECT_EQ(block_cache_evict_key(3, false, 0xffffffffu), kBlockCachePinned - 1u);  // never pinned by saturation
  EXPECT_EQ(block_cache_evict_key(3, false, 0xfffffffeu), kBlockCachePinned - 1u);
}

TEST(BlockCacheMath, StampsOfUseAndAdmission) {
  EXPECT_EQ(block_cache_used_stamp(CachePolicy::kLru, 5u, 9u), 9u);
  EXPECT_EQ(block_cache_used_stamp(CachePolicy::kLfu, 5u, 9u), 6u);
  EXPECT_EQ(block_cache_used_stamp(CachePolicy::kLfu, 0xfffffffeu, 9u), 0xfffffffeu);  // saturates below pinned
  EXPECT_EQ(block_cache_admit_stamp(CachePolicy::kLru, 9u), 9u);
  EXPECT_EQ(block_cache_admit_stamp(CachePolicy::kLfu, 9u), 1u);
}

TEST(BlockCacheMath, CandidatesAndBins) {
  EXPECT_TRUE(block_cache_candidate(1, -1, 0, 128, 128));
  EXPECT_FALSE(block_cache_candidate(0, -1, 0, 128, 128));  // not selected
  EXPECT_FALSE(block_cache_candidate(3, 4, 0, 128, 128));   // cached already
  EXPECT_FALSE(block_cache_candidate(3, -1, 1, 128, 255));  // still growing
  EXPECT_TRUE(block_cache_candidate(3, -1, 1, 128, 256));
  EXPECT_EQ(block_cache_count_bin(7), 7);
  EXPECT_EQ(block_cache_count_bin(255), 255);
  EXPECT_EQ(block_cache_count_bin(4000), 255);
}

TEST(BlockCacheMath, VictimOrderIsAStableSortByKey) {
  std::mt19937 rng(2);
  std::vector<uint32_t> keys(kBlockCacheSlots);
  for (uint32_t& k : keys) k = rng() % 6 == 0 ? kBlockCachePinned : rng() % 16;
  std::vector<int32_t> mine(keys.size()), stable(keys.size());
  std::iota(mine.begin(), mine.end(), 0);
  std::iota(stable.begin(), stable.end(), 0);
  std::shuffle(mine.begin(), mine.end(), rng);
  std::sort(mine.begin(), mine.end(), [&](int32_t a, int32_t b) {
    return block_cache_victim_before(keys[static_cast<size_t>(a)], a, keys[static_cast<size_t>(b)], b);
  });
  std::stable_sort(stable.begin(), stable.end(),
                   [&](int32_t a, int32_t b) { return keys[static_cast<size_t>(a)] < keys[static_cast<size_t>(b)]; });
  EXPECT_EQ(mine, stable);
}

TEST(BlockCacheMath, ClampsKeepTheLaunchBounds) {
  // a cache whose device-side max_blocks exceeds the launch's bound would overflow the kernel's shared counts
  EXPECT_EQ(block_cache_clamp_blocks(5000, 1024), 1024);
  EXPECT_EQ(block_cache_clamp_blocks(100, 1024), 100);
  EXPECT_EQ(block_cache_clamp_blocks(-3, 1024), 0);
  EXPECT_EQ(block_cache_clamp_blocks(10, -1), 0);
  EXPECT_EQ(block_cache_clamp_slots(4096), kBlockCacheSlots);
  EXPECT_EQ(block_cache_clamp_slots(12), 12);
  EXPECT_EQ(block_cache_clamp_slots(-12), 0);
}

}  // namespace
