#pragma once
// Host-side plan of launch_pq_scores: the workspace carving (the lookup tables of every (sequence, query head),
// then the per-chunk softmax statistics of the sum-of-probabilities fold) and the shared memory of its kernels.
// Plain C++: the launcher and the host tests use the same functions.
#include <cstddef>
#include <cstdint>

#include "softmax_math.h"

namespace kvret::cuda::math {

/// Tokens one scoring block covers; the sum-of-probabilities fold reduces per-chunk softmax statistics.
inline constexpr int32_t kPqChunkTokens = 2048;
/// Alignment of every workspace region.
inline constexpr size_t kPqWorkspaceAlign = 256;
/// Floats of centroids the table kernel stages in shared memory at a time (plus one float of padding per row).
inline constexpr int64_t kPqLutTileFloats = 8192;

struct PqScoresLayout {
  int32_t n_chunks = 0;   ///< chunks of kPqChunkTokens over max_tokens
  size_t lut_offset = 0;  ///< float [n_seqs, n_q_heads, pq_m, 2^pq_bits]
  size_t lut_bytes = 0;
  size_t partials_offset = 0;  ///< SoftmaxPartial [n_seqs, n_q_heads, n_chunks] (kSumProb only)
  size_t partials_bytes = 0;
  size_t total = 0;  ///< the workspace launch_pq_scores needs; 0 when there is nothing to score
};

constexpr size_t pq_align_up(size_t bytes) {
  return (bytes + kPqWorkspaceAlign - 1) / kPqWorkspaceAlign * kPqWorkspaceAlign;
}

/// The workspace of one launch. Each table is built once per (sequence, KV head) by the table kernel and read by
/// every chunk of both scoring passes.
constexpr PqScoresLayout pq_scores_layout(int32_t n_seqs, int32_t n_q_heads, int32_t pq_m, int32_t pq_bits,
                                          int32_t max_tokens, bool sum_prob) {
  PqScoresLayout l{};
  if (n_seqs <= 0 || n_q_heads <= 0 || pq_m <= 0 || pq_bits < 1 || pq_bits > 8 || max_tokens <= 0) return l;
  l.n_chunks = static_cast<int32_t>((static_cast<int64_t>(max_tokens) + kPqChunkTokens - 1) / kPqChunkTokens);
  const size_t heads = static_cast<size_t>(n_seqs) * static_cast<size_t>(n_q_heads);
  l.lut_offset = 0;
  l.lut_bytes = heads * static_cast<size_t>(pq_m) * (size_t{1} << pq_bits) * sizeof(float);
  l.partials_offset = pq_align_up(l.lut_bytes);
  l.partials_bytes = sum_prob ? heads * static_cast<size_t>(l.n_chunks) * sizeof(SoftmaxPartial) : 0;
  l.total = l.partials_offset + pq_align_up(l.partials_bytes);
  return l;
}

/// Dynamic shared memory (floats) of a scoring block: the group's tables [group][pq_m][2^pq_bits], then for the
/// sum-of-probabilities pass the per-head softmax max and 1/sum [group] each.
constexpr size_t pq_score_smem_floats(int32_t group, int32_t pq_m, int32_t pq_bits) {
  return static_cast<size_t>(group) * static_cast<size_t>(pq_m) * (size_t{1} << pq_bits) +
         2 * static_cast<size_t>(group);
}

/// Centroids per tile of the table kernel for sub-vectors of `sub` floats (rows padded to sub + 1 floats).
KVRET_HD constexpr int32_t pq_lut_tile_centroids(int32_t sub, int32_t n_centroids) {
  const int64_t fit = kPqLutTileFloats / (static_cast<int64_t>(sub) + 1);
  const int64_t tile = fit < 1 ? 1 : fit;
  return static_cast<int32_t>(tile < n_centroids ? tile : n_centroids);
}

/// Dynamic shared memory (floats) of the table kernel: the group's query sub-vectors [group][sub], then one tile of
/// centroids [tile][sub + 1].
constexpr size_t pq_lut_smem_floats(int32_t group, int32_t sub, int32_t n_centroids) {
  return static_cast<size_t>(group) * static_cast<size_t>(sub) +
         static_cast<size_t>(pq_lut_tile_centroids(sub, n_centroids)) * (static_cast<size_t>(sub) + 1);
}

}  // namespace kvret::cuda::math
