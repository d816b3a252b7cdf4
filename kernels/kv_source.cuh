#pragma once
// Device-side address arithmetic for kv_source.h.
#include "device_util.cuh"
#include "kv_source.h"

namespace kvret::cuda {

/// The address of row (position, head) of the host store in `pages` (host.k_pages or host.v_pages).
__device__ __forceinline__ const char* host_row(const HostKvView& host, const void* const* pages, int64_t position,
                                                int head) {
  const int64_t page = position / host.page_tokens;
  const int64_t in_page = position - page * host.page_tokens;
  return static_cast<const char*>(pages[page]) + in_page * host.token_stride + head * host.head_stride;
}

/// The byte offset of row `in_block` of `slot` of `head` in the cache's k or v array.
__device__ __forceinline__ int64_t cache_row_offset(const BlockCacheView& cache, int head, int slot, int in_block,
                                                    int block_tokens, int64_t row_bytes) {
  return ((static_cast<int64_t>(head) * cache.n_slots + slot) * block_tokens + in_block) * row_bytes;
}

}  // namespace kvret::cuda
