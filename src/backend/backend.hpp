#pragma once
// The backend a context runs on: where KV pages live, how working sets are gathered and attended, and which streams
// it orders work on. The CPU backend implements all of it; a CUDA backend fills the same interface (pinned,
// device-mapped pages; kernels on the caller's stream). The context owns one, made from config.device_type.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor_view.hpp"
#include "fetch/working_set.hpp"
#include "index/retriever.hpp"
#include "kvret.h"
#include "store/host_kv_store.hpp"
#include "store/page_allocator.hpp"

namespace kvret {

class ClusterSegmentBuilder;

/// Memory a backend hands out for kvret's own tensors (kvret_seq_attend's working set): host memory on the CPU
/// backend, device memory on the CUDA backend.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual std::byte* data() const noexcept = 0;
  virtual size_t bytes() const noexcept = 0;
  /// Where data() is, as a tensor's device field.
  virtual kvret_device device() const noexcept = 0;
};

/// One sequence's share of a batched gather (Backend::gather_batch): gather's arguments, and what gather returns.
struct GatherJob {
  const HostKvStore* store = nullptr;
  int64_t mid_begin = 0;
  int64_t mid_end = 0;
  const int32_t* const* selected = nullptr;  ///< [n_kv_heads] ascending middle positions (unused when count is 0)
  int64_t count = 0;
  const WorkingSetViews* out = nullptr;
  const std::vector<std::shared_ptr<const RowSource>>* sources = nullptr;  ///< the sequence's chain, asked first
  const void* sequence = nullptr;
  int32_t layer = 0;
  int64_t rows = 0;               ///< out: the rows written per head
  int64_t served_by_sources = 0;  ///< out: rows the sources wrote, over all heads
};

/// KVCrush's part of a device select (config.hamming_fraction > 0): the layer's signatures, host memory, rows
/// [0, tokens) of `words` words (`heads` bits each), and their epoch (KvCrushLayer::epoch: rows already copied stay
/// valid while it holds). The backend adds `representatives` per head to the important part by the rule of
/// KvCrushLayer::add_representatives (docs/kvcrush.md), bit for bit.
struct DeviceCrush {
  int64_t representatives = 0;
  /// Brings the layer's signatures up to date and sets the fields below; false when the host must select. The
  /// backend calls it after checking the call's inputs (a refused call leaves the signatures as they were) and
  /// before it writes anything.
  std::function<bool(DeviceCrush&)> prepare;
  const uint64_t* bits = nullptr;
  int64_t tokens = 0;
  int32_t heads = 0;
  int32_t words = 0;
  uint64_t epoch = 0;
};

/// One select a backend may run on its device (Backend::select_on_device): the layer's index, the request (its q
/// unused: the device reads `q` where it is) and the caller's tensors, checked by Sequence::check_select.
struct DeviceSelectJob {
  const Retriever* retriever = nullptr;
  SelectRequest request;
  const TensorView* q = nullptr;
  const TensorView* out = nullptr;
  const TensorView* scores = nullptr;  ///< optional
  bool check_finite = false;           ///< config.check_finite: non-finite q is KVRET_ERR_NONFINITE
  const void* sequence = nullptr;      ///< with layer, the key of the device's copy of the index
  const HostKvStore* store = nullptr;  ///< the layer's store (CLUSTER reads its pending tail's keys)
  int32_t layer = 0;
  /// Not null: request.budget is the important part and the representatives follow (a backend that cannot add them
  /// returns false); the count written per head is then kvcrush_selected_count (kernels/math/kvcrush_math.h).
  DeviceCrush* crush = nullptr;
};

/// SpeCache's quantized attention of one QUANT layer on the device (QuantRetriever::attend_dense's rule and
/// arguments; q and out the caller's tensors).
struct QuantAttendJob {
  const Retriever* retriever = nullptr;  ///< the layer's QuantRetriever
  const HostKvStore* store = nullptr;
  const TensorView* q = nullptr;             ///< [n_q_heads, head_dim], any float type
  const TensorView* out = nullptr;           ///< f32 [n_q_heads, head_dim]
  const int32_t* const* selected = nullptr;  ///< per KV head `count` ascending positions (host memory)
  int64_t count = 0;
  int32_t group = 1;
  float scale = 1.0f;
  int n_threads = 1;
  const void* sequence = nullptr;  ///< with layer, the key of the device's copy of the index
  int32_t layer = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const noexcept = 0;
  /// Where the KV stores' pages come from (outlives every sequence of the context).
  virtual PageAllocator& pages() noexcept = 0;
  /// Throws KVRET_ERR_DEVICE unless this backend's calls can read and write `t`'s memory.
  virtual void check_access(const TensorView& t) const = 0;
  /// Throws KVRET_ERR_DEVICE unless this backend's device code can read and write `t`'s memory in place (the
  /// working set and attention's tensors; the CPU backend: whatever check_access accepts).
  virtual void check_kernel_access(const TensorView&) const {}
  /// Checks that work can be ordered on `stream` (the CPU backend completes every call before it returns and
  /// accepts any stream).
  virtual void check_stream(kvret_stream stream) const = 0;
  /// Waits for the work enqueued on `stream`.
  virtual void synchronize(kvret_stream stream) = 0;
  /// The device field of host memory that kvret allocates itself and passes to this backend's calls (the CPU
  /// backend: KVRET_DEVICE_CPU; the CUDA backend: KVRET_DEVICE_CUDA_HOST).
  virtual kvret_device host_memory() const noexcept { return {KVRET_DEVICE_CPU, 0}; }
  /// For the parts of a call that run on the CPU (checks, the index): `t` itself when the CPU can read its memory,
  /// else a view of a copy of its extent in `storage`, taken after the work enqueued before it. Throws
  /// KVRET_ERR_OUT_OF_MEMORY or KVRET_ERR_CUDA.
  virtual TensorView host_readable(const TensorView& t, std::vector<std::byte>& storage);
  /// A view the CPU may write an output `t` through: `t` itself, or a copy of it in `storage` that write_back then
  /// copies into `t`.
  virtual TensorView host_writable(const TensorView& t, std::vector<std::byte>& storage);
  /// Copies what host_writable's view holds into `t` (nothing when the view is `t` itself).
  virtual void write_back(const TensorView& host, const TensorView& t);
  /// `bytes` of memory this backend's gather and attend write and read (throws KVRET_ERR_OUT_OF_MEMORY).
  virtual std::unique_ptr<DeviceBuffer> allocate(size_t bytes);
  /// Bytes the device reads from host memory when gather serves `rows` rows of `row_bytes` (keys and values) from
  /// the store (0 on the CPU backend).
  virtual int64_t bytes_to_device(int64_t rows, size_t row_bytes) const noexcept {
    (void)rows;
    (void)row_bytes;
    return 0;
  }
  /// gather_working_set's contract: sink + selected + local rows of `store` into `out`, the row sources first.
  virtual int64_t gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                         int64_t count, const WorkingSetViews& out, int n_threads,
                         const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence,
                         int32_t layer, int64_t* served_by_sources, kvret_stream stream) = 0;
  /// The block cache of a backend that keeps one (the CUDA backend; the CPU backend reads host memory and keeps
  /// none, so these do nothing there). Caches are per (sequence, layer), keyed by the `sequence` pointer gather
  /// receives; gather serves the rows the cache holds and then admits blocks. Where counts_fetches_on_device, the
  /// rows a cache served and the bytes loaded into it are counted on the device (device_fetch_counts reads them),
  /// not in *served_by_sources, so that a gather needs no host wait.
  virtual bool counts_fetches_on_device() const noexcept { return false; }
  ///
  /// prefetch: admits the blocks that the `count` ascending selected middle positions per head touch (the update's
  /// rule), ordered on `stream`. Never throws for want of device memory (the layer then has no cache).
  virtual void prefetch(const HostKvStore& store, const int32_t* const* selected, int64_t count, const void* sequence,
                        int32_t layer, kvret_stream stream) {
    (void)store;
    (void)selected;
    (void)count;
    (void)sequence;
    (void)layer;
    (void)stream;
  }
  /// Forgets the cached blocks of `sequence`'s `layer` (-1: every layer) that hold a position >= `from` (0: all),
  /// after its stored rows changed there (truncate) or moved (drop_front). Never throws.
  virtual void drop_cached(const void* sequence, int32_t layer, int64_t from) noexcept {
    (void)sequence;
    (void)layer;
    (void)from;
  }
  /// Frees every cache of `sequence` (it is closing). Never throws.
  virtual void release_caches(const void* sequence) noexcept { (void)sequence; }
  /// What the caches of `sequence` did: bytes copied into them since the last call (reset by it), and the device
  /// bytes they hold now.
  struct CacheUse {
    int64_t loaded_bytes = 0;
    int64_t held_bytes = 0;
  };
  virtual CacheUse take_cache_use(const void* sequence) noexcept {
    (void)sequence;
    return {};
  }
  /// gather from positions in this backend's device memory (kvret_seq_attend's select writes them there), with
  /// the block cache's update, ordered on `stream` and without a host wait: `selected` is [n_kv_heads, stride]
  /// device memory holding `count` ascending middle positions per head (produced by select_on_device, so not
  /// checked again), `out` the backend's memory. The rows the cache served and the bytes it loaded are counted on
  /// the device; device_fetch_counts reads them. Returns the rows written per head, or -1 (nothing enqueued) where
  /// it cannot (the default: never): the caller then gathers from host positions.
  virtual int64_t gather_device_selected(const HostKvStore& store, int64_t mid_begin, int64_t mid_end,
                                         const int32_t* selected, int64_t stride, int64_t count,
                                         const WorkingSetViews& out, const void* sequence, int32_t layer, int n_threads,
                                         kvret_stream stream) {
    (void)store;
    (void)mid_begin;
    (void)mid_end;
    (void)selected;
    (void)stride;
    (void)count;
    (void)out;
    (void)sequence;
    (void)layer;
    (void)n_threads;
    (void)stream;
    return -1;
  }
  /// What the gathers (gather, gather_batch, gather_device_selected) and prefetches of `sequence` counted on the
  /// device since it opened: the rows its block caches served, and the stats.bytes_h2d those gathers moved beyond the
  /// bytes_to_device of every row they wrote (the blocks loaded, less the bytes of the rows the caches served). Waits
  /// for the work enqueued before it. All zero when there were none, or when the counts cannot be read (a device
  /// error).
  struct DeviceFetchCounts {
    int64_t cache_hits = 0;
    int64_t bytes_h2d = 0;
  };
  virtual DeviceFetchCounts device_fetch_counts(const void* sequence) noexcept {
    (void)sequence;
    return {};
  }
  /// What this process's CUDA backends did so far, for tests and the step budget (docs/cuda_backend.md): host waits
  /// (copies the host waits for, stream and device synchronizations, device reductions read back by the host),
  /// passes (kernels and Thrust algorithms launched, gathers included), allocations (requests that reached the
  /// driver's allocator: cudaMalloc, cudaMallocAsync, cudaHostAlloc), uploads (tables built on the host and the
  /// host index's new rows, copied to the device through pinned staging), pageable copies (copies from host
  /// memory kvret did not pin, not staged) and page lookups (KV pages whose device address was looked up). All zero
  /// on a backend without a device.
  struct DeviceCounts {
    int64_t host_waits = 0;
    int64_t passes = 0;
    int64_t allocations = 0;
    int64_t pageable_copies = 0;
    int64_t uploads = 0;
    int64_t page_lookups = 0;
  };
  virtual DeviceCounts device_counts() const noexcept { return {}; }
  /// For tests: the host waits of this process's CUDA backends so far (copies the host waits for, stream and device
  /// synchronizations, device reductions read back by the host); 0 on a backend without a device.
  virtual int64_t host_waits() const noexcept { return 0; }
  /// For tests: the working-set gather passes (kernel launches over the rows of working sets) this process's CUDA
  /// backends have launched so far; 0 on a backend without a device.
  virtual int64_t gather_passes() const noexcept { return 0; }
  /// gather for each of the `n` jobs (sequences): the same rows, bytes and counts as one gather per job, ordered on
  /// `stream`. The default runs one gather per job, in order; a backend may fuse them (one launch for the batch).
  /// On a throw, what the jobs' working sets hold is unspecified (every job may have been written, or none).
  virtual void gather_batch(GatherJob* jobs, size_t n, int n_threads, kvret_stream stream);
  /// Whether select_on_device may run a select of `retriever` with these tensors (a cheap check of their kinds and
  /// memory; the default: never). When it is false the caller selects on the host.
  virtual bool selects_on_device(const Retriever& retriever, const TensorView& q, const TensorView& out,
                                 const TensorView* scores) const {
    (void)retriever;
    (void)q;
    (void)out;
    (void)scores;
    return false;
  }
  /// Runs the select on the device, ordered on `stream`: the positions (ascending per head) and the scores written
  /// into the job's tensors, request.budget per head, as the retriever's select would write them. Returns false,
  /// having written nothing, where it cannot (e.g. its copy of the index would pass config.device_bytes_limit):
  /// the caller then selects on the host. Throws KVRET_ERR_NONFINITE (nothing written) for a non-finite q under
  /// check_finite.
  virtual bool select_on_device(const DeviceSelectJob& job, kvret_stream stream) {
    (void)job;
    (void)stream;
    return false;
  }
  /// select_on_device for each of the `n` jobs (of distinct sequences), ordered on `stream`: done[i] set to what
  /// select_on_device(*jobs[i]) would return, with the same outputs. The default runs one select per job; a backend
  /// may fuse them (one set of passes for the jobs of a kind and budget). Throws as select_on_device; jobs may then
  /// have been written.
  virtual void select_batch_on_device(const DeviceSelectJob* const* jobs, size_t n, bool* done, kvret_stream stream) {
    for (size_t i = 0; i < n; ++i) done[i] = select_on_device(*jobs[i], stream);
  }
  /// For tests: the passes (kernel launches, Thrust algorithms) this process's CUDA backends have run so far; 0 on
  /// a backend without a device.
  virtual int64_t device_passes() const noexcept { return 0; }
  /// Quantized attention on the device, ordered on `stream`: out written as attend_dense writes it, and
  /// *key_rows set to its return. Returns false, having written nothing, where it cannot (the default: never; q or
  /// out not in device memory, no room for the index's device copy): the caller then attends on the host.
  virtual bool attend_quantized_on_device(const QuantAttendJob& job, int64_t* key_rows, kvret_stream stream) {
    (void)job;
    (void)key_rows;
    (void)stream;
    return false;
  }
  /// Where CLUSTER's segments are clustered when not on the CPU (the CUDA backend's device; the default: none, the
  /// CPU builds). The context's CLUSTER retrievers then build through it (with_cluster_builder).
  virtual std::shared_ptr<const ClusterSegmentBuilder> cluster_builder() const { return nullptr; }
  /// Bytes copied into the device copies of CLUSTER indexes (select_on_device's) since the backend was made.
  virtual int64_t cluster_upload_bytes() const noexcept { return 0; }
  /// attend's contract (core/attention.hpp), ordered on `stream`.
  virtual void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                      int64_t rows, float scale, const TensorView& out, int n_threads, kvret_stream stream) = 0;
};

/// Host pages, the OpenMP gather and the reference attention.
class CpuBackend : public Backend {
 public:
  const char* name() const noexcept override { return "cpu"; }
  PageAllocator& pages() noexcept override { return host_page_allocator(); }
  /// Host memory: KVRET_DEVICE_CPU and pinned KVRET_DEVICE_CUDA_HOST.
  void check_access(const TensorView& t) const override;
  void check_stream(kvret_stream) const override {}
  void synchronize(kvret_stream) override {}
  int64_t gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                 int64_t count, const WorkingSetViews& out, int n_threads,
                 const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence, int32_t layer,
                 int64_t* served_by_sources, kvret_stream stream) override;
  void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
              float scale, const TensorView& out, int n_threads, kvret_stream stream) override;
};

/// The backend of config.device_type: the CPU backend; the CUDA backend (KVRET_ERR_CUDA when no CUDA device can be
/// used); KVRET_ERR_UNSUPPORTED for a device this build lacks.
std::unique_ptr<Backend> make_backend(const kvret_config& config);

/// The CUDA backend of this build: "cuda" (built with nvcc), "thrust-omp" (Thrust's OpenMP host system, no GPU
/// needed), or nullptr (none).
const char* cuda_backend_system() noexcept;

}  // namespace kvret
