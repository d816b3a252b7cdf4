#pragma once
// Per-element math of the EXACT index (the quality oracle; src/index/exact_retriever.*), shared by the CPU retriever
// and the CUDA backend's device select (src/backend/exact_select_ops.hpp), so that both compute the same bits:
// the logit of a middle token for one query head is scale * (q . k), k the token's stored key converted to f32
// (exact for f16 and bf16), the dot product in dot8's order (page_math.h: eight partial sums over the whole blocks
// of eight, added as ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), then the tail in order), which is vec_math.hpp's
// dot, the one ExactRetriever::select calls. The fold and the top-k are the token softmax and order of
// softmax_math.h / topk_math.h that QUANT's select uses too.
//
// Every float operation that could be contracted into a fused multiply-add goes through hd.h's *_rn helpers.
#include "page_math.h"

namespace kvret::cuda::math {

/// The logit of a token for one query head q [d]: scale * (q . key), key [d] its key as f32.
KVRET_HD float exact_logit(float scale, const float* q, const float* key, int d) {
  return mul_rn(scale, dot8(q, key, d));
}

}  // namespace kvret::cuda::math
