#pragma once
// A retriever indexes the middle tokens of one (sequence, layer) and selects, per KV head, the `budget` middle
// positions that matter most for a query. Implementations: exact (oracle), pq (PQCache), page (Quest), cluster
// (ClusterKV), quant (SpeCache's low-bit copy), streaming (none).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

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

  /// Logits (middle tokens x query heads) below which a select runs on the calling thread: waking a thread team
  /// costs more than it saves on a few hundred tokens, and an engine calling from many threads of its own must
  /// not multiply its threads by n_threads for small work.
  static constexpr int64_t kParallelLogits = 32768;
  /// Whether the select's loop over KV heads runs on n_threads threads (the cost model).
  bool parallel() const noexcept { return (mid_end - mid_begin) * n_q_heads >= kParallelLogits; }
};

class ByteReader;
class ByteWriter;

class Retriever {
 public:
  virtual ~Retriever() = default;

  /// The indexed middle positions [indexed_begin(), indexed_end()): one contiguous range that extend grows and cut
  /// shrinks, and the only record of it (the sequence asks the index). Both are 0 before the first extend.
  bool indexed() const noexcept { return base_ >= 0; }
  int64_t indexed_begin() const noexcept { return base_ < 0 ? 0 : base_; }
  int64_t indexed_end() const noexcept { return end_ < 0 ? 0 : end_; }

  /// Indexes middle positions [begin, end) of `store` (nothing when end <= begin); once something is indexed,
  /// begin must be indexed_end() (KVRET_ERR_INTERNAL otherwise). `may_retrain` is true for prefill (a build may
  /// retrain the index on everything so far), false for decode (encode only). Strong guarantee: if it throws, the
  /// index is as it was.
  void extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads);

  /// Writes each KV head's selected positions, ascending, to out_rows[h][0..count) and returns count. With
  /// out_scores, also each position's score, aligned with out_rows: the folded score the kind ranked it by (higher
  /// first; a token sharing a PQ cell or a page shares its score).
  virtual int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows,
                         float* const* out_scores) const = 0;

  /// Bytes the index holds.
  virtual int64_t bytes() const noexcept = 0;

  /// The retriever whose select this one's select is, verbatim: the same positions and scores, from that
  /// retriever's index as it is. A backend may then run that retriever's select in this one's place (the CUDA
  /// backend selects on its device from its own copy of a PAGE, CLUSTER, PQ or QUANT index, or EXACT's keys in place),
  /// and the sequence may read that index as its kind's (CLUSTER's resident clusters, QUANT's quantized attention).
  /// kvret's own retrievers name themselves. The default, null, says "no other": the retriever is only ever run through
  /// its own select. A retriever that wraps one of kvret's own and forwards select (and extend, cut) to it unchanged
  /// may return the wrapped one's selects_as(); one whose select differs in anything must keep the default.
  virtual const Retriever* selects_as() const noexcept { return nullptr; }

  /// Whether cut(end) can drop the indexed positions at or above `end` exactly, leaving the index the positions
  /// below `end` would have built by the same extends. When it cannot (the default), the sequence rebuilds the
  /// index from the remaining positions instead.
  virtual bool can_cut(int64_t end) const noexcept {
    (void)end;
    return false;
  }
  /// Drops the indexed positions at or above `end` (only after can_cut(end)); `store` still holds them. The range
  /// becomes [indexed_begin(), end), or empty when end <= indexed_begin(). Never throws.
  void cut(const HostKvStore& store, int64_t end) noexcept;

  /// An independent copy (for a forked sequence). The default: KVRET_ERR_UNSUPPORTED.
  virtual std::unique_ptr<Retriever> clone() const;

  /// The index's state as a byte string (what a saved session keeps: no rebuild on restore). The default:
  /// KVRET_ERR_UNSUPPORTED.
  virtual std::vector<std::byte> save() const;
  /// Restores what save() wrote, into a retriever made by the same kind and config. Checks everything it reads
  /// (malformed, truncated or foreign input: KVRET_ERR_CORRUPT) and changes nothing on failure. `store` must hold
  /// the indexed tokens. The default: KVRET_ERR_UNSUPPORTED.
  virtual void restore(const HostKvStore& store, const std::byte* data, size_t size);

 protected:
  /// extend's work for a non-empty [begin, end): base_ and end_ still hold the range before it; extend records
  /// the new range after it returns.
  virtual void on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) = 0;
  /// cut's work for base_ <= ... < end_ (end may be at or below base_: drop everything); cut records the range.
  virtual void on_cut(const HostKvStore& store, int64_t end) noexcept { (void)store, (void)end; }

  /// Throws KVRET_ERR_INTERNAL unless the indexed range is the request's middle (`what` names the index).
  void require_covers(const SelectRequest& r, const char* what) const;
  /// The range, for save().
  void write_range(ByteWriter& w) const;
  /// A range written by write_range, checked against `store` (KVRET_ERR_CORRUPT); restore commits it with
  /// set_range.
  static std::pair<int64_t, int64_t> read_range(ByteReader& r, const HostKvStore& store);
  void set_range(std::pair<int64_t, int64_t> range) noexcept { std::tie(base_, end_) = range; }

  int64_t base_ = -1;  ///< the first indexed position; -1 (and end_ -1) while nothing is indexed
  int64_t end_ = -1;
};

/// One selection to run: one layer's retriever and store, its request, and where each KV head's positions go.
struct SelectJob {
  const Retriever* retriever = nullptr;
  const HostKvStore* store = nullptr;
  SelectRequest request;
  int32_t* const* out_rows = nullptr;
  float* const* out_scores = nullptr;  ///< optional: each position's score, aligned with out_rows
  int64_t count = 0;                   ///< set by select_batch: the positions written per head
};

/// An index kind, the value of kvret_config.index_kind: it makes every layer's retriever and selects for many
/// layers (of many sequences) in one call, which a GPU kind turns into one batched launch. The built-in kinds are
/// EXACT, PQ, PAGE, CLUSTER, QUANT and STREAMING; another kind is added with register_retriever_kind, without touching
/// the sequence or the C layer.
class RetrieverKind {
 public:
  virtual ~RetrieverKind() = default;
  virtual const char* name() const noexcept = 0;
  /// A new, empty retriever for `layer` (the layer decorrelates per-layer seeds).
  virtual std::unique_ptr<Retriever> make(const kvret_config& config, int layer) const = 0;
  /// False for a kind that selects no middle token (streaming: the working set is sink + local).
  virtual bool selects() const noexcept { return true; }
  /// Runs the n jobs, setting each count (the CPU kinds: one retriever after another). Throws like select.
  /// `stream` orders the work for a device kind (the positions are ready when the stream reaches that point); the
  /// CPU kinds finish before returning and ignore it.
  virtual void select_batch(SelectJob* jobs, size_t n, kvret_stream stream) const;
};

/// The kind registered for `index_kind`, or nullptr.
std::shared_ptr<const RetrieverKind> find_retriever_kind(int32_t index_kind);
/// Registers (or replaces, or with nullptr removes) the kind of an index_kind value; contexts keep the kind they
/// were created with. For extensions and tests: use values from 1000 up.
void register_retriever_kind(int32_t index_kind, std::shared_ptr<const RetrieverKind> kind);

/// The retriever of config.index_kind for `layer` (KVRET_ERR_UNSUPPORTED when no kind is registered for it).
std::unique_ptr<Retriever> make_retriever(const kvret_config& config, int layer);

}  // namespace kvret
