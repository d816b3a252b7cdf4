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

}  // namespace kvret
