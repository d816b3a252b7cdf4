// Host launcher of the batched top-k (topk_select.cuh).
#include "topk_select.cuh"
#include "topk_select.h"

namespace kvret::cuda {

cudaError_t launch_topk_positions(const TopkParams& params, cudaStream_t stream) {
  if (params.n_seqs < 0 || params.n_kv_heads <= 0 || params.k < 0 || params.positions_stride < params.k ||
      params.score_stride < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(params.n_seqs) * params.n_kv_heads;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff || params.scores == nullptr || params.n_tokens == nullptr ||
      (params.k > 0 && params.positions == nullptr)) {
    return cudaErrorInvalidValue;
  }
  // One cluster of kClusterSize blocks per row (the kernel's __cluster_dims__).
  if (rows * topk_detail::kClusterSize > 0x7fffffff) return cudaErrorInvalidValue;
  topk_detail::topk_positions_kernel<<<static_cast<unsigned>(rows * topk_detail::kClusterSize), topk_detail::kThreads,
                                       0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace kvret::cuda
