#pragma once
// Kernel of launch_working_set_gather (see working_set_gather.h).
//
// Grid (x: pieces of the rows, y: sequence * n_kv_heads + head). A row of kVecs 16-byte pieces is read by kVecs
// consecutive threads (a 256-byte f16 row of head_dim 128: half a warp). Each thread first issues the loads of its
// kGatherUnroll pieces of keys and of values, then stores them: 2 * kGatherUnroll * 16 bytes in flight per thread,
// which is what hides the latency of reads over PCIe from mapped pinned memory.
#include "kv_source.cuh"
#include "math/kv_math.h"
#include "working_set_gather.h"

namespace kvret::cuda::gather_detail {

inline constexpr int kThreads = 256;
inline constexpr int kGatherUnroll = 4;
inline constexpr int kPiecesPerBlock = kThreads * kGatherUnroll;

template <int kVecs>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const WorkingSetGatherSeq* seqs, KvGeometry geo, int32_t max_rows) {
  constexpr int64_t kRowBytes = int64_t{kVecs} * 16;
  __shared__ unsigned block_counts[3];
  const int pair = static_cast<int>(blockIdx.y);
  const int s = pair / geo.n_kv_heads;
  const int h = pair % geo.n_kv_heads;
  const WorkingSetGatherSeq& q = seqs[s];
  const int64_t n_rows = math::gather_clamp_rows(q.n_rows, q.out_capacity, max_rows);
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPiecesPerBlock;
  if (first >= n_rows * kVecs) return;  // uniform over the block
  const bool count = q.counters != nullptr;
  if (count && tid < 3) block_counts[tid] = 0;
  if (count) __syncthreads();

  const int32_t* positions = q.positions + h * q.positions_stride;
  const int32_t* table = q.cache.block_table != nullptr ? q.cache.block_table + h * q.cache.max_blocks : nullptr;
  Vec16 key_piece[kGatherUnroll];
  Vec16 value_piece[kGatherUnroll];
  int64_t out_offset[kGatherUnroll];
#pragma unroll
  for (int u = 0; u < kGatherUnroll; ++u) {
    const int64_t piece = first + u * kThreads + tid;
    const int64_t row = piece / kVecs;
    const int vec = static_cast<int>(piece % kVecs);
    out_offset[u] = -1;
    if (row >= n_rows) continue;
    out_offset[u] = (h * q.out_capacity + row) * kRowBytes + vec * 16;
    const int64_t position = positions[row];
    key_piece[u] = make_uint4(0, 0, 0, 0);
    value_piece[u] = make_uint4(0, 0, 0, 0);
    if (position < 0 || position >= q.host.n_tokens) {
      if (vec == 0 && q.out_positions != nullptr)
        q.out_positions[h * q.out_capacity + row] = static_cast<int32_t>(position);
      continue;
    }
    const int window = q.cache.window_k != nullptr ? math::window_slot(q.cache.window, position) : -1;
    const int64_t block = position / geo.block_tokens;
    const int slot = window < 0 && table != nullptr && block < q.cache.max_blocks ? table[block] : -1;
    const char* key_src;
    const char* value_src;
    if (window >= 0) {
      const int64_t offset =
          (static_cast<int64_t>(h) * (q.cache.window.sink_slots + q.cache.window.local_slots) + window) * kRowBytes;
      key_src = static_cast<const char*>(q.cache.window_k) + offset;
      value_src = static_cast<const char*>(q.cache.window_v) + offset;
    } else if (slot >= 0) {
      const int64_t offset = cache_row_offset(q.cache, h, slot, static_cast<int>(position - block * geo.block_tokens),
                                              geo.block_tokens, kRowBytes);
      key_src = static_cast<const char*>(q.cache.k) + offset;
      value_src = static_cast<const char*>(q.cache.v) + offset;
    } else {
      key_src = host_row(q.host, q.host.k_pages, position, h);
      value_src = host_row(q.host, q.host.v_pages, position, h);
      if (!math::aligned16(key_src) || !math::aligned16(value_src)) {  // a view the host check rejects: zero row
        if (vec == 0 && q.out_positions != nullptr)
          q.out_positions[h * q.out_capacity + row] = static_cast<int32_t>(position);
        continue;
      }
    }
    key_piece[u] = *reinterpret_cast<const Vec16*>(key_src + vec * 16);
    value_piece[u] = *reinterpret_cast<const Vec16*>(value_src + vec * 16);
    if (vec == 0) {
      if (q.out_positions != nullptr) q.out_positions[h * q.out_capacity + row] = static_cast<int32_t>(position);
      if (count) {
        const bool prefetched =
            slot >= 0 && q.cache.slot_prefetched != nullptr && q.cache.slot_prefetched[h * q.cache.n_slots + slot] != 0;
        atomicAdd(&block_counts[slot >= 0 || window >= 0 ? 0 : 1], 1u);
        if (prefetched) atomicAdd(&block_counts[2], 1u);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kGatherUnroll; ++u) {
    if (out_offset[u] < 0) continue;
    *reinterpret_cast<Vec16*>(static_cast<char*>(q.out_k) + out_offset[u]) = key_piece[u];
    *reinterpret_cast<Vec16*>(static_cast<char*>(q.out_v) + out_offset[u]) = value_piece[u];
  }
  if (count) {
    __syncthreads();
    if (tid < 3 && block_counts[tid] != 0)
      atomicAdd(&q.counters[tid], static_cast<unsigned long long>(block_counts[tid]));
  }
}

}  // namespace kvret::cuda::gather_detail
