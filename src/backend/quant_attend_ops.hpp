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
//   QuantAttendLogits    per (query head, token) its logit in double: the rescaled low-bit logit, or the exact one
//                        from the token's exact key (the sink, local, selected and candidate tokens)
//   QuantAttendWeights   per query head the maximum, then e^(l - max) in place, and the normaliser, in token order
//   QuantAttendOutput    per (query head, element) the weighted sum of the values in token order (the exact value of
//                        a sink, local or selected token; the low-bit copy's otherwise), divided by the normaliser
#include <cstddef>
#include <cstdint>

#include "backend/quant_select_ops.hpp"

namespace kvret::device_math {

/// The tokens a call reads exactly, per KV head: slot[h * n + t] is token t's row in keys/values ([heads, rows, d]
/// f32), or -1 for a middle token read from the low-bit copy; exact_value[h * rows + slot]: its value is exact too.
struct QuantExactRows {
  const int32_t* slot;
  const uint8_t* exact_value;
  const float* keys;
  const float* values;
  int64_t rows;
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
    const int32_t s = x.slot[h * n + t];
    logits[i] = s < 0 ? qm::quant_low_logit(rescale, low[hq * middle + (t - begin)])
                      : qm::quant_exact_logit(q + hq * d, x.keys + (h * x.rows + s) * d, d, scale);
  }
};

struct QuantAttendWeights {
  double* logits;  ///< [n_q_heads, n]: replaced by the weights
  double* z;       ///< [n_q_heads]
  int64_t n;
  KVRET_BACKEND_HD void operator()(int64_t hq) const {
    double* l = logits + hq * n;
    double m = -static_cast<double>(qm::pos_inf());
    for (int64_t t = 0; t < n; ++t) m = m < l[t] ? l[t] : m;
    double s = 0;
    for (int64_t t = 0; t < n; ++t) {
      l[t] = qm::quant_weight(l[t], m);
      s = qm::dadd_rn(s, l[t]);
    }
    z[hq] = s;
  }
};

struct QuantAttendOutput {
  QuantLayout l;
  QuantExactRows x;
  const double* weights;  ///< [n_q_heads, n]
  const double* z;        ///< [n_q_heads]
  DeviceTensor out;       ///< f32 [n_q_heads, d]
  int64_t n, begin;
  int32_t group;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / l.d, h = hq / group;
    const auto c = static_cast<int32_t>(i % l.d);
    const double* w = weights + hq * n;
    const int64_t quantized = l.blocks * l.group;
    const int64_t j = c / l.group;
    double acc = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int32_t s = x.slot[h * n + t];
      float v;
      if (s >= 0 && x.exact_value[h * x.rows + s] != 0) {
        v = x.values[(h * x.rows + s) * l.d + c];
      } else {
        const int64_t u = t - begin;  // a middle token of the copy
        if (u < quantized) {
          const int64_t row = h * l.cap_blocks * l.group + u;
          const uint16_t* p = l.value_params + row * l.value_row_params();
          v = qm::kivi_value_element(l.value_codes + row * l.value_row_bytes(), l.bits, c, f16_to_f32(p[2 * j]),
                                     f16_to_f32(p[2 * j + 1]));
        } else {
          v = f16_to_f32(l.res_v[(h * l.res_cap + (u - quantized)) * l.d + c]);
        }
      }
      acc = qm::quant_accumulate(acc, w[t], v);
    }
    *reinterpret_cast<float*>(out.at(hq, c)) = qm::quant_output(acc, z[hq]);
  }
};

}  // namespace kvret::device_math
