#pragma once
// PQ approximate scores with the GQA fold, batched over sequences (PQCache): a lookup table of query . centroid
// per (query head, sub-space, centroid) in shared memory, then one score per (KV head, token) from its codes.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernel_types.h"

namespace kvret::cuda {

/// Inputs and outputs of launch_pq_scores. Every pointer is device memory.
///
/// For sequence s, KV head h, token t and query head q of h's group (q / (n_q_heads / n_kv_heads) == h):
///   logit_q(t) = scale * sum_j  queries[s, q, j*sub : (j+1)*sub] . centroids[s][h, j, codes[s*n_kv_heads+h][t, j], :]
/// with sub = head_dim / pq_m, and
///   kSumProb:  scores[s, h, t] = sum_q softmax_t(logit_q)(t)   (softmax over t in [0, n_tokens[s]))
///   kMaxLogit: scores[s, h, t] = max_q logit_q(t)
/// Entries t >= n_tokens[s] of a score row are left untouched. n_tokens[s] is clamped to [0, max_tokens] on the
/// device, so a bad count never writes past score_stride.
///
/// The table entries and each token's logit have the CPU index's bits (math::pq_lut_entry, math::pq_token_logit);
/// the exponentials are the CPU's exp_nonpositive (math::exp_nonpositive).
struct PqScoreParams {
  int32_t n_seqs = 0;
  int32_t n_q_heads = 0;
  int32_t n_kv_heads = 0;  ///< n_q_heads % n_kv_heads == 0
  int32_t head_dim = 0;    ///< 64, 128 or 256
  int32_t pq_m = 0;        ///< sub-spaces; head_dim % pq_m == 0
  int32_t pq_bits = 0;     ///< 1..8: 2^pq_bits centroids per sub-space

  const float* queries = nullptr;           ///< [n_seqs, n_q_heads, head_dim]
  const float* const* centroids = nullptr;  ///< [n_seqs] pointers to [n_kv_heads, pq_m, 2^pq_bits, head_dim/pq_m]
  const uint8_t* const* codes = nullptr;    ///< [n_seqs * n_kv_heads] pointers to [n_tokens[s], pq_m]
  const int32_t* n_tokens = nullptr;        ///< [n_seqs] tokens scored per sequence
  int32_t max_tokens = 0;                   ///< host-side upper bound of n_tokens[*]: sizes the grid

  float scale = 0.0f;  ///< multiplies q.c; <= 0 means 1/sqrt(head_dim)
  GqaFold fold = GqaFold::kSumProb;

  float* scores = nullptr;   ///< [n_seqs, n_kv_heads, score_stride]
  int64_t score_stride = 0;  ///< >= max_tokens
};

/// Tokens one thread block scores; the softmax of kSumProb reduces per-chunk partials over the chunks.
inline constexpr int32_t kPqScoreChunkTokens = 2048;

/// Device workspace launch_pq_scores needs (math::pq_scores_layout): the lookup tables of every (sequence, query
/// head), [n_seqs, n_q_heads, pq_m, 2^pq_bits] floats, built once per launch, then for kSumProb the per-chunk
/// softmax statistics. 0 when there is nothing to score or the geometry is invalid.
size_t pq_scores_workspace_bytes(const PqScoreParams& params) noexcept;

/// Enqueues the scores on `stream`: the table kernel, then one scoring kernel for kMaxLogit or two for kSumProb.
/// Returns cudaErrorInvalidValue for an inconsistent geometry or a too-small or not 16-byte aligned workspace,
/// else the launch status.
cudaError_t launch_pq_scores(const PqScoreParams& params, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvret::cuda
