// Host launchers of the PQ score kernels (pq_scores.cuh).
#include <cmath>

#include "dispatch.cuh"
#include "pq_scores.cuh"
#include "pq_scores.h"

namespace kvret::cuda {

namespace {

bool valid_geometry(const PqScoreParams& p) {
  return p.n_seqs >= 0 && p.n_seqs <= 65535 && p.n_kv_heads > 0 && p.n_kv_heads <= 65535 && p.n_q_heads > 0 &&
         p.n_q_heads % p.n_kv_heads == 0 && supported_head_dim(p.head_dim) && p.pq_m > 0 && p.head_dim % p.pq_m == 0 &&
         p.pq_bits >= 1 && p.pq_bits <= 8 && p.max_tokens >= 0 && p.score_stride >= p.max_tokens;
}

int32_t n_chunks(const PqScoreParams& p) { return static_cast<int32_t>(ceil_div(p.max_tokens, kPqScoreChunkTokens)); }

}  // namespace

size_t pq_scores_workspace_bytes(const PqScoreParams& params) noexcept {
  if (params.fold != GqaFold::kSumProb || params.max_tokens <= 0 || params.n_seqs <= 0) return 0;
  return static_cast<size_t>(params.n_seqs) * static_cast<size_t>(params.n_q_heads) *
         static_cast<size_t>(n_chunks(params)) * sizeof(pq_scores_detail::SoftmaxPartial);
}

cudaError_t launch_pq_scores(const PqScoreParams& params, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  using namespace pq_scores_detail;
  if (!valid_geometry(params)) return cudaErrorInvalidValue;
  if (params.fold != GqaFold::kSumProb && params.fold != GqaFold::kMaxLogit) return cudaErrorInvalidValue;
  if (params.n_seqs == 0 || params.max_tokens == 0) return cudaSuccess;
  if (params.queries == nullptr || params.centroids == nullptr || params.codes == nullptr ||
      params.n_tokens == nullptr || params.scores == nullptr) {
    return cudaErrorInvalidValue;
  }
  const float scale = params.scale > 0.0f ? params.scale : 1.0f / std::sqrt(static_cast<float>(params.head_dim));
  const int group = params.n_q_heads / params.n_kv_heads;
  const size_t smem = smem_floats(group, params.head_dim, params.pq_m, params.pq_bits) * sizeof(float);
  const int chunks = n_chunks(params);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(params.n_kv_heads),
                  static_cast<unsigned>(params.n_seqs));

  if (params.fold == GqaFold::kMaxLogit) {
    cudaError_t err = prepare_dynamic_smem<max_logit_kernel>(smem);
    if (err != cudaSuccess) return err;
    max_logit_kernel<<<grid, kThreads, smem, stream>>>(params, scale);
    return cudaGetLastError();
  }

  if (workspace == nullptr || workspace_bytes < pq_scores_workspace_bytes(params)) return cudaErrorInvalidValue;
  auto* partials = static_cast<SoftmaxPartial*>(workspace);
  cudaError_t err = prepare_dynamic_smem<softmax_partials_kernel>(smem);
  if (err != cudaSuccess) return err;
  err = prepare_dynamic_smem<sum_prob_kernel>(smem);
  if (err != cudaSuccess) return err;
  softmax_partials_kernel<<<grid, kThreads, smem, stream>>>(params, scale, partials, chunks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  sum_prob_kernel<<<grid, kThreads, smem, stream>>>(params, scale, partials, chunks);
  return cudaGetLastError();
}

}  // namespace kvret::cuda
