#pragma once
// Folding the query heads of one KV group into one score per token.
#include <cstdint>

#include "kvret.h"

namespace kvret {

/// logits: [group, n] (already scaled). folded: [n].
/// KVRET_FOLD_SUM_PROB: sum over the group of each head's softmax over the n tokens.
/// KVRET_FOLD_MAX_LOGIT: max over the group of the logits.
void fold_logits(const float* logits, int group, int64_t n, kvret_gqa_fold fold, float* folded);

/// Weighted form for scores shared by many tokens (PQ code cells): token u has logits[g * n + u] for head g and
/// occurs weight[u] times; the softmax of each head runs over all occurrences. Cells of weight 0 are ignored.
void fold_weighted_logits(const float* logits, const int32_t* weight, int group, int64_t n, kvret_gqa_fold fold,
                          float* folded);

/// The sum-of-probabilities fold of PQ scores with m = 4 sub-spaces, without an exp per token and head.
/// lut: [group, 4, k] (scaled: l_j[c] = scale * <q_g,j, C_j[c]>); codes: [n, 4]; exact: the offsets (ascending, in
/// [0, n)) of the n_exact tokens scored exactly, exact_logits: their logits, [group, n_exact].
/// For each head, with M = max(sum_j max_c l_j[c], max of its exact logits) (NaN ignored) and d = M - sum_j max_j:
///   E_0[c] = exp((l_0[c] - max_0) - d), E_j[c] = exp(l_j[c] - max_j) (j = 1..3), exp_nonpositive's bits;
///   e[t] = (E_0[c0] * E_1[c1]) * (E_2[c2] * E_3[c3]) for a PQ token, exp(x - M) for an exact one;
///   z = the sum of e (fold_logits' unweighted order), folded[t] += e[t] * (1 / z), heads in order.
/// This is fold_logits of the PQ logits up to rounding (e^(a+b) as e^a e^b) and the reference of the softmax (M
/// bounds every logit instead of being their maximum). Returns false, with folded untouched, where it does not
/// apply (k > 64, or a non-finite M): the caller folds the logits instead. The same bits on every CPU.
bool pq4_softmax_fold(const float* lut, int group, int k, const uint8_t* codes, int64_t n, const int64_t* exact,
                      const float* exact_logits, int64_t n_exact, float* folded);

}  // namespace kvret
