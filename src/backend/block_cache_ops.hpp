#pragma once
// The CUDA backend's block cache (docs/cuda_backend.md), as per-element functors for Thrust passes: compiled for
// the device by nvcc and for the host on Thrust's OpenMP system, so that CI runs the very code a GPU runs. The
// decisions (eviction keys, the use of a cached block, candidates, their saturated counts) are the functions of
// kernels/math/block_cache_math.h, the ones the tuned kernels of kernels/block_cache use; the rule is written in
// kernels/block_cache.h. One cache holds, per KV head, n_slots slots of block_tokens rows (keys and values, the
// store's element type); a block is block_tokens consecutive positions.
//
// One update (after a fetch) or prefetch is these passes, each over every (head, block) or (head, slot):
//   CountSelected   selected positions per block (a prefetch: 1 per touched block)
//   UseSlots        cached blocks with a count are used (stamped), and every slot gets its eviction key
//   (stable sort of the slots by (head, key): the victims first, equal keys in slot order)
//   CandidateKeys   uncached complete selected blocks, by (head, descending saturated count)
//   (stable sort of the blocks by that key: equal counts keep ascending block order)
//   AdmitCounts     per head A = min(max_admit, candidates, evictable slots)
//   MarkAdmitted    the first A candidates of each head
//   (exclusive scan of the marks per head: the rank of each admitted block in ascending block order)
//   Install         the r-th admitted block into the r-th victim slot (table, slot, stamp, prefetched flag)
//   FillSlots       the admitted blocks' rows copied from the host store into their slots
#include <cstddef>
#include <cstdint>

#include "backend/device_math.hpp"
#include "math/block_cache_math.h"
#include "math/kv_math.h"

namespace kvret::device_math {

namespace bc = kvret::cuda::math;

/// One (sequence, layer) cache as the passes see it (device memory).
struct CacheView {
  int32_t* table = nullptr;       ///< [heads, max_blocks]: block -> slot, or -1
  int32_t* slot_block = nullptr;  ///< [heads, n_slots]: slot -> block, or -1 (empty)
  uint32_t* stamp = nullptr;      ///< [heads, n_slots]: LRU: step of the last use; LFU: use count
  uint8_t* prefetched = nullptr;  ///< [heads, n_slots]: 1 while a block a prefetch loaded is unused
  std::byte* k = nullptr;         ///< [heads, n_slots, block_tokens, row_bytes]
  std::byte* v = nullptr;         ///< same layout
  int32_t max_blocks = 0;         ///< entries of the table per head
  int32_t n_slots = 0;
  int32_t block_tokens = 0;
  int64_t row_bytes = 0;
  std::byte* window_k = nullptr;  ///< [heads, window.sink_slots + window.local_slots, row_bytes], or null
  std::byte* window_v = nullptr;  ///< same layout
  cuda::WindowRows window;        ///< the positions the windows hold

  /// Whether a gather may find rows here: a cached block or a held window row.
  bool serves() const noexcept {
    return (table != nullptr && max_blocks > 0) ||
           (window_k != nullptr && (window.sink_end > 0 || window.local_end > window.local_begin));
  }

  /// The key (kv 0) or value (kv 1) row of (head, position) in device memory: the windows' row where they hold the
  /// position, else the cached block's; null when neither holds it.
  KVRET_BACKEND_HD const std::byte* row(int kv, int64_t head, int64_t position) const {
    if (window_k != nullptr) {
      const int32_t w = cuda::math::window_slot(window, position);
      if (w >= 0)
        return (kv == 0 ? window_k : window_v) + (head * (window.sink_slots + window.local_slots) + w) * row_bytes;
    }
    if (table == nullptr || position < 0) return nullptr;
    const int64_t block = position / block_tokens;
    if (block >= max_blocks) return nullptr;
    const int32_t slot = table[head * max_blocks + block];
    if (slot < 0) return nullptr;
    const int64_t offset = ((head * n_slots + slot) * block_tokens + position % block_tokens) * row_bytes;
    return (kv == 0 ? k : v) + offset;
  }
};

/// Element i (head h, the r-th of n positions from `from`, element e) of a load of the device windows: that
/// element of the key and the value row of position from + r, from the store's pages (HostKvStore's layout: keys of
/// every head, then values) into the windows' row that window_slot gives in `next`.
struct FillWindow {
  std::byte* window_k;
  std::byte* window_v;
  cuda::WindowRows next;
  const std::byte* const* pages;  ///< [n_pages] the pages' bases
  int64_t heads, page_tokens, row_bytes, from, n;
  int32_t type, head_dim;  ///< the store's element type, elements per row
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t e = i % head_dim;
    const int64_t r = (i / head_dim) % n;
    const int64_t h = i / head_dim / n;
    const int64_t position = from + r;
    const int32_t w = cuda::math::window_slot(next, position);
    if (w < 0) return;
    const std::byte* key = pages[position / page_tokens] + (h * page_tokens + position % page_tokens) * row_bytes;
    const int64_t dst = (h * (next.sink_slots + next.local_slots) + w) * row_bytes;
    copy_element(key, type, window_k + dst, type, e);
    copy_element(key + heads * page_tokens * row_bytes, type, window_v + dst, type, e);
  }
};

/// The gather of GatherRows reading rows the cache holds (its windows, its blocks) from it: hit[r] = 1 where row r
/// came from it.
struct GatherCachedRows {
  GatherRows gather;
  CacheView cache;
  uint8_t* hit;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const RowCopy& c = gather.rows[i / gather.head_dim];
    const int64_t e = i % gather.head_dim;
    const std::byte* k_src = cache.row(0, c.head, c.position);
    const std::byte* v_src = cache.row(1, c.head, c.position);
    const bool cached = k_src != nullptr;
    copy_element(cached ? k_src : c.k_src, gather.src_type, gather.k_out.at(c.head, c.row), gather.k_out.type, e);
    copy_element(cached ? v_src : c.v_src, gather.src_type, gather.v_out.at(c.head, c.row), gather.v_out.type, e);
    if (e == 0) {
      *reinterpret_cast<int32_t*>(gather.positions.at(c.head, c.row)) = c.position;
      hit[i / gather.head_dim] = cached ? 1 : 0;
    }
  }
};

/// One job (sequence) of a batched gather (CudaBackend::gather_batch): its outputs and its (sequence, layer) cache
/// (table null, or max_blocks 0: none).
struct BatchGatherJob {
  DeviceTensor k_out, v_out, positions;
  CacheView cache;
};

/// Element i of the gather of a whole batch, one row list for every job (row i / head_dim, of job
/// job_of_row[i / head_dim]): GatherCachedRows with that job's outputs and cache, so each row's bytes are the ones
/// a gather of the job alone writes; hit[r] = 1 where row r came from a cache.
struct GatherBatchRows {
  const RowCopy* rows;
  const int32_t* job_of_row;
  const BatchGatherJob* jobs;
  int32_t src_type, head_dim;
  uint8_t* hit;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const BatchGatherJob& j = jobs[job_of_row[i / head_dim]];
    GatherCachedRows{GatherRows{rows, j.k_out, j.v_out, j.positions, src_type, head_dim}, j.cache, hit}(i);
  }
};

/// Element j: the rows of job j a batched gather served from its cache, from the inclusive scan of the batch's hits
/// (job j's rows are [ends[j - 1], ends[j]), ends[-1] = 0).
struct JobHits {
  const int64_t* scanned;
  const int64_t* ends;
  int64_t* hits;
  KVRET_BACKEND_HD void operator()(int64_t j) const {
    const int64_t begin = j == 0 ? 0 : ends[j - 1];
    const int64_t end = ends[j];
    hits[j] = end == begin ? 0 : scanned[end - 1] - (begin == 0 ? 0 : scanned[begin - 1]);
  }
};

/// The first index of the ascending items[0, n) that is >= x.
KVRET_BACKEND_HD inline int64_t lower_bound_i32(const int32_t* items, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (items[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// The first index of the ascending keys[0, n) that is >= x.
KVRET_BACKEND_HD inline int64_t lower_bound_u64(const uint64_t* keys, int64_t n, uint64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// (head, value) as one sort key: heads stay apart, values ascend within a head.
KVRET_BACKEND_HD inline uint64_t head_key(int64_t head, uint64_t value) {
  return (static_cast<uint64_t>(head) << 32) | value;
}

/// Element i = head * max_blocks + block: the selected positions of the head in the block (items: [heads, n],
/// ascending per head); a prefetch counts 1 for a touched block.
struct CountSelected {
  const int32_t* items;  ///< [heads, stride]: n ascending positions per head
  int64_t n, stride;
  int32_t max_blocks, block_tokens;
  bool prefetch;
  int32_t* counts;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / max_blocks, b = i % max_blocks;
    const int32_t* head_items = items + h * stride;
    const int64_t first = lower_bound_i32(head_items, n, b * block_tokens);
    const int64_t count = lower_bound_i32(head_items, n, (b + 1) * block_tokens) - first;
    counts[i] = static_cast<int32_t>(prefetch && count > 0 ? 1 : count);
  }
};

/// Element i = head * n_slots + slot: a cached block the call selected is used (an update stamps it with
/// block_cache_used_stamp and clears its prefetched flag; a prefetch only protects it); the slot's eviction key
/// (block_cache_evict_key) as (head, key) with the slot as the sort's value.
struct UseSlots {
  CacheView cache;
  const int32_t* counts;  ///< [heads, max_blocks]
  int32_t policy;
  uint32_t step;
  bool prefetch;
  uint64_t* keys;
  int32_t* slots;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / cache.n_slots;
    const int32_t block = cache.slot_block[i];
    const bool used = block >= 0 && block < cache.max_blocks && counts[h * cache.max_blocks + block] > 0;
    const uint32_t key = bc::block_cache_evict_key(block, used, block < 0 ? 0u : cache.stamp[i]);
    if (used && !prefetch) {
      cache.stamp[i] = bc::block_cache_used_stamp(static_cast<cuda::CachePolicy>(policy), cache.stamp[i], step);
      cache.prefetched[i] = 0;
    }
    keys[i] = head_key(h, key);
    slots[i] = static_cast<int32_t>(i % cache.n_slots);
  }
};

/// The key past every candidate of a head's segment.
inline constexpr uint64_t kNotCandidate = bc::kBlockCacheCountBins;

/// Element i = head * max_blocks + block: (head, 255 - saturated count) for a candidate (block_cache_candidate),
/// (head, 256) otherwise; the block as the sort's value.
struct CandidateKeys {
  const int32_t* table;
  const int32_t* counts;
  int32_t max_blocks, block_tokens;
  int64_t n_tokens;
  uint64_t* keys;
  int32_t* blocks;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / max_blocks, b = i % max_blocks;
    const int count = counts[i];
    const bool candidate = bc::block_cache_candidate(count, table[i], b, block_tokens, n_tokens);
    keys[i] =
        head_key(h, candidate ? static_cast<uint64_t>(bc::kBlockCacheCountBins - 1 - bc::block_cache_count_bin(count))
                              : kNotCandidate);
    blocks[i] = static_cast<int32_t>(b);
  }
};

/// Element h: A = min(max_admit, the head's candidates, its evictable slots) from the sorted keys.
struct AdmitCounts {
  const uint64_t* block_keys;  ///< sorted [heads, max_blocks]
  const uint64_t* slot_keys;   ///< sorted [heads, n_slots]
  int32_t max_blocks, n_slots, max_admit;
  int32_t* admit;
  KVRET_BACKEND_HD void operator()(int64_t h) const {
    const int64_t candidates = lower_bound_u64(block_keys + h * max_blocks, max_blocks, head_key(h, kNotCandidate));
    const int64_t evictable = lower_bound_u64(slot_keys + h * n_slots, n_slots, head_key(h, bc::kBlockCachePinned));
    int64_t a = max_admit < candidates ? max_admit : candidates;
    a = a < evictable ? a : evictable;
    admit[h] = static_cast<int32_t>(a);
  }
};

/// Element i = head * max_blocks + r: marks the r-th best candidate of the head when r < A (marks: zeroed before).
struct MarkAdmitted {
  const int32_t* sorted_blocks;
  const int32_t* admit;
  int32_t max_blocks;
  int32_t* marks;  ///< [heads, max_blocks] by block
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / max_blocks, r = i % max_blocks;
    if (r < admit[h]) marks[h * max_blocks + sorted_blocks[i]] = 1;
  }
};

/// The head of element i of a [heads, width] array (the scan's segment key).
struct HeadOf {
  int64_t width;
  KVRET_BACKEND_HD int64_t operator()(int64_t i) const { return i / width; }
};

/// A block loaded into a slot.
struct BlockLoad {
  int32_t slot;
  int32_t block;
};

/// Element i = head * max_blocks + block: a marked block, the rank-th admitted of its head in ascending block
/// order, goes to the rank-th victim (the sorted slots), evicting the block there; loads[head, rank] records it.
struct Install {
  CacheView cache;
  const int32_t* marks;
  const int32_t* ranks;
  const int32_t* victims;  ///< sorted slots [heads, n_slots]
  int32_t policy;
  uint32_t step;
  bool prefetch;
  BlockLoad* loads;  ///< [heads, n_slots]
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    if (marks[i] == 0) return;
    const int64_t h = i / cache.max_blocks;
    const int32_t block = static_cast<int32_t>(i % cache.max_blocks);
    const int32_t rank = ranks[i];
    const int32_t slot = victims[h * cache.n_slots + rank];
    const int64_t s = h * cache.n_slots + slot;
    const int32_t old = cache.slot_block[s];  // cached, so no admitted block: no other element writes its entry
    if (old >= 0 && old < cache.max_blocks) cache.table[h * cache.max_blocks + old] = -1;
    cache.slot_block[s] = block;
    cache.table[i] = slot;
    cache.stamp[s] = bc::block_cache_admit_stamp(static_cast<cuda::CachePolicy>(policy), step);
    cache.prefetched[s] = prefetch ? 1 : 0;
    loads[h * cache.n_slots + rank] = BlockLoad{slot, block};
  }
};

/// Element i of [heads, most, block_tokens, units]: unit u of row t of the head's r-th load (r < A), keys and
/// values, from the host store's pages (page p: keys of every head then values, page_tokens rows per head) into
/// the slot. Units are the store's elements (2 or 4 bytes).
struct FillSlots {
  CacheView cache;
  const BlockLoad* loads;
  const int32_t* admit;
  const std::byte* const* pages;  ///< [n_pages] the pages' bases
  int64_t heads, page_tokens;
  int32_t most;  ///< the most blocks any head may admit (a head's blocks past its A are skipped)
  int32_t units;
  int32_t unit_bytes;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t u = i % units;
    const int64_t t = (i / units) % cache.block_tokens;
    const int64_t r = (i / units / cache.block_tokens) % most;
    const int64_t h = i / units / cache.block_tokens / most;
    if (r >= admit[h]) return;
    const BlockLoad load = loads[h * cache.n_slots + r];
    const int64_t position = static_cast<int64_t>(load.block) * cache.block_tokens + t;
    const std::byte* page = pages[position / page_tokens];
    const int64_t key_offset = (h * page_tokens + position % page_tokens) * cache.row_bytes + u * unit_bytes;
    const int64_t value_offset = key_offset + heads * page_tokens * cache.row_bytes;
    const int64_t dst = ((h * cache.n_slots + load.slot) * cache.block_tokens + t) * cache.row_bytes + u * unit_bytes;
    if (unit_bytes == 4) {
      *reinterpret_cast<uint32_t*>(cache.k + dst) = *reinterpret_cast<const uint32_t*>(page + key_offset);
      *reinterpret_cast<uint32_t*>(cache.v + dst) = *reinterpret_cast<const uint32_t*>(page + value_offset);
    } else {
      *reinterpret_cast<uint16_t*>(cache.k + dst) = *reinterpret_cast<const uint16_t*>(page + key_offset);
      *reinterpret_cast<uint16_t*>(cache.v + dst) = *reinterpret_cast<const uint16_t*>(page + value_offset);
    }
  }
};

/// Element i = head * rows + row of a working set gathered from device positions: the row's RowCopy (sink rows,
/// then the `count` selected positions of the head's row of `selected`, then the local rows), its key and value
/// rows in the store's pages (HostKvStore's layout: keys of every head, then values).
struct WorkingSetRowCopies {
  const int32_t* selected;  ///< [heads, stride]
  int64_t stride, count, mid_begin, mid_end, rows, heads, page_tokens, row_bytes;
  const std::byte* const* pages;  ///< [n_pages] the pages' bases
  RowCopy* copies;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / rows, r = i % rows;
    const int64_t p = r < mid_begin           ? r
                      : r < mid_begin + count ? int64_t{selected[h * stride + (r - mid_begin)]}
                                              : mid_end + (r - mid_begin - count);
    const std::byte* page = pages[p / page_tokens];
    const int64_t key = (h * page_tokens + p % page_tokens) * row_bytes;
    copies[i] = RowCopy{page + key, page + key + heads * page_tokens * row_bytes, h, r, static_cast<int32_t>(p)};
  }
};

/// hit[i] as an int64_t (the scan that counts a gather's cache hits on the device).
struct HitAsI64 {
  KVRET_BACKEND_HD int64_t operator()(uint8_t hit) const { return hit; }
};

/// One element: adds the last of `scanned` (the inclusive scan of a gather's hits, n > 0) to *counter.
struct AddLast {
  const int64_t* scanned;
  int64_t n;
  int64_t* counter;
  KVRET_BACKEND_HD void operator()(int64_t) const { *counter += scanned[n - 1]; }
};

/// One element: adds each job's count (counts[j * stride]) to its counter (*targets[j]; none where null), one job
/// after another, since jobs of one sequence share its counter.
template <class Count>
struct AddJobCounts {
  const Count* counts;
  int64_t stride;
  int64_t* const* targets;
  int64_t n;
  KVRET_BACKEND_HD void operator()(int64_t) const {
    for (int64_t j = 0; j < n; ++j)
      if (targets[j] != nullptr) *targets[j] += static_cast<int64_t>(counts[j * stride]);
  }
};

/// One element: adds the bytes of the blocks an update admitted (A per head, keys and values) to *counter.
struct AddAdmittedBytes {
  const int32_t* admit;
  int64_t heads, block_bytes;
  int64_t* counter;
  KVRET_BACKEND_HD void operator()(int64_t) const {
    int64_t blocks = 0;
    for (int64_t h = 0; h < heads; ++h) blocks += admit[h];
    *counter += 2 * blocks * block_bytes;
  }
};

/// Element i = head * n_slots + slot: empties the slot when its block holds a position >= from (a cache whose
/// stored rows changed or moved there).
struct DropFrom {
  CacheView cache;
  int64_t from;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int32_t block = cache.slot_block[i];
    if (block < 0 || (static_cast<int64_t>(block) + 1) * cache.block_tokens <= from) return;
    const int64_t h = i / cache.n_slots;
    if (block < cache.max_blocks) cache.table[h * cache.max_blocks + block] = -1;
    cache.slot_block[i] = -1;
    cache.stamp[i] = 0;
    cache.prefetched[i] = 0;
  }
};

/// Element i of the new table [heads, new_blocks]: the old entry, or -1 past the old table.
struct GrowTable {
  const int32_t* old_table;
  int32_t old_blocks, new_blocks;
  int32_t* table;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / new_blocks, b = i % new_blocks;
    table[i] = b < old_blocks ? old_table[h * old_blocks + b] : -1;
  }
};

/// Element i: 0.
struct ZeroI32 {
  int32_t* out;
  KVRET_BACKEND_HD void operator()(int64_t i) const { out[i] = 0; }
};

/// Element i: the empty state of a new cache's slots.
struct ClearSlots {
  int32_t* slot_block;
  uint32_t* stamp;
  uint8_t* prefetched;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    slot_block[i] = -1;
    stamp[i] = 0;
    prefetched[i] = 0;
  }
};

}  // namespace kvret::device_math
