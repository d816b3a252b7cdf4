#pragma once
// The CRC-32 (zlib's) and the little-endian fields of the session store's stored blobs (the disk tier's files and
// the shared tier's values on Redis): one definition for both tiers.
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvret {

/// The CRC-32 of `size` bytes (zlib's crc32: polynomial 0xEDB88320, initial and final XOR 0xFFFFFFFF), any size.
uint32_t crc32_of(const void* data, size_t size) noexcept;

/// Writes `v` at `p` as sizeof(T) little-endian bytes, whatever the host's byte order.
template <class T>
void store_le(void* p, T v) noexcept {
  static_assert(std::is_integral_v<T>);
  using U = std::make_unsigned_t<T>;
  auto u = static_cast<U>(v);
  auto* out = static_cast<unsigned char*>(p);
  for (size_t b = 0; b < sizeof(T); ++b)
    out[b] = static_cast<unsigned char>((static_cast<uint64_t>(u) >> (8 * b)) & 0xff);
}

/// Reads sizeof(T) little-endian bytes at `p` as a T.
template <class T>
T load_le(const void* p) noexcept {
  static_assert(std::is_integral_v<T>);
  const auto* in = static_cast<const unsigned char*>(p);
  uint64_t u = 0;
  for (size_t b = 0; b < sizeof(T); ++b) u |= uint64_t{in[b]} << (8 * b);
  return static_cast<T>(static_cast<std::make_unsigned_t<T>>(u));
}

}  // namespace kvret
