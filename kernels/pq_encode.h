#pragma once
// PQ code assignment: the nearest centroid of every (token, KV head, sub-space), e.g. for decode tokens leaving the
// local window or for encoding a prefill once the codebook is trained.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernel_types.h"

namespace kvret::cuda {

/// Inputs and outputs of launch_pq_encode. Every pointer is device memory.
///
/// codes[h * code_head_stride + t * pq_m + j] = argmin_c sum_e (x[e] - centroids[h, j, c, e])^2 with
/// x = keys[t * key_token_stride + h * key_head_stride + j * sub + (0 .. sub)] converted to f32 and sub =
/// head_dim / pq_m. The distance is the CPU core's squared_distance (core/vec_math.hpp) operation for operation:
/// eight f32 partial sums with no fused multiply-add (math::pq_squared_distance), so the CPU computes the same
/// bits; an exact tie goes to the lower centroid index (math::nearer_centroid).
struct PqEncodeParams {
  int32_t n_tokens = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;  ///< 64, 128 or 256
  int32_t pq_m = 0;      ///< head_dim % pq_m == 0
  int32_t pq_bits = 0;   ///< 1..8

  ElemType key_type = ElemType::kF16;
  const void* keys = nullptr;    ///< [n_tokens, n_kv_heads, head_dim] by default strides
  int64_t key_token_stride = 0;  ///< elements between tokens; 0 means n_kv_heads * head_dim
  int64_t key_head_stride = 0;   ///< elements between heads; 0 means head_dim

  const float* centroids = nullptr;  ///< [n_kv_heads, pq_m, 2^pq_bits, head_dim / pq_m]
  uint8_t* codes = nullptr;          ///< [n_kv_heads, code_head_stride / pq_m, pq_m]: first token's codes at row 0
  int64_t code_head_stride = 0;      ///< bytes between heads; >= n_tokens * pq_m
};

/// Enqueues the encoding on `stream`.
cudaError_t launch_pq_encode(const PqEncodeParams& params, cudaStream_t stream);

}  // namespace kvret::cuda
