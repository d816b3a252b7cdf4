#pragma once
// Kernels of launch_pq_scores (see pq_scores.h). One thread block per (sequence, KV head, chunk of
// kPqScoreChunkTokens tokens): it builds the lookup table of its KV group in shared memory, then reads the chunk's
// codes coalesced (consecutive threads, consecutive tokens).
#include <cub/block/block_reduce.cuh>

#include "device_util.cuh"
#include "pq_scores.h"

namespace kvret::cuda::pq_scores_detail {

inline constexpr int kThreads = 256;
inline constexpr int kTokensPerThread = kPqScoreChunkTokens / kThreads;
static_assert(kTokensPerThread * kThreads == kPqScoreChunkTokens);

/// Softmax statistics of a set of logits: their max and sum(exp(logit - max)).
struct SoftmaxPartial {
  float max;
  float sum;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ SoftmaxPartial combine(SoftmaxPartial a, SoftmaxPartial b) {
  if (a.max == neg_inf()) return b;
  if (b.max == neg_inf()) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

struct CombinePartials {
  __device__ __forceinline__ SoftmaxPartial operator()(const SoftmaxPartial& a, const SoftmaxPartial& b) const {
    return combine(a, b);
  }
};

/// Shared memory of one block: the group's queries [g][head_dim], then the table [g][pq_m][2^pq_bits], then (for
/// the sum-prob pass) the per-head softmax max and 1/sum [g] each.
__host__ __device__ inline size_t smem_floats(int group, int head_dim, int pq_m, int pq_bits) {
  return static_cast<size_t>(group) * head_dim + static_cast<size_t>(group) * pq_m * (1 << pq_bits) +
         2 * static_cast<size_t>(group);
}

/// Fills lut[(qh * pq_m + j) * K + c] = scale * q[qh, j-th sub-vector] . centroid[h, j, c] for the group of KV
/// head h of sequence s. Ends with a barrier.
__device__ void build_lut(const PqScoreParams& p, int s, int h, int group, float scale, float* q_s, float* lut) {
  const int n_centroids = 1 << p.pq_bits;
  const int sub = p.head_dim / p.pq_m;
  const float* q = p.queries + (static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group) * p.head_dim;
  for (int i = threadIdx.x; i < group * p.head_dim; i += blockDim.x) q_s[i] = q[i];
  __syncthreads();
  const float* cent = p.centroids[s] + static_cast<size_t>(h) * p.pq_m * n_centroids * sub;
  const int entries = group * p.pq_m * n_centroids;
  for (int e = threadIdx.x; e < entries; e += blockDim.x) {
    const int c = e % n_centroids;
    const int j = (e / n_centroids) % p.pq_m;
    const int qh = e / (n_centroids * p.pq_m);
    const float* cv = cent + (static_cast<size_t>(j) * n_centroids + c) * sub;
    const float* qv = q_s + qh * p.head_dim + j * sub;
    float dot = 0.0f;
    for (int d = 0; d < sub; ++d) dot = fmaf(qv[d], cv[d], dot);
    lut[e] = scale * dot;
  }
  __syncthreads();
}

/// The approximate logit of one token for one query head: the sum of its pq_m table entries.
__device__ __forceinline__ float token_logit(const float* lut_head, const uint8_t* token_codes, int pq_m,
                                             int n_centroids) {
  float logit = 0.0f;
  for (int j = 0; j < pq_m; ++j) logit += lut_head[j * n_centroids + token_codes[j]];
  return logit;
}

/// kMaxLogit: scores = max over the group of the logits.
__global__ void __launch_bounds__(kThreads) max_logit_kernel(PqScoreParams p, float scale) {
  const int s = blockIdx.z;
  const int h = blockIdx.y;
  const int n = p.n_tokens[s];
  const int begin = blockIdx.x * kPqScoreChunkTokens;
  if (begin >= n) return;  // uniform over the block
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* lut = q_s + group * p.head_dim;
  build_lut(p, s, h, group, scale, q_s, lut);

  const uint8_t* codes = p.codes[static_cast<size_t>(s) * p.n_kv_heads + h];
  float* out = p.scores + (static_cast<size_t>(s) * p.n_kv_heads + h) * p.score_stride;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    const int t = begin + i * kThreads + static_cast<int>(threadIdx.x);
    if (t >= n) break;
    const uint8_t* token_codes = codes + static_cast<size_t>(t) * p.pq_m;
    float best = neg_inf();
    for (int qh = 0; qh < group; ++qh) {
      best = fmaxf(best, token_logit(lut + qh * p.pq_m * n_centroids, token_codes, p.pq_m, n_centroids));
    }
    out[t] = best;
  }
}

/// kSumProb, pass 1: each block writes, per query head of its group, the softmax statistics of its chunk to
/// partials[(s * n_q_heads + q) * n_chunks + chunk].
__global__ void __launch_bounds__(kThreads)
    softmax_partials_kernel(PqScoreParams p, float scale, SoftmaxPartial* partials, int n_chunks) {
  const int s = blockIdx.z;
  const int h = blockIdx.y;
  const int n = p.n_tokens[s];
  const int begin = blockIdx.x * kPqScoreChunkTokens;
  if (begin >= n) return;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* lut = q_s + group * p.head_dim;
  build_lut(p, s, h, group, scale, q_s, lut);

  using Reduce = cub::BlockReduce<SoftmaxPartial, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  const uint8_t* codes = p.codes[static_cast<size_t>(s) * p.n_kv_heads + h];
  for (int qh = 0; qh < group; ++qh) {
    const float* lut_head = lut + qh * p.pq_m * n_centroids;
    float logits[kTokensPerThread];
    float local_max = neg_inf();
#pragma unroll
    for (int i = 0; i < kTokensPerThread; ++i) {
      const int t = begin + i * kThreads + static_cast<int>(threadIdx.x);
      logits[i] = neg_inf();
      if (t < n) {
        logits[i] = token_logit(lut_head, codes + static_cast<size_t>(t) * p.pq_m, p.pq_m, n_centroids);
        local_max = fmaxf(local_max, logits[i]);
      }
    }
    float local_sum = 0.0f;
    if (local_max != neg_inf()) {
#pragma unroll
      for (int i = 0; i < kTokensPerThread; ++i) {
        if (logits[i] != neg_inf()) local_sum += expf(logits[i] - local_max);
      }
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
    sum_prob_kernel(PqScoreParams p, float scale, const SoftmaxPartial* partials, int n_chunks) {
  const int s = blockIdx.z;
  const int h = blockIdx.y;
  const int n = p.n_tokens[s];
  const int begin = blockIdx.x * kPqScoreChunkTokens;
  if (begin >= n) return;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int n_centroids = 1 << p.pq_bits;
  extern __shared__ float smem[];
  float* q_s = smem;
  float* lut = q_s + group * p.head_dim;
  float* head_max = lut + group * p.pq_m * n_centroids;
  float* head_inv_sum = head_max + group;

  // The softmax statistics of each head over the whole sequence: one warp per head.
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int seq_chunks = (n + kPqScoreChunkTokens - 1) / kPqScoreChunkTokens;
  for (int qh = warp; qh < group; qh += kThreads / 32) {
    const SoftmaxPartial* head_partials =
        partials + (static_cast<size_t>(s) * p.n_q_heads + static_cast<size_t>(h) * group + qh) * n_chunks;
    SoftmaxPartial acc{neg_inf(), 0.0f};
    for (int c = lane; c < seq_chunks; c += 32) acc = combine(acc, head_partials[c]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const SoftmaxPartial other{__shfl_xor_sync(0xffffffffu, acc.max, offset),
                                 __shfl_xor_sync(0xffffffffu, acc.sum, offset)};
      acc = combine(acc, other);
    }
    if (lane == 0) {
      head_max[qh] = acc.max;
      head_inv_sum[qh] = acc.sum > 0.0f ? 1.0f / acc.sum : 0.0f;
    }
  }
  build_lut(p, s, h, group, scale, q_s, lut);  // its barriers also publish head_max / head_inv_sum

  const uint8_t* codes = p.codes[static_cast<size_t>(s) * p.n_kv_heads + h];
  float* out = p.scores + (static_cast<size_t>(s) * p.n_kv_heads + h) * p.score_stride;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    const int t = begin + i * kThreads + static_cast<int>(threadIdx.x);
    if (t >= n) break;
    const uint8_t* token_codes = codes + static_cast<size_t>(t) * p.pq_m;
    float score = 0.0f;
    for (int qh = 0; qh < group; ++qh) {
      const float logit = token_logit(lut + qh * p.pq_m * n_centroids, token_codes, p.pq_m, n_centroids);
      score += expf(logit - head_max[qh]) * head_inv_sum[qh];
    }
    out[t] = score;
  }
}

}  // namespace kvret::cuda::pq_scores_detail
