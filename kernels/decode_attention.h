#pragma once
// Decode attention over working sets (flash-decoding): each sequence's rows are split into chunks attended in
// parallel, then the chunks' partial softmax results are merged. GQA: one pass over a KV head's rows serves every
// query head of its group.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernel_types.h"

namespace kvret::cuda {

/// One sequence of a decode-attention launch. Device memory.
struct DecodeAttentionSeq {
  const float* q = nullptr;  ///< [n_q_heads, head_dim]
  const void* k = nullptr;   ///< [n_kv_heads, kv_capacity, head_dim]
  const void* v = nullptr;   ///< same layout and type as k
  int64_t kv_capacity = 0;   ///< rows between consecutive heads of k and v
  int32_t n_rows = 0;        ///< rows attended, clamped on the device to [0, min(kv_capacity, max_rows)]; 0 gives a
                             ///< zero output, and so do k or v not 16-byte aligned (rows move in 16-byte pieces)
  float* out = nullptr;      ///< [n_q_heads, head_dim]
};

/// out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)] over the first n_rows rows, g(h) = h / (n_q_heads / n_kv_heads).
/// The exponentials are the CPU core's exp_nonpositive (math::exp_nonpositive); the online-softmax step and the
/// merge of the chunks are math::online_softmax_step / softmax_weight / merge_weight.
struct DecodeAttentionParams {
  const DecodeAttentionSeq* seqs = nullptr;  ///< device array [n_seqs]
  int32_t n_seqs = 0;
  int32_t n_q_heads = 0;
  int32_t n_kv_heads = 0;  ///< n_q_heads % n_kv_heads == 0, group size <= kDecodeAttentionMaxGroup
  int32_t head_dim = 0;    ///< 64, 128 or 256
  ElemType kv_type = ElemType::kF16;
  int32_t max_rows = 0;        ///< host-side upper bound of n_rows over the sequences
  int32_t rows_per_split = 0;  ///< rows per chunk (a multiple of 32); 0 picks one from the batch size
  float scale = 0.0f;          ///< <= 0 means 1/sqrt(head_dim)
};

inline constexpr int32_t kDecodeAttentionMaxGroup = 16;

/// Rows per chunk the launcher uses for `params` (resolves rows_per_split == 0).
int32_t decode_attention_rows_per_split(const DecodeAttentionParams& params) noexcept;

/// Device workspace of launch_decode_attention: the partial results of every chunk. 0 for params it does not take,
/// and where the current device cannot give one block the chunk kernel's shared memory (head_dim 256 with f32 keys
/// and values needs 148 KiB: not on compute capability 8.6 or 8.9, which allow 99 KiB).
size_t decode_attention_workspace_bytes(const DecodeAttentionParams& params) noexcept;

/// Enqueues the attention on `stream` (two kernels: the chunks, then the merge).
cudaError_t launch_decode_attention(const DecodeAttentionParams& params, void* workspace, size_t workspace_bytes,
                                    cudaStream_t stream);

}  // namespace kvret::cuda
