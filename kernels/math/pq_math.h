#pragma once
// Per-element and decision math of the PQ kernels (pq_scores.cuh, pq_encode.cuh, pq_kmeans.cuh): the lookup-table
// entry, the code lookup of a token's logit, the select's cell path (a cell's logit, an exact token's logit, the
// items' weights and which tokens a take keeps; the fold and take are page_math.h's weighted ones), the encoder's
// squared distance and nearest-centroid rule, k-means' assignment distance, and the clamp of a sequence's
// device-side token count. Every sum runs in the CPU core's
// order (core/vec_math.hpp: dot, squared_distance, pq_token_logits), so the entries, logits and distances are
// bit-identical to the CPU index's.
#include "hd.h"
#include "page_math.h"

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

// --- the per-token path (pq_cells() == 0): every token's logit, the unweighted fold, a top-k over tokens ---------

/// The maximum of x[0, n), NaN ignored (std::max(mx, x) from -inf; gqa_fold.cpp's max_ignoring_nan); -inf if none.
KVRET_HD float pq_max_ignoring_nan(const float* x, int64_t n) {
  float mx = neg_inf();
  for (int64_t i = 0; i < n; ++i) mx = page_max_step(mx, x[i]);
  return mx;
}

/// True for a finite float (neither NaN nor +-Inf).
KVRET_HD bool pq_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

/// The reference of one query head's m = 4 softmax fold (gqa_fold.cpp's pq4_softmax_fold; KVRET_FOLD_SUM_PROB, m = 4,
/// k <= 64): the maximum of each sub-space's table, their sum from +0, M = max(sum, the largest exact logit) and
/// shift = M - sum. `ok` is false where the fold does not apply (a non-finite sum or M): then every head of the KV
/// group folds its logits instead (pq_softmax_terms).
struct Pq4Reference {
  float max[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float m = 0.0f, shift = 0.0f;
  bool ok = false;
};

/// The table's part of Pq4Reference for one query head (lut_head [4][k]); the exact logits' maximum comes after.
KVRET_HD Pq4Reference pq4_table_reference(const float* lut_head, int k) {
  Pq4Reference r;
  float sum = 0.0f;
  for (int j = 0; j < 4; ++j) {
    r.max[j] = pq_max_ignoring_nan(lut_head + j * k, k);
    sum = add_rn(sum, r.max[j]);
  }
  r.m = sum;
  r.shift = sum;  // the sum, until pq4_finish_reference
  return r;
}

/// Completes a reference with the largest exact logit (NaN ignored, -inf without exact tokens).
KVRET_HD Pq4Reference pq4_finish_reference(Pq4Reference r, float exact_max) {
  const float sum = r.shift;
  r.m = sum < exact_max ? exact_max : sum;  // std::max(sum, exact_max)
  r.ok = pq_finite(sum) && pq_finite(r.m);
  r.shift = sub_rn(r.m, sum);
  return r;
}

/// The m = 4 fold's term of a PQ token for one query head: (E_0[c0] E_1[c1]) (E_2[c2] E_3[c3]), with
/// E_0[c] = e^((l_0[c] - max_0) - shift) and E_j[c] = e^(l_j[c] - max_j) (exp_nonpositive).
KVRET_HD float pq4_token_term(const float* lut_head, const uint8_t* codes, int k, const Pq4Reference& r) {
  float e[4];
  for (int j = 0; j < 4; ++j) {
    const float x = sub_rn(lut_head[j * k + codes[j]], r.max[j]);
    e[j] = exp_nonpositive(j == 0 ? sub_rn(x, r.shift) : x);
  }
  return mul_rn(mul_rn(e[0], e[1]), mul_rn(e[2], e[3]));
}

/// The m = 4 fold's term of an exact token: e^(logit - M).
KVRET_HD float pq4_exact_term(float logit, const Pq4Reference& r) { return exp_nonpositive(sub_rn(logit, r.m)); }

/// The unweighted softmax's normaliser of one head's terms e [n] (gqa_fold.cpp's unweighted_sum: eight double
/// partial sums over whole blocks of eight, added in lane order from 0, then the tail in order); used when z > 0
/// (a NaN z is used, as on the CPU).
KVRET_HD PageSoftmax pq_unweighted_normaliser(const float* e, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    for (int i = 0; i < 8; ++i) lane[i] = dadd_rn(lane[i], static_cast<double>(e[u + i]));
  double z = 0;
  for (int i = 0; i < 8; ++i) z = dadd_rn(z, lane[i]);
  for (; u < n; ++u) z = dadd_rn(z, static_cast<double>(e[u]));
  PageSoftmax s;
  if (z <= 0) return s;
  s.inv = static_cast<float>(1.0 / z);
  s.used = true;
  return s;
}

/// The unweighted softmax's term of a logit for a head whose largest logit is mx (fold_logits): e^(l - mx).
KVRET_HD float pq_softmax_term(float logit, float mx) { return exp_nonpositive(sub_rn(logit, mx)); }

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
