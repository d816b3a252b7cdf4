#pragma once
// KIVI quantization of one KV head (SpeCache's low-bit resident copy): keys are quantized per channel along
// tokens, values per token along channels, in groups of `group` elements (32 or 64), each group with its own
// minimum and maximum (two f16 values: 32 bits per group), at 2 bits or 1 bit per element.
//
//   2-bit: levels lo + c (hi - lo) / 3, c in 0..3 (the nearest level: error at most half a step, (hi - lo) / 6);
//          reconstructed as ((3 - c) lo + c hi) / 3, which gives the group's lo and hi back exactly.
//   1-bit: the improved rule: zero point z = (3 lo + hi) / 4, scale s = (hi - lo) / 2, c = round((x - z) / s)
//          clamped to {0, 1}; levels at a quarter and three quarters of [lo, hi] (error at most (hi - lo) / 4).
//
// Every input value is first rounded to f16 (after clamping to f16's finite range): the copy is of an f16 cache, so
// a group's lo and hi are f16 values and are stored exactly.
//
// The per-element math (codes, levels, affine form, the low-bit logit) is kernels/math/quant_math.h's, which the
// CUDA backend compiles too; the functions below forward to it.
//
// KiviHead keeps one head's tokens: the oldest ones quantized, in blocks of `group` tokens (a key group spans
// `group` tokens), and the most recent ones in full precision (f16), the residual window. With n tokens,
// quantized() = floor(max(0, n - residual) / group) * group: at least `residual` most recent tokens stay in f16, plus
// the up to group - 1 tokens that do not fill a key group yet. The quantized state is a function of the tokens
// alone (blocks start at token 0), so appending in pieces, or truncating, gives what appending the same tokens at
// once gives.
//
// Packed layouts (little-endian bit order within a byte: code j of a run at bit (j * bits) % 8 of byte
// (j * bits) / 8):
//   keys, per block of `group` tokens: codes [head_dim][group * bits / 8] (channel i's codes along the block's
//         tokens), then per channel its (lo, hi) as f16 [head_dim][2];
//   values, per token: codes [head_dim * bits / 8] (along channels), per channel group its (lo, hi) [head_dim /
//         group][2].
// Resident bytes per quantized token: 2 * head_dim * (bits + 32 / group) / 8 (keys and values), that is
// (bits + 32 / group) / 16 of the f16 bytes; a residual token costs 4 * head_dim bytes (keys and values in f16).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/large_vector.hpp"

namespace kvret {

struct KiviParams {
  int bits = 2;       ///< 1 or 2
  int group = 64;     ///< 32 or 64
  int residual = 64;  ///< tokens always kept in f16, >= 0
};

/// Throws KVRET_ERR_INVALID_ARGUMENT for bits other than 1 and 2, a group other than 32 and 64, a negative
/// residual, or a head_dim that is not a positive multiple of the group.
void check_kivi_params(int head_dim, const KiviParams& params);

/// x clamped to f16's finite range and rounded to f16, as f32 (NaN stays NaN).
float kivi_round(float x) noexcept;

/// The code of x in a group [lo, hi] (lo <= hi): the nearest 2-bit level, or the improved 1-bit rule. A NaN x, or
/// lo == hi, gives 0.
int kivi_code(float x, float lo, float hi, int bits) noexcept;
/// The value code c stands for in [lo, hi] (exact lo and hi for 2-bit codes 0 and 3).
float kivi_value(int code, float lo, float hi, int bits) noexcept;
/// The affine form of the levels: value = zero + code * step (up to rounding; kivi_value is the reference).
void kivi_affine(float lo, float hi, int bits, float* zero, float* step) noexcept;

/// Reads code j of a packed run.
int kivi_unpack(const uint8_t* codes, int64_t j, int bits) noexcept;

/// Quantizes one key block: rows[t * head_dim + i] for t < group (values already rounded by kivi_round), into
/// codes [head_dim][group * bits / 8] and params [head_dim][2] (f16 bits of lo, hi).
void kivi_quantize_keys(const float* rows, int head_dim, const KiviParams& p, uint8_t* codes,
                        uint16_t* params) noexcept;
/// Quantizes one value row (head_dim values, already rounded) into codes [head_dim * bits / 8] and params
/// [head_dim / group][2].
void kivi_quantize_value(const float* row, int head_dim, const KiviParams& p, uint8_t* codes,
                         uint16_t* params) noexcept;

/// Scaled logits of nq queries q [nq, head_dim] (row g at q + g * head_dim) against one quantized key block,
/// computed from the codes without reconstructing the keys: out[g * out_stride + t] = scale * (q . zero) +
/// scale * ((q * step) . codes_t) for t < group, with each channel's zero point and step (kivi_affine); the second
/// term is scaled_dots' over the codes as floats. scratch: (group + nq) * head_dim floats.
void kivi_key_block_logits(const float* q, int nq, float scale, int head_dim, const KiviParams& p, const uint8_t* codes,
                           const uint16_t* params, float* out, int64_t out_stride, float* scratch) noexcept;

class KiviHead {
 public:
  KiviHead(int head_dim, const KiviParams& params);
  KiviHead(const KiviHead& other);  ///< keeps the residual capacity (truncate never allocates)
  KiviHead& operator=(const KiviHead&) = delete;
  KiviHead(KiviHead&&) noexcept = default;
  KiviHead& operator=(KiviHead&&) noexcept = default;

  const KiviParams& params() const noexcept { return p_; }
  int head_dim() const noexcept { return d_; }
  int64_t size() const noexcept { return quantized_ + residual_tokens(); }
  /// Tokens [0, quantized()) are quantized, [quantized(), size()) are the f16 residual.
  int64_t quantized() const noexcept { return quantized_; }
  int64_t residual_tokens() const noexcept { return static_cast<int64_t>(res_k_.size()) / d_; }
  /// Tokens quantized for a head of n tokens.
  int64_t quantized_for(int64_t n) const noexcept;

  /// Bytes of the resident copy: packed codes and group parameters of keys and values, and the f16 residual.
  int64_t bytes() const noexcept;
  /// Bytes per quantized token (keys and values): 2 * head_dim * (bits + 32 / group) / 8.
  int64_t quantized_token_bytes() const noexcept;

  /// Makes room for n more tokens (may throw std::bad_alloc; changes no token).
  void reserve(int64_t n);
  /// Appends n tokens: keys [n, head_dim] and values [n, head_dim] in f32. Needs reserve(n) (or more) first.
  void append(const float* keys, const float* values, int64_t n) noexcept;
  /// Keeps the first n tokens (n <= size()). The residual tokens it keeps are read again with
  /// load(token, key_row, value_row) (f32 rows of head_dim), since a quantized token's exact values are gone.
  template <class Load>
  void truncate(int64_t n, Load&& load) noexcept {
    if (n >= size()) return;
    const int64_t q = quantized_for(n);
    const size_t d = static_cast<size_t>(d_);
    key_codes_.resize(static_cast<size_t>(q / p_.group) * key_block_codes());
    key_params_.resize(static_cast<size_t>(q / p_.group) * 2 * d);
    value_codes_.resize(static_cast<size_t>(q) * value_row_codes());
    value_params_.resize(static_cast<size_t>(q) * value_row_params());
    res_k_.resize(static_cast<size_t>(n - q) * d);  // within the capacity reserve gave for size() tokens
    res_v_.resize(static_cast<size_t>(n - q) * d);
    float k[256], v[256];  // head_dim <= 256
    for (int64_t t = q; t < n; ++t) {
      load(t, k, v);
      store_residual(static_cast<size_t>(t - q), k, v);
    }
    quantized_ = q;
  }

  // The packed state (for scoring, saving and tests).
  size_t key_block_codes() const noexcept { return static_cast<size_t>(d_) * p_.group * p_.bits / 8; }
  size_t value_row_codes() const noexcept { return static_cast<size_t>(d_) * p_.bits / 8; }
  size_t value_row_params() const noexcept { return static_cast<size_t>(d_ / p_.group) * 2; }
  const uint8_t* key_codes(int64_t block) const noexcept {
    return key_codes_.data() + static_cast<size_t>(block) * key_block_codes();
  }
  const uint16_t* key_params(int64_t block) const noexcept {
    return key_params_.data() + static_cast<size_t>(block) * 2 * d_;
  }
  const uint8_t* value_codes(int64_t token) const noexcept {
    return value_codes_.data() + static_cast<size_t>(token) * value_row_codes();
  }
  const uint16_t* value_params(int64_t token) const noexcept {
    return value_params_.data() + static_cast<size_t>(token) * value_row_params();
  }
  /// f16 rows of residual token j (0 = the first token after quantized()).
  const uint16_t* residual_key(int64_t j) const noexcept { return res_k_.data() + static_cast<size_t>(j) * d_; }
  const uint16_t* residual_value(int64_t j) const noexcept { return res_v_.data() + static_cast<size_t>(j) * d_; }

  /// Token t's key and value as the copy has them (dequantized, or the f16 residual), f32 [head_dim] each.
  void reconstruct(int64_t t, float* key, float* value) const noexcept;
  /// Token t's value alone, as reconstruct gives it.
  void reconstruct_value(int64_t t, float* value) const noexcept;

  /// Scaled logits of nq queries (q [nq, head_dim]) against every token: out[g * out_stride + t] for t < size().
  void logits(const float* q, int nq, float scale, float* out, int64_t out_stride) const;

  /// The raw arrays, for saving and restoring (restore_arrays checks their lengths and parameters).
  const LargeVector<uint8_t>& key_code_array() const noexcept { return key_codes_; }
  const LargeVector<uint16_t>& key_param_array() const noexcept { return key_params_; }
  const LargeVector<uint8_t>& value_code_array() const noexcept { return value_codes_; }
  const LargeVector<uint16_t>& value_param_array() const noexcept { return value_params_; }
  const std::vector<uint16_t>& residual_key_array() const noexcept { return res_k_; }
  const std::vector<uint16_t>& residual_value_array() const noexcept { return res_v_; }
  /// A head of n tokens from saved arrays: false (nothing changed) when a length does not fit n or a group's
  /// (lo, hi) is not an ordered pair of finite f16 values.
  bool restore_arrays(int64_t n, LargeVector<uint8_t> key_codes, LargeVector<uint16_t> key_params,
                      LargeVector<uint8_t> value_codes, LargeVector<uint16_t> value_params, std::vector<uint16_t> res_k,
                      std::vector<uint16_t> res_v);

 private:
  /// Residual elements (per array) a head of up to n tokens may hold: min(n, residual + group - 1) rows.
  size_t residual_capacity(int64_t n) const noexcept {
    return static_cast<size_t>(std::min<int64_t>(n, int64_t{p_.residual} + p_.group - 1)) * d_;
  }
  void store_residual(size_t j, const float* k, const float* v) noexcept;

  int d_;
  KiviParams p_;
  int64_t quantized_ = 0;
  LargeVector<uint8_t> key_codes_;       ///< [blocks][head_dim][group * bits / 8]
  LargeVector<uint16_t> key_params_;     ///< [blocks][head_dim][2]: f16 lo, hi
  LargeVector<uint8_t> value_codes_;     ///< [quantized][head_dim * bits / 8]
  LargeVector<uint16_t> value_params_;   ///< [quantized][head_dim / group][2]
  std::vector<uint16_t> res_k_, res_v_;  ///< [residual tokens][head_dim] f16
};

}  // namespace kvret
