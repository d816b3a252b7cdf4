#pragma once
// A validated, typed view of a borrowed kvret_tensor (DLPack layout). Validation throws kvret::Error with the
// specific status the C ABI promises (SHAPE, DTYPE, STRIDE, DEVICE, INVALID_ARGUMENT).
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "kvret.h"

namespace kvret {

enum class DType : uint8_t { F16, BF16, F32, I32 };

constexpr size_t dtype_size(DType t) noexcept { return (t == DType::F32 || t == DType::I32) ? 4 : 2; }
const char* dtype_name(DType t) noexcept;
DType kv_dtype_to_dtype(int32_t kv_dtype) noexcept;

/// Bit set of accepted dtypes.
struct DTypeSet {
  uint8_t bits = 0;
  constexpr DTypeSet(std::initializer_list<DType> types) {
    for (DType t : types) bits = static_cast<uint8_t>(bits | (1u << static_cast<unsigned>(t)));
  }
  constexpr bool contains(DType t) const noexcept { return bits & (1u << static_cast<unsigned>(t)); }
};
inline constexpr DTypeSet kFloatTypes{DType::F16, DType::BF16, DType::F32};

class TensorView {
 public:
  static constexpr int kMaxDims = 4;

  /// Validates the layout of `t` (named `name` in messages), whatever memory it is in: non-NULL, a dtype in
  /// `allowed`, rank among `ranks`, non-negative strides with a contiguous innermost dimension, sizes that fit 64
  /// bits. Whether a backend can read it is the backend's check (Backend::check_access).
  static TensorView from(const kvret_tensor* t, const char* name, DTypeSet allowed, std::initializer_list<int> ranks);

  int ndim() const noexcept { return ndim_; }
  int64_t dim(int i) const noexcept { return shape_[i]; }
  int64_t stride(int i) const noexcept { return strides_[i]; }
  DType dtype() const noexcept { return dtype_; }
  /// Where the memory is (DLPack device type and id).
  kvret_device device() const noexcept { return device_; }
  size_t elem_size() const noexcept { return dtype_size(dtype_); }
  const std::string& name() const noexcept { return name_; }
  /// Gives the view another name in messages (a slice of a batch: "positions[2]").
  void rename(std::string name) { name_ = std::move(name); }

  /// Throws KVRET_ERR_SHAPE unless dim(i) == extent.
  void expect_dim(int i, int64_t extent, const char* what) const;
  /// Throws KVRET_ERR_SHAPE unless dim(i) >= extent.
  void expect_dim_at_least(int i, int64_t extent, const char* what) const;

  /// Address of element (i0, i1, ...) — only the leading `n` indices are given, the rest are 0. nullptr for an
  /// empty tensor with NULL data (an offset from a null pointer is undefined).
  std::byte* at(std::initializer_list<int64_t> index) const noexcept {
    if (base_ == nullptr) return nullptr;
    int64_t offset = 0;
    int d = 0;
    for (int64_t i : index) offset += i * strides_[d++];
    return base_ + offset * static_cast<int64_t>(elem_size());
  }

  /// The sub-tensor at index i of the leading dimension (rank drops by one). Copies the name (may throw
  /// std::bad_alloc for a long one).
  TensorView slice(int64_t i) const {
    TensorView v = *this;
    v.base_ = at({i});
    for (int d = 1; d < ndim_; ++d) {
      v.shape_[d - 1] = shape_[d];
      v.strides_[d - 1] = strides_[d];
    }
    v.ndim_ = ndim_ - 1;
    return v;
  }

  /// The first element's address (nullptr for an empty tensor with NULL data).
  std::byte* data() const noexcept { return base_; }
  /// Bytes from the first element to the end of the last one: the span a copy of the tensor must cover (0 when
  /// a dimension is 0).
  size_t extent_bytes() const noexcept;
  /// The same layout at another address in another memory (a copy of the extent_bytes() from data()). Copies the
  /// name (may throw std::bad_alloc for a long one).
  TensorView rebased(std::byte* base, kvret_device device) const {
    TensorView v = *this;
    v.base_ = base;
    v.device_ = device;
    return v;
  }

  /// Reads `n` contiguous elements starting at `p` (of this view's dtype) as f32.
  void load_f32(const std::byte* p, size_t n, float* out) const noexcept;

 private:
  std::byte* base_ = nullptr;
  int ndim_ = 0;
  DType dtype_ = DType::F32;
  kvret_device device_{KVRET_DEVICE_CPU, 0};
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
  std::string name_;
};

/// Converts `n` elements of `src_type` at `src` into `dst_type` at `dst` (rows are contiguous).
void convert_row(const std::byte* src, DType src_type, std::byte* dst, DType dst_type, size_t n) noexcept;
/// Converts `n` elements of `src_type` to f32.
void load_row_f32(const std::byte* src, DType src_type, float* dst, size_t n) noexcept;
/// True if any of the `n` elements is NaN or Inf.
bool has_nonfinite(const std::byte* src, DType type, size_t n) noexcept;

}  // namespace kvret
