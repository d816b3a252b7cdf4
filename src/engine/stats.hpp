#pragma once
// Counters behind kvret_stats. Atomic so that stats may be read while other threads work on other sequences.
#include <atomic>
#include <cstdint>

#include "kvret.h"

namespace kvret {

struct StatCounters {
  std::atomic<int64_t> tokens_stored{0};
  std::atomic<int64_t> host_bytes{0};
  std::atomic<int64_t> index_bytes{0};
  std::atomic<int64_t> index_builds{0};
  std::atomic<int64_t> index_build_ns{0};
  std::atomic<int64_t> selections{0};
  std::atomic<int64_t> fetches{0};
  std::atomic<int64_t> fetched_rows{0};
  std::atomic<int64_t> cache_hits{0};
  std::atomic<int64_t> cache_misses{0};
  std::atomic<int64_t> bytes_h2d{0};
  std::atomic<int64_t> prefetch_hits{0};
  std::atomic<int64_t> device_bytes{0};  ///< live: the backend memory the sequence holds
  std::atomic<int64_t> cluster_reuse_rows{0};
  std::atomic<int64_t> cluster_reuse_hits{0};
  std::atomic<int64_t> cluster_reuse_bytes{0};  ///< live: the resident clusters' copies

  /// Adds these counters to *out (fields beyond out->struct_size are left alone).
  void add_to(kvret_stats* out) const noexcept;
  /// Adds these counters into `other` (used when a sequence closes).
  void add_into(StatCounters& other) const noexcept;
};

}  // namespace kvret
