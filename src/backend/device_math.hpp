#pragma once
// The CUDA backend's per-element math, compiled for the host by g++ (and tested there against the CPU core) and for
// the device by nvcc: element loads as f32 and stores from f32, and the reference attention's pieces.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "math/half_math.h"

#if defined(__CUDACC__)
#define KVRET_BACKEND_HD __host__ __device__
#else
#define KVRET_BACKEND_HD
#endif

namespace kvret::device_math {

/// Element types as the backend's tensors carry them (the values of kvret::DType).
enum ElemType : int32_t { kF16 = 0, kBF16 = 1, kF32 = 2, kI32 = 3 };

KVRET_BACKEND_HD inline float bits_to_f32(uint32_t bits) {
  union {
    uint32_t u;
    float f;
  } x{bits};
  return x.f;
}

/// IEEE half -> f32 as the CPU core converts: exact for every number, every NaN the quiet NaN of its sign.
KVRET_BACKEND_HD inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_f32(sign | (mantissa != 0 ? 0x7fc00000u : 0x7f800000u));  // NaN, inf
  if (exponent != 0) return bits_to_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_f32(sign);  // +-0
  // subnormal half: normalise
  uint32_t e = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  return bits_to_f32(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

KVRET_BACKEND_HD inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

KVRET_BACKEND_HD inline size_t elem_bytes(int32_t type) { return type == kF16 || type == kBF16 ? 2 : 4; }

/// Element i of a row of `type` at `row`, as f32.
KVRET_BACKEND_HD inline float load_f32(const std::byte* row, int32_t type, int64_t i) {
  if (type == kF32) {
    float f;
    const auto* p = reinterpret_cast<const float*>(row) + i;
    f = *p;
    return f;
  }
  const uint16_t h = reinterpret_cast<const uint16_t*>(row)[i];
  return type == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

/// f stored as element i of a row of `type` at `row`: f32 as it is, f16 and bf16 rounded to nearest even as the
/// CPU core rounds (kernels/math/half_math.h).
KVRET_BACKEND_HD inline void store_f32(std::byte* row, int32_t type, int64_t i, float f) {
  if (type == kF32) {
    reinterpret_cast<float*>(row)[i] = f;
    return;
  }
  reinterpret_cast<uint16_t*>(row)[i] = type == kF16 ? cuda::math::f32_to_f16_bits(f) : cuda::math::f32_to_bf16_bits(f);
}

/// Element i of a `src_type` row into a `dst_type` row (dst_type is src_type or f32: the gather's outputs).
KVRET_BACKEND_HD inline void copy_element(const std::byte* src, int32_t src_type, std::byte* dst, int32_t dst_type,
                                          int64_t i) {
  if (dst_type == src_type) {
    if (elem_bytes(src_type) == 4)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    else
      reinterpret_cast<uint16_t*>(dst)[i] = reinterpret_cast<const uint16_t*>(src)[i];
    return;
  }
  reinterpret_cast<float*>(dst)[i] = load_f32(src, src_type, i);
}

/// A strided tensor of up to 3 dimensions as the device functors read it (element strides).
struct DeviceTensor {
  std::byte* base = nullptr;
  int32_t type = kF32;
  int64_t stride[3] = {0, 0, 0};

  KVRET_BACKEND_HD std::byte* at(int64_t i0, int64_t i1 = 0, int64_t i2 = 0) const {
    return base + (i0 * stride[0] + i1 * stride[1] + i2 * stride[2]) * static_cast<int64_t>(elem_bytes(type));
  }
};

/// The reference attention in three passes, one functor each, so that no thread keeps a row of head_dim values:
/// logits[h, r] = scale * q[h] . k[g(h), r]; per head the maximum and the normaliser z = sum exp(logit - max);
/// out[h, t] = sum_r exp(logit - max) v[g(h), r, t] / z.
struct AttentionLogits {
  DeviceTensor q, k;
  float* logits;
  int64_t rows;
  int32_t head_dim, group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / rows, r = i % rows;
    const std::byte* qh = q.at(h);
    const std::byte* kr = k.at(h / group, r);
    float s = 0.0f;
    for (int32_t t = 0; t < head_dim; ++t) s += load_f32(qh, q.type, t) * load_f32(kr, k.type, t);
    logits[i] = scale * s;
  }
};

struct AttentionNormaliser {
  float* logits;  ///< [heads, rows]: replaced by exp(logit - max)
  float* inv_z;   ///< [heads]
  int64_t rows;
  KVRET_BACKEND_HD void operator()(int64_t h) const {
    float* l = logits + h * rows;
    float mx = l[0];
    for (int64_t r = 1; r < rows; ++r) mx = l[r] > mx ? l[r] : mx;
    double z = 0;
    for (int64_t r = 0; r < rows; ++r) {
      l[r] = expf(l[r] - mx);
      z += l[r];
    }
    inv_z[h] = static_cast<float>(1.0 / z);
  }
};

struct AttentionOutput {
  DeviceTensor v, out;
  const float* weights;  ///< [heads, rows]
  const float* inv_z;
  int64_t rows;
  int32_t head_dim, group;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / head_dim, t = i % head_dim;
    const float* w = weights + h * rows;
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) acc += w[r] * load_f32(v.at(h / group, r), v.type, t);
    store_f32(out.at(h, t), out.type, 0, acc * inv_z[h]);
  }
};

/// Element i of an f32 [heads, head_dim] array into out's type (the tuned attention's f32 result, rounded for an
/// f16 or bf16 out).
struct StoreRows {
  const float* src;
  DeviceTensor out;
  int32_t head_dim;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    store_f32(out.at(i / head_dim, i % head_dim), out.type, 0, src[i]);
  }
};

/// One working-set row: where its key and value come from and go, and its position.
struct RowCopy {
  const std::byte* k_src;
  const std::byte* v_src;
  int64_t head;
  int64_t row;
  int32_t position;
};

/// Element i of the gather: row i / head_dim, element i % head_dim, converted to the output type; the row's
/// position with its first element.
struct GatherRows {
  const RowCopy* rows;
  DeviceTensor k_out, v_out, positions;
  int32_t src_type, head_dim;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const RowCopy& c = rows[i / head_dim];
    const int64_t e = i % head_dim;
    copy_element(c.k_src, src_type, k_out.at(c.head, c.row), k_out.type, e);
    copy_element(c.v_src, src_type, v_out.at(c.head, c.row), v_out.type, e);
    if (e == 0) *reinterpret_cast<int32_t*>(positions.at(c.head, c.row)) = c.position;
  }
};

}  // namespace kvret::device_math
