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

/// One job's device mirror of the page bounds: [n_kv_heads, capacity, 2d].
struct PageBounds {
  const float* bounds;
  int64_t capacity;
};

/// Per (job, query head, page p < width): the scaled bound, -inf for the padding past the job's pages.
struct PageLogits {
  const float* split;         ///< [jobs * n_kv_heads * group, 2d]
  const PageBounds* mirrors;  ///< per job
  float* logits;              ///< [jobs * n_kv_heads * group, width]
  const int64_t* n_of;        ///< per job its pages
  int64_t width, heads;       ///< the most pages of a job; KV heads per job
  int32_t d, group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hg = i / width, p = i % width, job = hg / (heads * group), h = hg / group % heads;
    if (p >= n_of[job]) {
      logits[i] = pm::neg_inf();
      return;
    }
    const PageBounds& m = mirrors[job];
    logits[i] = pm::page_logit(scale, pm::page_bound(split + hg * 2 * d, m.bounds + (h * m.capacity + p) * 2 * d, d));
  }
};

struct PageSoftmaxes {
  float* logits;             ///< [jobs * n_q_heads, width]: replaced by the softmax's terms
  pm::PageSoftmax* out;      ///< [jobs * n_q_heads]
  const int64_t* n_of;       ///< per job its pages
  const int64_t* tokens_of;  ///< per job its middle tokens
  int64_t width, q_heads;    ///< q_heads: per job
  int32_t page_size;
  KVRET_BACKEND_HD void operator()(int64_t hq) const {
    const int64_t job = hq / q_heads;
    out[hq] = pm::page_softmax_terms(logits + hq * width, n_of[job], tokens_of[job], page_size);
  }
};

/// Entry p of KV head h folded over the head's `group` query heads' rows of n logits (MAX_LOGIT: the logits;
/// SUM_PROB: the softmax's terms, with `softmax` per query head).
KVRET_BACKEND_HD inline float fold_entry(const float* logits, const pm::PageSoftmax* softmax, int64_t h, int64_t p,
                                         int64_t n, int32_t group, bool max_logit) {
  float f = max_logit ? pm::neg_inf() : 0.0f;
  for (int32_t g = 0; g < group; ++g) {
    const int64_t hq = h * group + g;
    const float l = logits[hq * n + p];
    f = max_logit ? pm::page_max_step(f, l) : pm::page_sum_prob_step(f, l, softmax[hq]);
  }
  return f;
}

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
    const float f = fold_entry(logits, softmax, h, p, n, group, max_logit);
    folded[i] = f;
    keys[i] = pm::page_order_key(f, static_cast<uint32_t>(p));
    index[i] = i;
  }
};

/// The folded entries alone (PageFold without the sort's keys), for the tuned top-k of kernels/topk_select.
struct TokenFold {
  const float* logits;
  const pm::PageSoftmax* softmax;
  float* folded;  ///< [n_kv_heads, n]
  int64_t n;
  int32_t group;
  bool max_logit;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    folded[i] = fold_entry(logits, softmax, i / n, i % n, n, group, max_logit);
  }
};

/// The KV head of each sorted index (the key of the second, stable sort).
struct PageHeadOfIndex {
  const int64_t* index;
  int64_t* head;
  int64_t n;
  KVRET_BACKEND_HD void operator()(int64_t i) const { head[i] = index[i] / n; }
};

/// The tokens of each sorted page (0 for the padding).
struct PageSortedWeights {
  const int64_t* index;
  int64_t* weight;
  const int64_t* n_of;       ///< per job its pages
  const int64_t* tokens_of;  ///< per job its middle tokens
  int64_t width, heads;      ///< heads: KV heads per job
  int32_t page_size;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t p = index[i] % width, job = index[i] / width / heads;
    weight[i] = p < n_of[job] ? pm::page_weight(p, n_of[job], tokens_of[job], page_size) : 0;
  }
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

/// Per (job, KV head, page): the tokens taken from it, at its offset in the head's row of the job's tensors.
struct PageWrite {
  const int64_t* taken;   ///< [jobs * n_kv_heads, width]
  const int64_t* offset;  ///< exclusive scan of taken per head
  const float* folded;
  const DeviceTensor* outs;    ///< per job i32 [n_kv_heads, >= count]
  const DeviceTensor* scores;  ///< per job f32 [n_kv_heads, >= count] (base null: none)
  const int64_t* base_of;      ///< per job its first middle position
  int64_t width, heads;        ///< heads: KV heads per job
  int32_t page_size;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t segment = i / width, p = i % width, job = segment / heads, h = segment % heads;
    const int64_t first = base_of[job] + p * page_size;
    for (int64_t t = 0; t < taken[i]; ++t) {
      *reinterpret_cast<int32_t*>(outs[job].at(h, offset[i] + t)) = static_cast<int32_t>(first + t);
      if (scores[job].base != nullptr) *reinterpret_cast<float*>(scores[job].at(h, offset[i] + t)) = folded[i];
    }
  }
};

// The token top-k's reference passes (cuda_backend.cu's reference_top: the top-k kernel's contract,
// kernels/topk_select.h, in Thrust passes), over rows of `width` folded scores, `heads` rows per job:

/// Per entry its order key (page_order_key: score descending, NaN lowest, -0 as +0, ties to the lower entry), or the
/// largest key past its job's tokens (so that the padding sorts last), and its own index.
struct TopkOrderKeys {
  const float* folded;    ///< [rows, width]
  const int32_t* tokens;  ///< per job the entries of its rows
  uint64_t* keys;
  int64_t* index;
  int64_t width, heads;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / width, e = i % width;
    keys[i] = e < tokens[row / heads] ? pm::page_order_key(folded[i], static_cast<uint32_t>(e)) : ~uint64_t{0};
    index[i] = i;
  }
};

/// After the sort by key and the stable sort by row: the j-th best entry of each row as (row << 32 | entry).
struct TopkPick {
  const int64_t* index;  ///< [rows, width]: per row its entries best first
  uint64_t* pick;        ///< [rows, k]
  int64_t width, k;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / k, j = i % k;
    pick[i] = static_cast<uint64_t>(row) << 32 | static_cast<uint32_t>(index[row * width + j] % width);
  }
};

/// The sorted picks (per row ascending) as the kernel writes them: the entry plus its job's offset (none: 0).
struct TopkEntries {
  const uint64_t* pick;
  const int32_t* offsets;  ///< per job, or null
  int32_t* out;            ///< [rows, k]
  int64_t heads;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const auto entry = static_cast<int32_t>(pick[i] & 0xffffffffu);
    out[i] = offsets != nullptr ? entry + offsets[static_cast<int64_t>(pick[i] >> 32) / heads] : entry;
  }
};

/// The entries the tuned top-k selected (per segment `budget` entries of its row of `width`, ascending) as positions
/// (`positions[segment * width + entry]`, or without them the job's middle start plus the entry) with their folded
/// scores into each job's tensors: per (segment, j < budget) out[job](head, j).
struct TopkWrite {
  const int32_t* index;        ///< [segments, budget]
  const float* folded;         ///< [segments, width]
  const int32_t* positions;    ///< [segments, width], or null
  const int64_t* base_of;      ///< per job its first middle position
  const DeviceTensor* outs;    ///< per job i32 [n_kv_heads, >= budget]
  const DeviceTensor* scores;  ///< per job f32 [n_kv_heads, >= budget] (base null: none)
  int64_t budget, heads, width;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t segment = i / budget, j = i % budget, job = segment / heads, h = segment % heads;
    const int64_t at = segment * width + index[i];
    *reinterpret_cast<int32_t*>(outs[job].at(h, j)) =
        positions != nullptr ? positions[at] : static_cast<int32_t>(base_of[job] + index[i]);
    if (scores[job].base != nullptr) *reinterpret_cast<float*>(scores[job].at(h, j)) = folded[at];
  }
};

/// The sorted keys' positions and scores into each job's tensors: per (segment, j < budget) out[job](head, j).
struct TopWrite {
  const uint64_t* keys;  ///< sorted: per segment the positions ascending
  const float* score;
  const DeviceTensor* outs;    ///< per job i32 [n_kv_heads, >= budget]
  const DeviceTensor* scores;  ///< per job f32 [n_kv_heads, >= budget] (base null: none)
  int64_t budget, heads;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t segment = i / budget, j = i % budget, job = segment / heads, h = segment % heads;
    *reinterpret_cast<int32_t*>(outs[job].at(h, j)) = static_cast<int32_t>(keys[i] & 0xffffffffu);
    if (scores[job].base != nullptr) *reinterpret_cast<float*>(scores[job].at(h, j)) = score[i];
  }
};

}  // namespace kvret::device_math
