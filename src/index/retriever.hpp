#pragma once
// A retriever indexes the middle tokens of one (sequence, layer) and selects, per KV head, the `budget` middle
// positions that matter most for a query. Implementations: exact (oracle), pq (PQCache), page (Quest),
// streaming (none).
#include <cstdint>
#include <memory>

#include "kvret.h"
#include "store/host_kv_store.hpp"

namespace kvret {

struct SelectRequest {
  const float* q = nullptr;  ///< [n_q_heads, head_dim] f32, unscaled
  int n_q_heads = 0;
  int group = 1;          ///< query heads per KV head
  float scale = 1.0f;     ///< logit scale, 1/sqrt(head_dim)
  int64_t mid_begin = 0;  ///< middle positions [mid_begin, mid_end)
  int64_t mid_end = 0;
  int64_t budget = 0;  ///< 1 <= budget <= mid_end - mid_begin
  kvret_gqa_fold fold = KVRET_FOLD_SUM_PROB;
  int n_threads = 1;
};

class Retriever {
 public:
  virtual ~Retriever() = default;

  /// Indexes middle positions [begin, end) of `store`; calls cover one contiguous, growing range. `may_retrain`
  /// is true for prefill (a build may retrain the index on everything so far), false for decode (encode only).
  /// Strong guarantee: if it throws, the index is as it was.
  virtual void extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) = 0;

  /// Writes each KV head's selected positions, ascending, to out_rows[h][0..count) and returns count.
  virtual int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows) const = 0;

  /// Bytes the index holds.
  virtual int64_t bytes() const noexcept = 0;

  /// Whether cut(end) can drop the indexed positions at or above `end` exactly, leaving the index the positions
  /// below `end` would have built by the same extends. When it cannot (the default), the sequence rebuilds the
  /// index from the remaining positions instead.
  virtual bool can_cut(int64_t end) const noexcept {
    (void)end;
    return false;
  }
  /// Drops the indexed positions at or above `end` (only after can_cut(end)); `store` still holds them. Never throws.
  virtual void cut(const HostKvStore& store, int64_t end) noexcept { (void)store, (void)end; }

  /// An independent copy (for a forked sequence). The default: KVRET_ERR_UNSUPPORTED.
  virtual std::unique_ptr<Retriever> clone() const;
};

/// The retriever for config.index_kind; `layer` decorrelates per-layer seeds.
std::unique_ptr<Retriever> make_retriever(const kvret_config& config, int layer);

}  // namespace kvret
