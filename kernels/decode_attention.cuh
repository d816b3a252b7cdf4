#pragma once
// Kernels of launch_decode_attention (see decode_attention.h).
//
// Chunk kernel: grid (chunk, KV head, sequence), 4 warps. Rows go by tiles of 32: (A) each warp computes the dot
// products of 8 rows with every query head of the group (lane-interleaved elements, a warp sum per head), (B) one
// warp per head updates the running max and sum and turns the tile's scores into weights, (C) every thread owns
// head_dim / 128 output elements of every head and adds the weighted value rows. The chunk writes its unnormalised
// output with its max and sum; the merge kernel rescales and adds the chunks of each query head.
#include "decode_attention.h"
#include "device_util.cuh"

namespace kvret::cuda::attention_detail {

inline constexpr int kThreads = 128;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kTileRows = 32;
inline constexpr int kMaxGroup = kDecodeAttentionMaxGroup;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

/// Workspace layout: partial outputs [n_seqs, n_q_heads, n_splits, head_dim] then (max, sum) pairs
/// [n_seqs, n_q_heads, n_splits].
struct Partials {
  float* out;
  float2* max_sum;
};

template <int kHeadDim, typename T>
__global__ void __launch_bounds__(kThreads)
    chunk_kernel(DecodeAttentionParams p, float scale, int rows_per_split, int n_splits, Partials partials) {
  constexpr int kPerLane = kHeadDim / 32;                           // q.k elements per lane
  constexpr int kPerThread = (kHeadDim + kThreads - 1) / kThreads;  // output elements per thread and head
  __shared__ float q_s[kMaxGroup][kHeadDim];
  __shared__ float weight_s[kMaxGroup][kTileRows];
  __shared__ float max_s[kMaxGroup];
  __shared__ float sum_s[kMaxGroup];
  __shared__ float rescale_s[kMaxGroup];

  const int split = static_cast<int>(blockIdx.x);
  const int kv_head = static_cast<int>(blockIdx.y);
  const int s = static_cast<int>(blockIdx.z);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int group = p.n_q_heads / p.n_kv_heads;
  const DecodeAttentionSeq& seq = p.seqs[s];
  const int row_begin = split * rows_per_split;
  const int row_end = min(seq.n_rows, row_begin + rows_per_split);
  if (row_begin >= row_end) return;  // uniform: the merge reads only the chunks that hold rows

  for (int i = tid; i < group * kHeadDim; i += kThreads) {
    q_s[i / kHeadDim][i % kHeadDim] = seq.q[(static_cast<int64_t>(kv_head) * group) * kHeadDim + i];
  }
  for (int h = tid; h < group; h += kThreads) {
    max_s[h] = neg_inf();
    sum_s[h] = 0.0f;
  }
  const T* k = static_cast<const T*>(seq.k) + static_cast<int64_t>(kv_head) * seq.kv_capacity * kHeadDim;
  const T* v = static_cast<const T*>(seq.v) + static_cast<int64_t>(kv_head) * seq.kv_capacity * kHeadDim;
  float acc[kMaxGroup][kPerThread];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) acc[h][i] = 0.0f;
  }
  __syncthreads();

  for (int tile = row_begin; tile < row_end; tile += kTileRows) {
    const int tile_rows = min(kTileRows, row_end - tile);
    // (A) scores of the tile
    for (int r = warp; r < kTileRows; r += kWarps) {
      if (r >= tile_rows) {
        if (lane < group) weight_s[lane][r] = neg_inf();
        continue;
      }
      float key[kPerLane];
      const T* key_row = k + static_cast<int64_t>(tile + r) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) key[i] = to_float(key_row[lane + 32 * i]);
      for (int h = 0; h < group; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) dot = fmaf(q_s[h][lane + 32 * i], key[i], dot);
        dot = warp_sum(dot);
        if (lane == 0) weight_s[h][r] = dot * scale;
      }
    }
    __syncthreads();
    // (B) online softmax, one warp per head
    for (int h = warp; h < group; h += kWarps) {
      const float score = weight_s[h][lane];
      const float old_max = max_s[h];
      const float new_max = fmaxf(old_max, warp_max(score));
      const float weight = score == neg_inf() ? 0.0f : expf(score - new_max);
      const float rescale = old_max == neg_inf() ? 0.0f : expf(old_max - new_max);
      const float tile_sum = warp_sum(weight);
      weight_s[h][lane] = weight;
      __syncwarp();  // every lane has read max_s[h] and sum_s[h] before lane 0 rewrites them
      if (lane == 0) {
        max_s[h] = new_max;
        sum_s[h] = sum_s[h] * rescale + tile_sum;
        rescale_s[h] = rescale;
      }
    }
    __syncthreads();
    // (C) weighted values
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int d = tid + i * kThreads;
      if (d >= kHeadDim) break;
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
        if (h < group) acc[h][i] *= rescale_s[h];
      }
      for (int r = 0; r < tile_rows; ++r) {
        const float value = to_float(v[static_cast<int64_t>(tile + r) * kHeadDim + d]);
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h) {
          if (h < group) acc[h][i] = fmaf(weight_s[h][r], value, acc[h][i]);
        }
      }
    }
    __syncthreads();  // weight_s and rescale_s are rewritten by the next tile
  }

  const int64_t base = (static_cast<int64_t>(s) * p.n_q_heads + static_cast<int64_t>(kv_head) * group) * n_splits;
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    if (h >= group) break;
    const int64_t slot = base + static_cast<int64_t>(h) * n_splits + split;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int d = tid + i * kThreads;
      if (d < kHeadDim) partials.out[slot * kHeadDim + d] = acc[h][i];
    }
    if (tid == 0) partials.max_sum[slot] = make_float2(max_s[h], sum_s[h]);
  }
}

/// Merges the chunks of one (sequence, query head). Grid (n_q_heads, n_seqs).
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(DecodeAttentionParams p, int rows_per_split, int n_splits, Partials partials) {
  const int qh = static_cast<int>(blockIdx.x);
  const int s = static_cast<int>(blockIdx.y);
  const DecodeAttentionSeq& seq = p.seqs[s];
  float* out = seq.out + static_cast<int64_t>(qh) * kHeadDim;
  const int chunks = min((max(seq.n_rows, 0) + rows_per_split - 1) / rows_per_split, n_splits);
  const int64_t base = (static_cast<int64_t>(s) * p.n_q_heads + qh) * n_splits;
  float global_max = neg_inf();
  for (int c = 0; c < chunks; ++c) global_max = fmaxf(global_max, partials.max_sum[base + c].x);
  float total = 0.0f;
  for (int c = 0; c < chunks; ++c) {
    const float2 ms = partials.max_sum[base + c];
    total += ms.y * expf(ms.x - global_max);
  }
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = static_cast<int>(threadIdx.x); d < kHeadDim; d += kThreads) {
    float value = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const float2 ms = partials.max_sum[base + c];
      value = fmaf(partials.out[(base + c) * kHeadDim + d], expf(ms.x - global_max), value);
    }
    out[d] = value * inv_total;
  }
}

}  // namespace kvret::cuda::attention_detail
