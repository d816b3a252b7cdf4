#pragma once
// One sequence (request or conversation): per layer a host KV store and an index over its middle tokens.
// Every public call validates everything before it changes anything, so a call that throws leaves the sequence
// as it was.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/tensor_view.hpp"
#include "engine/cluster_reuse.hpp"
#include "engine/kvcrush_layer.hpp"
#include "engine/layer_load.hpp"
#include "engine/layer_state.hpp"
#include "engine/stats.hpp"
#include "index/retriever.hpp"
#include "kvret.h"
#include "select/kvcrush.hpp"
#include "store/host_kv_store.hpp"

namespace kvret {

class Context;
namespace session {
class SessionStore;
}

/// "layer N", as error messages name a layer.
inline std::string layer_name(int32_t layer) { return "layer " + std::to_string(layer); }

/// A [Hq, D] query view converted to f32 ([Hq * D]); with check_finite a NaN or Inf is KVRET_ERR_NONFINITE.
std::vector<float> load_query(const TensorView& q, bool check_finite);

/// Positions of the three token groups of a layer with `length` tokens.
struct TokenGroups {
  int64_t length = 0;
  int64_t mid_begin = 0;  ///< sink is [0, mid_begin)
  int64_t mid_end = 0;    ///< middle is [mid_begin, mid_end), local is [mid_end, length)
  int64_t middle() const noexcept { return mid_end - mid_begin; }
};

class Sequence {
 public:
  explicit Sequence(Context& ctx);
  /// A fork's sequence: its layers already filled.
  struct ForkTag {};
  Sequence(Context& ctx, ForkTag);
  ~Sequence();  ///< stops a background load of its layers, waits for its background builds
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  Context& context() const noexcept { return ctx_; }
  /// Waits for every background build of this sequence, ignoring their failures.
  void drain() noexcept;
  /// Waits until every layer is loaded (a session opened from disk loads its layers in the background; docs/
  /// sessions.md); throws the failure that stopped the load.
  void wait_loaded() const;

  void append_prefill(int32_t layer, const kvret_tensor* k, const kvret_tensor* v);
  void append_decode(int32_t layer, const kvret_tensor* k, const kvret_tensor* v);
  void wait_index(int32_t layer);
  /// Rolls every layer back to its first `length` tokens (layers holding fewer keep theirs); see kvret_seq_truncate.
  /// Strong guarantee.
  void truncate(int64_t length);
  /// Drops `count` tokens of every layer after its first `keep`; see kvret_seq_drop_front. Strong guarantee.
  void drop_front(int64_t keep, int64_t count);
  /// A new sequence of the same context holding the same tokens, index and stats of state (tokens, bytes), sharing
  /// this one's KV pages copy-on-write; see kvret_seq_fork. Strong guarantee (nothing is created on failure).
  std::unique_ptr<Sequence> fork();

  int64_t length(int32_t layer) const;
  TokenGroups groups(int32_t layer) const;
  /// The groups of a layer holding `length` tokens.
  TokenGroups groups_at(int64_t length) const noexcept;
  /// Resolves a requested budget (KVRET_BUDGET_DEFAULT allowed) to the number selected per head; throws
  /// KVRET_ERR_BUDGET for 0, negatives other than the default, or more than the layer's length.
  int64_t resolve_budget(int32_t layer, int32_t budget) const;

  /// Validates q ([Hq, D]), out ([Hkv, >= count]) and scores when given (f32, [Hkv, >= count]) for `layer`;
  /// returns the count select will write.
  int64_t check_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                       const TensorView* scores = nullptr) const;
  /// A select validated and ready to run: the job for the context's RetrieverKind::select_batch and the storage it
  /// points into (job.retriever is null when there is nothing to select).
  struct PreparedSelect {
    std::vector<float> q;
    /// The outputs as given and the host views select writes (the same, unless the backend's memory needs a copy:
    /// finish_select then copies them in).
    TensorView out, out_host, scores, scores_host;
    bool has_scores = false;
    std::vector<std::byte> out_copy, scores_copy;
    std::vector<int32_t*> rows;
    std::vector<float*> score_rows;
    SelectJob job;
    /// KVCrush (config.hamming_fraction > 0): the representatives finish_select adds per head to the job's
    /// selection of the important part of the budget, and the layer they come from.
    int64_t representatives = 0;
    int32_t layer = 0;
  };
  /// Validates (check_select), loads q, waits for the layer's build and fills p; the kind runs p.job.
  void prepare_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                      const TensorView* scores, PreparedSelect& p);
  /// After the kind ran p.job: KVCrush's representatives added (p.representatives), then the selection into the
  /// caller's tensors (Backend::write_back).
  void finish_select(PreparedSelect& p);
  /// A select to run on the backend's device (Backend::select_on_device or select_batch_on_device), made by
  /// prepare_device_select: the job, the tensors and KVCrush part it points to, and the count it writes per head.
  /// It points into itself: make it where it stays until finish_device_select.
  struct DeviceSelectPlan {
    DeviceSelectPlan() = default;
    DeviceSelectPlan(const DeviceSelectPlan&) = delete;
    DeviceSelectPlan& operator=(const DeviceSelectPlan&) = delete;
    TensorView q, out, scores;
    DeviceSelectJob job;
    DeviceCrush crush;
    int64_t selected = 0;
  };
  /// After check_select: fills `plan` for a select on the device and returns true, or returns false when the host
  /// must select (the backend does not select this index or these tensors there, nothing to select, KVCrush groups).
  bool prepare_device_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                             const TensorView* scores, DeviceSelectPlan& plan);
  /// After the backend ran plan.job: the select counted in the stats.
  void finish_device_select(const DeviceSelectPlan& plan);
  /// The select of select_checked on the backend's device (Backend::select_on_device), after check_select: true,
  /// with *count, when it ran there; false, with nothing written, when the host must select. It runs on `stream`;
  /// unless `in_stream_order`, the call waits for it (kvret_select returns with its outputs written), else the
  /// caller orders what reads them on the same stream.
  bool select_on_device(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                        const TensorView* scores, int64_t* count, kvret_stream stream = nullptr,
                        bool in_stream_order = false);
  /// Selects (after check_select) and returns the count written.
  int64_t select_checked(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                         const TensorView* scores = nullptr);
  /// kvret_select, and kvret_select_scored when `scores` is not null.
  int64_t select(int32_t layer, const kvret_tensor* q, int32_t budget, const kvret_tensor* out,
                 const kvret_tensor* scores = nullptr);

  /// kvret_prefetch_async: selects with the guessed query and keeps the selection (per KV head) as the layer's
  /// prefetched rows; the layer's next fetch counts the rows it takes from them as prefetch hits and drops them.
  /// On a backend with a block cache (CUDA), the blocks the selection touches are loaded into the layer's cache,
  /// ordered on `stream`.
  void prefetch(int32_t layer, const kvret_tensor* q_guess, int32_t budget, kvret_stream stream = nullptr);

  int64_t working_set_capacity(int32_t layer, int32_t budget) const;
  /// select + fetch + attention in one call (kvret_seq_attend).
  void attend(int32_t layer, const kvret_tensor* q, int32_t budget, float scale, const kvret_tensor* out,
              kvret_stream stream = nullptr);
  int64_t fetch(int32_t layer, const kvret_tensor* positions, int32_t count, const kvret_working_set* out,
                kvret_stream stream = nullptr);
  /// kvret_fetch_batch_async over `seqs` (distinct sequences of one context; the caller checked the handles): every
  /// argument of every sequence is validated before any working set is written, then one Backend::gather_batch for
  /// the batch. positions: int32 [n, n_kv_heads, >= max count] (unused, and may be NULL, when every count is 0).
  /// Each sequence ends as kvret_fetch_async would leave it, stats included. A throw while gathering leaves every
  /// sequence's stats as they were (a cluster layer's resident copy is dropped, as a failed single fetch drops it).
  static void fetch_batch(Context& ctx, Sequence* const* seqs, int32_t n, int32_t layer, const kvret_tensor* positions,
                          const int32_t* counts, const kvret_working_set* outs, int64_t* out_rows, kvret_stream stream);
  /// kvret_select_batch over `seqs` (distinct sequences of one context; the caller checked the handles and each
  /// select, check_select with q.slice(i) and out.slice(i)): the selects the backend's device can run go to it in
  /// one call (which fuses those it can) unless config.check_finite, the others to the index kind in one call;
  /// out_counts[i] gets the count written per head for seqs[i].
  static void select_batch(Context& ctx, Sequence* const* seqs, int32_t n, int32_t layer, const TensorView& q,
                           int32_t budget, const TensorView& out, int32_t* out_counts);
  void read(int32_t layer, int64_t begin, int64_t end, const kvret_tensor* k, const kvret_tensor* v) const;

  /// kvret_seq_observe: the prompt's last queries as the layer's observation window. Strong guarantee.
  void observe(int32_t layer, const kvret_tensor* q_window);
  /// kvret_seq_observe_attention: one step's probabilities added to the layer's accumulated attention. Strong
  /// guarantee.
  void observe_attention(int32_t layer, const kvret_tensor* probs);
  /// Brings `crush` up to the layer's tokens from the importance the config and the layer's inputs give: the
  /// accumulated sums (KVRET_IMPORTANCE_ACCUMULATED, once a step was observed), else the observed query window,
  /// else the layer's last keys (KvCrushLayer::update).
  void refresh_crush(int32_t layer, KvCrushLayer& crush) const;
  /// The layer's accumulated attention ([n_q_heads, tokens] sums) and the steps added to it. For tests and tooling.
  const AttentionAccumulator& accumulated(int32_t layer) const;
  int64_t accumulated_steps(int32_t layer) const;
  /// Whether any layer holds an observed query window or accumulated attention (sessions do not save them).
  bool holds_importance_inputs() const noexcept;
  /// The layer's KVCrush select state (null unless config.hamming_fraction > 0). For tests.
  const KvCrushLayer* crush(int32_t layer) const;

  /// The counters, with what the gathers and prefetches of a backend that counts them on the device (the CUDA
  /// backend's block cache) counted there folded in first (a wait for the device, only after such a gather).
  const StatCounters& stats() const noexcept {
    fold_device_counts();
    return stats_;
  }
  /// The index of a layer (waits for its build first). For tests and tooling.
  const Retriever& index(int32_t layer);
  /// The host store of a layer. For tests and tooling.
  const HostKvStore& store(int32_t layer) const { return layer_at(layer).store(); }

  /// The C layer's in-call flag (kvret.h: one sequence is used by one thread at a time). try_enter sets it with one
  /// compare-and-swap and answers false, changing nothing, while another call holds it; leave clears it.
  bool try_enter() noexcept {
    bool idle = false;
    return in_call_.compare_exchange_strong(idle, true, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void leave() noexcept { in_call_.store(false, std::memory_order_release); }

 private:
  friend class session::SessionStore;  ///< saves the layers and restores them into a new sequence

  /// An append's k and v, checked against the config (shapes, and finiteness when config.check_finite).
  struct AppendRows {
    TensorView k, v;  ///< host-readable (views of k_copy and v_copy when the backend's memory needs copies)
    int64_t tokens;
    bool tokens_dim;  ///< [T, Hkv, D] (else one token, [Hkv, D])
    std::vector<std::byte> k_copy{}, v_copy{};
  };
  AppendRows check_append(int32_t layer, const kvret_tensor* k, const kvret_tensor* v, bool prefill) const;
  /// Throws KVRET_ERR_STATE / KVRET_ERR_CAPACITY / KVRET_ERR_OUT_OF_MEMORY unless `tokens` more fit the layer.
  void check_capacity(int32_t layer, int64_t length, int64_t tokens, bool prefill) const;
  /// How a fetch's messages name its arguments: "positions", "out.k", "count" for kvret_fetch_async, and
  /// "positions[i]", "outs[i].k", "counts[i]" for entry i of kvret_fetch_batch_async.
  struct FetchNames {
    std::string positions, k, v, out_positions, count;
  };
  /// A fetch validated and ready to gather: the working-set views, the sorted selection of every head, and, once
  /// begin_fetch ran, the row-source chain and the gather job.
  struct PreparedFetch {
    int32_t layer = 0;
    int64_t count = 0;
    TokenGroups g;
    int64_t rows = 0;
    WorkingSetViews ws;
    std::vector<std::vector<int32_t>> selected;
    std::vector<const int32_t*> rows_ptr;
    std::vector<std::shared_ptr<const RowSource>> chain;
    const ClusterRetriever* clusters = nullptr;
    ClusterReuseLayer* reuse = nullptr;
    GatherJob job;
  };
  /// Checks the layer, count and working set of a fetch (changes nothing) and fills p up to its selection.
  void check_fetch(int32_t layer, int32_t count, const kvret_working_set* out, const FetchNames& names,
                   PreparedFetch& p) const;
  /// Checks a fetch's selection (a host-readable [n_kv_heads, >= count] view: distinct middle positions per head)
  /// and keeps it, sorted, in p.
  void check_fetch_positions(const TensorView& positions, const FetchNames& names, PreparedFetch& p) const;
  /// Sets up p's row-source chain (ClusterKV's resident clusters first, then the context's sources) and p.job.
  /// Changes a cluster layer's resident copy: on a later failure call abort_fetch.
  void begin_fetch(PreparedFetch& p);
  /// After a failed gather: drops a cluster layer's resident copy, which may hold some heads' updates only.
  void abort_fetch(PreparedFetch& p) noexcept;
  /// After the gather: the stats (rows, hits, bytes, prefetch hits, cluster reuse). Never throws.
  void finish_fetch(PreparedFetch& p) noexcept;
  LayerState& layer_at(int32_t layer) const;
  /// After a fetch or prefetch: the bytes the backend copied into this sequence's block caches (stats.bytes_h2d)
  /// and the device memory it holds (stats.device_bytes: the caches and attend's working set).
  void note_cache_use();
  void check_layer(int32_t layer) const;
  void append(int32_t layer, const kvret_tensor* k, const kvret_tensor* v, bool prefill);
  /// kvret_seq_attend under config.quant_attention: after the select into `selected` ([n_kv_heads, width], count
  /// per head), attention over every token with the low-bit copy standing in for the unselected middle.
  void attend_quantized(int32_t layer, const TensorView& q, const int32_t* selected, int64_t width, int64_t count,
                        float scale, const TensorView& out);
  /// Indexes what an append moved into the middle: the entry of the token leaving the local window at decode, or a
  /// prefill build (now, or queued with config.background_build).
  void index_appended(int32_t layer, LayerState& l, bool prefill);

  /// attend's own selection and f32 working set, reused by every call.
  struct AttendScratch {
    std::vector<int32_t> selected;
    std::unique_ptr<DeviceBuffer> k, v, positions;  ///< the backend's memory
    std::unique_ptr<DeviceBuffer> device_selected;  ///< attend_on_device's selection, [n_kv_heads, width] int32
  };
  /// kvret_seq_attend with the selection kept on the device (docs/cuda_backend.md): select into
  /// attend_scratch_.device_selected, gather from it with the block cache's update, attend, and no host wait.
  /// False, with nothing changed, where it does not apply (the caller then runs the host path).
  bool attend_on_device(int32_t layer, const TensorView& q, int32_t budget, int64_t width, float scale,
                        const TensorView& out, kvret_stream stream);
  /// Adds what the backend counted on the device for this sequence since the last fold to stats_.
  void fold_device_counts() const noexcept;

  Context& ctx_;
  /// The layers; while load_ runs, those from load_->ready() on are null and filled by its loader.
  std::vector<std::unique_ptr<LayerState>> layers_;
  /// The background load of the layers (a session opened from disk); null when every layer was in from the start.
  std::shared_ptr<LayerLoad> load_;
  /// Per layer, the last prefetch's selection ([n_kv_heads] ascending positions), until the layer's next fetch.
  std::vector<std::vector<std::vector<int32_t>>> prefetched_;
  /// Per layer, KVCrush's signatures (empty unless config.hamming_fraction > 0).
  std::vector<KvCrushLayer> crush_;
  /// Per layer, ClusterKV's resident clusters (config.cluster_reuse_steps > 0 on a cluster index; sized at the
  /// first fetch that uses them; a fork starts without).
  std::vector<ClusterReuseLayer> reuse_;
  /// Per layer, the inputs of KVCrush's importance besides the keys (docs/kvcrush.md).
  struct ImportanceInputs {
    std::vector<float> window;  ///< kvret_seq_observe's queries, [n_q_heads, w, head_dim] (empty: none)
    int w = 0;
    int64_t observed_at = 0;       ///< the layer's length at that call
    AttentionAccumulator sums{0};  ///< H2O's accumulated attention, [n_q_heads, tokens]
    int64_t steps = 0;             ///< steps added to sums
  };
  std::vector<ImportanceInputs> importance_;
  /// Adds one step's probabilities ([n_q_heads, n], checked) to the layer's sums. Strong guarantee.
  void accumulate(int32_t layer, const float* probs, int64_t n);
  /// Under KVRET_IMPORTANCE_ACCUMULATED, the probabilities of attend's step over its working set (sink, the
  /// selection rows[h][0..count), local) added to the layer's sums.
  void accumulate_attend(int32_t layer, const TensorView& q, const int32_t* selected, int64_t width, int64_t count,
                         float scale);
  AttendScratch attend_scratch_;
  mutable StatCounters stats_;  ///< mutable: fold_device_counts adds the device's counts when they are read
  /// The device counts already in stats_ (Backend::device_fetch_counts is cumulative), and whether there are any.
  mutable std::atomic<int64_t> folded_hits_{0}, folded_bytes_{0};
  std::atomic<bool> device_counted_{false};
  std::atomic<bool> in_call_{false};  ///< try_enter / leave
};

}  // namespace kvret
