#pragma once
// Byte strings of saved state (a retriever's index): little-endian plain values and length-prefixed arrays,
// written by ByteWriter and read back by ByteReader, which checks every length against what is left and reports
// malformed input as KVRET_ERR_CORRUPT (never reads past the end).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.hpp"

namespace kvret {

class ByteWriter {
 public:
  ByteWriter() { bytes_.reserve(64); }  // also keeps GCC 12 from misreading the first insert as an overflow
  template <class T>
  void value(const T& x) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&x);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  /// The element count, then the elements.
  template <class T, class A>
  void array(const std::vector<T, A>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    value<uint64_t>(v.size());
    if (v.empty()) return;  // data() may be null
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    bytes_.insert(bytes_.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<std::byte>& bytes() noexcept { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

class ByteReader {
 public:
  ByteReader(const std::byte* data, size_t size) : data_(data), left_(size) {}
  template <class T>
  T value() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T x;
    std::memcpy(&x, data_, sizeof(T));
    advance(sizeof(T));
    return x;
  }
  /// An array written by ByteWriter::array, of exactly `expected` elements when expected >= 0.
  template <class T, class A = std::allocator<T>>
  std::vector<T, A> array(int64_t expected = -1) {
    const auto n = value<uint64_t>();
    KVRET_REQUIRE(n <= left_ / sizeof(T), KVRET_ERR_CORRUPT, "saved state: an array is longer than the data left");
    KVRET_REQUIRE(
        expected < 0 || n == static_cast<uint64_t>(expected), KVRET_ERR_CORRUPT,
        "saved state: an array of " + std::to_string(n) + " elements where " + std::to_string(expected) + " belong");
    std::vector<T, A> v(static_cast<size_t>(n));
    if (n > 0) std::memcpy(v.data(), data_, static_cast<size_t>(n) * sizeof(T));  // an empty vector's data() is null
    advance(static_cast<size_t>(n) * sizeof(T));
    return v;
  }
  size_t left() const noexcept { return left_; }

 private:
  void need(size_t n) const { KVRET_REQUIRE(n <= left_, KVRET_ERR_CORRUPT, "saved state: truncated"); }
  void advance(size_t n) noexcept {
    data_ += n;
    left_ -= n;
  }
  const std::byte* data_;
  size_t left_;
};

/// Throws KVRET_ERR_CORRUPT with `what` unless `ok`.
inline void require_intact(bool ok, const char* what) {
  if (!ok) throw Error(KVRET_ERR_CORRUPT, std::string("saved state: ") + what);
}
inline void require_intact(bool ok, const std::string& what) {
  if (!ok) throw Error(KVRET_ERR_CORRUPT, "saved state: " + what);
}

/// Every saved state begins with this magic, a tag naming its kind, and the version of its layout.
constexpr uint32_t kStateMagic = 0x5452564bu;  // "KVRT"

inline void write_header(ByteWriter& w, uint32_t tag, uint32_t version) {
  w.value(kStateMagic);
  w.value(tag);
  w.value(version);
}

inline void read_header(ByteReader& r, uint32_t tag, uint32_t version) {
  require_intact(r.value<uint32_t>() == kStateMagic, "not a kvret index state");
  require_intact(r.value<uint32_t>() == tag, "the state of another index kind");
  require_intact(r.value<uint32_t>() == version, "a layout version this kvret does not read");
}

}  // namespace kvret
