#pragma once
// The disk tier of the session store: a directory of blob files, one per key (BlobTier).
//
// The directory is private to one context (docs/reliability.md, "Security rules"): created 0700 when missing,
// refused when another user owns it or group or others can write it, and locked (flock on its ".lock" file) for
// the tier's life, so a second context on it is refused instead of deleting the first one's temporary files. Files
// are created 0600 at an unpredictable temporary name (O_EXCL, O_NOFOLLOW) and renamed into place; a blob is read
// only from a regular file, opened without following a link and without blocking (a FIFO or a link planted in the
// directory reads as corrupt, never blocks, and is never written through). Every name is resolved against the
// directory opened once, not against its path.
//
// A blob's file is named from its key (hex-encoded, so any key bytes are safe) and holds a 32-byte header (magic,
// layout version, payload size, expiry time, the payload's CRC-32 and the header's own CRC-32) and the payload. A
// put writes a temporary file, fsyncs it, renames it over the old one and fsyncs the directory, so a reader sees the
// old blob or the new one whole, even when the writer is killed mid-put. A get checks the header, the size and the
// CRC-32 of the payload (zlib): a torn or altered file is KVRET_ERR_CORRUPT.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "session/blob_tier.hpp"

namespace kvret::session {

class DiskTier final : public BlobTier {
 public:
  /// Keys longer than this are refused (KVRET_ERR_INVALID_ARGUMENT): the hex file name must fit a directory entry.
  static constexpr size_t kMaxKeyBytes = 120;

  /// Opens (creating it 0700 when missing) the directory `dir`, locks it, removes the temporary files a killed
  /// writer left and lists the blobs there. Throws kvret::Error: KVRET_ERR_IO when the directory cannot be created
  /// or read; KVRET_ERR_INVALID_ARGUMENT when it is not a directory, another user owns it or group or others can
  /// write it; KVRET_ERR_BUSY when another tier (in this process or another) holds its lock.
  explicit DiskTier(std::string dir);
  ~DiskTier() override;
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  /// The lock file inside the directory (held with flock for the tier's life).
  static constexpr const char* kLockName = ".lock";

  const char* name() const noexcept override { return "disk"; }
  void put(const std::string& key, const std::byte* data, size_t size, int64_t ttl_ms) override;
  std::optional<std::vector<std::byte>> get(const std::string& key) override;
  bool remove(const std::string& key) override;

  /// The keys of the blobs in the directory (as found when it was opened, plus puts, less removes).
  std::vector<std::string> keys() const;
  const std::string& dir() const noexcept { return dir_; }
  /// Bytes of the blob files (headers included).
  int64_t bytes() const;
  int64_t reads() const;
  int64_t writes() const;

 private:
  /// The file name of a blob (checks the key: KVRET_ERR_INVALID_ARGUMENT).
  std::string name_of(const std::string& key) const;

  std::string dir_;
  int dir_fd_ = -1;   // the directory, opened once: every file is opened relative to it
  int lock_fd_ = -1;  // the lock file, flock'ed exclusively
  mutable std::mutex mu_;
  std::unordered_map<std::string, int64_t> files_;  // key -> file bytes
  int64_t bytes_ = 0;
  int64_t reads_ = 0;
  int64_t writes_ = 0;
};

}  // namespace kvret::session
