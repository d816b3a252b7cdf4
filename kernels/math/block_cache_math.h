#pragma once
// Decision math of the block cache (block_cache.cuh): eviction keys, the use of a cached block, the admission
// candidates and their saturated counts, the victim order, and the clamp of a cache's device-side block count.
#include "../kernel_types.h"
#include "hd.h"

namespace kvret::cuda::math {

/// The largest n_slots a cache may have (the victim choice sorts the slots in one thread block).
inline constexpr int32_t kBlockCacheSlots = 2048;
/// Selected-token counts saturate at kBlockCacheCountBins - 1 for the admission threshold.
inline constexpr int kBlockCacheCountBins = 256;
/// The eviction key of a slot this call must keep (a used or prefetched-and-listed block).
inline constexpr uint32_t kBlockCachePinned = 0xffffffffu;

/// The eviction key of a slot: 0 when empty, kBlockCachePinned when its block is used by this call, else (kLru)
/// its stamp + 1 or (kLfu) its count + 1, saturated below kBlockCachePinned. Victims are the smallest keys.
KVRET_HD uint32_t block_cache_evict_key(int32_t slot_block, bool used, uint32_t stamp) {
  if (slot_block < 0) return 0u;
  if (used) return kBlockCachePinned;
  return (stamp < kBlockCachePinned - 2u ? stamp : kBlockCachePinned - 2u) + 1u;
}

/// The stamp of a cached block used by an update: kLru: the step; kLfu: its count + 1 (saturating).
KVRET_HD uint32_t block_cache_used_stamp(CachePolicy policy, uint32_t stamp, uint32_t step) {
  if (policy == CachePolicy::kLru) return step;
  return stamp < kBlockCachePinned - 1u ? stamp + 1u : stamp;
}

/// The stamp of a newly admitted block: kLru: the step; kLfu: 1.
KVRET_HD uint32_t block_cache_admit_stamp(CachePolicy policy, uint32_t step) {
  return policy == CachePolicy::kLru ? step : 1u;
}

/// The admission bin of a block's selected-token count (saturated).
KVRET_HD int block_cache_count_bin(int count) {
  return count < kBlockCacheCountBins - 1 ? count : kBlockCacheCountBins - 1;
}

/// An admission candidate: selected (count > 0), not cached (table entry < 0), and complete (every token of the
/// block is stored: a still-growing block is never cached).
KVRET_HD bool block_cache_candidate(int count, int32_t table_entry, int64_t block, int32_t block_tokens,
                                    int64_t n_tokens) {
  return count > 0 && table_entry < 0 && (block + 1) * block_tokens <= n_tokens;
}

/// The victim order: ascending eviction key, equal keys by ascending slot (a stable sort of the slots by key).
KVRET_HD bool block_cache_victim_before(uint32_t key_a, int32_t slot_a, uint32_t key_b, int32_t slot_b) {
  return key_a < key_b || (key_a == key_b && slot_a < slot_b);
}

/// The blocks of a cache the bookkeeping kernel considers: the device-side cache.max_blocks clamped to
/// [0, launch_max_blocks] (the launch's bound sizes the kernel's shared counts; blocks beyond it are ignored:
/// neither counted nor admitted).
KVRET_HD int32_t block_cache_clamp_blocks(int32_t cache_max_blocks, int32_t launch_max_blocks) {
  return static_cast<int32_t>(clamp_i64(cache_max_blocks, 0, launch_max_blocks < 0 ? 0 : launch_max_blocks));
}

/// The slots of a cache the bookkeeping kernel considers: n_slots clamped to [0, kBlockCacheSlots].
KVRET_HD int32_t block_cache_clamp_slots(int32_t n_slots) {
  return static_cast<int32_t>(clamp_i64(n_slots, 0, kBlockCacheSlots));
}

}  // namespace kvret::cuda::math
