#pragma once
// A tier of the session store below host DRAM: named byte strings (blobs), each replaced whole. The disk tier (a
// directory of files) and the shared tier (Redis) implement it; the session store writes a session as one blob per
// layer and then its manifest blob, so a reader that finds the manifest finds every layer it names.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvret::session {

class BlobTier {
 public:
  virtual ~BlobTier() = default;

  /// A short name for messages ("disk", "redis").
  virtual const char* name() const noexcept = 0;

  /// Stores `size` bytes under `key` (a non-empty string without NUL), replacing what was there: a reader sees the
  /// old bytes or the new ones, never a mix or a part, even when the writer dies mid-put. ttl_ms > 0: the blob is a
  /// miss from that many milliseconds on. Throws kvret::Error: KVRET_ERR_IO (a full disk, a lost connection, a
  /// timeout), KVRET_ERR_CAPACITY (the tier's capacity); the old bytes stay.
  virtual void put(const std::string& key, const std::byte* data, size_t size, int64_t ttl_ms) = 0;

  /// The bytes stored under `key`, checked against their checksums; std::nullopt on a miss (never stored, removed
  /// or expired). Throws kvret::Error: KVRET_ERR_CORRUPT (a checksum or the framing fails), KVRET_ERR_IO.
  virtual std::optional<std::vector<std::byte>> get(const std::string& key) = 0;

  /// Removes `key`; false when there was nothing under it. Throws kvret::Error KVRET_ERR_IO.
  virtual bool remove(const std::string& key) = 0;
};

}  // namespace kvret::session
