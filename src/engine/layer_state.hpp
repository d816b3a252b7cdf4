#pragma once
// One layer of one sequence: its KV store, its index over the middle tokens, and the index's background build.
// What is indexed is the index's own range (Retriever::indexed_end), recorded nowhere else.
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/rope.hpp"
#include "engine/build_queue.hpp"
#include "engine/stats.hpp"
#include "index/retriever.hpp"
#include "kvret.h"
#include "store/host_kv_store.hpp"

namespace kvret {

/// The rotary embedding of the keys the layers' stores keep (config.rope_keys = 1; docs/rope.md); null when the
/// keys are given rotated (rope_keys = 0). One object serves every layer of a sequence.
std::shared_ptr<const rope::Rope> rope_of(const kvret_config& config);

class LayerState {
 public:
  /// `layer` names the layer in messages.
  LayerState(int32_t layer, HostKvStore store, std::unique_ptr<Retriever> index)
      : layer_(layer), store_(std::move(store)), index_(std::move(index)) {}
  ~LayerState() { drain(); }
  LayerState(const LayerState&) = delete;
  LayerState& operator=(const LayerState&) = delete;

  HostKvStore& store() noexcept { return store_; }
  const HostKvStore& store() const noexcept { return store_; }
  /// The index, as it is now (call wait() first for a finished build).
  const Retriever& index() const noexcept { return *index_; }
  int64_t indexed_end() const noexcept { return index_->indexed_end(); }

  /// Indexes the middle tokens [max(indexed_end(), mid_begin), end) now, on the calling thread; nothing when they
  /// are indexed already. `build` is true for a prefill build (the index may retrain; it counts in index_builds),
  /// false for a decode token's entry. Strong guarantee.
  void index_to(int64_t mid_begin, int64_t end, bool build, int n_threads, StatCounters& stats);
  /// Queues index_to(mid_begin, end, true, ...) on `queue`; until it ran, wait() waits for it and reports its
  /// failure. If queueing throws, nothing is pending. `stats` must outlive the build (drain() waits for it).
  void schedule_build(BuildQueue& queue, int64_t mid_begin, int64_t end, int n_threads, StatCounters& stats);
  /// Waits for a pending build and rethrows its failure, once (the next index_to builds the gap it left).
  void wait();
  /// Waits for a pending build, ignoring its failure (it stays for the next wait()).
  void drain() noexcept;

  /// Drops the indexed tokens at or above `end` (after index().can_cut(end)). Never throws.
  void cut_index(int64_t end, StatCounters& stats) noexcept;
  /// Replaces the index with `index` (built aside). Never throws.
  void replace_index(std::unique_ptr<Retriever> index, StatCounters& stats) noexcept;
  /// A copy of this layer: the same tokens, sharing the KV pages copy-on-write, and a copy of the index
  /// (KVRET_ERR_UNSUPPORTED when the kind cannot copy it).
  std::unique_ptr<LayerState> fork() const;
  /// The index's bytes as last counted in the sequence's stats.
  int64_t index_bytes() const noexcept { return index_bytes_; }

 private:
  /// Counts the index's change of size in `stats`.
  void account_index(StatCounters& stats) noexcept;

  int32_t layer_;
  HostKvStore store_;
  std::unique_ptr<Retriever> index_;
  int64_t index_bytes_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool build_pending_ = false;
  kvret_status build_status_ = KVRET_OK;
  std::string build_message_;
};

}  // namespace kvret
