#pragma once
// Kernels of launch_pq_scores (see pq_scores.h).
//
// 1. lut_kernel builds every lookup table once per launch, into the workspace: one block per (sub-space, KV head,
//    sequence) stages its group's query sub-vectors and tiles of the sub-space's centroids in shared memory (the
//    centroids of a sub-space are contiguous, so consecutive threads read consecutive floats), computes the entries
//    with math::pq_lut_entry (the CPU index's bits) and writes them coalesced (consecutive threads, consecutive
//    centroids).
// 2. One block per (sequence, KV head, chunk of kPqScoreChunkTokens tokens) copies its group's tables from the
//    workspace into shared memory (coalesced) and scores the chunk's tokens from their codes (read coalesced:
//    consecutive threads, consecutive tokens) with math::pq_token_logit. Both passes of kSumProb read the same
//    tables; nothing is rebuilt per chunk.
// Every per-sequence count is clamped on the device to the launch's max_tokens (math::pq_scores_clamp_tokens).
#include <cub/block/block_reduce.cuh>

#include "device_util.cuh"
#include "math/pq_math.h"
#include "math/pq_scores_layout.h"
#include "math/softmax_math.h"
#include "pq_scores.h"

namespace kvret::cuda::pq_scores_detail {

inline constexpr int kThreads = 256;
inline constexpr int kTokensPerThread = kPqScoreChunkTokens / kThreads;
static_assert(kTokensPerThread * kThreads == kPqScoreChunkTokens);
static_assert(math::kPqChunkTokens == kPqScoreChunkTokens);

using SoftmaxPartial = math::SoftmaxPartial;
using Reduce = cub::BlockReduce<SoftmaxPartial, kThreads>;
/// Static shared memory of softmax_partials_kernel (the others have none): the block reduction's storage.
static_assert(sizeof(typename Reduce::TempStorage) <= 1024, "pq_scores: static shared memory over its 1 KiB budget");

struct CombinePartials {
  __device__ __forceinline__ SoftmaxPartial operator()(const SoftmaxPartial& a, const SoftmaxPartial& b) const {
    return math::softmax_combine(a, b);
  }
};

/// lut[((s * n_q_heads + q) * pq_m + j) * K + c] = pq_lut_entry(q's j-th sub-vector, centroid (h, j, c), scale)
/// for the query heads q of KV head h's group. Grid (pq_m, n_kv_heads, n_seqs); dynamic shared memory
/// math::pq_lut_smem_floats(group, sub, K) floats.
__global__ void __launch_bounds__(kThreads) lut_kernel(PqScoreParams p, float scale, float* lut) {
  extern __shared__ float smem[];
  const int j = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const int s = static_cast<int>(blockIdx.z);
  const int tid = static_cast<int>(threadIdx.x);
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  const int sub = p.head_dim / p.pq_m;
  const int pitch = sub + 1;  // odd for the even sub-vector lengths: consecutive centroids hit distinct banks
  const int tile = math::pq_lut_tile_centroids(sub, n_centroids);
  float* q_s = smem;                // [group][sub]
  float* c_s = smem + group * sub;  // [tile][pitch]

  const float* q = p.queries + (static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group) * p.head_dim +
                   static_cast<size_t>(j) * sub;
  for (int i = tid; i < group * sub; i += kThreads) q_s[i] = q[static_cast<size_t>(i / sub) * p.head_dim + i % sub];
  const float* cent = p.centroids[s] + (static_cast<size_t>(h) * p.pq_m + j) * n_centroids * sub;  // [K][sub]
  float* out = lut + ((static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group) * p.pq_m + j) *
                         static_cast<size_t>(n_centroids);
  const size_t head_stride = static_cast<size_t>(p.pq_m) * n_centroids;
  for (int c0 = 0; c0 < n_centroids; c0 += tile) {
    const int n_c = min(tile, n_centroids - c0);
    __syncthreads();  // q_s is written (first tile) / c_s is no longer read (later tiles)
    const float* tile_src = cent + static_cast<size_t>(c0) * sub;
    for (int i = tid; i < n_c * sub; i += kThreads) c_s[(i / sub) * pitch + i % sub] = tile_src[i];
    __syncthreads();
    for (int e = tid; e < group * n_c; e += kThreads) {
      const int qh = e / n_c;
      const int c = e % n_c;
      out[qh * head_stride + c0 + c] = math::pq_lut_entry(q_s + qh * sub, c_s + c * pitch, sub, scale);
    }
  }
}

/// Copies the tables of KV head h's group ([group][pq_m][K] floats, contiguous in the workspace) into shared
/// memory. Ends with a barrier.
__device__ __forceinline__ void load_tables(const PqScoreParams& p, const float* lut, int s, int h, int group,
                                            float* lut_s) {
  const int floats = group * p.pq_m * (1 << p.pq_bits);
  const float* src = lut + (static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group) *
                               static_cast<size_t>(p.pq_m) * (1 << p.pq_bits);
  for (int i = static_cast<int>(threadIdx.x); i < floats; i += kThreads) lut_s[i] = src[i];
  __syncthreads();
}

/// kMaxLogit: scores = max over the group of the logits. Dynamic shared memory: the group's tables.
__global__ void __launch_bounds__(kThreads) max_logit_kernel(PqScoreParams p, const float* lut) {
  const int s = blockIdx.z;
  const int h = blockIdx.y;
  const int n = math::pq_scores_clamp_tokens(p.n_tokens[s], p.max_tokens);
  const int begin = blockIdx.x * kPqScoreChunkTokens;
  if (begin >= n) return;  // uniform over the block
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  extern __shared__ float smem[];
  float* lut_s = smem;
  load_tables(p, lut, s, h, group, lut_s);

  const uint8_t* codes = p.codes[static_cast<size_t>(s) * p.n_kv_heads + h];
  float* out = p.scores + (static_cast<size_t>(s) * p.n_kv_heads + h) * p.score_stride;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    const int t = begin + i * kThreads + static_cast<int>(threadIdx.x);
    if (t >= n) break;
    const uint8_t* token_codes = codes + static_cast<size_t>(t) * p.pq_m;
    float best = math::neg_inf();
    for (int qh = 0; qh < group; ++qh) {
      best = fmaxf(best, math::pq_token_logit(lut_s + qh * p.pq_m * n_centroids, token_codes, p.pq_m, n_centroids));
    }
    out[t] = best;
  }
}

/// kSumProb, pass 1: each block writes, per query head of its group, the softmax statistics of its chunk to
/// partials[(s * n_q_heads + q) * n_chunks + chunk].
__global__ void __launch_bounds__(kThreads)
    softmax_partials_kernel(PqScoreParams p, const float* lut, SoftmaxPartial* partials, int n_chunks) {
  const int s = blockIdx.z;
  const int h = blockIdx.y;
  const int n = math::pq_scores_clamp_tokens(p.n_tokens[s], p.max_tokens);
  const int begin = blockIdx.x * kPqScoreChunkTokens;
  if (begin >= n) return;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  extern __shared__ float smem[];
  float* lut_s = smem;
  load_tables(p, lut, s, h, group, lut_s);

  __shared__ typename Reduce::TempStorage reduce_storage;
  const uint8_t* codes = p.codes[static_cast<size_t>(s) * p.n_kv_heads + h];
  for (int qh = 0; qh < group; ++qh) {
    const float* lut_head = lut_s + qh * p.pq_m * n_centroids;
    float logits[kTokensPerThread];
    float local_max = math::neg_inf();
#pragma unroll
    for (int i = 0; i < kTokensPerThread; ++i) {
      const int t = begin + i * kThreads + static_cast<int>(threadIdx.x);
      logits[i] = math::neg_inf();
      if (t < n) {
        logits[i] = math::pq_token_logit(lut_head, codes + static_cast<size_t>(t) * p.pq_m, p.pq_m, n_centroids);
        local_max = fmaxf(local_max, logits[i]);
      }
    }
    float local_sum = 0.0f;
    if (local_max != math::neg_inf()) {
#pragma unroll
      for (int i = 0; i < kTokensPerThread; ++i) local_sum += math::softmax_weight(logits[i], local_max);
    }
    const SoftmaxPartial block = Reduce(reduce_storage).Reduce(SoftmaxPartial{local_max, local_sum}, CombinePartials{});
    if (threadIdx.x == 0) {
      partials[(static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group + qh) * n_chunks + blockIdx.x] =
          block;
    }
    __syncthreads();  // reduce_storage is reused by the next head
  }
}

/// kSumProb, pass 2: combines the partials of each query head over the sequence's chunks, then writes
/// sum_q exp(logit_q - max_q) / sum_q for every token of the block's chunk.
__global__ void __launch_bounds__(kThreads)
    sum_prob_kernel(PqScoreParams p, const float* lut, const SoftmaxPartial* partials, int n_chunks) {
  const int s = blockIdx.z;
  const int h = blockIdx.y;
  const int n = math::pq_scores_clamp_tokens(p.n_tokens[s], p.max_tokens);
  const int begin = blockIdx.x * kPqScoreChunkTokens;
  if (begin >= n) return;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  extern __shared__ float smem[];
  float* lut_s = smem;
  float* head_max = lut_s + group * p.pq_m * n_centroids;
  float* head_inv_sum = head_max + group;

  // The softmax statistics of each head over the whole sequence: one warp per head. The clamped count never
  // reaches past the n_chunks partials of a head.
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int seq_chunks = min((n + kPqScoreChunkTokens - 1) / kPqScoreChunkTokens, n_chunks);
  for (int qh = warp; qh < group; qh += kThreads / 32) {
    const SoftmaxPartial* head_partials =
        partials + (static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group + qh) * n_chunks;
    SoftmaxPartial acc{math::neg_inf(), 0.0f};
    for (int c = lane; c < seq_chunks; c += 32) acc = math::softmax_combine(acc, head_partials[c]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const SoftmaxPartial other{__shfl_xor_sync(0xffffffffu, acc.max, offset),
                                 __shfl_xor_sync(0xffffffffu, acc.sum, offset)};
      acc = math::softmax_combine(acc, other);
    }
    if (lane == 0) {
      head_max[qh] = acc.max;
      head_inv_sum[qh] = acc.sum > 0.0f ? 1.0f / acc.sum : 0.0f;
    }
  }
  load_tables(p, lut, s, h, group, lut_s);  // its barrier also publishes head_max / head_inv_sum

  const uint8_t* codes = p.codes[static_cast<size_t>(s) * p.n_kv_heads + h];
  float* out = p.scores + (static_cast<size_t>(s) * p.n_kv_heads + h) * p.score_stride;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    const int t = begin + i * kThreads + static_cast<int>(threadIdx.x);
    if (t >= n) break;
    const uint8_t* token_codes = codes + static_cast<size_t>(t) * p.pq_m;
    float score = 0.0f;
    for (int qh = 0; qh < group; ++qh) {
      const float logit = math::pq_token_logit(lut_s + qh * p.pq_m * n_centroids, token_codes, p.pq_m, n_centroids);
      score += math::softmax_weight(logit, head_max[qh]) * head_inv_sum[qh];
    }
    out[t] = score;
  }
}

}  // namespace kvret::cuda::pq_scores_detail
