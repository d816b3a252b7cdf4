#pragma once
// Kernel of launch_pq_encode (see pq_encode.h). A thread block takes kTokensPerBlock tokens of one (KV head,
// sub-space): their sub-vectors sit in shared memory, and the sub-space's centroids stream through shared memory in
// tiles of 32, stored transposed and padded so that lane l reads centroid l without bank conflicts. Each warp owns
// kTokensPerWarp tokens; each lane keeps its best centroid per token, and a warp argmin ends the search. The
// distance and the nearest-centroid rule are math::pq_squared_distance and math::nearer_centroid.
#include "device_util.cuh"
#include "math/pq_math.h"
#include "pq_encode.h"

namespace kvret::cuda::pq_encode_detail {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kTokensPerWarp = 4;
inline constexpr int kTokensPerBlock = kWarps * kTokensPerWarp;
inline constexpr int kCentroidTile = 32;
inline constexpr int kTilePitch = kCentroidTile + 1;  // padding: column e of consecutive centroids hits distinct banks

/// Shared memory: tokens [kTokensPerBlock][sub], centroid tile [sub][kTilePitch]. Dynamic; the kernel has no
/// static shared memory.
__host__ __device__ inline size_t smem_bytes(int sub) {
  return (static_cast<size_t>(kTokensPerBlock) * sub + static_cast<size_t>(sub) * kTilePitch) * sizeof(float);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    pq_encode_kernel(PqEncodeParams p, int64_t token_stride, int64_t head_stride) {
  extern __shared__ float smem[];
  const int sub = p.head_dim / p.pq_m;
  const int n_centroids = 1 << p.pq_bits;
  float* x_s = smem;                          // [kTokensPerBlock][sub]
  float* c_s = smem + kTokensPerBlock * sub;  // [sub][kTilePitch]
  const int h = static_cast<int>(blockIdx.y) / p.pq_m;
  const int j = static_cast<int>(blockIdx.y) % p.pq_m;
  const int token0 = static_cast<int>(blockIdx.x) * kTokensPerBlock;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;

  const T* keys = static_cast<const T*>(p.keys);
  for (int i = tid; i < kTokensPerBlock * sub; i += kThreads) {
    const int t = token0 + i / sub;
    const int e = i % sub;
    x_s[i] = t < p.n_tokens ? to_float(keys[t * token_stride + h * head_stride + j * sub + e]) : 0.0f;
  }

  float best_dist[kTokensPerWarp];
  int best_code[kTokensPerWarp];
#pragma unroll
  for (int u = 0; u < kTokensPerWarp; ++u) {
    best_dist[u] = __int_as_float(0x7f800000);  // +inf
    best_code[u] = n_centroids;                 // beyond every real code: loses every tie
  }

  const float* centroids = p.centroids + (static_cast<size_t>(h) * p.pq_m + j) * n_centroids * sub;
  for (int c0 = 0; c0 < n_centroids; c0 += kCentroidTile) {
    const int tile = min(kCentroidTile, n_centroids - c0);
    __syncthreads();  // x_s is written (first tile) / c_s is no longer read (later tiles)
    for (int i = tid; i < tile * sub; i += kThreads) {
      const int c = i / sub;
      const int e = i % sub;
      c_s[e * kTilePitch + c] = centroids[static_cast<size_t>(c0 + c) * sub + e];
    }
    __syncthreads();
    if (lane < tile) {
#pragma unroll
      for (int u = 0; u < kTokensPerWarp; ++u) {
        const float* x = x_s + (warp * kTokensPerWarp + u) * sub;
        const float dist = math::pq_squared_distance(x, c_s + lane, sub, kTilePitch);
        if (math::nearer_centroid(dist, c0 + lane, best_dist[u], best_code[u])) {
          best_dist[u] = dist;
          best_code[u] = c0 + lane;
        }
      }
    }
  }

#pragma unroll
  for (int u = 0; u < kTokensPerWarp; ++u) {
    float dist = best_dist[u];
    int code = best_code[u];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_dist = __shfl_xor_sync(0xffffffffu, dist, offset);
      const int other_code = __shfl_xor_sync(0xffffffffu, code, offset);
      if (math::nearer_centroid(other_dist, other_code, dist, code)) {
        dist = other_dist;
        code = other_code;
      }
    }
    const int t = token0 + warp * kTokensPerWarp + u;
    if (lane == 0 && t < p.n_tokens) {
      // A NaN distance never wins a comparison; such a token keeps code 0.
      p.codes[h * p.code_head_stride + static_cast<int64_t>(t) * p.pq_m + j] =
          static_cast<uint8_t>(code < n_centroids ? code : 0);
    }
  }
}

}  // namespace kvret::cuda::pq_encode_detail
