#pragma once
// Per-element and decision math of the PAGE index (Quest; src/index/page_retriever.*), shared by the CPU retriever
// and the device select of the CUDA backend (src/backend/page_select_ops.hpp), so that both compute the same bits:
//
// - the bound of a page for a query q: sum_i max(q_i min_i, q_i max_i), written as the dot product of the split
//   query [min(q, 0), max(q, 0)] with the page's [min, max] row in eight partial sums (vec_math's dot order), then
//   scaled;
// - the fold over a KV group's query heads: KVRET_FOLD_MAX_LOGIT the largest logit (NaN ignored);
//   KVRET_FOLD_SUM_PROB, per head, a softmax over pages weighted by their token counts (the maximum, exp_nonpositive
//   terms, the normaliser in eight float partial sums then double, its inverse) accumulated in head order;
// - the order of pages (score descending, NaN lowest, -0 as +0, ties to the lower page) and the take: whole pages
//   in that order while they fit the budget, the page that crosses it trimmed to its earliest tokens.
//
// Every float operation that could be contracted into a fused multiply-add goes through hd.h's *_rn helpers.
#include "hd.h"
#include "softmax_math.h"
#include "topk_math.h"

namespace kvret::cuda::math {

/// std::min(q, 0.0f) and std::max(q, 0.0f), as the CPU index writes them (a NaN and a -0 pass through).
KVRET_HD float page_neg_part(float q) { return 0.0f < q ? 0.0f : q; }
KVRET_HD float page_pos_part(float q) { return q < 0.0f ? 0.0f : q; }

/// The query split for the bound: split [2d] = [min(q, 0), max(q, 0)].
KVRET_HD void page_split(const float* q, int d, float* split) {
  for (int i = 0; i < d; ++i) {
    split[i] = page_neg_part(q[i]);
    split[d + i] = page_pos_part(q[i]);
  }
}

/// The dot product of a [n] and b [n] in eight partial sums over whole blocks of eight, the lanes added as
/// ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), then the tail in order: vec_math.hpp's dot (and scaled_dots') order.
KVRET_HD float dot8(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] = add_rn(acc[l], mul_rn(a[i + l], b[i + l]));
  float s = add_rn(add_rn(add_rn(acc[0], acc[4]), add_rn(acc[1], acc[5])),
                   add_rn(add_rn(acc[2], acc[6]), add_rn(acc[3], acc[7])));
  for (; i < n; ++i) s = add_rn(s, mul_rn(a[i], b[i]));
  return s;
}

/// The unscaled bound of one page: the split query [2d] against the page's row [2d] (its element-wise min, then
/// max), in dot8's order.
KVRET_HD float page_bound(const float* split, const float* row, int d) { return dot8(split, row, 2 * d); }

/// A page's logit: its bound times the select's scale.
KVRET_HD float page_logit(float scale, float bound) { return mul_rn(scale, bound); }

/// The tokens of page p of n_pages over `tokens` indexed tokens (page_size, or fewer for a partial last page).
KVRET_HD int32_t page_weight(int64_t p, int64_t n_pages, int64_t tokens, int32_t page_size) {
  return p + 1 < n_pages ? page_size : static_cast<int32_t>(tokens - (n_pages - 1) * int64_t{page_size});
}

/// std::max(acc, l): the MAX_LOGIT fold's step (start from -inf; a NaN logit keeps acc).
KVRET_HD float page_max_step(float acc, float l) { return acc < l ? l : acc; }

/// One query head's softmax over pages (KVRET_FOLD_SUM_PROB): the maximum logit and the inverse normaliser.
struct PageSoftmax {
  float max = 0.0f;
  float inv = 0.0f;
  bool used = false;  ///< false: the head adds nothing (no finite maximum, or a normaliser <= 0)
};

/// The softmax of one head's logits l [n] over groups of weight(u) tokens each (a group of weight 0 counts for
/// nothing), in place: the maximum over the groups of positive weight (NaN ignored), then l_u replaced by its term
/// e^(l_u - max), the normaliser z = sum_u weight_u e_u in eight float partial sums (whole blocks of eight) added in
/// lane order in double, then the tail in double, and inv = (float)(1 / z): gqa_fold.cpp's weighted fold, operation
/// for operation. Without a finite maximum l is left as it was and the head is not used.
template <class Weight>
KVRET_HD PageSoftmax weighted_softmax_terms(float* l, int64_t n, Weight weight) {
  PageSoftmax s;
  float mx = neg_inf();
  for (int64_t u = 0; u < n; ++u) mx = page_max_step(mx, weight(u) > 0 ? l[u] : neg_inf());
  if (!(mx > neg_inf())) return s;
  for (int64_t u = 0; u < n; ++u) l[u] = exp_nonpositive(sub_rn(l[u], mx));
  float zf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    for (int i = 0; i < 8; ++i) zf[i] = add_rn(zf[i], mul_rn(static_cast<float>(weight(u + i)), l[u + i]));
  double z = 0;
  for (int i = 0; i < 8; ++i) z = dadd_rn(z, static_cast<double>(zf[i]));
  for (; u < n; ++u) z = dadd_rn(z, dmul_rn(static_cast<double>(weight(u)), static_cast<double>(l[u])));
  if (z <= 0) return s;
  s.max = mx;
  s.inv = static_cast<float>(1.0 / z);
  s.used = true;
  return s;
}

/// The softmax of one head's logits l [n_pages], the pages weighted by their token counts (page_weight, all
/// positive): weighted_softmax_terms.
KVRET_HD PageSoftmax page_softmax_terms(float* l, int64_t n_pages, int64_t tokens, int32_t page_size) {
  return weighted_softmax_terms(l, n_pages, [=](int64_t p) { return page_weight(p, n_pages, tokens, page_size); });
}

/// The SUM_PROB fold's step for one page and one head: acc + e * inv, e the page's term from page_softmax_terms
/// (start from 0; heads in order).
KVRET_HD float page_sum_prob_step(float acc, float e, const PageSoftmax& s) {
  return s.used ? add_rn(acc, mul_rn(e, s.inv)) : acc;
}

/// The order of pages as one ascending integer: score descending (NaN lowest, as -inf; -0 as +0), ties to the
/// lower page (select/topk.hpp's descending_key).
KVRET_HD uint64_t page_order_key(float score, uint32_t page) {
  return static_cast<uint64_t>(~topk_order_key(score)) << 32 | page;
}

/// The tokens taken from a page of `weight` tokens when `before` tokens of better pages were taken before it: the
/// whole page while it fits the budget, the rest of the budget for the page that crosses it, then nothing.
KVRET_HD int64_t page_take(int64_t before, int64_t weight, int64_t budget) {
  if (before >= budget) return 0;
  const int64_t room = budget - before;
  return weight < room ? weight : room;
}

/// How many of the best pages are enough to fill `budget` (every page but the last holds page_size tokens): the
/// take never looks past them.
KVRET_HD int64_t page_pages_needed(int64_t budget, int32_t page_size, int64_t n_pages) {
  const int64_t k = budget / page_size + 2;
  return k < n_pages ? k : n_pages;
}

}  // namespace kvret::cuda::math
