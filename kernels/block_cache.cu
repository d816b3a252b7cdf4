// Host launchers of the block-cache update and prefetch (block_cache.cuh).
#include "block_cache.cuh"
#include "block_cache.h"
#include "dispatch.cuh"

namespace kvret::cuda {

namespace {

constexpr size_t kAlign = 256;

int64_t pairs_of(const BlockCacheUpdateParams& p) { return static_cast<int64_t>(p.n_seqs) * p.geo.n_kv_heads; }

size_t loads_bytes(const BlockCacheUpdateParams& p) {
  const size_t bytes =
      static_cast<size_t>(pairs_of(p)) * static_cast<size_t>(p.max_admit) * sizeof(block_cache_detail::BlockLoad);
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

cudaError_t launch(const BlockCacheUpdateParams& p, bool prefetch, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  using namespace block_cache_detail;
  if (p.n_seqs < 0 || p.geo.n_kv_heads <= 0 || !supported_head_dim(p.geo.head_dim) || p.geo.block_tokens <= 0 ||
      p.max_admit <= 0 || p.max_admit > kBlockCacheMaxSlots || p.max_blocks < 0 ||
      (p.policy != CachePolicy::kLru && p.policy != CachePolicy::kLfu)) {
    return cudaErrorInvalidValue;
  }
  const int64_t pairs = pairs_of(p);
  if (pairs == 0) return cudaSuccess;
  if (p.seqs == nullptr || pairs > 65535 || workspace == nullptr || !math::aligned16(workspace) ||
      workspace_bytes < block_cache_workspace_bytes(p)) {
    return cudaErrorInvalidValue;
  }
  auto* loads = static_cast<BlockLoad*>(workspace);
  auto* load_counts = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + loads_bytes(p));

  const size_t smem = static_cast<size_t>(p.max_blocks) * sizeof(int);
  cudaError_t err = prepare_dynamic_smem<bookkeeping_kernel>(smem);
  if (err != cudaSuccess) return err;
  bookkeeping_kernel<<<static_cast<unsigned>(pairs), kBookThreads, smem, stream>>>(
      p.seqs, p.geo, p.policy, p.max_admit, p.max_blocks, prefetch, loads, load_counts);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  const int64_t vecs = kv_row_bytes(p.geo) / 16;
  const int64_t pieces = static_cast<int64_t>(p.max_admit) * p.geo.block_tokens * vecs;
  const dim3 grid(static_cast<unsigned>(ceil_div(pieces, kCopyPiecesPerBlock)), static_cast<unsigned>(pairs));
  switch (vecs) {
    case 8:
      fill_kernel<8><<<grid, kCopyThreads, 0, stream>>>(p.seqs, p.geo, p.max_admit, loads, load_counts);
      break;
    case 16:
      fill_kernel<16><<<grid, kCopyThreads, 0, stream>>>(p.seqs, p.geo, p.max_admit, loads, load_counts);
      break;
    case 32:
      fill_kernel<32><<<grid, kCopyThreads, 0, stream>>>(p.seqs, p.geo, p.max_admit, loads, load_counts);
      break;
    case 64:
      fill_kernel<64><<<grid, kCopyThreads, 0, stream>>>(p.seqs, p.geo, p.max_admit, loads, load_counts);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

size_t block_cache_workspace_bytes(const BlockCacheUpdateParams& params) noexcept {
  if (params.n_seqs <= 0 || params.geo.n_kv_heads <= 0 || params.max_admit <= 0) return 0;
  return loads_bytes(params) + static_cast<size_t>(pairs_of(params)) * sizeof(int32_t);
}

cudaError_t launch_block_cache_update(const BlockCacheUpdateParams& params, void* workspace, size_t workspace_bytes,
                                      cudaStream_t stream) {
  return launch(params, false, workspace, workspace_bytes, stream);
}

cudaError_t launch_block_cache_prefetch(const BlockCacheUpdateParams& params, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream) {
  return launch(params, true, workspace, workspace_bytes, stream);
}

}  // namespace kvret::cuda
