// Host launchers of the PQ score kernels (pq_scores.cuh).
#include <cmath>

#include "dispatch.cuh"
#include "math/pq_scores_layout.h"
#include "pq_scores.cuh"
#include "pq_scores.h"

namespace kvret::cuda {

namespace {

bool valid_geometry(const PqScoreParams& p) {
  return p.n_seqs >= 0 && p.n_seqs <= 65535 && p.n_kv_heads > 0 && p.n_kv_heads <= 65535 && p.n_q_heads > 0 &&
         p.n_q_heads % p.n_kv_heads == 0 && supported_head_dim(p.head_dim) && p.pq_m > 0 && p.head_dim % p.pq_m == 0 &&
         p.pq_bits >= 1 && p.pq_bits <= 8 && p.max_tokens >= 0 && p.score_stride >= p.max_tokens;
}

math::PqScoresLayout layout_of(const PqScoreParams& p) {
  return math::pq_scores_layout(p.n_seqs, p.n_q_heads, p.pq_m, p.pq_bits, p.max_tokens, p.fold == GqaFold::kSumProb);
}

}  // namespace

size_t pq_scores_workspace_bytes(const PqScoreParams& params) noexcept {
  if (!valid_geometry(params)) return 0;
  return layout_of(params).total;
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
  const math::PqScoresLayout layout = layout_of(params);
  if (workspace == nullptr || !math::aligned16(workspace) || workspace_bytes < layout.total) {
    return cudaErrorInvalidValue;
  }
  auto* lut = reinterpret_cast<float*>(static_cast<char*>(workspace) + layout.lut_offset);
  const float scale = params.scale > 0.0f ? params.scale : 1.0f / std::sqrt(static_cast<float>(params.head_dim));
  const int group = params.n_q_heads / params.n_kv_heads;
  const int sub = params.head_dim / params.pq_m;
  const int chunks = layout.n_chunks;

  const size_t lut_smem = math::pq_lut_smem_floats(group, sub, 1 << params.pq_bits) * sizeof(float);
  cudaError_t err = prepare_dynamic_smem<lut_kernel>(lut_smem);
  if (err != cudaSuccess) return err;
  const dim3 lut_grid(static_cast<unsigned>(params.pq_m), static_cast<unsigned>(params.n_kv_heads),
                      static_cast<unsigned>(params.n_seqs));
  lut_kernel<<<lut_grid, kThreads, lut_smem, stream>>>(params, scale, lut);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  const size_t smem = math::pq_score_smem_floats(group, params.pq_m, params.pq_bits) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(params.n_kv_heads),
                  static_cast<unsigned>(params.n_seqs));
  if (params.fold == GqaFold::kMaxLogit) {
    if ((err = prepare_dynamic_smem<max_logit_kernel>(smem)) != cudaSuccess) return err;
    max_logit_kernel<<<grid, kThreads, smem, stream>>>(params, lut);
    return cudaGetLastError();
  }

  auto* partials = reinterpret_cast<SoftmaxPartial*>(static_cast<char*>(workspace) + layout.partials_offset);
  if ((err = prepare_dynamic_smem<softmax_partials_kernel>(smem)) != cudaSuccess) return err;
  if ((err = prepare_dynamic_smem<sum_prob_kernel>(smem)) != cudaSuccess) return err;
  softmax_partials_kernel<<<grid, kThreads, smem, stream>>>(params, lut, partials, chunks);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  sum_prob_kernel<<<grid, kThreads, smem, stream>>>(params, lut, partials, chunks);
  return cudaGetLastError();
}

}  // namespace kvret::cuda
