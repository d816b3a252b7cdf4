#pragma once
// The CUDA backend's quantized attention for the QUANT index (SpeCache's output rule, QuantRetriever::attend_dense;
// docs/quant.md), as per-element functors for Thrust passes over the device copy of the low-bit index
// (quant_select_ops.hpp's QuantLayout). The math is kernels/math/quant_math.h, the functions attend_dense calls.
//
// One call over the n tokens of a (sequence, layer), the middle [begin, end), is these passes:
//   PageLoadQuery, QuantBlockLogits, QuantResidualLogits   q and the low-bit logits at select's scale (quant_select)
//   (the candidates, with re-ranking: select's candidate passes, the maximum over each group, over a copy of those
//   logits)
//   QuantExactLoad       the exact rows' keys (and values where exact), read from the store's pinned pages in f32
//   QuantExactScores     the exact rows (sink, local, selected; per KV head in position order) attended as attend
//   QuantExactSpans      does (kernels/math/attend_math.h): per (query head, row) its score, per (query head, span)
//   QuantExactValues     the online softmax's steps over the span's blocks, per (query head, span, element) its
//                        weighted values
//   QuantAttendLogits    per (query head, other token) its logit in double: the rescaled low-bit logit, or the exact
//                        one from a candidate's exact key
//   QuantAttendWeights   per query head the spans' merge, the maximum over every token, the exact rows' share, then
//                        e^(l - max) in place and the normaliser, in token order
//   QuantAttendOutput    per (query head, element) the spans' merged values times the share, plus the other tokens'
//                        weighted values in token order (a candidate's from the low-bit copy), over the normaliser
#include <cstddef>
#include <cstdint>

#include "backend/quant_select_ops.hpp"

namespace kvret::device_math {

/// The tokens a call reads exactly, per KV head: slot[h * n + t] is token t's row in keys/values ([heads, rows, d]
/// f32), or -1 for a middle token read from the low-bit copy; exact_value[h * rows + slot]: its value is exact too
/// (an exact row). exact_row[h * rows + i] is the slot of head h's i-th exact row in position order, i <
/// exact_count[h]; a head's exact rows are cut into at most `spans` spans.
struct QuantExactRows {
  const int32_t* slot;
  const uint8_t* exact_value;
  const float* keys;
  const float* values;
  int64_t rows;
  const int32_t* exact_row;
  const int32_t* exact_count;
  int64_t spans;
  KVRET_BACKEND_HD bool exact(int64_t h, int64_t n, int64_t t) const {
    const int32_t s = slot[h * n + t];
    return s >= 0 && exact_value[h * rows + s] != 0;
  }
};

/// The exact rows' attention state: per query head its rows' scores, then weights ([n_q_heads, rows]), the
/// accumulator's rescale factor of each block ([n_q_heads, rows / kAttendBlockRows rounded up]), each span's maximum,
/// sum and weighted values ([n_q_heads, spans] and [n_q_heads, spans, d]), and the merge's maximum, the exact rows'
/// share and NaN flag per query head.
struct QuantExactState {
  float* weights;
  float* alpha;
  float* span_max;
  double* span_sum;
  float* span_acc;
  double* exact_max;
  double* share;
  uint8_t* nan;
  KVRET_BACKEND_HD static int64_t blocks(int64_t rows) {
    return (rows + qm::kAttendBlockRows - 1) / qm::kAttendBlockRows;
  }
};

/// Rows [r0, r1) of a head's exact rows by span (attend_span_rows of its row count); empty past its last span.
KVRET_BACKEND_HD inline void quant_exact_span(int64_t count, int64_t s, int64_t* r0, int64_t* r1) {
  const int64_t span = qm::attend_span_rows(count);
  *r0 = s * span < count ? s * span : count;
  *r1 = *r0 + span < count ? *r0 + span : count;
}

struct QuantExactScores {
  QuantExactRows x;
  QuantExactState st;
  const float* q;  ///< [n_q_heads, d]
  int32_t d, group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / x.rows, r = i % x.rows, h = hq / group;
    if (r >= x.exact_count[h]) return;
    st.weights[i] = qm::attend_score(q + hq * d, x.keys + (h * x.rows + x.exact_row[h * x.rows + r]) * d, d, scale);
  }
};

struct QuantExactSpans {
  QuantExactRows x;
  QuantExactState st;
  int32_t group;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / x.spans, s = i % x.spans;
    int64_t r0, r1;
    quant_exact_span(x.exact_count[hq / group], s, &r0, &r1);
    float m = qm::neg_inf();
    double l = 0;
    for (int64_t b = r0; b < r1; b += qm::kAttendBlockRows) {
      const int64_t n = r1 - b < qm::kAttendBlockRows ? r1 - b : qm::kAttendBlockRows;
      st.alpha[hq * QuantExactState::blocks(x.rows) + b / qm::kAttendBlockRows] =
          qm::attend_block_step(st.weights + hq * x.rows + b, n, &m, &l);
    }
    st.span_max[i] = m;
    st.span_sum[i] = l;
  }
};

struct QuantExactValues {
  QuantExactRows x;
  QuantExactState st;
  int32_t d, group;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / (x.spans * d), s = (i / d) % x.spans, c = i % d, h = hq / group;
    int64_t r0, r1;
    quant_exact_span(x.exact_count[h], s, &r0, &r1);
    float acc = 0;
    for (int64_t b = r0; b < r1; b += qm::kAttendBlockRows) {
      const float alpha = st.alpha[hq * QuantExactState::blocks(x.rows) + b / qm::kAttendBlockRows];
      if (alpha != 1.0f) acc = qm::mul_rn(acc, alpha);
      const int64_t e = r1 - b < qm::kAttendBlockRows ? r1 : b + qm::kAttendBlockRows;
      for (int64_t r = b; r < e; ++r)
        acc = qm::attend_accumulate(acc, st.weights[hq * x.rows + r],
                                    x.values[(h * x.rows + x.exact_row[h * x.rows + r]) * d + c]);
    }
    st.span_acc[i] = acc;
  }
};

/// Element i of the exact rows' load (row i / head_dim of `copies`, element i % head_dim): its key, and its value
/// where exact_value marks it, converted to f32 into keys / values [heads, rows, head_dim] at (head, row); a row
/// read for its key only moves no value bytes.
struct QuantExactLoad {
  const RowCopy* copies;
  const uint8_t* exact_value;
  float* keys;
  float* values;
  int64_t rows;
  int32_t src_type, head_dim;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const RowCopy& c = copies[i / head_dim];
    const int64_t e = i % head_dim;
    const int64_t row = c.head * rows + c.row;
    copy_element(c.k_src, src_type, reinterpret_cast<std::byte*>(keys + row * head_dim), kF32, e);
    if (exact_value[row] != 0)
      copy_element(c.v_src, src_type, reinterpret_cast<std::byte*>(values + row * head_dim), kF32, e);
  }
};

struct QuantAttendLogits {
  QuantExactRows x;
  const float* q;    ///< [n_q_heads, d]
  const float* low;  ///< [n_q_heads, middle]: the low-bit logits at select's scale
  double* logits;    ///< [n_q_heads, n]
  int64_t n, begin, middle;
  int32_t d, group;
  float scale;
  double rescale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / n, t = i % n, h = hq / group;
    if (x.exact(h, n, t)) return;  // attended with the exact rows
    const int32_t s = x.slot[h * n + t];
    logits[i] = s < 0 ? qm::quant_low_logit(rescale, low[hq * middle + (t - begin)])
                      : qm::quant_exact_logit(q + hq * d, x.keys + (h * x.rows + s) * d, d, scale);
  }
};

struct QuantAttendWeights {
  QuantExactRows x;
  QuantExactState st;
  double* logits;  ///< [n_q_heads, n]: replaced by the weights
  double* z;       ///< [n_q_heads]
  int64_t n;
  int32_t group;
  KVRET_BACKEND_HD void operator()(int64_t hq) const {
    const int64_t h = hq / group;
    // the exact rows' spans merged (attend_head's merge_spans), then every other token's logit in position order
    bool nan = false;
    const double exact_max = qm::attend_merge_max(st.span_max + hq * x.spans, x.spans, 1, &nan);
    double total = 0;
    for (int64_t s = 0; s < x.spans && !nan; ++s) {
      const float ms = st.span_max[hq * x.spans + s];
      if (ms == qm::neg_inf()) continue;
      total = qm::attend_merge_add(total, qm::attend_span_weight(ms, exact_max), st.span_sum[hq * x.spans + s]);
    }
    double* l = logits + hq * n;
    double m = exact_max;
    for (int64_t t = 0; t < n; ++t)
      if (!x.exact(h, n, t)) m = m < l[t] ? l[t] : m;
    const double share = qm::quant_exact_share(exact_max, m);
    double sum = qm::dmul_rn(share, total);
    for (int64_t t = 0; t < n; ++t) {
      if (x.exact(h, n, t)) continue;
      l[t] = qm::quant_weight(l[t], m);
      sum = qm::dadd_rn(sum, l[t]);
    }
    z[hq] = sum;
    st.exact_max[hq] = exact_max;
    st.share[hq] = share;
    st.nan[hq] = nan ? 1 : 0;
  }
};

struct QuantAttendOutput {
  QuantLayout l;
  QuantExactRows x;
  QuantExactState st;
  const double* weights;  ///< [n_q_heads, n]
  const double* z;        ///< [n_q_heads]
  DeviceTensor out;       ///< f32 [n_q_heads, d]
  int64_t n, begin;
  int32_t group;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / l.d, h = hq / group;
    const auto c = static_cast<int32_t>(i % l.d);
    std::byte* o = out.at(hq, c);  // f32, f16 or bf16 (the f32 result rounded)
    if (st.nan[hq] != 0) {
      store_f32(o, out.type, 0, qm::bits_float(0x7fc00000u));
      return;
    }
    // the exact rows' weighted values (the spans merged), times their share
    double exact = 0;
    for (int64_t s = 0; s < x.spans; ++s) {
      const float ms = st.span_max[hq * x.spans + s];
      if (ms == qm::neg_inf()) continue;
      exact = qm::attend_merge_add(exact, qm::attend_span_weight(ms, st.exact_max[hq]),
                                   static_cast<double>(st.span_acc[(hq * x.spans + s) * l.d + c]));
    }
    double acc = qm::dmul_rn(st.share[hq], exact);
    const double* w = weights + hq * n;
    const int64_t quantized = l.blocks * l.group;
    const int64_t j = c / l.group;
    for (int64_t t = 0; t < n; ++t) {
      if (x.exact(h, n, t)) continue;
      const int64_t u = t - begin;  // a middle token of the copy (a candidate keeps its low-bit value)
      float v;
      if (u < quantized) {
        const int64_t row = h * l.cap_blocks * l.group + u;
        const uint16_t* p = l.value_params + row * l.value_row_params();
        v = qm::kivi_value_element(l.value_codes + row * l.value_row_bytes(), l.bits, c, f16_to_f32(p[2 * j]),
                                   f16_to_f32(p[2 * j + 1]));
      } else {
        v = f16_to_f32(l.res_v[(h * l.res_cap + (u - quantized)) * l.d + c]);
      }
      acc = qm::quant_accumulate(acc, w[t], v);
    }
    store_f32(o, out.type, 0, qm::quant_output(acc, z[hq]));
  }
};

}  // namespace kvret::device_math
