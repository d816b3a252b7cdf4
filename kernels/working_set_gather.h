#pragma once
// The working-set gather: for every KV head, the rows of its working set (sink + selected + local positions),
// from the device windows where they hold the position, else from the GPU block cache where its block is cached,
// else straight from mapped pinned host memory.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kv_source.h"

namespace kvret::cuda {

/// One sequence of a gather. Every pointer is device memory (or mapped host memory, for host.*).
struct WorkingSetGatherSeq {
  BlockCacheView cache;
  HostKvView host;
  const int32_t* positions = nullptr;  ///< [n_kv_heads, positions_stride]: the rows to gather, per head
  int64_t positions_stride = 0;
  int32_t n_rows = 0;     ///< rows per head (<= out_capacity)
  void* out_k = nullptr;  ///< [n_kv_heads, out_capacity, head_dim], same element type as the store
  void* out_v = nullptr;
  int32_t* out_positions = nullptr;  ///< optional [n_kv_heads, out_capacity]: the position of each row
  int64_t out_capacity = 0;
  unsigned long long* counters = nullptr;  ///< optional [3], added to: rows from the cache (its windows
                                           ///< or blocks), rows from the host,
                                           ///< rows from a block loaded by a prefetch and not used before
};

/// Enqueues the gather of n_seqs sequences (`seqs` is a device array) on `stream`. Each thread moves 16-byte
/// pieces of rows, kGatherUnroll of them (keys and values) in flight before its first store; consecutive threads
/// take consecutive pieces of a row, so every warp reads whole rows. A position outside [0, host.n_tokens) gives
/// a zero row. max_rows (host) sizes the grid; each sequence's n_rows is clamped on the device to
/// [0, min(out_capacity, max_rows)]. Host rows must be 16-byte aligned (math::host_kv_view_aligned checks a view
/// when it is built); a misaligned host row is never loaded and gives a zero row.
cudaError_t launch_working_set_gather(const WorkingSetGatherSeq* seqs, int32_t n_seqs, int32_t max_rows,
                                      const KvGeometry& geo, cudaStream_t stream);

}  // namespace kvret::cuda
