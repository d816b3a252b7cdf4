#pragma once
// The CUDA backend's select for the PAGE index (docs/cuda_backend.md), as per-element functors for Thrust passes:
// compiled for the device by nvcc and for the host on Thrust's OpenMP system. The math is kernels/math/page_math.h,
// the functions the CPU retriever (src/index/page_retriever.cpp) calls, so both compute the same bits.
//
// One select of one (sequence, layer), over n pages of the device mirror of the page bounds, is these passes:
//   PageLoadQuery   q from the caller's tensor (any float type, any strides) into f32 [n_q_heads, d]
//   PageSplitQuery  per query head [min(q, 0), max(q, 0)]
//   PageLogits      the scaled bound of every (query head, page)
//   PageSoftmaxes   KVRET_FOLD_SUM_PROB: per query head the maximum, the terms (in place of the logits) and the
//                   inverse normaliser (one thread each, the CPU's order)
//   PageFold        per (KV head, page) the folded score, its order key and its index
//   (stable sort of the indices by key, then stably by KV head: per head the pages best first)
//   PageSortedWeights  the tokens of each page in that order
//   (inclusive scan per head: the tokens of the pages up to each one)
//   PageTake        the tokens taken from each page (whole pages, the page that crosses the budget trimmed)
//   (exclusive scan per head in page order: where each page's tokens go)
//   PageWrite       the positions (ascending per head) and their scores into the caller's tensors
#include <cstddef>
#include <cstdint>

#include "backend/device_math.hpp"
#include "math/page_math.h"

namespace kvret::device_math {

namespace pm = kvret::cuda::math;

struct PageLoadQuery {
  DeviceTensor q;  ///< [n_q_heads, d], f32, f16 or bf16
  float* out;      ///< [n_q_heads, d]
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const { out[i] = load_f32(q.at(i / d, i % d), q.type, 0); }
};

/// q of each job of a select on the device from its tensor into f32 [jobs, n_q_heads, d].
struct LoadQueries {
  const DeviceTensor* q;  ///< per job [n_q_heads, d]
  float* out;
  int64_t per_job;  ///< n_q_heads * d
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const DeviceTensor& t = q[i / per_job];
    const int64_t j = i % per_job;
    out[i] = load_f32(t.at(j / d, j % d), t.type, 0);
  }
};

/// The split query of every head: [n_q_heads, 2d].
struct PageSplitQuery {
  const float* q;  ///< [n_q_heads, d]
  float* split;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t hq) const { pm::page_split(q + hq * d, d, split + hq * 2 * d); }
};

/// True for NaN and +-Inf.
struct PageNonFinite {
  KVRET_BACKEND_HD bool operator()(float x) const { return (pm::float_bits(x) & 0x7f800000u) == 0x7f800000u; }
};

struct PageLogits {
  const float* split;   ///< [n_kv_heads * group, 2d]
  const float* bounds;  ///< the mirror: [n_kv_heads, capacity, 2d]
  float* logits;        ///< [n_kv_heads * group, n]
  int64_t n, capacity;
  int32_t d, group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hg = i / n, p = i % n, h = hg / group;
    logits[i] = pm::page_logit(scale, pm::page_bound(split + hg * 2 * d, bounds + (h * capacity + p) * 2 * d, d));
  }
};

struct PageSoftmaxes {
  float* logits;         ///< [n_q_heads, n]: replaced by the softmax's terms
  pm::PageSoftmax* out;  ///< [n_q_heads]
  int64_t n, tokens;
  int32_t page_size;
  KVRET_BACKEND_HD void operator()(int64_t hq) const {
    out[hq] = pm::page_softmax_terms(logits + hq * n, n, tokens, page_size);
  }
};

struct PageFold {
  const float* logits;             ///< MAX_LOGIT: the logits; SUM_PROB: the softmax's terms
  const pm::PageSoftmax* softmax;  ///< [n_q_heads] (SUM_PROB)
  float* folded;                   ///< [n_kv_heads, n]
  uint64_t* keys;                  ///< [n_kv_heads * n]
  int64_t* index;                  ///< [n_kv_heads * n]
  int64_t n;
  int32_t group;
  bool max_logit;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / n, p = i % n;
    float f = max_logit ? pm::neg_inf() : 0.0f;
    for (int32_t g = 0; g < group; ++g) {
      const int64_t hq = h * group + g;
      const float l = logits[hq * n + p];
      f = max_logit ? pm::page_max_step(f, l) : pm::page_sum_prob_step(f, l, softmax[hq]);
    }
    folded[i] = f;
    keys[i] = pm::page_order_key(f, static_cast<uint32_t>(p));
    index[i] = i;
  }
};

/// The KV head of each sorted index (the key of the second, stable sort).
struct PageHeadOfIndex {
  const int64_t* index;
  int64_t* head;
  int64_t n;
  KVRET_BACKEND_HD void operator()(int64_t i) const { head[i] = index[i] / n; }
};

struct PageSortedWeights {
  const int64_t* index;
  int64_t* weight;
  int64_t n, tokens;
  int32_t page_size;
  KVRET_BACKEND_HD void operator()(int64_t i) const { weight[i] = pm::page_weight(index[i] % n, n, tokens, page_size); }
};

struct PageTake {
  const int64_t* index;
  const int64_t* weight;  ///< in sorted order
  const int64_t* upto;    ///< inclusive scan of weight per head
  int64_t* taken;         ///< [n_kv_heads, n], page order
  int64_t budget;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    taken[index[i]] = pm::page_take(upto[i] - weight[i], weight[i], budget);
  }
};

struct PageWrite {
  const int64_t* taken;   ///< [n_kv_heads, n]
  const int64_t* offset;  ///< exclusive scan of taken per head
  const float* folded;
  DeviceTensor out;     ///< i32 [n_kv_heads, >= count]
  DeviceTensor scores;  ///< f32 [n_kv_heads, >= count] (base null: none)
  int64_t n, mid_begin;
  int32_t page_size;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / n, p = i % n;
    const int64_t first = mid_begin + p * page_size;
    for (int64_t t = 0; t < taken[i]; ++t) {
      *reinterpret_cast<int32_t*>(out.at(h, offset[i] + t)) = static_cast<int32_t>(first + t);
      if (scores.base != nullptr) *reinterpret_cast<float*>(scores.at(h, offset[i] + t)) = folded[i];
    }
  }
};

}  // namespace kvret::device_math
