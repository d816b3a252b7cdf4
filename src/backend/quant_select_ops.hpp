#pragma once
// The CUDA backend's select for the QUANT index (SpeCache's low-bit copy; docs/quant.md, docs/cuda_backend.md), as
// per-element functors for Thrust passes: compiled for the device by nvcc and for the host on Thrust's OpenMP
// system. The math is kernels/math/quant_math.h, the functions the CPU index (src/core/kivi_quant.cpp,
// src/index/quant_retriever.cpp) calls or is tested against, so both compute the same bits.
//
// The device mirror of one (sequence, layer)'s copy (QuantLayout): per KV head its packed key blocks and their
// per-channel (lo, hi), its packed value rows and their per-group (lo, hi), and its f16 residual window.
//
// One select of one (sequence, layer), over the n middle tokens, is these passes, around the token top-k of
// page_select_ops.hpp (cuda_backend.cu's select_top and top_write):
//   PageLoadQuery        q into f32 [n_q_heads, d]
//   QuantBlockLogits     per (query head, key block) the low-bit logits of its `group` tokens from the codes
//   QuantResidualLogits  per (query head, residual token) its logit from the f16 key
//   QuantSoftmaxes       KVRET_FOLD_SUM_PROB: per query head the maximum, the terms and the inverse normaliser
//   TokenFold, the top-k (the tuned kernel, or TopkOrderKeys, sorts, TopkPick, a sort, TopkEntries), TopkWrite:
//                        the positions ascending per head with their folded scores into the caller's tensors
// With re-ranking (quant_rerank = r > 1) the first top-k takes min(n, r x budget) candidates (by the maximum
// logit); their exact keys come from the store (QuantExactLogits: scale * q . k, EXACT's logit), and the same
// fold and top-k over the candidates take the budget.
#include <cstddef>
#include <cstdint>

#include "backend/cluster_select_ops.hpp"
#include "backend/exact_select_ops.hpp"
#include "backend/page_select_ops.hpp"
#include "math/quant_math.h"

namespace kvret::device_math {

namespace qm = kvret::cuda::math;

/// The device mirror of one (sequence, layer)'s low-bit copy, every head the same shape, `cap_blocks` key blocks
/// (and cap_blocks * group value rows) and `res_cap` residual rows of room per head, `blocks` and `residual` of them
/// in use.
struct QuantLayout {
  const uint8_t* key_codes;      ///< [heads][cap_blocks][d * group * bits / 8]
  const uint16_t* key_params;    ///< [heads][cap_blocks][d][2]: f16 lo, hi
  const uint8_t* value_codes;    ///< [heads][cap_blocks * group][d * bits / 8]
  const uint16_t* value_params;  ///< [heads][cap_blocks * group][d / group][2]
  const uint16_t* res_k;         ///< [heads][res_cap][d] f16
  const uint16_t* res_v;         ///< [heads][res_cap][d] f16
  int64_t heads, cap_blocks, res_cap, blocks, residual;
  int32_t d, group, bits;

  KVRET_BACKEND_HD int64_t key_block_bytes() const { return int64_t{d} * group * bits / 8; }
  KVRET_BACKEND_HD int64_t value_row_bytes() const { return int64_t{d} * bits / 8; }
  KVRET_BACKEND_HD int64_t value_row_params() const { return int64_t{d} / group * 2; }
  /// Middle tokens in the copy: the quantized ones, then the residual.
  KVRET_BACKEND_HD int64_t tokens() const { return blocks * group + residual; }
  KVRET_BACKEND_HD const uint8_t* block_codes(int64_t h, int64_t b) const {
    return key_codes + (h * cap_blocks + b) * key_block_bytes();
  }
  KVRET_BACKEND_HD const uint16_t* block_params(int64_t h, int64_t b) const {
    return key_params + (h * cap_blocks + b) * 2 * d;
  }
  KVRET_BACKEND_HD const uint16_t* residual_key(int64_t h, int64_t j) const { return res_k + (h * res_cap + j) * d; }

  /// Device bytes of a mirror of this shape (every array, every head).
  static size_t bytes_for(int64_t heads, int64_t cap_blocks, int64_t res_cap, int32_t d, int32_t group, int32_t bits) {
    const int64_t kb = int64_t{d} * group * bits / 8, vr = int64_t{d} * bits / 8, vp = int64_t{d} / group * 2;
    return static_cast<size_t>(
        heads * (cap_blocks * (kb + 4 * int64_t{d}) + cap_blocks * group * (vr + 2 * vp) + 2 * res_cap * d * 2));
  }
};

/// QuantLayout's arrays at `base` (in its order), nothing in use yet.
inline QuantLayout quant_layout(std::byte* base, int64_t heads, int64_t cap_blocks, int64_t res_cap, int32_t d,
                                int32_t group, int32_t bits) {
  QuantLayout l{};
  l.heads = heads;
  l.cap_blocks = cap_blocks;
  l.res_cap = res_cap;
  l.d = d;
  l.group = group;
  l.bits = bits;
  std::byte* p = base;
  l.key_codes = reinterpret_cast<const uint8_t*>(p);
  p += heads * cap_blocks * l.key_block_bytes();
  l.key_params = reinterpret_cast<const uint16_t*>(p);
  p += heads * cap_blocks * 2 * d * 2;
  l.value_codes = reinterpret_cast<const uint8_t*>(p);
  p += heads * cap_blocks * group * l.value_row_bytes();
  l.value_params = reinterpret_cast<const uint16_t*>(p);
  p += heads * cap_blocks * group * l.value_row_params() * 2;
  l.res_k = reinterpret_cast<const uint16_t*>(p);
  p += heads * res_cap * d * 2;
  l.res_v = reinterpret_cast<const uint16_t*>(p);
  return l;
}

/// Per (job, query head, key block b < max_blocks): the low-bit logits of the block's tokens, kivi_key_block_logits'
/// bits: the channels' affine forms from their f16 (lo, hi), w = q * step, base = scale * (q . zero), then per token
/// scale * (w . codes) + base. Blocks past the job's own do nothing.
struct QuantBlockLogits {
  const QuantLayout* layouts;          ///< per job (blocks and residual set)
  const float* q;                      ///< [jobs * n_q_heads, d]
  float* logits;                       ///< [jobs * n_q_heads, width]
  int64_t width, max_blocks, q_heads;  ///< q_heads: per job
  int32_t group;                       ///< query heads per KV head
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / max_blocks, b = i % max_blocks;
    const QuantLayout& l = layouts[row / q_heads];
    if (b >= l.blocks) return;
    const int64_t h = row % q_heads / group;
    const float* qh = q + row * l.d;
    const uint8_t* codes = l.block_codes(h, b);
    const uint16_t* params = l.block_params(h, b);
    float w[256], zero[256];  // head_dim <= 256
    for (int32_t c = 0; c < l.d; ++c) {
      float step;
      qm::kivi_affine(f16_to_f32(params[2 * c]), f16_to_f32(params[2 * c + 1]), l.bits, zero + c, &step);
      w[c] = qm::mul_rn(qh[c], step);
    }
    const float base = qm::kivi_logit_base(scale, qh, zero, l.d);
    float* out = logits + row * width + b * l.group;
    for (int32_t t = 0; t < l.group; ++t)
      out[t] = qm::kivi_low_bit_logit(scale, w, base, codes, l.group, l.bits, t, l.d);
  }
};

/// Per (job, query head, token t in [first, width)), `first` the fewest quantized tokens of a job: a residual
/// token's logit scale * q . k with the f16 key (scaled_dots' bits), -inf for the padding past the job's tokens; a
/// quantized token (QuantBlockLogits') is left alone.
struct QuantResidualLogits {
  const QuantLayout* layouts;
  const float* q;
  float* logits;
  int64_t width, first, q_heads;
  int32_t group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / (width - first), t = first + i % (width - first);
    const QuantLayout& l = layouts[row / q_heads];
    const int64_t quantized = l.blocks * l.group;
    if (t < quantized) return;
    if (t >= l.tokens()) {
      logits[row * width + t] = qm::neg_inf();
      return;
    }
    const uint16_t* k16 = l.residual_key(row % q_heads / group, t - quantized);
    float k[256];
    for (int32_t c = 0; c < l.d; ++c) k[c] = f16_to_f32(k16[c]);
    logits[row * width + t] = qm::mul_rn(scale, qm::dot8(q + row * l.d, k, l.d));
  }
};

/// Per (query head, candidate): EXACT's logit scale * q . k from the candidate's exact key.
struct QuantExactLogits {
  const float* q;     ///< [n_q_heads, d]
  const float* keys;  ///< [n_kv_heads, n, d]
  float* logits;      ///< [n_q_heads, n]
  int64_t n;
  int32_t d, group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t hq = i / n, u = i % n;
    logits[i] = qm::mul_rn(scale, qm::dot8(q + hq * d, keys + ((hq / group) * n + u) * d, d));
  }
};

/// Element i (row = i / d: segment s = job * heads + head and candidate u = row % n; element e = i % d) of the
/// re-ranking's key load: the stored key of position cand[row] of the segment's head, read from its job's pages
/// (`pages`, one per job) and converted to f32 into out [segments, n, d].
struct QuantCandidateKeys {
  const int32_t* cand;
  const ExactKeyPages* pages;
  float* out;
  int64_t n, heads;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / d, s = row / n;
    const ExactKeyPages& p = pages[s / heads];
    copy_element(p.key_row(s % heads, cand[row]), p.type, reinterpret_cast<std::byte*>(out + row * d), kF32, i % d);
  }
};

// The token top-k below runs over `segments` rows (the KV heads of one select, or of every select of a fused
// batch, job after job: segment = job * heads + head) of `width` entries each. In a fused batch a job's row holds
// its n_of[job] tokens and then padding up to the batch's widest row; without n_of every entry is a token.

/// KVRET_FOLD_SUM_PROB: per query head the softmax over its tokens (gqa_fold.cpp's unweighted fold).
struct QuantSoftmaxes {
  float* logits;         ///< [n_q_heads, width]: replaced by the softmax's terms
  qm::PageSoftmax* out;  ///< [n_q_heads]
  int64_t width;
  const int64_t* n_of = nullptr;  ///< per job its tokens (null: width)
  int64_t rows_per_job = 1;       ///< query heads per job
  KVRET_BACKEND_HD void operator()(int64_t hq) const {
    out[hq] = qm::token_softmax_terms(logits + hq * width, n_of != nullptr ? n_of[hq / rows_per_job] : width);
  }
};

}  // namespace kvret::device_math
