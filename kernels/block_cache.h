#pragma once
// The GPU block cache (PQCache): per (sequence, layer, KV head) a fixed number of slots, each holding the keys and
// values of one block of block_tokens consecutive tokens. After each fetch, the blocks that hold the most selected
// tokens are admitted, evicting by LRU or LFU; a prefetch admits given blocks ahead of the fetch that needs them.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kv_source.h"
#include "math/block_cache_math.h"

namespace kvret::cuda {

/// One sequence of a cache update or prefetch. Device memory.
struct BlockCacheUpdateSeq {
  BlockCacheView cache;
  HostKvView host;                 ///< where admitted blocks are loaded from
  const int32_t* items = nullptr;  ///< [n_kv_heads, items_stride]: token positions (update) or blocks (prefetch)
  int64_t items_stride = 0;
  int32_t n_items = 0;
  uint32_t step = 0;  ///< the caller's clock, one tick per update: the LRU stamp of the blocks used now
};

struct BlockCacheUpdateParams {
  const BlockCacheUpdateSeq* seqs = nullptr;  ///< device array [n_seqs]
  int32_t n_seqs = 0;
  KvGeometry geo;
  CachePolicy policy = CachePolicy::kLru;
  int32_t max_admit = 0;   ///< blocks admitted per (sequence, head) and call, 1 .. kBlockCacheMaxSlots
  int32_t max_blocks = 0;  ///< host-side upper bound of cache.max_blocks over the sequences: sizes the kernel's
                           ///< shared counts; a cache's device-side max_blocks is clamped to it (blocks beyond it
                           ///< are neither counted nor admitted)
};

/// The largest n_slots a cache may have (the victim choice sorts the slots in one thread block); a larger n_slots
/// is clamped to it on the device.
inline constexpr int32_t kBlockCacheMaxSlots = math::kBlockCacheSlots;

/// Device workspace of launch_block_cache_update / launch_block_cache_prefetch.
size_t block_cache_workspace_bytes(const BlockCacheUpdateParams& params) noexcept;

/// Update after a fetch; `items` are the selected token positions of each head. Per (sequence, head):
///  1. count the selected tokens of every block (positions outside [0, max_blocks * block_tokens) are ignored);
///  2. every cached block with a count > 0 is "used": kLru stamps it with `step`, kLfu adds 1 to its count, and its
///     prefetched flag is cleared; used blocks are not evicted by this call;
///  3. candidates are the blocks with a count > 0 that are not cached and are complete
///     ((block + 1) * block_tokens <= host.n_tokens: a block still growing is never cached);
///  4. A = min(max_admit, candidates, evictable slots) blocks are admitted: the A candidates with the largest
///     counts (counts saturate at 255; equal counts: the lower block first), taken in ascending block order;
///  5. victims are the A evictable slots with the smallest key (empty: 0; kLru: stamp + 1; kLfu: count + 1;
///     equal keys: the lower slot first); the r-th admitted block goes to the r-th victim, with stamp `step`
///     (kLru) or 1 (kLfu) and prefetched flag 0;
///  6. the admitted blocks are copied from the host store into their slots.
/// Stream-ordered: put it after the gather that read the cache (same stream, or an event) and before the next.
cudaError_t launch_block_cache_update(const BlockCacheUpdateParams& params, void* workspace, size_t workspace_bytes,
                                      cudaStream_t stream);

/// Prefetch: `items` are block indices to load. The same steps as the update, except that every listed block
/// counts 1, that cached listed blocks are protected from eviction without changing their stamp or count, and
/// that admitted blocks get the prefetched flag 1 (the gather counts rows from them as prefetch hits).
cudaError_t launch_block_cache_prefetch(const BlockCacheUpdateParams& params, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream);

}  // namespace kvret::cuda
