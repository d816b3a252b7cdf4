#pragma once
// Per-element and decision math of the CLUSTER index (ClusterKV; src/index/cluster_retriever.*), shared by the CPU
// retriever and the CUDA backend's device select, so that both compute the same bits. It builds on PAGE's
// (page_math.h): a select scores groups of tokens that share one score and takes whole groups best first.
//
// A KV head's groups, in this order: its C clusters (weight: the cluster's size, possibly 0), its E exact singletons
// and the P pending decode tokens (weight 1 each). Per query head of the KV group:
// - the logit of a cluster: scale * (q . mu) with mu its centroid; of a singleton or a pending token: scale * (q . k)
//   with k its own key; the dot product in dot8's order (vec_math.hpp's dot, which scaled_dots computes too);
// - the fold over the KV group's query heads: KVRET_FOLD_MAX_LOGIT the largest logit (NaN ignored);
//   KVRET_FOLD_SUM_PROB, per head, a softmax over the groups weighted by their sizes (weighted_softmax_terms:
//   gqa_fold.cpp's weighted fold), accumulated in head order;
// - the order of groups (score descending, NaN lowest, -0 as +0, ties to the lower group; grouped_take's order) and
//   the take: whole groups in that order while they fit the budget, the group that crosses it trimmed to its
//   earliest positions (a cluster's positions are stored ascending), then nothing.
//
// Every float operation that could be contracted into a fused multiply-add goes through hd.h's *_rn helpers.
#include "page_math.h"

namespace kvret::cuda::math {

/// The logit of a group for one query head q [d]: scale * (q . row), row a centroid or a key [d].
KVRET_HD float cluster_logit(float scale, const float* q, const float* row, int d) {
  return mul_rn(scale, dot8(q, row, d));
}

/// The weight (tokens) of group u of a head with n_clusters clusters of the given sizes: the cluster's size, or 1 for
/// an exact singleton or a pending token.
KVRET_HD int32_t cluster_weight(const int32_t* sizes, int64_t n_clusters, int64_t u) {
  return u < n_clusters ? sizes[u] : 1;
}

/// One head's softmax over its groups (KVRET_FOLD_SUM_PROB): weighted_softmax_terms with cluster_weight.
KVRET_HD PageSoftmax cluster_softmax_terms(float* l, int64_t groups, const int32_t* sizes, int64_t n_clusters) {
  return weighted_softmax_terms(l, groups, [=](int64_t u) { return cluster_weight(sizes, n_clusters, u); });
}

/// The MAX_LOGIT fold's step (start from -inf; a NaN logit keeps acc).
KVRET_HD float cluster_max_step(float acc, float l) { return page_max_step(acc, l); }

/// The SUM_PROB fold's step for one group and one head (start from 0; heads in order).
KVRET_HD float cluster_sum_prob_step(float acc, float e, const PageSoftmax& s) { return page_sum_prob_step(acc, e, s); }

/// The order of groups as one ascending integer: score descending (NaN lowest, -0 as +0), ties to the lower group.
KVRET_HD uint64_t cluster_order_key(float score, uint32_t group) { return page_order_key(score, group); }

/// The tokens taken from a group of `weight` tokens when `before` tokens of better groups were taken before it: the
/// whole group while it fits the budget, the rest of the budget for the group that crosses it (a cluster keeps its
/// earliest positions), then nothing.
KVRET_HD int64_t cluster_take(int64_t before, int64_t weight, int64_t budget) {
  return page_take(before, weight, budget);
}

}  // namespace kvret::cuda::math
