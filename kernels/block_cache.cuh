#pragma once
// Kernels of launch_block_cache_update / launch_block_cache_prefetch (see block_cache.h).
//
// Bookkeeping: one thread block per (sequence, KV head). Block counts live in shared memory; the admitted blocks
// are chosen like the top-k selection (a histogram of the counts, a cub::BlockScan for the threshold count, an
// order-preserving compaction), the victims by a cub::BlockRadixSort of the slots' eviction keys (stable, so equal
// keys keep slot order). Then a copy kernel, laid out like the gather, moves the admitted blocks' rows from mapped
// pinned host memory into their slots.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "block_cache.h"
#include "kv_source.cuh"
#include "math/block_cache_math.h"
#include "math/topk_math.h"

namespace kvret::cuda::block_cache_detail {

inline constexpr int kBookThreads = 512;
inline constexpr int kSlotsPerThread = kBlockCacheMaxSlots / kBookThreads;
static_assert(kSlotsPerThread * kBookThreads == kBlockCacheMaxSlots);
inline constexpr int kBlocksPerThread = 4;  // compaction tile
inline constexpr int kCountBins = math::kBlockCacheCountBins;
inline constexpr uint32_t kPinned = math::kBlockCachePinned;  // eviction key of a slot this call must keep

inline constexpr int kCopyThreads = 256;
inline constexpr int kCopyUnroll = 4;
inline constexpr int kCopyPiecesPerBlock = kCopyThreads * kCopyUnroll;

struct BlockLoad {
  int32_t slot;
  int32_t block;
};

using Sort = cub::BlockRadixSort<uint32_t, kBookThreads, kSlotsPerThread, int32_t>;
using Scan = cub::BlockScan<int, kBookThreads>;
union BookTemp {
  typename Sort::TempStorage sort;
  typename Scan::TempStorage scan;
};
/// Static shared memory of bookkeeping_kernel: sort/scan storage, the count histogram, the admitted blocks and
/// their victims, two scalars. The dynamic part is the block counts, [launch max_blocks] ints.
inline constexpr size_t kBookStaticSmemBytes =
    sizeof(BookTemp) + sizeof(int) * (kCountBins + 2 * kBlockCacheMaxSlots + 2);
static_assert(kBookStaticSmemBytes <= 40 * 1024, "block cache: static shared memory over its 40 KiB budget");

/// One block per (sequence, KV head). launch_max_blocks is the launch's host-side bound: the block counts in
/// shared memory have that many entries, and a cache's device-side max_blocks is clamped to it.
__global__ void __launch_bounds__(kBookThreads, 1)
    bookkeeping_kernel(const BlockCacheUpdateSeq* seqs, KvGeometry geo, CachePolicy policy, int max_admit,
                       int launch_max_blocks, bool prefetch, BlockLoad* loads, int32_t* load_counts) {
  __shared__ BookTemp temp;
  __shared__ int hist[kCountBins];
  __shared__ int admitted[kBlockCacheMaxSlots];
  __shared__ int victims[kBlockCacheMaxSlots];
  __shared__ int s_threshold;
  __shared__ int s_need_equal;
  extern __shared__ int block_count[];  // [launch_max_blocks]; the first max_blocks are used

  const int pair = static_cast<int>(blockIdx.x);
  const int s = pair / geo.n_kv_heads;
  const int h = pair % geo.n_kv_heads;
  const int tid = static_cast<int>(threadIdx.x);
  const BlockCacheUpdateSeq& q = seqs[s];
  const BlockCacheView& cache = q.cache;
  const int table_stride = max(cache.max_blocks, 0);                                           // the table's real size
  const int max_blocks = math::block_cache_clamp_blocks(cache.max_blocks, launch_max_blocks);  // blocks considered
  const int n_slots = math::block_cache_clamp_slots(cache.n_slots);
  const int slot_stride = max(cache.n_slots, 0);
  int32_t* table = cache.block_table + static_cast<int64_t>(h) * table_stride;
  int32_t* slot_block = cache.slot_block + static_cast<int64_t>(h) * slot_stride;
  uint32_t* stamp = cache.slot_stamp + static_cast<int64_t>(h) * slot_stride;
  uint8_t* prefetched =
      cache.slot_prefetched != nullptr ? cache.slot_prefetched + static_cast<int64_t>(h) * slot_stride : nullptr;

  // 1. selected tokens per block
  for (int b = tid; b < max_blocks; b += kBookThreads) block_count[b] = 0;
  for (int b = tid; b < kCountBins; b += kBookThreads) hist[b] = 0;
  __syncthreads();
  const int32_t* items = q.items + h * q.items_stride;
  for (int i = tid; i < q.n_items; i += kBookThreads) {
    const int32_t item = items[i];
    if (item < 0) continue;
    const int64_t block = prefetch ? item : item / geo.block_tokens;
    if (block >= max_blocks) continue;
    if (prefetch) {
      atomicOr(&block_count[block], 1);
    } else {
      atomicAdd(&block_count[block], 1);
    }
  }
  __syncthreads();

  // 2. use the cached blocks that were selected; eviction keys of every slot (blocked: slot = tid * 4 + i)
  uint32_t keys[kSlotsPerThread];
  int32_t slots[kSlotsPerThread];
  int evictable = 0;
#pragma unroll
  for (int i = 0; i < kSlotsPerThread; ++i) {
    const int slot = tid * kSlotsPerThread + i;
    keys[i] = kPinned;
    slots[i] = -1;
    if (slot >= n_slots) continue;
    slots[i] = slot;
    const int32_t block = slot_block[slot];
    const bool used = block >= 0 && block < max_blocks && block_count[block] > 0;
    keys[i] = math::block_cache_evict_key(block, used, block < 0 ? 0u : stamp[slot]);
    if (used && !prefetch) {
      stamp[slot] = math::block_cache_used_stamp(policy, stamp[slot], q.step);
      if (prefetched != nullptr) prefetched[slot] = 0;
    }
    evictable += keys[i] != kPinned ? 1 : 0;
  }

  // 3. candidates: selected, not cached, complete; histogram of their (saturated) counts
  for (int b = tid; b < max_blocks; b += kBookThreads) {
    const int count = block_count[b];
    if (math::block_cache_candidate(count, table[b], b, geo.block_tokens, q.host.n_tokens)) {
      atomicAdd(&hist[math::block_cache_count_bin(count)], 1);
    }
  }
  int unused = 0;
  int n_evictable = 0;
  Scan(temp.scan).ExclusiveSum(evictable, unused, n_evictable);
  __syncthreads();  // hist complete; temp.scan free again

  // 4. the threshold count: thread t holds the number of candidates with count (255 - t)
  const int bin_count = tid < kCountBins ? hist[kCountBins - 1 - tid] : 0;
  int at_or_above = 0;
  int n_candidates = 0;
  Scan(temp.scan).InclusiveSum(bin_count, at_or_above, n_candidates);
  const int n_admit = min(min(max_admit, n_candidates), min(n_evictable, n_slots));
  if (tid < kCountBins && n_admit > 0 && math::radix_bin_holds(at_or_above, bin_count, n_admit)) {
    s_threshold = kCountBins - 1 - tid;
    s_need_equal = n_admit - (at_or_above - bin_count);
  }
  __syncthreads();
  const int threshold = n_admit > 0 ? s_threshold : kCountBins;
  const int need_equal = n_admit > 0 ? s_need_equal : 0;

  // ... the admitted blocks in ascending order: above the threshold, or at it and among the first need_equal
  int equal_carry = 0;
  int out_carry = 0;
  for (int base = 0; base < max_blocks && out_carry < n_admit; base += kBookThreads * kBlocksPerThread) {
    bool above[kBlocksPerThread];
    bool equal[kBlocksPerThread];
    int n_equal = 0;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int b = base + tid * kBlocksPerThread + i;
      above[i] = false;
      equal[i] = false;
      if (b < max_blocks) {
        const int count = math::block_cache_count_bin(block_count[b]);
        const bool candidate = math::block_cache_candidate(count, table[b], b, geo.block_tokens, q.host.n_tokens);
        above[i] = candidate && count > threshold;
        equal[i] = candidate && count == threshold;
      }
      n_equal += equal[i] ? 1 : 0;
    }
    int equal_rank = 0;
    int tile_equal = 0;
    Scan(temp.scan).ExclusiveSum(n_equal, equal_rank, tile_equal);
    __syncthreads();
    equal_rank += equal_carry;
    bool take[kBlocksPerThread];
    int n_take = 0;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      take[i] = above[i];
      if (equal[i]) {
        take[i] = equal_rank < need_equal;
        ++equal_rank;
      }
      n_take += take[i] ? 1 : 0;
    }
    int out_index = 0;
    int tile_taken = 0;
    Scan(temp.scan).ExclusiveSum(n_take, out_index, tile_taken);
    __syncthreads();
    out_index += out_carry;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      if (take[i]) admitted[out_index++] = base + tid * kBlocksPerThread + i;
    }
    equal_carry += tile_equal;
    out_carry += tile_taken;
  }

  // 5. victims: the slots in ascending eviction key (stable: equal keys keep slot order)
  Sort(temp.sort).Sort(keys, slots);
#pragma unroll
  for (int i = 0; i < kSlotsPerThread; ++i) {
    const int rank = tid * kSlotsPerThread + i;
    if (rank < n_admit) victims[rank] = slots[i];
  }
  __syncthreads();

  // 6. install: the r-th admitted block goes to the r-th victim
  BlockLoad* pair_loads = loads + static_cast<int64_t>(pair) * max_admit;
  for (int r = tid; r < n_admit; r += kBookThreads) {
    const int slot = victims[r];
    const int block = admitted[r];
    const int32_t old = slot_block[slot];
    if (old >= 0 && old < table_stride) table[old] = -1;
    slot_block[slot] = block;
    table[block] = slot;
    stamp[slot] = math::block_cache_admit_stamp(policy, q.step);
    if (prefetched != nullptr) prefetched[slot] = prefetch ? 1 : 0;
    pair_loads[r] = BlockLoad{slot, block};
  }
  if (tid == 0) load_counts[pair] = n_admit;
}

/// Copies the admitted blocks' rows from the host store into their slots. Grid (x: pieces, y: pair).
template <int kVecs>
__global__ void __launch_bounds__(kCopyThreads)
    fill_kernel(const BlockCacheUpdateSeq* seqs, KvGeometry geo, int max_admit, const BlockLoad* loads,
                const int32_t* load_counts) {
  constexpr int64_t kRowBytes = int64_t{kVecs} * 16;
  const int pair = static_cast<int>(blockIdx.y);
  const int s = pair / geo.n_kv_heads;
  const int h = pair % geo.n_kv_heads;
  const int64_t pieces_per_block = static_cast<int64_t>(geo.block_tokens) * kVecs;
  const int64_t total = load_counts[pair] * pieces_per_block;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kCopyPiecesPerBlock;
  if (first >= total) return;
  const BlockCacheUpdateSeq& q = seqs[s];
  const BlockLoad* pair_loads = loads + static_cast<int64_t>(pair) * max_admit;
  Vec16 key_piece[kCopyUnroll];
  Vec16 value_piece[kCopyUnroll];
  int64_t dst[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t piece = first + u * kCopyThreads + static_cast<int>(threadIdx.x);
    dst[u] = -1;
    if (piece >= total) continue;
    const BlockLoad load = pair_loads[piece / pieces_per_block];
    const int64_t in_load = piece % pieces_per_block;
    const int row = static_cast<int>(in_load / kVecs);
    const int vec = static_cast<int>(in_load % kVecs);
    const int64_t position = static_cast<int64_t>(load.block) * geo.block_tokens + row;
    const char* key_row = host_row(q.host, q.host.k_pages, position, h);
    const char* value_row = host_row(q.host, q.host.v_pages, position, h);
    if (!math::aligned16(key_row) || !math::aligned16(value_row)) continue;  // a view the host check rejects
    key_piece[u] = *reinterpret_cast<const Vec16*>(key_row + vec * 16);
    value_piece[u] = *reinterpret_cast<const Vec16*>(value_row + vec * 16);
    dst[u] = cache_row_offset(q.cache, h, load.slot, row, geo.block_tokens, kRowBytes) + vec * 16;
  }
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    if (dst[u] < 0) continue;
    *reinterpret_cast<Vec16*>(static_cast<char*>(q.cache.k) + dst[u]) = key_piece[u];
    *reinterpret_cast<Vec16*>(static_cast<char*>(q.cache.v) + dst[u]) = value_piece[u];
  }
}

}  // namespace kvret::cuda::block_cache_detail
