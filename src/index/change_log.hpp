#pragma once
// The recent changes of an index that a copy elsewhere (the CUDA backend's device mirrors) keeps up with by taking
// only what changed. The index is a row of units (pages, key blocks); every change gets a new version, unique in the
// process, and records the first unit it changed (every unit from there on may differ). The last kChanges changes
// are kept: a copy of an older version is told that every unit may differ.
#include <array>
#include <cstddef>
#include <cstdint>

namespace kvret {

class ChangeLog {
 public:
  /// Changes remembered.
  static constexpr size_t kChanges = 8;

  /// A version number no index of the process has had before: increasing, never 0.
  static uint64_t next_version() noexcept;

  ChangeLog() noexcept : version_(next_version()) {}

  /// The current version. A copy of the log has its original's until either changes.
  uint64_t version() const noexcept { return version_; }

  /// Records a change of the units from `first` on under a new version.
  void mark(int64_t first) noexcept;

  /// Forgets every change under a new version: a copy of any earlier version must take every unit (a restore).
  void reset() noexcept;

  /// The first unit that may differ from version `v`'s, of the `units` there are now: `units` when v is the
  /// current version, 0 when v is not one of the last kChanges versions (too old to know, or never this log's).
  int64_t changed_since(uint64_t v, int64_t units) const noexcept;

 private:
  struct Change {
    uint64_t from = 0;  ///< the version before the change (0: none recorded)
    int64_t first = 0;  ///< the first unit it changed
  };
  uint64_t version_;
  std::array<Change, kChanges> changes_{};  ///< a ring, next_ the oldest
  size_t next_ = 0;
};

}  // namespace kvret
