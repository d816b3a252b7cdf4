#pragma once
// Per-element and decision math of the QUANT index (SpeCache's KIVI low-bit copy; src/core/kivi_quant.* and
// src/index/quant_retriever.*), single source for the CPU core and the CUDA backend, so that both compute the same
// bits:
// - a group's affine form (zero point and step), the code of an element (the quantization decision) and the value a
//   code stands for, in float, every operation through hd.h's *_rn helpers and the correctly rounded divisions below;
// - reading code j of a packed run, and the dequantized element of a key block (per channel along tokens) or of a
//   value row (per token along channels);
// - the low-bit logit of a token, computed from the codes without reconstructing the key: scale * ((q * step) .
//   codes_t) + scale * (q . zero), both dot products in dot8's order (vec_math.hpp's dot and scaled_dots, which
//   kivi_key_block_logits calls);
// - the SUM_PROB fold's softmax over tokens (token_softmax_terms: select/gqa_fold.cpp's unweighted fold, which the
//   CUDA backend's QUANT select uses with page_math.h's fold steps);
// - quantized attention's output rule (QuantRetriever::attend_dense): the exact rows (sink, local, selected) by the
//   blocked decode attention (attend_math.h), joined in double to the other tokens' terms: an exact logit (scale *
//   sum q_i k_i, summed in channel order) for a candidate, a low-bit logit rescaled to the softmax's scale otherwise,
//   a token's weight e^(l - max), and the weighted sums.
// A group's lo and hi arrive as f32 (the callers decode the stored f16 bits: core/half.hpp on the host,
// backend/device_math.hpp on the device; both are exact).
#include <cmath>

#include "attend_math.h"
#include "page_math.h"

namespace kvret::cuda::math {

/// a / b correctly rounded (nvcc's default division is too, unless -prec-div=false; this says it explicitly).
KVRET_HD float quant_div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

KVRET_HD double quant_ddiv_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

/// Code j of a packed run (little-endian bit order within a byte: bit (j * bits) % 8 of byte (j * bits) / 8).
KVRET_HD int kivi_unpack(const uint8_t* codes, int64_t j, int bits) {
  const int64_t bit = j * bits;
  return (codes[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1);
}

/// The affine form of a group's levels: value = zero + code * step (up to rounding; kivi_value is the reference).
/// 2-bit: zero lo, step (hi - lo) / 3; 1-bit: zero (3 lo + hi) / 4, step (hi - lo) / 2.
KVRET_HD void kivi_affine(float lo, float hi, int bits, float* zero, float* step) {
  if (bits == 2) {
    *zero = lo;
    *step = quant_div_rn(sub_rn(hi, lo), 3.0f);
  } else {
    *zero = quant_div_rn(add_rn(mul_rn(3.0f, lo), hi), 4.0f);
    *step = quant_div_rn(sub_rn(hi, lo), 2.0f);
  }
}

/// The code of x in a group [lo, hi] (lo <= hi): the nearest 2-bit level, or the improved 1-bit rule
/// round((x - zero) / step) clamped to {0, 1}. A NaN x, or lo == hi (or NaN bounds), gives 0.
KVRET_HD int kivi_code(float x, float lo, float hi, int bits) {
  if (!(hi > lo)) return 0;
  if (bits == 2) {
    const float t = mul_rn(quant_div_rn(sub_rn(x, lo), sub_rn(hi, lo)), 3.0f);  // x == hi gives exactly 3
    return (t >= 0.5f) + (t >= 1.5f) + (t >= 2.5f);
  }
  float zero, step;
  kivi_affine(lo, hi, 1, &zero, &step);
  return quant_div_rn(sub_rn(x, zero), step) >= 0.5f ? 1 : 0;
}

/// The value code c stands for in [lo, hi]: 2-bit ((3 - c) lo + c hi) / 3 (exact lo and hi for codes 0 and 3),
/// 1-bit ((3 - 2c) lo + (1 + 2c) hi) / 4.
KVRET_HD float kivi_value(int code, float lo, float hi, int bits) {
  if (bits == 2)
    return quant_div_rn(add_rn(mul_rn(static_cast<float>(3 - code), lo), mul_rn(static_cast<float>(code), hi)), 3.0f);
  return quant_div_rn(
      add_rn(mul_rn(static_cast<float>(3 - 2 * code), lo), mul_rn(static_cast<float>(1 + 2 * code), hi)), 4.0f);
}

/// Bytes of one channel's codes in a key block of `group` tokens.
KVRET_HD int kivi_key_channel_bytes(int group, int bits) { return group * bits / 8; }

/// Channel i of token `within` of a key block (codes [head_dim][group * bits / 8]), dequantized with the channel's
/// (lo, hi).
KVRET_HD float kivi_key_element(const uint8_t* block_codes, int group, int bits, int i, int within, float lo,
                                float hi) {
  const uint8_t* c = block_codes + static_cast<int64_t>(kivi_key_channel_bytes(group, bits)) * i;
  return kivi_value(kivi_unpack(c, within, bits), lo, hi, bits);
}

/// Channel i of a value row (codes [head_dim * bits / 8]), dequantized with its channel group's (lo, hi).
KVRET_HD float kivi_value_element(const uint8_t* row_codes, int bits, int i, float lo, float hi) {
  return kivi_value(kivi_unpack(row_codes, i, bits), lo, hi, bits);
}

/// (q * step) . codes_t over d channels in dot8's order, token `within` of a key block: w [d] is q * step element by
/// element (mul_rn), the codes are read as floats 0..3 (exact), so this is dot8(w, codes_t as floats, d).
KVRET_HD float kivi_code_dot(const float* w, const uint8_t* block_codes, int group, int bits, int within, int d) {
  const int64_t per_channel = kivi_key_channel_bytes(group, bits);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  const auto code = [&](int c) { return static_cast<float>(kivi_unpack(block_codes + per_channel * c, within, bits)); };
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] = add_rn(acc[l], mul_rn(w[i + l], code(i + l)));
  float s = add_rn(add_rn(add_rn(acc[0], acc[4]), add_rn(acc[1], acc[5])),
                   add_rn(add_rn(acc[2], acc[6]), add_rn(acc[3], acc[7])));
  for (; i < d; ++i) s = add_rn(s, mul_rn(w[i], code(i)));
  return s;
}

/// The zero-point term of a query against a key block: scale * (q . zero), zero [d] the channels' zero points.
KVRET_HD float kivi_logit_base(float scale, const float* q, const float* zero, int d) {
  return mul_rn(scale, dot8(q, zero, d));
}

/// The low-bit logit of token `within` of a key block: scale * kivi_code_dot(w, ...) + base (kivi_logit_base).
KVRET_HD float kivi_low_bit_logit(float scale, const float* w, float base, const uint8_t* block_codes, int group,
                                  int bits, int within, int d) {
  return add_rn(mul_rn(scale, kivi_code_dot(w, block_codes, group, bits, within, d)), base);
}

/// The SUM_PROB fold's softmax of one query head over n tokens, in place (select/gqa_fold.cpp's unweighted fold,
/// operation for operation, which QUANT's select uses): the maximum (NaN ignored), l_u replaced by e^(l_u - max)
/// (exp_nonpositive), the normaliser in eight double partial sums (lane i takes the terms at 8b + i of the whole
/// blocks of eight) added in lane order, then the tail in order, and inv = (float)(1 / z). Without a finite maximum
/// l is left as it was; with z <= 0 the head is not used either. The fold's step is page_sum_prob_step.
KVRET_HD PageSoftmax token_softmax_terms(float* l, int64_t n) {
  PageSoftmax s;
  float mx = neg_inf();
  for (int64_t u = 0; u < n; ++u) mx = page_max_step(mx, l[u]);
  if (!(mx > neg_inf())) return s;
  for (int64_t u = 0; u < n; ++u) l[u] = exp_nonpositive(sub_rn(l[u], mx));
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    for (int i = 0; i < 8; ++i) lane[i] = dadd_rn(lane[i], static_cast<double>(l[u + i]));
  double z = 0;
  for (int i = 0; i < 8; ++i) z = dadd_rn(z, lane[i]);
  for (; u < n; ++u) z = dadd_rn(z, static_cast<double>(l[u]));
  if (z <= 0) return s;
  s.max = mx;
  s.inv = static_cast<float>(quant_ddiv_rn(1.0, z));
  s.used = true;
  return s;
}

// Quantized attention's output rule (double precision).

/// The factor from select's logit scale (1 / sqrt(head_dim), the low-bit logits') to the softmax's.
KVRET_HD double quant_rescale(float scale, float select_scale) {
  return quant_ddiv_rn(static_cast<double>(scale), static_cast<double>(select_scale));
}

/// A low-bit logit at the softmax's scale.
KVRET_HD double quant_low_logit(double rescale, float low) { return dmul_rn(rescale, static_cast<double>(low)); }

/// An exact logit: (sum_i q_i k_i in channel order, in double) * scale.
KVRET_HD double quant_exact_logit(const float* q, const float* key, int d, float scale) {
  double s = 0;
  for (int i = 0; i < d; ++i) s = dadd_rn(s, dmul_rn(static_cast<double>(q[i]), static_cast<double>(key[i])));
  return dmul_rn(s, static_cast<double>(scale));
}

/// A token's weight against its head's maximum logit: e^(l - max) (attend_dexp). Host and device each use their own
/// exp (the host's std::exp; the device's exp, within 1 ulp): with the exact rows' merge, the one operation of the
/// rule not bit-identical across them.
KVRET_HD double quant_weight(double l, double max) { return attend_dexp(l, max); }

/// The share of the exact rows' attention (their largest score exact_max, attend_head's normaliser and weighted
/// values, relative to it) in a head whose largest logit over every token is max (>= exact_max): e^(exact_max - max),
/// 0 without an exact row. The normaliser and each weighted sum start at share * the exact rows' ones, then take the
/// other tokens' terms in position order.
KVRET_HD double quant_exact_share(double exact_max, double max) {
  return exact_max == -static_cast<double>(pos_inf()) ? 0.0 : quant_weight(exact_max, max);
}

/// acc + w * v, the weighted sum's step (also the normaliser's, with v = 1).
KVRET_HD double quant_accumulate(double acc, double w, float v) {
  return dadd_rn(acc, dmul_rn(w, static_cast<double>(v)));
}

/// An output element: acc / z rounded to f32.
KVRET_HD float quant_output(double acc, double z) { return static_cast<float>(quant_ddiv_rn(acc, z)); }

}  // namespace kvret::cuda::math
