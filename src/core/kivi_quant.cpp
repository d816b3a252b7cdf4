#include "core/kivi_quant.hpp"

#include <algorithm>
#include <string>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "math/quant_math.h"

namespace kvret {

namespace {
constexpr float kF16Max = 65504.0f;
constexpr int kMaxDim = 256;  ///< head_dim <= 256 (config)
constexpr int kMaxGroup = 64;

/// min and max of n values at x[0], x[stride], ...
void group_range(const float* x, int n, int64_t stride, float* lo, float* hi) noexcept {
  float a = x[0], b = x[0];
  for (int j = 1; j < n; ++j) {
    const float v = x[j * stride];
    a = v < a ? v : a;
    b = v > b ? v : b;
  }
  *lo = a;
  *hi = b;
}

void put_code(uint8_t* codes, int64_t j, int bits, int code) noexcept {
  const int64_t bit = j * bits;
  codes[bit >> 3] = static_cast<uint8_t>(codes[bit >> 3] | (code << (bit & 7)));
}
}  // namespace

void check_kivi_params(int head_dim, const KiviParams& p) {
  require(p.bits == 1 || p.bits == 2, KVRET_ERR_INVALID_ARGUMENT,
          "KIVI bits must be 1 or 2, got " + std::to_string(p.bits));
  require(p.group == 32 || p.group == 64, KVRET_ERR_INVALID_ARGUMENT,
          "KIVI group size must be 32 or 64, got " + std::to_string(p.group));
  require(p.residual >= 0, KVRET_ERR_INVALID_ARGUMENT,
          "KIVI residual window must be >= 0, got " + std::to_string(p.residual));
  require(head_dim >= p.group && head_dim <= kMaxDim && head_dim % p.group == 0, KVRET_ERR_INVALID_ARGUMENT,
          "KIVI head_dim " + std::to_string(head_dim) + " is not a multiple of the group size " +
              std::to_string(p.group) + " (at most 256)");
}

float kivi_round(float x) noexcept {
  x = x > kF16Max ? kF16Max : x;
  x = x < -kF16Max ? -kF16Max : x;
  return f16_to_f32(f32_to_f16(x));
}

void kivi_affine(float lo, float hi, int bits, float* zero, float* step) noexcept {
  cuda::math::kivi_affine(lo, hi, bits, zero, step);
}

int kivi_code(float x, float lo, float hi, int bits) noexcept { return cuda::math::kivi_code(x, lo, hi, bits); }

float kivi_value(int code, float lo, float hi, int bits) noexcept { return cuda::math::kivi_value(code, lo, hi, bits); }

int kivi_unpack(const uint8_t* codes, int64_t j, int bits) noexcept { return cuda::math::kivi_unpack(codes, j, bits); }

void kivi_quantize_keys(const float* rows, int d, const KiviParams& p, uint8_t* codes, uint16_t* params) noexcept {
  const size_t per_channel = static_cast<size_t>(p.group) * p.bits / 8;
  std::fill_n(codes, per_channel * d, uint8_t{0});
  for (int i = 0; i < d; ++i) {
    float lo, hi;
    group_range(rows + i, p.group, d, &lo, &hi);
    params[2 * i] = f32_to_f16(lo);
    params[2 * i + 1] = f32_to_f16(hi);
    uint8_t* c = codes + per_channel * i;
    for (int t = 0; t < p.group; ++t) put_code(c, t, p.bits, kivi_code(rows[t * d + i], lo, hi, p.bits));
  }
}

void kivi_quantize_value(const float* row, int d, const KiviParams& p, uint8_t* codes, uint16_t* params) noexcept {
  std::fill_n(codes, static_cast<size_t>(d) * p.bits / 8, uint8_t{0});
  for (int j = 0; j < d / p.group; ++j) {
    const float* x = row + j * p.group;
    float lo, hi;
    group_range(x, p.group, 1, &lo, &hi);
    params[2 * j] = f32_to_f16(lo);
    params[2 * j + 1] = f32_to_f16(hi);
    for (int i = 0; i < p.group; ++i) put_code(codes, j * p.group + i, p.bits, kivi_code(x[i], lo, hi, p.bits));
  }
}

namespace {
/// kCodeFloats[bits - 1][byte]: the codes a byte packs, as floats (8 one-bit or 4 two-bit codes, lowest bits first).
struct CodeFloats {
  float one[256][8];
  float two[256][4];
  CodeFloats() noexcept {
    for (int b = 0; b < 256; ++b) {
      for (int j = 0; j < 8; ++j) one[b][j] = static_cast<float>((b >> j) & 1);
      for (int j = 0; j < 4; ++j) two[b][j] = static_cast<float>((b >> (2 * j)) & 3);
    }
  }
};
const CodeFloats kCodeFloats;
}  // namespace

void kivi_key_block_logits(const float* q, int nq, float scale, int d, const KiviParams& p, const uint8_t* codes,
                           const uint16_t* params, float* out, int64_t out_stride, float* scratch) noexcept {
  const int g = p.group;
  const int per_channel = g * p.bits / 8;
  const int per_byte = 8 / p.bits;
  float* tile = scratch;    // [g][d]: token t's codes as floats, channel by channel
  float* w = tile + g * d;  // [nq][d]: q * step
  float zero[kMaxDim], step[kMaxDim];
  for (int i = 0; i < d; ++i) {
    const uint8_t* c = codes + static_cast<size_t>(per_channel) * i;
    for (int b = 0; b < per_channel; ++b) {
      const float* f = p.bits == 1 ? kCodeFloats.one[c[b]] : kCodeFloats.two[c[b]];
      for (int j = 0; j < per_byte; ++j) tile[(b * per_byte + j) * d + i] = f[j];
    }
    kivi_affine(f16_to_f32(params[2 * i]), f16_to_f32(params[2 * i + 1]), p.bits, zero + i, step + i);
  }
  for (int h = 0; h < nq; ++h)
    for (int i = 0; i < d; ++i) w[h * d + i] = q[static_cast<int64_t>(h) * d + i] * step[i];
  scaled_dots(w, d, nq, tile, d, g, d, scale, out, out_stride);
  for (int h = 0; h < nq; ++h) {
    const float base = cuda::math::kivi_logit_base(scale, q + static_cast<int64_t>(h) * d, zero, d);
    float* o = out + h * out_stride;
    for (int t = 0; t < g; ++t) o[t] += base;
  }
}

KiviHead::KiviHead(int head_dim, const KiviParams& params) : d_(head_dim), p_(params) {
  check_kivi_params(head_dim, params);
}

KiviHead::KiviHead(const KiviHead& o)
    : d_(o.d_),
      p_(o.p_),
      quantized_(o.quantized_),
      key_codes_(o.key_codes_),
      key_params_(o.key_params_),
      value_codes_(o.value_codes_),
      value_params_(o.value_params_),
      res_k_(o.res_k_),
      res_v_(o.res_v_) {
  res_k_.reserve(residual_capacity(size()));  // truncate must not allocate
  res_v_.reserve(residual_capacity(size()));
}

int64_t KiviHead::quantized_for(int64_t n) const noexcept {
  return n <= p_.residual ? 0 : (n - p_.residual) / p_.group * p_.group;
}

int64_t KiviHead::bytes() const noexcept {
  return static_cast<int64_t>(key_codes_.size() + value_codes_.size() +
                              2 * (key_params_.size() + value_params_.size() + res_k_.size() + res_v_.size()));
}

int64_t KiviHead::quantized_token_bytes() const noexcept {
  const auto key_block = static_cast<int64_t>(key_block_codes()) + 4 * d_;
  return key_block / p_.group + static_cast<int64_t>(value_row_codes() + 2 * value_row_params());
}

void KiviHead::reserve(int64_t n) {
  const int64_t q = quantized_for(size() + n);
  const auto grow = [](auto& v, size_t needed) {
    if (v.capacity() < needed) v.reserve(std::max(needed, v.capacity() + v.capacity() / 2));
  };
  grow(key_codes_, static_cast<size_t>(q / p_.group) * key_block_codes());
  grow(key_params_, static_cast<size_t>(q / p_.group) * 2 * d_);
  grow(value_codes_, static_cast<size_t>(q) * value_row_codes());
  grow(value_params_, static_cast<size_t>(q) * value_row_params());
  // the residual of any length up to the new size (an append's, or a truncation's): at most residual + group - 1
  // rows, grown geometrically up to that
  const size_t cap = residual_capacity(size() + n), full = residual_capacity(INT64_MAX);
  const auto grow_residual = [cap, full](std::vector<uint16_t>& v) {
    if (v.capacity() < cap) v.reserve(std::min(full, std::max(cap, v.capacity() * 2)));
  };
  grow_residual(res_k_);
  grow_residual(res_v_);
}

void KiviHead::store_residual(size_t j, const float* k, const float* v) noexcept {
  uint16_t* rk = res_k_.data() + j * d_;
  uint16_t* rv = res_v_.data() + j * d_;
  for (int i = 0; i < d_; ++i) {
    rk[i] = f32_to_f16(kivi_round(k[i]));
    rv[i] = f32_to_f16(kivi_round(v[i]));
  }
}

void KiviHead::append(const float* keys, const float* values, int64_t n) noexcept {
  if (n <= 0) return;
  const int64_t old_size = size(), q_old = quantized_, total = old_size + n;
  const int64_t q_new = quantized_for(total);
  const size_t d = static_cast<size_t>(d_);
  // token j of [q_old, total) as rounded f32 rows: the residual's, then the input's
  const auto load = [&](int64_t j, float* k, float* v) {
    if (j < old_size) {
      const uint16_t* rk = residual_key(j - q_old);
      const uint16_t* rv = residual_value(j - q_old);
      for (size_t i = 0; i < d; ++i) {
        k[i] = f16_to_f32(rk[i]);
        v[i] = f16_to_f32(rv[i]);
      }
    } else {
      const float* ik = keys + static_cast<size_t>(j - old_size) * d;
      const float* iv = values + static_cast<size_t>(j - old_size) * d;
      for (size_t i = 0; i < d; ++i) {
        k[i] = kivi_round(ik[i]);
        v[i] = kivi_round(iv[i]);
      }
    }
  };
  float tile[kMaxGroup * kMaxDim];
  float value[kMaxDim];
  for (int64_t b0 = q_old; b0 < q_new; b0 += p_.group) {
    const int64_t block = b0 / p_.group;
    key_codes_.resize(static_cast<size_t>(block + 1) * key_block_codes());  // within the reserved capacity
    key_params_.resize(static_cast<size_t>(block + 1) * 2 * d);
    value_codes_.resize(static_cast<size_t>(b0 + p_.group) * value_row_codes());
    value_params_.resize(static_cast<size_t>(b0 + p_.group) * value_row_params());
    for (int t = 0; t < p_.group; ++t) {
      load(b0 + t, tile + static_cast<size_t>(t) * d, value);
      kivi_quantize_value(value, d_, p_, value_codes_.data() + static_cast<size_t>(b0 + t) * value_row_codes(),
                          value_params_.data() + static_cast<size_t>(b0 + t) * value_row_params());
    }
    kivi_quantize_keys(tile, d_, p_, key_codes_.data() + static_cast<size_t>(block) * key_block_codes(),
                       key_params_.data() + static_cast<size_t>(block) * 2 * d);
  }
  // the residual becomes [q_new, total): drop what was quantized, then add the input's rows
  const int64_t kept_from = std::min(q_new, old_size);  // first old residual token kept
  const auto drop = static_cast<int64_t>(static_cast<size_t>(kept_from - q_old) * d);
  res_k_.erase(res_k_.begin(), res_k_.begin() + drop);
  res_v_.erase(res_v_.begin(), res_v_.begin() + drop);
  const int64_t first_input = std::max(q_new, old_size);
  const size_t at = res_k_.size() / d;
  res_k_.resize(static_cast<size_t>(total - q_new) * d);  // at most residual + group - 1 rows: the capacity
  res_v_.resize(static_cast<size_t>(total - q_new) * d);
  for (int64_t j = first_input; j < total; ++j)
    store_residual(at + static_cast<size_t>(j - first_input), keys + static_cast<size_t>(j - old_size) * d,
                   values + static_cast<size_t>(j - old_size) * d);
  quantized_ = q_new;
}

void KiviHead::reconstruct(int64_t t, float* key, float* value) const noexcept {
  if (t >= quantized_) {
    for (int i = 0; i < d_; ++i) key[i] = f16_to_f32(residual_key(t - quantized_)[i]);
  } else {
    const int64_t block = t / p_.group;
    const int within = static_cast<int>(t % p_.group);
    const uint8_t* kc = key_codes(block);
    const uint16_t* kp = key_params(block);
    for (int i = 0; i < d_; ++i)
      key[i] = cuda::math::kivi_key_element(kc, p_.group, p_.bits, i, within, f16_to_f32(kp[2 * i]),
                                            f16_to_f32(kp[2 * i + 1]));
  }
  reconstruct_value(t, value);
}

void KiviHead::reconstruct_value(int64_t t, float* value) const noexcept {
  if (t >= quantized_) {
    for (int i = 0; i < d_; ++i) value[i] = f16_to_f32(residual_value(t - quantized_)[i]);
    return;
  }
  const uint8_t* vc = value_codes(t);
  const uint16_t* vp = value_params(t);
  for (int i = 0; i < d_; ++i) {
    const int j = i / p_.group;
    value[i] = cuda::math::kivi_value_element(vc, p_.bits, i, f16_to_f32(vp[2 * j]), f16_to_f32(vp[2 * j + 1]));
  }
}

void KiviHead::logits(const float* q, int nq, float scale, float* out, int64_t out_stride) const {
  std::vector<float> scratch(static_cast<size_t>(d_) * (p_.group + nq));
  for (int64_t b = 0; b < quantized_ / p_.group; ++b)
    kivi_key_block_logits(q, nq, scale, d_, p_, key_codes(b), key_params(b), out + b * p_.group, out_stride,
                          scratch.data());
  if (residual_tokens() > 0)
    scaled_dots(q, d_, nq, res_k_.data(), DType::F16, d_, residual_tokens(), d_, scale, out + quantized_, out_stride);
}

bool KiviHead::restore_arrays(int64_t n, LargeVector<uint8_t> key_codes, LargeVector<uint16_t> key_params,
                              LargeVector<uint8_t> value_codes, LargeVector<uint16_t> value_params,
                              std::vector<uint16_t> res_k, std::vector<uint16_t> res_v) {
  if (n < 0) return false;
  const int64_t q = quantized_for(n);
  const size_t d = static_cast<size_t>(d_);
  const auto blocks = static_cast<size_t>(q / p_.group);
  if (key_codes.size() != blocks * key_block_codes() || key_params.size() != blocks * 2 * d ||
      value_codes.size() != static_cast<size_t>(q) * value_row_codes() ||
      value_params.size() != static_cast<size_t>(q) * value_row_params() ||
      res_k.size() != static_cast<size_t>(n - q) * d || res_v.size() != res_k.size())
    return false;
  const auto ordered = [](const auto& params) {
    for (size_t i = 0; i + 1 < params.size(); i += 2)
      if (f16_to_f32(params[i]) > f16_to_f32(params[i + 1])) return false;
    return true;
  };
  if (!ordered(key_params) || !ordered(value_params)) return false;
  res_k.reserve(residual_capacity(n));  // truncate must never allocate
  res_v.reserve(residual_capacity(n));
  key_codes_.swap(key_codes);  // commit
  key_params_.swap(key_params);
  value_codes_.swap(value_codes);
  value_params_.swap(value_params);
  res_k_.swap(res_k);
  res_v_.swap(res_v);
  quantized_ = q;
  return true;
}

}  // namespace kvret
