#pragma once
// Softmax math of the kernels: the exponential (the CPU core's exp_nonpositive, operation for operation), the
// online-softmax step of decode attention, and the merge of partial softmax statistics (decode attention's chunks,
// the PQ sum-of-probabilities fold's chunks).
#include "hd.h"

namespace kvret::cuda::math {

/// e^x for x <= 0: the CPU core's exp_nonpositive (core/vec_math.hpp) with the same operations in the same order,
/// so the same bits on host and device (relative error below 2e-7; x < -87 gives 0, x > 0 is taken as 0, NaN stays
/// NaN).
KVRET_HD float exp_nonpositive(float x) {
  x = x > 0.0f ? 0.0f : x;
  x = x < -87.0f ? -87.0f : x;
  const float t = mul_rn(x, 1.44269504088896341f);
  const float fn = static_cast<float>(static_cast<int32_t>(sub_rn(t == t ? t : 0.0f, 0.5f)));
  const float f = sub_rn(t, fn);
  const float y = mul_rn(f, 0.693147180559945309f);
  float p = 1.0f / 720.0f;
  p = add_rn(mul_rn(p, y), 1.0f / 120.0f);
  p = add_rn(mul_rn(p, y), 1.0f / 24.0f);
  p = add_rn(mul_rn(p, y), 1.0f / 6.0f);
  p = add_rn(mul_rn(p, y), 0.5f);
  p = add_rn(mul_rn(p, y), 1.0f);
  p = add_rn(mul_rn(p, y), 1.0f);
  const float scale = bits_float(static_cast<uint32_t>((static_cast<int32_t>(fn) + 127) << 23));
  return x <= -87.0f ? 0.0f : mul_rn(p, scale);
}

/// Softmax statistics of a set of logits: their max and sum(exp(logit - max)). {-inf, 0} is the empty set.
struct SoftmaxPartial {
  float max;
  float sum;
};

/// e^(logit - max) of one logit against a running or final max; 0 for a -inf logit (also when the max is -inf).
KVRET_HD float softmax_weight(float logit, float max) {
  return logit == neg_inf() ? 0.0f : exp_nonpositive(logit - max);
}

/// The union of two sets' statistics (associative up to rounding; the empty set is neutral).
KVRET_HD SoftmaxPartial softmax_combine(SoftmaxPartial a, SoftmaxPartial b) {
  if (a.max == neg_inf()) return b;
  if (b.max == neg_inf()) return a;
  const float m = max_f(a.max, b.max);
  return {m, add_rn(mul_rn(a.sum, exp_nonpositive(a.max - m)), mul_rn(b.sum, exp_nonpositive(b.max - m)))};
}

/// One online-softmax step: a running state absorbs a tile whose largest logit is tile_max. The caller multiplies
/// its running sum and output by `rescale`, weights the tile's logits with softmax_weight(logit, new_max), and adds
/// the tile's weight sum (online_softmax_sum).
struct OnlineSoftmaxStep {
  float new_max;
  float rescale;
};

KVRET_HD OnlineSoftmaxStep online_softmax_step(float old_max, float tile_max) {
  const float m = max_f(old_max, tile_max);
  return {m, old_max == neg_inf() ? 0.0f : exp_nonpositive(old_max - m)};
}

KVRET_HD float online_softmax_sum(float old_sum, float rescale, float tile_sum) {
  return add_rn(mul_rn(old_sum, rescale), tile_sum);
}

/// The weight of a chunk's unnormalised output in the merge: e^(chunk_max - global_max), 0 for an empty chunk.
KVRET_HD float merge_weight(float chunk_max, float global_max) {
  return chunk_max == neg_inf() ? 0.0f : exp_nonpositive(chunk_max - global_max);
}

}  // namespace kvret::cuda::math
