#pragma once
// Batched top-k over score rows: for every (sequence, KV head) the positions of the k largest scores, written in
// ascending position order. One launch for the whole batch.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvret::cuda {

/// Inputs and outputs of launch_topk_positions. Every pointer is device memory.
///
/// Row (s, h) holds n = n_tokens[s] scores. With kk = min(k, n), the row's selection is the kk indices with the
/// largest scores; among equal scores the lower index ranks higher (so the selection is unique). Scores order as
/// in the CPU selection (select/topk.hpp): every NaN counts as -inf, whatever its sign and payload, and -0 counts
/// as +0 (math::topk_order_key). n is clamped to [0, score_stride] on the device. The selection is written
/// ascending, each index plus position_offset[s], to positions[(s * n_kv_heads + h) * positions_stride + 0 .. kk).
struct TopkParams {
  int32_t n_seqs = 0;
  int32_t n_kv_heads = 0;
  const float* scores = nullptr;  ///< [n_seqs, n_kv_heads, score_stride]
  int64_t score_stride = 0;
  const int32_t* n_tokens = nullptr;  ///< [n_seqs] valid scores per row of that sequence (clamped to score_stride)
  int32_t k = 0;                      ///< the budget; >= 0

  const int32_t* position_offset = nullptr;  ///< optional [n_seqs], added to every written index (e.g. n_sink)
  int32_t* positions = nullptr;              ///< [n_seqs, n_kv_heads, positions_stride]
  int64_t positions_stride = 0;              ///< >= k
  int32_t* counts = nullptr;                 ///< optional [n_seqs]: kk of each sequence
};

/// How launch_topk_positions spreads a row over thread blocks. Both give the same selection.
enum class TopkPath {
  kAuto,    ///< a cluster of 8 blocks per row where the device's code was compiled for sm_90 or newer, else kBlocks
  kBlocks,  ///< one block per row (no thread-block clusters): the path of sm_80 and sm_89, on any device
};

/// Enqueues the selection on `stream`: a 3-pass radix select (11 + 11 + 10 bits) on the scores' order keys, then an
/// order-preserving compaction writes the selected indices ascending, so no sort of the selection is needed and k
/// has no upper limit. Needs no workspace. With TopkPath::kAuto each row is spread over a thread-block cluster of 8
/// blocks (distributed shared memory) where the code the device runs was compiled for sm_90 or newer, and runs in one
/// block otherwise (sm_80, sm_89: fewer multiprocessors busy when there are few rows, the same result).
cudaError_t launch_topk_positions(const TopkParams& params, cudaStream_t stream, TopkPath path = TopkPath::kAuto);

/// Whether TopkPath::kAuto launches clusters on the current device.
cudaError_t topk_uses_clusters(bool* uses);

}  // namespace kvret::cuda
