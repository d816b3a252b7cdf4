#pragma once
// Kernels of launch_decode_attention (see decode_attention.h).
//
// Chunk kernel: grid (chunk, KV head, sequence), 4 warps. Rows go by tiles of 32, double-buffered in shared memory:
// while a tile is computed, the next tile's K and V rows are already on their way, copied global -> shared in
// 16-byte pieces with cp.async (consecutive threads, consecutive pieces; every row in flight at once). Per tile:
// (A) each warp computes the dot products of 8 rows with every query head of the group (lane-interleaved elements
// read from shared memory, a warp sum per head), (B) one warp per head takes the online-softmax step
// (math::online_softmax_step, math::softmax_weight) and turns the tile's scores into weights, (C) every thread owns
// head_dim / 128 output elements of every head and adds the weighted value rows. The chunk writes its unnormalised
// output with its max and sum; the merge kernel rescales (math::merge_weight) and adds the chunks of each query
// head.
#include <cuda_pipeline.h>

#include "decode_attention.h"
#include "device_util.cuh"
#include "math/kv_math.h"
#include "math/softmax_math.h"

namespace kvret::cuda::attention_detail {

inline constexpr int kThreads = 128;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kTileRows = math::kAttentionTileRows;
inline constexpr int kMaxGroup = kDecodeAttentionMaxGroup;
static_assert(kTileRows == 32, "phase (B) maps one tile row to one lane");

/// Static shared memory of the chunk kernel: the group's queries, the tile's weights, max / sum / rescale per head.
template <int kHeadDim>
inline constexpr size_t kChunkStaticSmemBytes = sizeof(float) * (static_cast<size_t>(kMaxGroup) * kHeadDim +
                                                                 kMaxGroup * kTileRows + 3 * kMaxGroup);
static_assert(kChunkStaticSmemBytes<256> <= 20 * 1024, "decode attention: static shared memory over its 20 KiB");
static_assert(kChunkStaticSmemBytes<256> + math::attention_kv_smem_bytes(256, 4) <= 227 * 1024,
              "decode attention: shared memory over an H100's 227 KiB per block");

/// Workspace layout: partial outputs [n_seqs, n_q_heads, n_splits, head_dim] then (max, sum) pairs
/// [n_seqs, n_q_heads, n_splits].
struct Partials {
  float* out;
  float2* max_sum;
};

/// Starts the copy of `rows` rows (from row `first` of this head's k and v) into one stage of shared memory, in
/// 16-byte pieces, and commits them as one cp.async group.
template <int kRowBytes>
__device__ __forceinline__ void issue_tile(const char* k, const char* v, int64_t first, int rows, char* k_dst,
                                           char* v_dst) {
  constexpr int kVecsPerRow = kRowBytes / 16;
  const int pieces = rows * kVecsPerRow;
  const char* k_src = k + first * kRowBytes;
  const char* v_src = v + first * kRowBytes;
  for (int i = static_cast<int>(threadIdx.x); i < pieces; i += kThreads) {
    __pipeline_memcpy_async(k_dst + i * 16, k_src + static_cast<int64_t>(i) * 16, 16);
    __pipeline_memcpy_async(v_dst + i * 16, v_src + static_cast<int64_t>(i) * 16, 16);
  }
  __pipeline_commit();
}

// Registers of chunk_kernel: ptxas's own choice up to sm_90 (the code measured on an H100); from sm_100 on, planned
// for one block per multiprocessor, where ptxas 13.0 on its own keeps 40-64 registers and spills 8-16 bytes.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define KVRET_CHUNK_LAUNCH_BOUNDS __launch_bounds__(kThreads, 1)
#else
#define KVRET_CHUNK_LAUNCH_BOUNDS __launch_bounds__(kThreads)
#endif

/// Dynamic shared memory: math::attention_kv_smem_bytes(kHeadDim, sizeof(T)).
template <int kHeadDim, typename T>
__global__ void KVRET_CHUNK_LAUNCH_BOUNDS chunk_kernel(DecodeAttentionParams p, float scale, int rows_per_split,
                                                       int n_splits, Partials partials) {
  constexpr int kPerLane = kHeadDim / 32;                           // q.k elements per lane
  constexpr int kPerThread = (kHeadDim + kThreads - 1) / kThreads;  // output elements per thread and head
  constexpr int kRowBytes = kHeadDim * static_cast<int>(sizeof(T));
  constexpr int kTileBytes = kTileRows * kRowBytes;
  static_assert(kRowBytes % 16 == 0, "rows move in 16-byte pieces");
  __shared__ float q_s[kMaxGroup][kHeadDim];
  __shared__ float weight_s[kMaxGroup][kTileRows];
  __shared__ float max_s[kMaxGroup];
  __shared__ float sum_s[kMaxGroup];
  __shared__ float rescale_s[kMaxGroup];
  extern __shared__ __align__(16) char kv_s[];  // [stage][K tile, V tile]

  const int split = static_cast<int>(blockIdx.x);
  const int kv_head = static_cast<int>(blockIdx.y);
  const int s = static_cast<int>(blockIdx.z);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int group = p.n_q_heads / p.n_kv_heads;
  const DecodeAttentionSeq& seq = p.seqs[s];
  const int n_rows = math::attention_rows(seq.n_rows, seq.kv_capacity, p.max_rows, seq.k, seq.v);
  const int row_begin = split * rows_per_split;
  const int row_end = min(n_rows, row_begin + rows_per_split);
  if (row_begin >= row_end) return;  // uniform: the merge reads only the chunks that hold rows

  const char* k = static_cast<const char*>(seq.k) + static_cast<int64_t>(kv_head) * seq.kv_capacity * kRowBytes;
  const char* v = static_cast<const char*>(seq.v) + static_cast<int64_t>(kv_head) * seq.kv_capacity * kRowBytes;
  issue_tile<kRowBytes>(k, v, row_begin, min(kTileRows, row_end - row_begin), kv_s, kv_s + kTileBytes);

  for (int i = tid; i < group * kHeadDim; i += kThreads) {
    q_s[i / kHeadDim][i % kHeadDim] = seq.q[(static_cast<int64_t>(kv_head) * group) * kHeadDim + i];
  }
  for (int h = tid; h < group; h += kThreads) {
    max_s[h] = math::neg_inf();
    sum_s[h] = 0.0f;
  }
  float acc[kMaxGroup][kPerThread];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) acc[h][i] = 0.0f;
  }

  int stage = 0;
  for (int tile = row_begin; tile < row_end; tile += kTileRows, stage ^= 1) {
    const int tile_rows = min(kTileRows, row_end - tile);
    const int next = tile + kTileRows;
    if (next < row_end) {  // the next tile goes to the other stage, free since the barrier that ended the last tile
      char* next_k = kv_s + 2 * (stage ^ 1) * kTileBytes;
      issue_tile<kRowBytes>(k, v, next, min(kTileRows, row_end - next), next_k, next_k + kTileBytes);
      __pipeline_wait_prior(1);  // this tile's copies are done (the next tile's may still run)
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();  // every thread's pieces of this tile (and, the first time, q_s / max_s / sum_s) are visible
    const T* k_tile = reinterpret_cast<const T*>(kv_s + 2 * stage * kTileBytes);
    const T* v_tile = reinterpret_cast<const T*>(kv_s + (2 * stage + 1) * kTileBytes);

    // (A) scores of the tile
    for (int r = warp; r < kTileRows; r += kWarps) {
      if (r >= tile_rows) {
        if (lane < group) weight_s[lane][r] = math::neg_inf();
        continue;
      }
      float key[kPerLane];
      const T* key_row = k_tile + r * kHeadDim;
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
      const math::OnlineSoftmaxStep step = math::online_softmax_step(max_s[h], warp_max(score));
      const float weight = math::softmax_weight(score, step.new_max);
      const float tile_sum = warp_sum(weight);
      weight_s[h][lane] = weight;
      __syncwarp();  // every lane has read max_s[h] before lane 0 rewrites it
      if (lane == 0) {
        max_s[h] = step.new_max;
        sum_s[h] = math::online_softmax_sum(sum_s[h], step.rescale, tile_sum);
        rescale_s[h] = step.rescale;
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
        const float value = to_float(v_tile[r * kHeadDim + d]);
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h) {
          if (h < group) acc[h][i] = fmaf(weight_s[h][r], value, acc[h][i]);
        }
      }
    }
    __syncthreads();  // weight_s, rescale_s and this stage are rewritten by the next tiles
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
  const int n_rows = math::attention_rows(seq.n_rows, seq.kv_capacity, p.max_rows, seq.k, seq.v);
  const int chunks = min((n_rows + rows_per_split - 1) / rows_per_split, n_splits);
  const int64_t base = (static_cast<int64_t>(s) * p.n_q_heads + qh) * n_splits;
  float global_max = math::neg_inf();
  for (int c = 0; c < chunks; ++c) global_max = fmaxf(global_max, partials.max_sum[base + c].x);
  float total = 0.0f;
  for (int c = 0; c < chunks; ++c) {
    const float2 ms = partials.max_sum[base + c];
    total += ms.y * math::merge_weight(ms.x, global_max);
  }
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = static_cast<int>(threadIdx.x); d < kHeadDim; d += kThreads) {
    float value = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const float w = math::merge_weight(partials.max_sum[base + c].x, global_max);
      value = fmaf(partials.out[(base + c) * kHeadDim + d], w, value);
    }
    out[d] = value * inv_total;
  }
}

}  // namespace kvret::cuda::attention_detail
