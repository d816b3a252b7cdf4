#pragma once
// Per-element and decision math of the PQ kernels (pq_scores.cuh, pq_encode.cuh, pq_kmeans.cuh): the lookup-table
// entry, the code lookup of a token's logit, the select's cell path (a cell's logit, an exact token's logit, the
// items' weights and which tokens a take keeps; the fold and take are page_math.h's weighted ones), the encoder's
// squared distance and nearest-centroid rule, k-means' assignment distance, and the clamp of a sequence's
// device-side token count. Every sum runs in the CPU core's
// order (core/vec_math.hpp: dot, squared_distance, pq_token_logits), so the entries, logits and distances are
// bit-identical to the CPU index's.
#include "hd.h"

namespace kvret::cuda::math {

/// sum_i a[i] * b[i] in the order of the CPU's dot(): eight partial sums (lane l takes i = 8u + l of the whole
/// blocks of eight) added as ((0+4)+(1+5))+((2+6)+(3+7)), then the tail in index order.
KVRET_HD float dot_cpu_order(const float* a, const float* b, int n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int l = 0; l < 8; ++l) acc[l] = add_rn(acc[l], mul_rn(a[i + l], b[i + l]));
  }
  float s = add_rn(add_rn(add_rn(acc[0], acc[4]), add_rn(acc[1], acc[5])),
                   add_rn(add_rn(acc[2], acc[6]), add_rn(acc[3], acc[7])));
  for (; i < n; ++i) s = add_rn(s, mul_rn(a[i], b[i]));
  return s;
}

/// One entry of the PQ lookup table: scale * (q's sub-vector . centroid), the CPU index's lookup_table bits.
KVRET_HD float pq_lut_entry(const float* q_sub, const float* centroid, int sub, float scale) {
  return mul_rn(scale, dot_cpu_order(q_sub, centroid, sub));
}

/// A token's approximate logit for one query head: the sum of its pq_m table entries (lut_head is [pq_m][k]),
/// from +0 in sub-space order, and for pq_m = 4 as ((0 + l0) + l1) + (l2 + l3): pq_token_logits' bits.
KVRET_HD float pq_token_logit(const float* lut_head, const uint8_t* codes, int pq_m, int k) {
  if (pq_m == 4) {
    return add_rn(add_rn(add_rn(0.0f, lut_head[codes[0]]), lut_head[k + codes[1]]),
                  add_rn(lut_head[2 * k + codes[2]], lut_head[3 * k + codes[3]]));
  }
  float s = 0.0f;
  for (int j = 0; j < pq_m; ++j) s = add_rn(s, lut_head[j * k + codes[j]]);
  return s;
}

/// The code cells of an index of pq_m sub-spaces of 2^bits centroids: k^m when bits * m <= 16 (select then scores,
/// folds and takes cells instead of tokens), else 0 (a score per token).
KVRET_HD int64_t pq_cells(int pq_m, int bits) { return bits * pq_m <= 16 ? int64_t{1} << (bits * pq_m) : 0; }

/// The logit of code cell u = sum_j c_j k^j for one query head (lut_head is [pq_m][k]): l_0[c_0], then + l_j[c_j]
/// for j = 1..pq_m-1 in order (no leading +0: the CPU select's cell table, built by k^j-strided copies).
KVRET_HD float pq_cell_logit(const float* lut_head, int64_t cell, int pq_m, int k) {
  float s = lut_head[cell % k];
  for (int j = 1; j < pq_m; ++j) {
    cell /= k;
    s = add_rn(s, lut_head[j * k + cell % k]);
  }
  return s;
}

/// The logit of an exact token for one query head: scale * (q . key), key its stored key as f32, in the CPU dot's
/// order (scaled_dots' bits).
KVRET_HD float pq_exact_logit(float scale, const float* q, const float* key, int d) {
  return mul_rn(scale, dot_cpu_order(q, key, d));
}

/// The items a select of the cell path ranks, per KV head: its `cells` code cells (item u < cells), then its
/// n_exact exact tokens (item cells + e, in position order). The weight of an item: a cell's token count without
/// the exact tokens, 1 for an exact token, 0 past them (padding).
KVRET_HD int32_t pq_item_weight(const int32_t* cell_counts, int64_t cells, int64_t n_exact, int64_t u) {
  return u < cells ? cell_counts[u] : u < cells + n_exact ? 1 : 0;
}

/// Whether a token is selected: its item (of `weight` tokens) had `taken` of them taken (grouped_take: whole items
/// best first, the one that crosses the budget trimmed to its earliest tokens); `rank` is the token's place among
/// its item's tokens in position order (only needed for a trimmed item).
KVRET_HD bool pq_token_taken(int64_t taken, int64_t weight, int64_t rank) {
  return taken >= weight ? taken > 0 : rank < taken;
}

/// The encoder's squared distance of a sub-vector to a centroid in the order of the CPU's squared_distance():
/// eight partial sums of (a - b)^2, combined as in dot_cpu_order, then the tail. The centroid's elements are
/// c[0], c[c_stride], ... (the encoder reads them from a transposed tile in shared memory).
KVRET_HD float pq_squared_distance(const float* x, const float* c, int sub, int c_stride = 1) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int i = 0;
  for (; i + 8 <= sub; i += 8) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int l = 0; l < 8; ++l) {
      const float d = sub_rn(x[i + l], c[(i + l) * c_stride]);
      acc[l] = add_rn(acc[l], mul_rn(d, d));
    }
  }
  float s = add_rn(add_rn(add_rn(acc[0], acc[4]), add_rn(acc[1], acc[5])),
                   add_rn(add_rn(acc[2], acc[6]), add_rn(acc[3], acc[7])));
  for (; i < sub; ++i) {
    const float d = sub_rn(x[i], c[i * c_stride]);
    s = add_rn(s, mul_rn(d, d));
  }
  return s;
}

/// The nearest-centroid rule of the encoder and of k-means: candidate (dist, code) beats the best so far when it
/// is strictly nearer, or equally near with a lower code. A NaN distance never wins.
KVRET_HD bool nearer_centroid(float dist, int code, float best_dist, int best_code) {
  return dist < best_dist || (dist == best_dist && code < best_code);
}

/// k-means' assignment distance from the GEMM's cross term: (||x||^2 - 2 x.c) + ||c||^2, never contracted.
KVRET_HD float kmeans_distance(float x_norm, float cross, float c_norm) {
  return add_rn(sub_rn(x_norm, mul_rn(2.0f, cross)), c_norm);
}

/// The tokens the PQ score kernels score for a sequence: its device-side count n_tokens[s] clamped to
/// [0, max_tokens]. The launcher checks max_tokens <= score_stride and sizes the grid and the softmax partials by
/// max_tokens, so a clamped count never writes past a score row nor reads past the partials of its chunks.
KVRET_HD int32_t pq_scores_clamp_tokens(int32_t n_tokens, int32_t max_tokens) {
  return static_cast<int32_t>(clamp_i64(n_tokens, 0, max_tokens < 0 ? 0 : max_tokens));
}

}  // namespace kvret::cuda::math
