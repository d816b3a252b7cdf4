#pragma once
// The arithmetic of kvret's blocked decode attention (src/core/attention.cpp), single source for the CPU core and the
// CUDA backend's quantized attention over its exact rows (src/backend/quant_attend_ops.hpp), so that both compute
// the same bits:
// - a KV head's rows are cut into spans (attend_span_rows, a function of the row count alone), a span into blocks of
//   kAttendBlockRows rows;
// - a score is scale * (q . k) in dot8's order;
// - per block and query head, the online softmax's step (attend_block_step): the block's maximum (NaN if a score
//   is NaN), the running maximum, the rescale factor of the accumulator e^(old max - new max), the block's scores
//   replaced by their weights e^(score - max) (exp_nonpositive) and summed in eight lanes, the running sum (double)
//   rescaled and increased;
// - an accumulator element is multiplied by the block's rescale factor (when it is not 1), then gets weight * value
//   added row by row in row order;
// - the spans' partial results are merged per query head in span order, in double (attend_merge_max,
//   attend_span_weight): a span whose maximum is -inf has no weight and is skipped; a NaN maximum makes the head NaN.
// Every float operation that could be contracted into a fused multiply-add goes through hd.h's *_rn helpers. The one
// operation not bit-identical across host and device on a GPU is the merge's double exponential (the host's
// std::exp, the device's exp, within 1 ulp); on Thrust's host system both are std::exp.
#include <cmath>

#include "hd.h"
#include "page_math.h"
#include "softmax_math.h"

namespace kvret::cuda::math {

/// Rows per block: one block's scores for a whole query group are kept at once.
constexpr int64_t kAttendBlockRows = 64;
/// The fewest rows of a span, and the most spans of one KV head.
constexpr int64_t kAttendMinSpanRows = 512;
constexpr int64_t kAttendMaxSpans = 64;

/// The rows of each span of a KV head for `rows` rows (the last span may be shorter): a multiple of
/// kAttendBlockRows, at least kAttendMinSpanRows, and large enough for at most kAttendMaxSpans spans.
KVRET_HD int64_t attend_span_rows(int64_t rows) {
  const int64_t spread = (rows + kAttendMaxSpans - 1) / kAttendMaxSpans;
  const int64_t blocks = (spread + kAttendBlockRows - 1) / kAttendBlockRows;
  const int64_t span = blocks * kAttendBlockRows;
  return span < kAttendMinSpanRows ? kAttendMinSpanRows : span;
}

/// A score: scale * (q . k) over d elements in dot8's order.
KVRET_HD float attend_score(const float* q, const float* k, int d, float scale) { return mul_rn(scale, dot8(q, k, d)); }

/// The largest of n scores, or NaN when one of them is NaN.
KVRET_HD float attend_block_max(const float* p, int64_t n) {
  float mx = neg_inf();
  bool nan = false;
  for (int64_t r = 0; r < n; ++r) {
    nan = nan || p[r] != p[r];
    mx = p[r] > mx ? p[r] : mx;
  }
  return nan ? bits_float(0x7fc00000u) : mx;
}

/// p[r] = exp_nonpositive(p[r] - mx) for r < n; returns their sum in eight lanes over the multiple-of-8 prefix
/// (lane r mod 8), reduced ((0+4)+(1+5))+((2+6)+(3+7)), then the tail in order.
KVRET_HD float attend_block_weights(float* p, int64_t n, float mx) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t r = 0;
  for (; r + 8 <= n; r += 8)
    for (int i = 0; i < 8; ++i) lane[i] = add_rn(lane[i], p[r + i] = exp_nonpositive(sub_rn(p[r + i], mx)));
  float sum = add_rn(add_rn(add_rn(lane[0], lane[4]), add_rn(lane[1], lane[5])),
                     add_rn(add_rn(lane[2], lane[6]), add_rn(lane[3], lane[7])));
  for (; r < n; ++r) sum = add_rn(sum, p[r] = exp_nonpositive(sub_rn(p[r], mx)));
  return sum;
}

/// The running maximum after a block whose maximum is bm (NaN once either is NaN).
KVRET_HD float attend_running_max(float m, float bm) {
  return m != m || bm != bm ? bits_float(0x7fc00000u) : (m < bm ? bm : m);
}

/// The running sum after a block: l * alpha + the block's weight sum.
KVRET_HD double attend_running_sum(double l, float alpha, float block_sum) {
  return dadd_rn(dmul_rn(l, static_cast<double>(alpha)), static_cast<double>(block_sum));
}

/// One block's online-softmax step for one query head: the scores p [n] become weights, *m and *l are updated, and
/// the accumulator's rescale factor is returned (1 while every score so far is -inf, when the weights are all 0).
/// block_max(p, n) and block_weights(p, n, mx) compute attend_block_max's and attend_block_weights' bits (the CPU's
/// SIMD paths pass their own).
template <class BlockMax, class BlockWeights>
KVRET_HD float attend_block_step(float* p, int64_t n, float* m, double* l, BlockMax block_max,
                                 BlockWeights block_weights) {
  const float mx = attend_running_max(*m, block_max(p, n));
  if (mx == neg_inf()) {
    for (int64_t r = 0; r < n; ++r) p[r] = 0.0f;
    return 1.0f;
  }
  const float alpha = exp_nonpositive(sub_rn(*m, mx));  // 0 for m = -inf, NaN once a score was NaN
  *m = mx;
  *l = attend_running_sum(*l, alpha, block_weights(p, n, mx));
  return alpha;
}

struct AttendBlockMax {
  KVRET_HD float operator()(const float* p, int64_t n) const { return attend_block_max(p, n); }
};
struct AttendBlockWeights {
  KVRET_HD float operator()(float* p, int64_t n, float mx) const { return attend_block_weights(p, n, mx); }
};

/// attend_block_step on the scalar path.
KVRET_HD float attend_block_step(float* p, int64_t n, float* m, double* l) {
  return attend_block_step(p, n, m, l, AttendBlockMax{}, AttendBlockWeights{});
}

/// An accumulator element's step for one row: acc + w * v.
KVRET_HD float attend_accumulate(float acc, float w, float v) { return add_rn(acc, mul_rn(w, v)); }

/// The merge's maximum over n spans' maxima (m[s * stride]), in double; *nan when one of them is NaN.
KVRET_HD double attend_merge_max(const float* m, int64_t n, int64_t stride, bool* nan) {
  double mx = -static_cast<double>(pos_inf());
  for (int64_t s = 0; s < n; ++s) {
    const float mi = m[s * stride];
    *nan = *nan || mi != mi;
    const double x = static_cast<double>(mi);
    mx = mx < x ? x : mx;
  }
  return mx;
}

/// e^(x - mx) in double: the host's std::exp, the device's exp.
KVRET_HD double attend_dexp(double x, double mx) {
#if defined(__CUDA_ARCH__)
  return ::exp(x - mx);
#else
  return std::exp(x - mx);
#endif
}

/// The merge weight of a span whose maximum is m_s (not -inf) against the merge's maximum.
KVRET_HD double attend_span_weight(float m_s, double mx) { return attend_dexp(static_cast<double>(m_s), mx); }

/// A merge's step: sum + w * x (the normaliser's with x a span's sum, an output element's with x its accumulator).
KVRET_HD double attend_merge_add(double sum, double w, double x) { return dadd_rn(sum, dmul_rn(w, x)); }

}  // namespace kvret::cuda::math
