#include "core/tensor_view.hpp"

#include <cpuid.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/vec_math.hpp"

namespace kvret {

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
    case DType::F32:
      return "float32";
    case DType::I32:
      return "int32";
  }
  return "?";
}

DType kv_dtype_to_dtype(int32_t kv_dtype) noexcept {
  switch (kv_dtype) {
    case KVRET_KV_BF16:
      return DType::BF16;
    case KVRET_KV_F32:
      return DType::F32;
    default:
      return DType::F16;
  }
}

namespace {

bool decode_dtype(const kvret_dtype& d, DType* out) {
  if (d.lanes != 1) return false;
  if (d.code == KVRET_DTYPE_FLOAT && d.bits == 16)
    *out = DType::F16;
  else if (d.code == KVRET_DTYPE_BFLOAT && d.bits == 16)
    *out = DType::BF16;
  else if (d.code == KVRET_DTYPE_FLOAT && d.bits == 32)
    *out = DType::F32;
  else if (d.code == KVRET_DTYPE_INT && d.bits == 32)
    *out = DType::I32;
  else
    return false;
  return true;
}

std::string describe_dtype(const kvret_dtype& d) {
  return "code " + std::to_string(d.code) + ", bits " + std::to_string(d.bits) + ", lanes " + std::to_string(d.lanes);
}

}  // namespace

size_t TensorView::extent_bytes() const noexcept {
  int64_t last = 0;  // offset of the last element, in elements
  for (int d = 0; d < ndim_; ++d) {
    if (shape_[d] == 0) return 0;
    last += (shape_[d] - 1) * strides_[d];
  }
  return static_cast<size_t>(last + 1) * elem_size();
}

TensorView TensorView::from(const kvret_tensor* t, const char* name, DTypeSet allowed,
                            std::initializer_list<int> ranks) {
  require(t != nullptr, KVRET_ERR_INVALID_ARGUMENT, std::string(name) + ": tensor descriptor is NULL");
  TensorView v;
  v.name_ = name;
  // Only the layout is checked here: whether the context's backend can read the memory is Backend::check_access.
  v.device_ = t->device;
  DType dt{};
  require(decode_dtype(t->dtype, &dt), KVRET_ERR_DTYPE,
          std::string(name) + ": unsupported dtype (" + describe_dtype(t->dtype) + ")");
  require(allowed.contains(dt), KVRET_ERR_DTYPE,
          std::string(name) + ": dtype " + dtype_name(dt) + " is not accepted here");
  bool rank_ok = false;
  std::string rank_list;
  for (int r : ranks) {
    rank_ok |= (t->ndim == r);
    rank_list += (rank_list.empty() ? "" : " or ") + std::to_string(r);
  }
  require(rank_ok, KVRET_ERR_SHAPE,
          std::string(name) + ": expected " + rank_list + " dimensions, got " + std::to_string(t->ndim));
  require(t->ndim <= kMaxDims && t->shape != nullptr, KVRET_ERR_SHAPE, std::string(name) + ": shape is NULL");
  v.ndim_ = t->ndim;
  v.dtype_ = dt;
  bool empty = false;
  for (int i = 0; i < t->ndim; ++i) {
    require(t->shape[i] >= 0, KVRET_ERR_SHAPE,
            std::string(name) + ": negative extent in dimension " + std::to_string(i));
    v.shape_[i] = t->shape[i];
    empty |= t->shape[i] == 0;
  }
  // Default strides, and the byte offset of the last element: every product and sum is overflow-checked, so that
  // no shape or stride, however large, wraps an address computed later.
  int64_t running = 1;
  int64_t last = 0;  // elements from the first to the last one addressed
  const auto too_large = [&] {
    return Error(KVRET_ERR_SHAPE, std::string(name) + ": shape and strides address more than 2^63 bytes");
  };
  for (int i = t->ndim - 1; i >= 0; --i) {
    v.strides_[i] = t->strides ? t->strides[i] : running;
    require(v.strides_[i] >= 0, KVRET_ERR_STRIDE,
            std::string(name) + ": negative stride in dimension " + std::to_string(i));
    if (empty) continue;
    int64_t span = 0;
    if (__builtin_mul_overflow(v.shape_[i] - 1, v.strides_[i], &span) || __builtin_add_overflow(last, span, &last) ||
        (!t->strides && __builtin_mul_overflow(running, v.shape_[i], &running)))
      throw too_large();
  }
  int64_t last_byte = 0;
  if (!empty && (__builtin_mul_overflow(last, static_cast<int64_t>(dtype_size(dt)), &last_byte) ||
                 t->byte_offset > static_cast<uint64_t>(INT64_MAX - last_byte)))
    throw too_large();
  if (t->ndim > 0 && v.shape_[t->ndim - 1] > 1) {
    require(v.strides_[t->ndim - 1] == 1, KVRET_ERR_STRIDE,
            std::string(name) + ": the innermost dimension must be contiguous (stride 1), got stride " +
                std::to_string(v.strides_[t->ndim - 1]));
  }
  require(t->data != nullptr || empty, KVRET_ERR_INVALID_ARGUMENT, std::string(name) + ": data is NULL");
  // NULL data (an empty tensor) gets no offset: arithmetic on a null pointer is undefined.
  v.base_ = t->data ? static_cast<std::byte*>(t->data) + t->byte_offset : nullptr;
  return v;
}

void TensorView::expect_dim(int i, int64_t extent, const char* what) const {
  require(shape_[i] == extent, KVRET_ERR_SHAPE,
          name_ + ": dimension " + std::to_string(i) + " (" + what + ") is " + std::to_string(shape_[i]) +
              ", expected " + std::to_string(extent));
}

void TensorView::expect_dim_at_least(int i, int64_t extent, const char* what) const {
  require(shape_[i] >= extent, KVRET_ERR_SHAPE,
          name_ + ": dimension " + std::to_string(i) + " (" + what + ") is " + std::to_string(shape_[i]) +
              ", needs at least " + std::to_string(extent));
}

void TensorView::load_f32(const std::byte* p, size_t n, float* out) const noexcept { load_row_f32(p, dtype_, out, n); }

namespace {

// f16 -> f32 with the F16C instruction where the CPU has it (every x86-64 since 2012), the exact table elsewhere.
__attribute__((target("avx,f16c"))) void f16_row_f16c(const uint16_t* h, float* out, size_t n) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = f16_to_f32(h[i]);
}

const bool kHasF16c = cpu_has_f16c();

}  // namespace

void load_row_f32(const std::byte* src, DType src_type, float* dst, size_t n) noexcept {
  switch (src_type) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F16: {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
      if (kHasF16c) {
        f16_row_f16c(h, dst, n);
        return;
      }
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
      return;
    }
    case DType::BF16: {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      return;
    }
    case DType::I32: {
      const auto* h = reinterpret_cast<const int32_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(h[i]);
      return;
    }
  }
}

void convert_row(const std::byte* src, DType src_type, std::byte* dst, DType dst_type, size_t n) noexcept {
  if (n == 0) return;  // src and dst may be null (an empty vector's data)
  if (src_type == dst_type) {
    std::memcpy(dst, src, n * dtype_size(src_type));
    return;
  }
  if (dst_type == DType::F32) {
    load_row_f32(src, src_type, reinterpret_cast<float*>(dst), n);
    return;
  }
  auto* out = reinterpret_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float f;
    load_row_f32(src + i * dtype_size(src_type), src_type, &f, 1);
    out[i] = dst_type == DType::F16 ? f32_to_f16(f) : f32_to_bf16(f);
  }
}

bool has_nonfinite(const std::byte* src, DType type, size_t n) noexcept {
  if (type == DType::I32) return false;
  if (type == DType::F32) {
    const auto* f = reinterpret_cast<const float*>(src);
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(f[i])) return true;
    return false;
  }
  // f16: exponent 0x7c00 all ones; bf16: exponent 0x7f80 all ones.
  const uint16_t mask = type == DType::F16 ? 0x7c00u : 0x7f80u;
  const auto* h = reinterpret_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; ++i)
    if ((h[i] & mask) == mask) return true;
  return false;
}

}  // namespace kvret
