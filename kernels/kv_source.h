#pragma once
// Where the GPU finds a sequence's keys and values for one layer: the block cache in device memory, and the full
// store in mapped pinned host memory. Shared by the working-set gather and the block-cache update.
#include <cstdint>

#include "kernel_types.h"

namespace kvret::cuda {

/// Geometry common to every sequence of one launch.
struct KvGeometry {
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;  ///< 64, 128 or 256
  ElemType elem_type = ElemType::kF16;
  int32_t block_tokens = 128;  ///< tokens per cache block
};

/// Row bytes of one (token, head): head_dim * element size, 128 .. 1024, always a multiple of 16.
constexpr int64_t kv_row_bytes(const KvGeometry& geo) noexcept {
  return static_cast<int64_t>(geo.head_dim) * static_cast<int64_t>(elem_size(geo.elem_type));
}

/// Which positions the device windows of one (sequence, layer) hold (math::window_slot finds a position's row):
/// per KV head, sink_slots rows holding positions [0, sink_end) (position p in row p), then local_slots rows
/// holding positions [local_begin, local_end) (position p in row sink_slots + p % local_slots). Invariants:
/// 0 <= sink_end <= sink_slots, 0 <= local_begin <= local_end, local_end - local_begin <= local_slots.
struct WindowRows {
  int32_t sink_slots = 0;
  int32_t sink_end = 0;
  int32_t local_slots = 0;
  int64_t local_begin = 0;
  int64_t local_end = 0;
};

/// The GPU block cache of one (sequence, layer): per KV head, n_slots slots of block_tokens rows each, and the
/// device windows (the sink and the most recent rows). Device memory. A null block_table means "no cached block";
/// null window_k means "no windows": every other row comes from the host store.
struct BlockCacheView {
  int32_t* block_table = nullptr;      ///< [n_kv_heads, max_blocks]: block (position / block_tokens) -> slot or -1
  int32_t* slot_block = nullptr;       ///< [n_kv_heads, n_slots]: slot -> block or -1 (empty)
  uint32_t* slot_stamp = nullptr;      ///< [n_kv_heads, n_slots]: kLru: step of the last use; kLfu: use count
  uint8_t* slot_prefetched = nullptr;  ///< optional [n_kv_heads, n_slots]: 1 while a prefetched block is unused
  void* k = nullptr;                   ///< [n_kv_heads, n_slots, block_tokens, head_dim]
  void* v = nullptr;                   ///< same layout as k
  int32_t max_blocks = 0;              ///< entries of block_table per head
  int32_t n_slots = 0;
  const void* window_k = nullptr;  ///< optional [n_kv_heads, window.sink_slots + window.local_slots, head_dim]
  const void* window_v = nullptr;  ///< same layout as window_k
  WindowRows window;               ///< the positions the windows hold (read before the block table)
};

/// The full KV of one (sequence, layer) in pinned host memory mapped into the device's address space
/// (cudaHostAlloc(..., cudaHostAllocMapped) and cudaHostGetDevicePointer). Row (position p, head h) is at
///   page[p / page_tokens] + (p % page_tokens) * token_stride + h * head_stride        (bytes)
/// in k_pages (keys) and v_pages (values). One page of page_tokens >= n_tokens describes a flat store.
/// Rows must be 16-byte aligned: whoever builds a view checks it with math::host_kv_view_aligned (math/kv_math.h)
/// and does not launch with a view that fails it.
struct HostKvView {
  const void* const* k_pages = nullptr;  ///< device-readable array of device pointers, one per page
  const void* const* v_pages = nullptr;
  int64_t page_tokens = 0;
  int64_t token_stride = 0;  ///< bytes
  int64_t head_stride = 0;   ///< bytes
  int64_t n_tokens = 0;      ///< tokens stored; rows at or beyond it are never read
};

}  // namespace kvret::cuda
