#pragma once
// The CUDA backend's select for the PQ index (docs/pq.md, docs/cuda_backend.md), both of its paths, as per-element
// functors for Thrust passes: compiled for the device by nvcc and for the host on Thrust's OpenMP
// system. The math is kernels/math/pq_math.h and page_math.h, the functions the CPU retriever
// (src/index/pq_retriever.cpp) is tested against, so both compute the same bits.
//
// A KV head's items are its C code cells and its E_h exact tokens, in that order (items past C + E_h, up to the
// layer's largest E, are padding of weight 0). One select of one (sequence, layer) is these passes, around
// page_select_ops.hpp's shared ones:
//   PageLoadQuery   q into f32 [n_q_heads, d]
//   PqLut           the lookup table of every (query head, sub-space, centroid)
//   PqItemLogits    the logit of every (query head, item): a cell's from the table, an exact token's q . k
//   PqSoftmaxes     KVRET_FOLD_SUM_PROB: per query head the maximum, the terms and the inverse normaliser
//   PageFold        per (KV head, item) the folded score, its order key and its index
//   (the two stable sorts: per head the items best first)
//   PqSortedWeights the tokens of each item in that order
//   (inclusive scan, PageTake, exclusive scan: the tokens taken from each item)
//   PqTrimmed       per (KV head, token): whether its item is the one trimmed (exclusive scan: its rank there)
//   PqTaken         per (KV head, token): whether it is selected (exclusive scan: where it goes)
//   PqWrite         the positions (ascending per head) and their item's score into the caller's tensors
//
// The per-token path (pq_bits * pq_m > 16: no cells; a token's item is -1, or e for the e-th exact token):
//   PqLut, then PqTokenLogits  the logit of every (query head, token): its table entries' sum, or q . k if exact
//   PqTokenHeads    KVRET_FOLD_SUM_PROB: per query head the largest logit and, for m = 4 (k <= 64), the reference
//                   of the fold from tables of exponentials (gqa_fold.cpp's pq4_softmax_fold)
//   PqTokenTerms    the softmax's terms in place of the logits: the m = 4 fold's products where every head of the
//                   KV group has a finite reference, else e^(l - max)
//   PqTokenSums     per query head the normaliser (eight double partial sums)
//   TokenFold, the token top-k and TopkWrite of page_select_ops.hpp (cuda_backend.cu's top_write)
#include <cstddef>
#include <cstdint>

#include "backend/page_select_ops.hpp"
#include "math/pq_math.h"

namespace kvret::device_math {

/// The device mirror of one (sequence, layer)'s PQ index, all heads side by side.
struct PqLayout {
  const float* codebook;    ///< [heads, m, k, dsub]
  const int32_t* counts;    ///< [heads, cells]: a cell's tokens without the exact ones
  const int32_t* n_exact;   ///< [heads]
  const int32_t* items;     ///< [heads, capacity]: the item of each token (pq_math.h), the first `tokens` set
  const float* exact_keys;  ///< [heads, exact_capacity, d]: the exact tokens' keys as f32
  const uint8_t* codes;     ///< [heads, capacity, m] (per-token path)
  int64_t cells, capacity, exact_capacity, max_exact, tokens;
  int32_t m, k, dsub, d;
  /// Items per head, padding included.
  KVRET_BACKEND_HD int64_t items_per_head() const { return cells + max_exact; }
  KVRET_BACKEND_HD int32_t weight(int64_t h, int64_t u) const {
    return pm::pq_item_weight(counts + h * cells, cells, n_exact[h], u);
  }
};

// The cell path's passes below run over one select or a fused batch of them (job after job, one layout per job):
// each job's rows are `items` wide (the C cells and then the most exact tokens of any head of any job; a head's
// items past its own are padding of weight 0) and `tokens` wide for the per-token passes (a job's tokens past its
// own, up to the most of any job, are padding: never flagged, never written).

/// lut [jobs * n_q_heads, m, k]: lut[hq][j][c] = scale * <q_hq,j, C_h,j[c]>.
struct PqLut {
  const PqLayout* layouts;  ///< per job
  const float* q;           ///< [jobs * n_q_heads, d]
  float* lut;
  int64_t q_heads, mk;  ///< q_heads: per job; mk: m * k, every job's
  int32_t group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / mk;
    const PqLayout& l = layouts[row / q_heads];
    const int64_t j = (i % mk) / l.k, c = i % l.k, h = row % q_heads / group;
    lut[i] =
        pm::pq_lut_entry(q + row * l.d + j * l.dsub, l.codebook + ((h * l.m + j) * l.k + c) * l.dsub, l.dsub, scale);
  }
};

/// logits [jobs * n_q_heads, items]: a cell's from the table, an exact token's q . k, -inf for padding.
struct PqItemLogits {
  const PqLayout* layouts;
  const float* q;    ///< [jobs * n_q_heads, d]
  const float* lut;  ///< [jobs * n_q_heads, m, k]
  float* logits;
  int64_t items, q_heads;
  int32_t group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / items, u = i % items, h = row % q_heads / group;
    const PqLayout& l = layouts[row / q_heads];
    if (u < l.cells) {
      logits[i] = pm::pq_cell_logit(lut + row * l.m * l.k, u, l.m, l.k);
    } else if (u < l.cells + l.n_exact[h]) {
      const float* key = l.exact_keys + (h * l.exact_capacity + (u - l.cells)) * l.d;
      logits[i] = pm::pq_exact_logit(scale, q + row * l.d, key, l.d);
    } else {
      logits[i] = pm::neg_inf();
    }
  }
};

/// Per query head: the weighted softmax over its KV head's C + E_h items (not the padding), in place.
struct PqSoftmaxes {
  const PqLayout* layouts;
  float* logits;         ///< [jobs * n_q_heads, items]: replaced by the softmax's terms
  pm::PageSoftmax* out;  ///< [jobs * n_q_heads]
  int64_t items, q_heads;
  int32_t group;
  KVRET_BACKEND_HD void operator()(int64_t row) const {
    const PqLayout& l = layouts[row / q_heads];
    const int64_t h = row % q_heads / group;
    const int32_t* counts = l.counts + h * l.cells;
    const int64_t cells = l.cells, exact = l.n_exact[h];
    out[row] = pm::weighted_softmax_terms(logits + row * items, cells + exact,
                                          [=](int64_t u) { return pm::pq_item_weight(counts, cells, exact, u); });
  }
};

struct PqSortedWeights {
  const PqLayout* layouts;
  const int64_t* index;
  int64_t* weight;
  int64_t items, heads;  ///< heads: KV heads per job
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t segment = index[i] / items;
    weight[i] = layouts[segment / heads].weight(segment % heads, index[i] % items);
  }
};

/// A (job, KV head, token) entry of the per-token passes: its layout, head and token, or null past the job's tokens.
struct PqTokenEntry {
  const PqLayout* l;
  int64_t segment, h, t;
};
KVRET_BACKEND_HD inline PqTokenEntry pq_token_entry(const PqLayout* layouts, int64_t i, int64_t tokens, int64_t heads) {
  const int64_t segment = i / tokens, t = i % tokens;
  const PqLayout* l = layouts + segment / heads;
  return {t < l->tokens ? l : nullptr, segment, segment % heads, t};
}

/// Per (job, KV head, token): 1 when its item is taken in part (the trimmed cell), else 0.
struct PqTrimmed {
  const PqLayout* layouts;
  const int64_t* taken;  ///< [jobs * heads, items]
  int64_t* flag;         ///< [jobs * heads, tokens]
  int64_t items, tokens, heads;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const PqTokenEntry e = pq_token_entry(layouts, i, tokens, heads);
    if (e.l == nullptr) {
      flag[i] = 0;
      return;
    }
    const int32_t u = e.l->items[e.h * e.l->capacity + e.t];
    const int64_t took = taken[e.segment * items + u];
    flag[i] = took > 0 && took < e.l->weight(e.h, u) ? 1 : 0;
  }
};

/// Per (job, KV head, token): 1 when it is selected (rank: its place among the trimmed item's tokens).
struct PqTaken {
  const PqLayout* layouts;
  const int64_t* taken;
  const int64_t* rank;  ///< [jobs * heads, tokens]: exclusive scan of PqTrimmed per head
  int64_t* flag;        ///< [jobs * heads, tokens]
  int64_t items, tokens, heads;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const PqTokenEntry e = pq_token_entry(layouts, i, tokens, heads);
    if (e.l == nullptr) {
      flag[i] = 0;
      return;
    }
    const int32_t u = e.l->items[e.h * e.l->capacity + e.t];
    flag[i] = pm::pq_token_taken(taken[e.segment * items + u], e.l->weight(e.h, u), rank[i]) ? 1 : 0;
  }
};

struct PqWrite {
  const PqLayout* layouts;
  const int64_t* selected;     ///< [jobs * heads, tokens]: PqTaken
  const int64_t* offset;       ///< exclusive scan of selected per head
  const float* folded;         ///< [jobs * heads, items]
  const DeviceTensor* outs;    ///< per job i32 [n_kv_heads, >= budget]
  const DeviceTensor* scores;  ///< per job f32 [n_kv_heads, >= budget] (base null: none)
  const int64_t* base_of;      ///< per job its first middle position
  int64_t items, tokens, heads;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    if (selected[i] == 0) return;
    const PqTokenEntry e = pq_token_entry(layouts, i, tokens, heads);
    const int64_t job = e.segment / heads;
    *reinterpret_cast<int32_t*>(outs[job].at(e.h, offset[i])) = static_cast<int32_t>(base_of[job] + e.t);
    if (scores[job].base != nullptr) {
      const int32_t u = e.l->items[e.h * e.l->capacity + e.t];
      *reinterpret_cast<float*>(scores[job].at(e.h, offset[i])) = folded[e.segment * items + u];
    }
  }
};

// --- the per-token path ------------------------------------------------------------------------------------------

// Its passes run over one select or a fused batch (job after job, one layout per job), each job's rows `width`
// tokens wide, the most tokens of any job; a job's tokens past its own are padding (logit -inf, never taken).

/// logits [jobs * n_q_heads, width]: a token's table entries' sum, or an exact token's q . k; -inf for padding.
struct PqTokenLogits {
  const PqLayout* layouts;
  const float* q;    ///< [jobs * n_q_heads, d]
  const float* lut;  ///< [jobs * n_q_heads, m, k]
  float* logits;
  int64_t width, q_heads;  ///< q_heads: per job
  int32_t group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / width, t = i % width, h = row % q_heads / group;
    const PqLayout& l = layouts[row / q_heads];
    if (t >= l.tokens) {
      logits[i] = pm::neg_inf();
      return;
    }
    const int32_t item = l.items[h * l.capacity + t];
    if (item >= 0) {
      const float* key = l.exact_keys + (h * l.exact_capacity + item) * l.d;
      logits[i] = pm::pq_exact_logit(scale, q + row * l.d, key, l.d);
    } else {
      logits[i] = pm::pq_token_logit(lut + row * l.m * l.k, l.codes + (h * l.capacity + t) * l.m, l.m, l.k);
    }
  }
};

/// Per query head: the largest logit (NaN ignored) and the m = 4 fold's reference.
struct PqTokenHead {
  float max;
  pm::Pq4Reference ref;
};

struct PqTokenHeads {
  const PqLayout* layouts;
  const float* lut;
  const float* logits;  ///< [jobs * n_q_heads, width]
  PqTokenHead* out;     ///< [jobs * n_q_heads]
  int64_t width, q_heads;
  int32_t group;
  bool pq4;  ///< m = 4 and k <= 64
  KVRET_BACKEND_HD void operator()(int64_t row) const {
    const PqLayout& l = layouts[row / q_heads];
    const float* x = logits + row * width;
    const int32_t* items = l.items + row % q_heads / group * l.capacity;
    float mx = pm::neg_inf(), exact_max = pm::neg_inf();
    for (int64_t t = 0; t < l.tokens; ++t) {
      mx = pm::page_max_step(mx, x[t]);
      if (items[t] >= 0) exact_max = pm::page_max_step(exact_max, x[t]);
    }
    PqTokenHead r;
    r.max = mx;
    if (pq4) r.ref = pm::pq4_finish_reference(pm::pq4_table_reference(lut + row * 4 * l.k, l.k), exact_max);
    out[row] = r;
  }
  /// Whether KV head h (of every job, job after job) folds by the m = 4 tables: every head of its group has a
  /// finite reference.
  KVRET_BACKEND_HD static bool by_tables(const PqTokenHead* heads, int64_t h, int32_t group, bool pq4) {
    if (!pq4) return false;
    for (int32_t g = 0; g < group; ++g)
      if (!heads[h * group + g].ref.ok) return false;
    return true;
  }
};

/// The softmax's terms of every (query head, token), in place of its logit (the padding is left as it is).
struct PqTokenTerms {
  const PqLayout* layouts;
  const float* lut;
  const PqTokenHead* heads;
  float* logits;  ///< [jobs * n_q_heads, width]: replaced by the terms
  int64_t width, q_heads;
  int32_t group;
  bool pq4;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / width, t = i % width, h = row % q_heads / group;
    const PqLayout& l = layouts[row / q_heads];
    if (t >= l.tokens) return;
    const PqTokenHead& head = heads[row];
    if (PqTokenHeads::by_tables(heads, row / group, group, pq4)) {
      logits[i] = l.items[h * l.capacity + t] >= 0
                      ? pm::pq4_exact_term(logits[i], head.ref)
                      : pm::pq4_token_term(lut + row * 4 * l.k, l.codes + (h * l.capacity + t) * 4, l.k, head.ref);
    } else if (head.max > pm::neg_inf()) {
      logits[i] = pm::pq_softmax_term(logits[i], head.max);
    }  // else the head adds nothing (PqTokenSums)
  }
};

struct PqTokenSums {
  const PqLayout* layouts;
  const PqTokenHead* heads;
  const float* terms;    ///< [jobs * n_q_heads, width]
  pm::PageSoftmax* out;  ///< [jobs * n_q_heads]
  int64_t width, q_heads;
  int32_t group;
  bool pq4;
  KVRET_BACKEND_HD void operator()(int64_t row) const {
    const bool tables = PqTokenHeads::by_tables(heads, row / group, group, pq4);
    out[row] = tables || heads[row].max > pm::neg_inf()
                   ? pm::pq_unweighted_normaliser(terms + row * width, layouts[row / q_heads].tokens)
                   : pm::PageSoftmax{};
  }
};

}  // namespace kvret::device_math
