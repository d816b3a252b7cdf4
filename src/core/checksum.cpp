#include "core/checksum.hpp"

#include <zlib.h>

namespace kvret {

uint32_t crc32_of(const void* data, size_t size) noexcept {
  // crc32_z takes a size_t length; older zlibs (before 1.2.9) lack it, so the length goes in chunks of 1 GiB.
  const auto* p = static_cast<const Bytef*>(data);
  uLong crc = ::crc32(0L, Z_NULL, 0);
  while (size > 0) {
    const size_t chunk = size < (size_t{1} << 30) ? size : (size_t{1} << 30);
    crc = ::crc32(crc, p, static_cast<uInt>(chunk));
    p += chunk;
    size -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace kvret
