// The CUDA backend (see cuda_backend.hpp). One source, two device systems: nvcc builds it on Thrust's CUDA system;
// KVRET_THRUST_OMP builds it with the host compiler on Thrust's OpenMP system, where the same algorithms run on the
// CPU and "device" memory is host memory.
#include <thrust/binary_search.h>
#include <thrust/copy.h>
#include <thrust/count.h>
#include <thrust/device_free.h>
#include <thrust/device_malloc.h>
#include <thrust/execution_policy.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/iterator/zip_iterator.h>
#include <thrust/scan.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/system_error.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/block_cache_ops.hpp"
#include "backend/cluster_build_ops.hpp"
#include "backend/cluster_select_ops.hpp"
#include "backend/cuda_arch.hpp"
#include "backend/cuda_backend.hpp"
#include "backend/device_math.hpp"
#include "backend/exact_select_ops.hpp"
#include "backend/kvcrush_select_ops.hpp"
#include "backend/page_select_ops.hpp"
#include "backend/pq_select_ops.hpp"
#include "backend/quant_attend_ops.hpp"
#include "backend/quant_select_ops.hpp"
#include "core/attention.hpp"
#include "core/error.hpp"
#include "core/tensor_view.hpp"
#include "fetch/working_set.hpp"
#include "index/cluster_retriever.hpp"
#include "index/exact_retriever.hpp"
#include "index/kmeans.hpp"
#include "index/page_retriever.hpp"
#include "index/pq_retriever.hpp"
#include "index/quant_retriever.hpp"
#include "store/host_kv_store.hpp"

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cuda_runtime_api.h>

#include "decode_attention.h"  // kernels/: the tuned attention
#include "store/host_kv_store.hpp"
#include "topk_select.h"         // kernels/: the tuned top-k
#include "working_set_gather.h"  // kernels/: the tuned gather
#define KVRET_ON_GPU 1
#else
#define KVRET_ON_GPU 0
#endif
#include "backend/device_memory.hpp"  // after KVRET_ON_GPU
#include "backend/page_tables.hpp"

namespace kvret {

namespace {

namespace dm = device_math;
using namespace device_runtime;  // NOLINT: the runtime below the passes (device_memory.hpp)

/// KV pages the device reads in place: pinned, mapped host memory (host memory on Thrust's host system).
class PinnedPages final : public PageAllocator {
 public:
  std::byte* allocate(size_t bytes) noexcept override {
#if KVRET_ON_GPU
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;  // the store reports KVRET_ERR_OUT_OF_MEMORY and keeps what it held
    }
    note_allocation();
    return static_cast<std::byte*>(p);
#else
    note_allocation();
    return host_page_allocator().allocate(bytes);
#endif
  }
  void deallocate(std::byte* p, size_t bytes) noexcept override {
#if KVRET_ON_GPU
    (void)bytes;
    (void)cudaFreeHost(p);
#else
    host_page_allocator().deallocate(p, bytes);
#endif
  }
};

/// The key of a store's page table (PageTables): its (sequence, layer), or the store itself for a call without a
/// sequence.
const void* page_key(const void* sequence, const HostKvStore& store) noexcept {
  return sequence != nullptr ? sequence : &store;
}

/// The device memory a context keeps between calls, against config.device_bytes_limit (0: unlimited).
class DeviceBudget {
 public:
  explicit DeviceBudget(int64_t limit) : limit_(limit) {}
  /// Counts `bytes` more; KVRET_ERR_CAPACITY (nothing counted) when that would pass the limit.
  void take(size_t bytes) {
    const auto b = static_cast<int64_t>(bytes);
    int64_t held = held_.load();
    do {
      require(limit_ == 0 || b <= limit_ - held, KVRET_ERR_CAPACITY,
              "device memory is full: " + std::to_string(held) + " of " + std::to_string(limit_) +
                  " bytes (config.device_bytes_limit) held, the call needs " + std::to_string(b) + " more");
    } while (!held_.compare_exchange_weak(held, held + b));
  }
  void give(size_t bytes) noexcept { held_ -= static_cast<int64_t>(bytes); }

 private:
  int64_t limit_;
  std::atomic<int64_t> held_{0};
};

/// Device memory for kvret's own tensors, counted in the context's budget while it lives.
class ThrustBuffer final : public DeviceBuffer {
 public:
  ThrustBuffer(size_t bytes, kvret_device device, DeviceBudget& budget)
      : taken_(bytes, budget), data_(bytes), device_(device) {}
  std::byte* data() const noexcept override { return data_.get(); }
  size_t bytes() const noexcept override { return data_.size(); }
  kvret_device device() const noexcept override { return device_; }

 private:
  struct Taken {  // first member: counted before the allocation, given back after it is freed
    Taken(size_t b, DeviceBudget& budget) : bytes(b), owner(budget) { owner.take(bytes); }
    ~Taken() { owner.give(bytes); }
    Taken(const Taken&) = delete;
    Taken& operator=(const Taken&) = delete;
    size_t bytes;
    DeviceBudget& owner;
  };
  Taken taken_;
  DeviceArray<std::byte> data_;
  kvret_device device_;
};

/// `bytes` of a context's budget, taken while it lives (KVRET_ERR_CAPACITY, nothing taken, when they do not fit).
class BudgetShare {
 public:
  BudgetShare(size_t bytes, DeviceBudget& budget) : bytes_(bytes), owner_(budget) { owner_.take(bytes_); }
  ~BudgetShare() { owner_.give(bytes_); }
  BudgetShare(const BudgetShare&) = delete;
  BudgetShare& operator=(const BudgetShare&) = delete;
  size_t bytes() const noexcept { return bytes_; }

 private:
  size_t bytes_;
  DeviceBudget& owner_;
};

/// The most rows each device window (the sink, the local rows) of a (sequence, layer) holds per KV head.
constexpr int32_t kWindowRows = 4096;

/// The block cache of one (sequence, layer): per KV head n_slots slots of block_tokens rows, keys and values, the
/// table from blocks to slots (grown with the layer), and the device windows: the sink rows and the most recent
/// rows (cuda::WindowRows), refreshed before each gather. Its device memory counts in the context's budget.
class LayerCache {
 public:
  /// Throws KVRET_ERR_CAPACITY (over config.device_bytes_limit) or std::bad_alloc (the device is full).
  LayerCache(int heads, int32_t n_slots, int32_t block_tokens, size_t row_bytes, int32_t sink_rows, int32_t local_rows,
             DeviceBudget& budget, kvret_stream stream, int n_threads)
      : heads_(heads),
        n_slots_(n_slots),
        block_tokens_(block_tokens),
        row_bytes_(static_cast<int64_t>(row_bytes)),
        share_(
            slot_bytes(heads, n_slots, block_tokens, row_bytes) + window_bytes(heads, sink_rows, local_rows, row_bytes),
            budget),
        k_(static_cast<size_t>(heads) * n_slots * block_tokens * row_bytes),
        v_(k_.size()),
        slot_block_(static_cast<size_t>(heads) * n_slots),
        stamp_(slot_block_.size()),
        prefetched_(slot_block_.size()),
        window_k_(window_bytes(heads, sink_rows, local_rows, row_bytes) / 2),
        window_v_(window_k_.size()),
        budget_(budget) {
    window_.sink_slots = sink_rows;
    window_.local_slots = local_rows;
    for_each_index(stream, n_threads, static_cast<int64_t>(slot_block_.size()),
                   dm::ClearSlots{slot_block_.get(), stamp_.get(), prefetched_.get()});
  }
  /// The device bytes of the slots (rows and their bookkeeping).
  static size_t slot_bytes(int heads, int32_t n_slots, int32_t block_tokens, size_t row_bytes) {
    const size_t slots = static_cast<size_t>(heads) * static_cast<size_t>(n_slots);
    return 2 * slots * static_cast<size_t>(block_tokens) * row_bytes +
           slots * (sizeof(int32_t) + sizeof(uint32_t) + sizeof(uint8_t));
  }
  /// The device bytes of the windows (keys and values).
  static size_t window_bytes(int heads, int32_t sink_rows, int32_t local_rows, size_t row_bytes) {
    return 2 * static_cast<size_t>(heads) * (static_cast<size_t>(sink_rows) + static_cast<size_t>(local_rows)) *
           row_bytes;
  }
  /// Loads into the windows, on `stream`, the rows of a layer of `store.size()` tokens they are to hold and do not
  /// (cuda::math::window_refresh); returns the bytes copied.
  int64_t refresh_windows(const HostKvStore& store, const std::byte* const* pages, kvret_stream stream, int n_threads) {
    const cuda::math::WindowRefresh r = cuda::math::window_refresh(window_, store.size());
    const int64_t n = (r.sink_to - r.sink_from) + (r.local_to - r.local_from);
    if (n > 0) {
      for (const auto& [from, to] : {std::pair{r.sink_from, r.sink_to}, std::pair{r.local_from, r.local_to}}) {
        if (to > from)
          for_each_index(
              stream, n_threads, heads_ * (to - from) * store.head_dim(),
              dm::FillWindow{window_k_.get(), window_v_.get(), r.next, pages, heads_, HostKvStore::kPageTokens,
                             row_bytes_, from, to - from, static_cast<int32_t>(store.dtype()), store.head_dim()});
      }
    }
    window_ = r.next;  // the page table is freed in stream order after the loads
    return 2 * heads_ * n * row_bytes_;
  }
  /// After the rows at or past `from` changed: the windows hold none of them (the cached blocks: DropFrom).
  void drop_windows_from(int64_t from) noexcept { window_ = cuda::math::window_drop_from(window_, from); }
  int64_t bytes() const noexcept {
    return static_cast<int64_t>(share_.bytes() + (table_share_ ? table_share_->bytes() : 0));
  }
  /// Grows the table to cover `blocks` blocks (at least doubling). When the budget or the device refuses, the
  /// table stays as it was: blocks past it are neither looked up nor admitted.
  void cover(int64_t blocks, kvret_stream stream, int n_threads) {
    if (blocks <= max_blocks_) return;
    const int64_t grown = std::min<int64_t>(std::max<int64_t>({blocks, 2 * int64_t{max_blocks_}, 64}), INT32_MAX);
    const size_t entries = static_cast<size_t>(heads_) * static_cast<size_t>(grown);
    try {
      auto share = std::make_unique<BudgetShare>(entries * sizeof(int32_t), budget_);
      auto table = std::make_unique<DeviceArray<int32_t>>(entries);
      for_each_index(
          stream, n_threads, static_cast<int64_t>(entries),
          dm::GrowTable{table_ ? table_->get() : nullptr, max_blocks_, static_cast<int32_t>(grown), table->get()});
      table_ = std::move(table);  // the old table is freed after the copy (cudaFree waits for the device)
      table_share_ = std::move(share);
      max_blocks_ = static_cast<int32_t>(grown);
    } catch (const std::bad_alloc&) {
    } catch (const Error& e) {
      if (e.status() != KVRET_ERR_CAPACITY) throw;
    }
  }
  dm::CacheView view() const noexcept {
    dm::CacheView c;
    c.table = table_ ? table_->get() : nullptr;
    c.slot_block = slot_block_.get();
    c.stamp = stamp_.get();
    c.prefetched = prefetched_.get();
    c.k = k_.get();
    c.v = v_.get();
    c.max_blocks = table_ ? max_blocks_ : 0;
    c.n_slots = n_slots_;
    c.block_tokens = block_tokens_;
    c.row_bytes = row_bytes_;
    if (window_.sink_slots + window_.local_slots > 0) {
      c.window_k = window_k_.get();
      c.window_v = window_v_.get();
      c.window = window_;
    }
    return c;
  }
  int heads() const noexcept { return heads_; }
  /// The clock of updates and prefetches (the LRU stamp of the blocks they use), from 1.
  uint32_t tick() noexcept { return ++step_; }

 private:
  int heads_;
  int32_t n_slots_;
  int32_t block_tokens_;
  int64_t row_bytes_;
  BudgetShare share_;  // before the arrays: counted before they are allocated, given back after they are freed
  DeviceArray<std::byte> k_, v_;
  DeviceArray<int32_t> slot_block_;
  DeviceArray<uint32_t> stamp_;
  DeviceArray<uint8_t> prefetched_;
  DeviceArray<std::byte> window_k_, window_v_;
  cuda::WindowRows window_;
  DeviceBudget& budget_;
  std::unique_ptr<BudgetShare> table_share_;
  std::unique_ptr<DeviceArray<int32_t>> table_;
  int32_t max_blocks_ = 0;
  uint32_t step_ = 0;
};

/// The device copy of one (sequence, layer)'s KVCrush signatures: rows [0, tokens) of `words` words, equal to the
/// layer's of `epoch` (KvCrushLayer::epoch), in room for `capacity` rows; its device memory counts in the budget.
struct CrushMirror {
  std::unique_ptr<BudgetShare> share;  // before the array: counted before it is allocated, given back after
  std::unique_ptr<DeviceArray<uint64_t>> bits;
  uint64_t epoch = 0;
  int64_t tokens = 0, capacity = 0;
  int32_t words = 0;
  int64_t bytes() const noexcept { return share ? static_cast<int64_t>(share->bytes()) : 0; }
};

/// The sizes of a CLUSTER mirror's arrays per KV head: clusters, ids and exact singletons (rows of d elements for
/// the centroids and the singletons' keys).
struct ClusterCounts {
  int64_t heads = 0, clusters = 0, ids = 0, exacts = 0;
  int32_t d = 0;
  ClusterCounts() = default;
  explicit ClusterCounts(const ClusterRetriever& c)
      : heads(c.n_kv_heads()),
        clusters(c.clusters()),
        ids(c.sorted_ids(0).size()),
        exacts(c.exacts()),
        d(c.head_dim()) {}
  bool fits(const ClusterCounts& n) const { return n.clusters <= clusters && n.ids <= ids && n.exacts <= exacts; }
  /// The bytes of arrays of these sizes for every head (4-byte elements).
  size_t bytes() const {
    return static_cast<size_t>(heads * (clusters * d + clusters + (clusters + 1) + ids + exacts + exacts * d)) * 4;
  }
};

/// What a PQ mirror holds (pq_layout's arrays): capacities and the items sent.
struct PqMirror {
  int64_t token_capacity = 0, exact_capacity = 0;  // per head
  int64_t tokens = 0;                              // the items sent, per head
  uint64_t layout_version = 0;                     // the index's layout_version() they belong to
  std::vector<int64_t> exacts;                     // per head: the exact keys sent
};

/// The device mirror of one (sequence, layer)'s index, equal to the retriever's of `version`; its device memory
/// counts in the budget. PAGE: per KV head `capacity` pages of [min, max] f32 rows, the first `pages` of them the
/// bounds. CLUSTER: the clusters' arrays side by side (cluster_layout), each head's part `room` elements long, the
/// first of them the retriever's segments `held` (stamp and segment). PQ: pq_layout's arrays, sized by `pq`.
struct IndexMirror {
  std::unique_ptr<BudgetShare> share;  // before the array: counted before it is allocated, given back after
  std::unique_ptr<DeviceArray<std::byte>> data;
  const void* retriever = nullptr;
  uint64_t version = 0;
  int64_t capacity = 0;
  ClusterCounts room;
  std::vector<std::pair<uint64_t, ClusterRetriever::Segment>> held;
  PqMirror pq;
  int64_t bytes() const noexcept { return share ? static_cast<int64_t>(share->bytes()) : 0; }
  float* bounds() const noexcept { return reinterpret_cast<float*>(data->get()); }
};

/// The CLUSTER mirror's arrays at `base` (4-byte elements; each array `room` long per head, in ClusterCounts'
/// order) holding `n`, the pending tail not set.
dm::ClusterLayout cluster_layout(std::byte* base, const ClusterCounts& n, const ClusterCounts& room) {
  dm::ClusterLayout l{};
  auto* f = reinterpret_cast<float*>(base);
  const int64_t h = room.heads;
  l.centroids = f;
  auto* i = reinterpret_cast<int32_t*>(f + h * room.clusters * room.d);
  l.sizes = i;
  l.offsets = i + h * room.clusters;
  l.ids = l.offsets + h * (room.clusters + 1);
  l.exact_pos = l.ids + h * room.ids;
  l.exact_keys = reinterpret_cast<const float*>(l.exact_pos + h * room.exacts);
  l.clusters = n.clusters;
  l.ids_per_head = n.ids;
  l.exacts = n.exacts;
  l.cluster_stride = room.clusters;
  l.id_stride = room.ids;
  l.exact_stride = room.exacts;
  l.d = n.d;
  return l;
}

/// The PQ mirror's arrays at `base` (4-byte elements: codebook, counts, exact counts, items, exact keys; then the
/// codes, bytes, on the per-token path), for capacities of `tokens` tokens and `exacts` exact keys per head; tokens
/// and max_exact not set.
dm::PqLayout pq_layout(std::byte* base, const PqRetriever& pq, int64_t tokens, int64_t exacts) {
  dm::PqLayout l{};
  const int64_t heads = pq.n_kv_heads();
  l.m = pq.m();
  l.k = pq.k();
  l.dsub = pq.sub_dim();
  l.d = pq.head_dim();
  l.cells = pq.n_cells();
  l.capacity = tokens;
  l.exact_capacity = exacts;
  auto* f = reinterpret_cast<float*>(base);
  l.codebook = f;
  auto* i = reinterpret_cast<int32_t*>(f + heads * l.m * l.k * l.dsub);
  l.counts = i;
  l.n_exact = i + heads * l.cells;
  l.items = l.n_exact + heads;
  l.exact_keys = reinterpret_cast<const float*>(l.items + heads * tokens);
  l.codes = reinterpret_cast<const uint8_t*>(l.exact_keys + heads * exacts * l.d);
  return l;
}

size_t pq_mirror_bytes(const PqRetriever& pq, int64_t tokens, int64_t exacts) {
  const int64_t heads = pq.n_kv_heads();
  return static_cast<size_t>(
             heads * (int64_t{pq.m()} * pq.k() * pq.sub_dim() + pq.n_cells() + 1 + tokens + exacts * pq.head_dim())) *
             4 +
         (pq.scores_cells() ? 0 : static_cast<size_t>(heads * tokens * pq.m()));
}

dm::DeviceTensor device_tensor(const TensorView& t) {
  dm::DeviceTensor d;
  d.base = t.data();
  d.type = static_cast<int32_t>(t.dtype());
  for (int i = 0; i < t.ndim() && i < 3; ++i) d.stride[i] = t.stride(i);
  return d;
}

/// CLUSTER's segment build on the device (cluster_build_ops.hpp): cluster_segment_index's result, bit for bit,
/// from Thrust passes over device arrays; the keys go up once and the layout comes back (the host retriever keeps
/// the index). The assignment is a reference pass (one dot8 per entry), not cuBLAS: a tuned SGEMM sums in another
/// order and could change which cluster wins. Its passes run on a non-blocking stream of its own, so that a build
/// on the context's build thread neither waits for nor holds up the caller's decode work; the result comes back to
/// the host, which hands it to the layer's index (a select on the layer waits for the build there, and then copies
/// what changed into the device's mirror on the caller's stream).
class CudaClusterBuilder final : public ClusterSegmentBuilder {
 public:
  explicit CudaClusterBuilder(int device_id) : device_id_(device_id) {}

  ClusterSegmentIndex build(const ClusterSegmentJob& job) const override {
    DeviceScope scope(device_id_);
    ClusterSegmentIndex out;
    CosineKmeansResult& r = out.kmeans;
    const int64_t n = job.n;
    const int32_t d = job.d;
    const int32_t k = std::max(1, job.k);
    r.directions.assign(static_cast<size_t>(k) * d, 0.0f);
    out.centroids.assign(static_cast<size_t>(k) * d, 0.0f);
    out.sizes.assign(static_cast<size_t>(k), 0);
    if (n <= 0) return out;
    const auto nd = static_cast<size_t>(n) * d;
    const OwnStream stream;  // before the arrays: destroyed after them
    const kvret_stream s = stream.get();
    const int threads = 0;
    const auto up = [&](void* dst, const void* src, size_t bytes) {
      if (bytes > 0) upload(dst, src, bytes, s);
    };
    const auto down = [&](void* dst, const void* src, size_t bytes) {
      if (bytes > 0) copy_bytes(dst, src, bytes, s, true);
    };
    const auto iota = [&](int64_t* p, int64_t count) {
      with_policy(s, threads, count, [&](const auto& policy) { thrust::sequence(policy, p, p + count); });
    };
    // lower bounds of 0..k in sorted keys [count]: offsets [k + 1]
    const auto bounds = [&](const int32_t* sorted, int64_t count, int64_t* offsets) {
      with_policy(s, threads, count, [&](const auto& policy) {
        thrust::lower_bound(policy, sorted, sorted + count, thrust::counting_iterator<int32_t>(0),
                            thrust::counting_iterator<int32_t>(k + 1), offsets);
      });
    };

    const DeviceArray<float> keys(nd, s), unit(nd, s);
    up(keys.get(), job.keys, nd * sizeof(float));
    for_each_index(s, threads, n, dm::KmUnitRows{keys.get(), unit.get(), d});

    // the training points and the seeds, drawn on the host as the CPU draws them
    const std::vector<int64_t> sample = cosine_kmeans_sample(n, k, job.seed, job.sample);
    const int64_t m = sample.empty() ? n : static_cast<int64_t>(sample.size());
    r.trained = m;
    std::unique_ptr<DeviceArray<float>> drawn;
    if (m < n) {
      drawn = std::make_unique<DeviceArray<float>>(static_cast<size_t>(m) * d, s);
      const DeviceArray<int64_t> index(static_cast<size_t>(m), s);
      up(index.get(), sample.data(), sample.size() * sizeof(int64_t));
      for_each_index(s, threads, m, dm::KmGatherRows{unit.get(), index.get(), drawn->get(), d});
    }
    const float* train = m < n ? drawn->get() : unit.get();
    const DeviceArray<float> directions(static_cast<size_t>(k) * d, s);
    {
      const std::vector<int64_t> seeds = forgy_indices(m, k, job.seed);
      const DeviceArray<int64_t> index(seeds.size(), s);
      up(index.get(), seeds.data(), seeds.size() * sizeof(int64_t));
      for_each_index(s, threads, k, dm::KmGatherRows{train, index.get(), directions.get(), d});
    }

    const DeviceArray<float> score(static_cast<size_t>(std::max(m, n)) * k, s), cosine(static_cast<size_t>(n), s);
    const DeviceArray<int32_t> labels(static_cast<size_t>(n), s), changed(static_cast<size_t>(n), s),
        sorted(static_cast<size_t>(n), s);
    const DeviceArray<int64_t> order(static_cast<size_t>(n), s), lowest(static_cast<size_t>(m), s);
    const DeviceArray<int64_t> offsets(static_cast<size_t>(k) + 1, s), empty_rank(static_cast<size_t>(k), s);
    const DeviceArray<double> sums(static_cast<size_t>(k) * d, s), objective(1, s);
    const auto assign = [&](const float* x, int64_t count) {
      with_policy(s, threads, count, [&](const auto& policy) { thrust::fill_n(policy, labels.get(), count, -1); });
      for_each_index(s, threads, count * k, dm::KmCosineGemm{x, directions.get(), score.get(), k, d});
      for_each_index(s, threads, count, dm::KmArgmax{score.get(), labels.get(), cosine.get(), changed.get(), k});
    };
    with_policy(s, threads, m, [&](const auto& policy) { thrust::fill_n(policy, labels.get(), m, -1); });
    const int iters = std::max(1, job.max_iters);
    std::vector<int64_t> host_offsets(static_cast<size_t>(k) + 1), host_rank(static_cast<size_t>(k));
    for (int it = 0; it < iters; ++it) {
      for_each_index(s, threads, m * k, dm::KmCosineGemm{train, directions.get(), score.get(), k, d});
      for_each_index(s, threads, m, dm::KmArgmax{score.get(), labels.get(), cosine.get(), changed.get(), k});
      for_each_index(s, threads, 1, dm::KmObjective{cosine.get(), m, objective.get()});
      double value = 0;
      down(&value, objective.get(), sizeof(double));
      r.objective.push_back(value);
      r.iterations = it + 1;
      int64_t moved = 0;
      with_policy(s, threads, m, [&](const auto& policy) {
        moved = static_cast<int64_t>(thrust::count(policy, changed.get(), changed.get() + m, 1));
        note_wait();  // the count comes back to the host
      });
      if (moved == 0 || it + 1 == iters) break;  // settled, or the cap: directions stay the ones assigned to

      // each cluster's points in point order, their sums, the new directions
      with_policy(s, threads, m, [&](const auto& policy) { thrust::copy_n(policy, labels.get(), m, sorted.get()); });
      iota(order.get(), m);
      with_policy(s, threads, m, [&](const auto& policy) {
        thrust::stable_sort_by_key(policy, sorted.get(), sorted.get() + m, order.get());
      });
      bounds(sorted.get(), m, offsets.get());
      for_each_index(s, threads, static_cast<int64_t>(k) * d,
                     dm::KmClusterSums{train, order.get(), offsets.get(), sums.get(), d});
      down(host_offsets.data(), offsets.get(), host_offsets.size() * sizeof(int64_t));
      int64_t emptied = 0;
      for (int32_t j = 0; j < k; ++j) {
        host_rank[static_cast<size_t>(j)] = emptied;
        if (host_offsets[static_cast<size_t>(j) + 1] == host_offsets[static_cast<size_t>(j)]) ++emptied;
      }
      if (emptied > 0) {  // points by increasing cosine, ties to the earlier: where emptied clusters re-seed
        up(empty_rank.get(), host_rank.data(), host_rank.size() * sizeof(int64_t));
        const DeviceArray<float> by(static_cast<size_t>(m), s);
        with_policy(s, threads, m, [&](const auto& policy) { thrust::copy_n(policy, cosine.get(), m, by.get()); });
        iota(lowest.get(), m);
        with_policy(s, threads, m, [&](const auto& policy) {
          thrust::stable_sort_by_key(policy, by.get(), by.get() + m, lowest.get());
        });
      }
      for_each_index(
          s, threads, k,
          dm::KmDirections{sums.get(), offsets.get(), empty_rank.get(), lowest.get(), train, directions.get(), m, d});
    }
    if (m < n) assign(unit.get(), n);  // every key, once, to the max-cosine of the trained directions

    // the exact singletons: the lowest fits (ties: the earlier position)
    const int64_t e = std::min<int64_t>(std::max<int64_t>(job.exacts, 0), n);
    with_policy(s, threads, n, [&](const auto& policy) { thrust::copy_n(policy, labels.get(), n, sorted.get()); });
    if (e > 0) {
      const DeviceArray<float> fit(static_cast<size_t>(n), s);
      for_each_index(s, threads, n, dm::KmFit{keys.get(), directions.get(), labels.get(), fit.get(), d});
      iota(order.get(), n);
      with_policy(s, threads, n, [&](const auto& policy) {
        thrust::stable_sort_by_key(policy, fit.get(), fit.get() + n, order.get());
      });
      for_each_index(s, threads, e, dm::KmMarkExact{order.get(), sorted.get(), k});
    }
    // the layout: positions sorted stably by cluster (the singletons last, ascending), sizes, the raw means
    iota(order.get(), n);
    with_policy(s, threads, n, [&](const auto& policy) {
      thrust::stable_sort_by_key(policy, sorted.get(), sorted.get() + n, order.get());
    });
    bounds(sorted.get(), n, offsets.get());
    const DeviceArray<float> centroids(static_cast<size_t>(k) * d, s);
    for_each_index(s, threads, static_cast<int64_t>(k) * d,
                   dm::KmMeans{keys.get(), order.get(), offsets.get(), centroids.get(), d});

    r.labels.resize(static_cast<size_t>(n));
    down(r.labels.data(), labels.get(), static_cast<size_t>(n) * sizeof(int32_t));
    down(r.directions.data(), directions.get(), r.directions.size() * sizeof(float));
    down(out.centroids.data(), centroids.get(), out.centroids.size() * sizeof(float));
    down(host_offsets.data(), offsets.get(), host_offsets.size() * sizeof(int64_t));
    std::vector<int64_t> points(static_cast<size_t>(n));
    down(points.data(), order.get(), points.size() * sizeof(int64_t));
    for (int32_t j = 0; j < k; ++j)
      out.sizes[static_cast<size_t>(j)] =
          static_cast<int32_t>(host_offsets[static_cast<size_t>(j) + 1] - host_offsets[static_cast<size_t>(j)]);
    out.ids.resize(static_cast<size_t>(n - e));
    for (int64_t i = 0; i < n - e; ++i)
      out.ids[static_cast<size_t>(i)] = static_cast<int32_t>(job.begin + points[static_cast<size_t>(i)]);
    for (int64_t i = n - e; i < n; ++i) {
      const int64_t p = points[static_cast<size_t>(i)];
      out.exact_pos.push_back(static_cast<int32_t>(job.begin + p));
      out.exact_keys.insert(out.exact_keys.end(), job.keys + p * d, job.keys + (p + 1) * d);
    }
    return out;
  }

 private:
  int device_id_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const kvret_config& config)
      : device_id_(config.device_id),
        budget_(config.device_bytes_limit),
        block_tokens_(config.block_tokens),
        n_slots_(static_cast<int32_t>(
            std::min<int64_t>(config.cache_capacity_tokens / config.block_tokens, cuda::math::kBlockCacheSlots))),
        policy_(config.cache_policy),
        sink_rows_(std::min(config.n_sink, kWindowRows)),
        local_rows_(std::min(config.n_local, kWindowRows)) {
#if KVRET_ON_GPU
    int pageable = 0;
    if (cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device_id_) != cudaSuccess) {
      (void)cudaGetLastError();
      pageable = 0;
    }
    pageable_access_ = pageable != 0;
#endif
    Workspaces::get().backend_made();
  }
  ~CudaBackend() override { Workspaces::get().backend_gone(); }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const noexcept override { return "cuda"; }
  PageAllocator& pages() noexcept override { return pages_; }

  void check_access(const TensorView& t) const override {
    const kvret_device d = t.device();
    if (d.device_type == KVRET_DEVICE_CUDA_HOST) {
#if KVRET_ON_GPU
      check_memory(t);
#endif
      return;
    }
    require(d.device_type == KVRET_DEVICE_CUDA, KVRET_ERR_DEVICE,
            t.name() + ": device type " + std::to_string(d.device_type) +
                " is not reachable by the CUDA backend (use memory of CUDA device " + std::to_string(device_id_) +
                ", KVRET_DEVICE_CUDA, or pinned host memory, KVRET_DEVICE_CUDA_HOST)");
    require(d.device_id == device_id_, KVRET_ERR_DEVICE,
            t.name() + ": is on CUDA device " + std::to_string(d.device_id) + "; the context uses device " +
                std::to_string(device_id_) + " (config.device_id)");
#if KVRET_ON_GPU
    check_memory(t);
#endif
  }
#if KVRET_ON_GPU
  /// The driver's view of t's memory (cudaMemoryTypeUnregistered for pageable host memory).
  static cudaPointerAttributes attributes(const TensorView& t) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, t.data()) != cudaSuccess) {
      (void)cudaGetLastError();
      a.type = cudaMemoryTypeUnregistered;
    }
    return a;
  }
  /// The label against the memory itself: the host reads memory labelled KVRET_DEVICE_CUDA_HOST directly, so device
  /// memory under that label would make it fault; and another GPU's memory is refused whatever its label.
  void check_memory(const TensorView& t) const {
    if (t.data() == nullptr || t.extent_bytes() == 0) return;
    const cudaPointerAttributes a = attributes(t);
    require(t.device().device_type != KVRET_DEVICE_CUDA_HOST || a.type != cudaMemoryTypeDevice, KVRET_ERR_DEVICE,
            t.name() + ": is labelled KVRET_DEVICE_CUDA_HOST but is device memory (label it KVRET_DEVICE_CUDA)");
    require(a.type != cudaMemoryTypeDevice || a.device == device_id_, KVRET_ERR_DEVICE,
            t.name() + ": is memory of CUDA device " + std::to_string(a.device) + "; the context uses device " +
                std::to_string(device_id_) + " (config.device_id)");
  }
  /// Memory a kernel reads or writes (the working set, attention's inputs and output): pageable host memory, where
  /// the GPU has no pageable memory access, would make the kernel fault, and a fault on the device ends every later
  /// call of the process. (Calls that read or write a tensor on the host copy it with cudaMemcpy, which reaches
  /// pageable memory too.)
  void check_kernel_access(const TensorView& t) const override {
    if (pageable_access_ || t.data() == nullptr || t.extent_bytes() == 0) return;
    require(attributes(t).type != cudaMemoryTypeUnregistered, KVRET_ERR_DEVICE,
            t.name() + ": is pageable host memory, which kernels on CUDA device " + std::to_string(device_id_) +
                " cannot reach; pass memory from cudaMalloc or cudaMallocManaged, or pinned memory (cudaHostAlloc, "
                "cudaHostRegister)");
  }
#endif
  void check_stream(kvret_stream) const override {}
  void synchronize(kvret_stream stream) override {
    note_wait();
#if KVRET_ON_GPU
    DeviceScope scope(device_id_);
    check_cuda(cudaStreamSynchronize(cuda_stream(stream)), "cudaStreamSynchronize");
#else
    (void)stream;
#endif
  }

  kvret_device host_memory() const noexcept override { return {KVRET_DEVICE_CUDA_HOST, 0}; }

  TensorView host_readable(const TensorView& t, std::vector<std::byte>& storage) override {
    if (t.device().device_type != KVRET_DEVICE_CUDA || t.data() == nullptr || t.extent_bytes() == 0) return t;
    DeviceScope scope(device_id_);
    storage.resize(t.extent_bytes());
    copy_bytes(storage.data(), t.data(), storage.size(), nullptr, true);
    return t.rebased(storage.data(), {KVRET_DEVICE_CPU, 0});
  }
  TensorView host_writable(const TensorView& t, std::vector<std::byte>& storage) override {
    return host_readable(t, storage);  // the copy keeps whatever lies between the elements the call writes
  }
  void write_back(const TensorView& host, const TensorView& t) override {
    if (host.data() == t.data()) return;
    DeviceScope scope(device_id_);
    note_pageable_copy();
    copy_bytes(t.data(), host.data(), t.extent_bytes(), nullptr, true);
  }
  bool counts_fetches_on_device() const noexcept override { return n_slots_ > 0; }
  int64_t bytes_to_device(int64_t rows, size_t row_bytes) const noexcept override {
    return 2 * rows * static_cast<int64_t>(row_bytes);  // the gather reads keys and values from mapped pages
  }
  std::unique_ptr<DeviceBuffer> allocate(size_t bytes) override {
    DeviceScope scope(device_id_);
    return std::make_unique<ThrustBuffer>(bytes, kvret_device{KVRET_DEVICE_CUDA, device_id_}, budget_);
  }

  int64_t gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                 int64_t count, const WorkingSetViews& out, int n_threads,
                 const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence, int32_t layer,
                 int64_t* served_by_sources, kvret_stream stream) override {
    DeviceScope scope(device_id_);
    if (!sources.empty()) {
      // Row sources write through host pointers: the working set is assembled in host copies of the outputs and
      // copied in whole.
      std::vector<std::byte> ks, vs, ps;
      const WorkingSetViews host{host_writable(out.k, ks), host_writable(out.v, vs), host_writable(out.positions, ps)};
      const int64_t rows = gather_working_set(store, mid_begin, mid_end, selected, count, host, n_threads, sources,
                                              sequence, layer, served_by_sources);
      write_back(host.k, out.k);
      write_back(host.v, out.v);
      write_back(host.positions, out.positions);
      return rows;
    }
    check_kernel_access(out.k);
    check_kernel_access(out.v);
    check_kernel_access(out.positions);
    if (served_by_sources != nullptr) *served_by_sources = 0;  // the cache's rows are counted on the device
    const int64_t rows = mid_begin + count + (store.size() - mid_end);
    int64_t* counters = counters_of(sequence, store, stream, n_threads);
    LayerCache* cache = gather_cache_of(store, sequence, layer, stream, n_threads);
    gather_rows(store, mid_begin, mid_end, selected, count, rows, out, n_threads, cache, counters, stream);
    if (cache != nullptr && count > 0)
      update(store, selected, count, sequence, layer, *cache, false, stream, n_threads);
    return rows;
  }

  /// The jobs without row sources gathered in one pass over one row list for the whole batch (each row from its
  /// job's cache or its store's pages, into its job's working set), then each job's cache update, in job order; the
  /// jobs with row sources through host copies, as gather does. One gather per job where fewer than two jobs go
  /// without sources, where a (sequence, layer) comes twice (the second reads what the first's update left) or
  /// where the stores differ in element type or shape.
  void gather_batch(GatherJob* jobs, size_t n, int n_threads, kvret_stream stream) override {
    std::vector<size_t> fused;
    std::vector<std::pair<const void*, int32_t>> keys;
    for (size_t i = 0; i < n; ++i) {
      const GatherJob& j = jobs[i];
      if (j.sources->empty()) fused.push_back(i);
      if (j.sequence != nullptr) keys.emplace_back(j.sequence, j.layer);
    }
    std::sort(keys.begin(), keys.end());
    bool fits = fused.size() >= 2 && std::adjacent_find(keys.begin(), keys.end()) == keys.end();
    for (const size_t i : fused) {
      const HostKvStore& a = *jobs[fused[0]].store;
      const HostKvStore& b = *jobs[i].store;
      fits = fits && a.dtype() == b.dtype() && a.head_dim() == b.head_dim() && a.n_kv_heads() == b.n_kv_heads() &&
             a.row_bytes() == b.row_bytes();
    }
    if (!fits) {
      Backend::gather_batch(jobs, n, n_threads, stream);
      return;
    }
    DeviceScope scope(device_id_);
    for (size_t i = 0; i < n; ++i) {  // the host-copy jobs, as gather does
      GatherJob& j = jobs[i];
      if (!j.sources->empty())
        j.rows = gather(*j.store, j.mid_begin, j.mid_end, j.selected, j.count, *j.out, n_threads, *j.sources,
                        j.sequence, j.layer, &j.served_by_sources, stream);
    }
    for (const size_t i : fused) {
      const WorkingSetViews& out = *jobs[i].out;
      check_kernel_access(out.k);
      check_kernel_access(out.v);
      check_kernel_access(out.positions);
    }
    std::vector<LayerCache*> caches(fused.size(), nullptr);
    std::vector<int64_t*> hit_counters(fused.size(), nullptr);
    for (size_t f = 0; f < fused.size(); ++f) {
      GatherJob& j = jobs[fused[f]];
      j.served_by_sources = 0;  // the caches' rows are counted on the device
      j.rows = j.mid_begin + j.count + (j.store->size() - j.mid_end);
      hit_counters[f] = counters_of(j.sequence, *j.store, stream, n_threads);
      caches[f] = gather_cache_of(*j.store, j.sequence, j.layer, stream, n_threads);
      if (caches[f] == nullptr) hit_counters[f] = nullptr;
    }
    gather_fused(jobs, fused, caches, hit_counters, n_threads, stream);
    for (size_t f = 0; f < fused.size(); ++f) {
      GatherJob& j = jobs[fused[f]];
      if (caches[f] != nullptr && j.count > 0)
        update(*j.store, j.selected, j.count, j.sequence, j.layer, *caches[f], false, stream, n_threads);
    }
  }

  void prefetch(const HostKvStore& store, const int32_t* const* selected, int64_t count, const void* sequence,
                int32_t layer, kvret_stream stream) override {
    DeviceScope scope(device_id_);
    LayerCache* cache = cache_of(store, sequence, layer, stream, 0);
    if (cache != nullptr && count > 0) update(store, selected, count, sequence, layer, *cache, true, stream, 0);
  }

  int64_t gather_device_selected(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* selected,
                                 int64_t stride, int64_t count, const WorkingSetViews& out, const void* sequence,
                                 int32_t layer, int n_threads, kvret_stream stream) override {
    if (sequence == nullptr || store.size() == 0) return -1;
    DeviceScope scope(device_id_);
    check_kernel_access(out.k);
    check_kernel_access(out.v);
    check_kernel_access(out.positions);
    int64_t* counters = fetch_counters(sequence, store.row_bytes(), stream, n_threads);
    const int heads = store.n_kv_heads();
    const int64_t rows = mid_begin + count + (store.size() - mid_end);
    const int64_t entries = heads * rows;
    if (entries == 0) return rows;
    LayerCache* cache = gather_cache_of(store, sequence, layer, stream, n_threads);
    // the rows' sources, made on the device from the positions and the store's pages
    const int64_t page_tokens = HostKvStore::kPageTokens;
    const std::byte* const* device_pages = page_tables_.of(store, sequence, layer, stream).keys;
    const DeviceArray<dm::RowCopy> copies(static_cast<size_t>(entries), stream);
    for_each_index(stream, n_threads, entries,
                   dm::WorkingSetRowCopies{selected, stride, count, mid_begin, mid_end, rows, heads, page_tokens,
                                           static_cast<int64_t>(store.row_bytes()), device_pages, copies.get()});
    const dm::GatherRows gather{copies.get(),
                                device_tensor(out.k),
                                device_tensor(out.v),
                                device_tensor(out.positions),
                                static_cast<int32_t>(store.dtype()),
                                store.head_dim()};
    const int64_t n = entries * store.head_dim();
    note_gather_pass();
    if (cache == nullptr || !cache->view().serves()) {
      for_each_index(stream, n_threads, n, gather);
    } else {  // the cache's rows, and their count added on the device
      const DeviceArray<uint8_t> hit(static_cast<size_t>(entries), stream);
      for_each_index(stream, n_threads, n, dm::GatherCachedRows{gather, cache->view(), hit.get()});
      add_hits(hit.get(), entries, counters, stream, n_threads);
    }
    if (cache != nullptr && count > 0) {
      try {
        update_passes(store, device_pages, selected, stride, count, *cache, false, stream, n_threads, counters + 1);
      } catch (const std::bad_alloc&) {
        forget(sequence, layer);
      } catch (...) {
        forget(sequence, layer);
        throw;
      }
    }
    return rows;  // the temporaries are freed in stream order after the passes
  }

  DeviceFetchCounts device_fetch_counts(const void* sequence) noexcept override {
    try {
      std::lock_guard<std::mutex> lock(caches_mutex_);
      const auto it = fetch_counts_.find(sequence);
      if (it == fetch_counts_.end()) return {};
      DeviceScope scope(device_id_);
      int64_t counts[2] = {0, 0};
      synchronize_device();  // the work of every stream that may add to them, the caller's non-blocking ones too
      copy_bytes(counts, it->second.counters->get(), sizeof counts, nullptr, true);
      DeviceFetchCounts out;
      out.cache_hits = counts[0];
      out.bytes_h2d = counts[1] - bytes_to_device(counts[0], it->second.row_bytes);
      return out;
    } catch (...) {
      return {};
    }
  }

  int64_t host_waits() const noexcept override { return g_counts.host_waits.load(); }
  int64_t gather_passes() const noexcept override { return g_counts.gather_passes.load(); }
  int64_t device_passes() const noexcept override { return g_counts.passes.load(); }
  DeviceCounts device_counts() const noexcept override { return device_runtime::device_counts(); }

  void drop_cached(const void* sequence, int32_t layer, int64_t from) noexcept override {
    std::lock_guard<std::mutex> lock(caches_mutex_);
    try {  // the rows change after this: work still reading them (a fetch, a select of EXACT) finishes first
      DeviceScope scope(device_id_);
      synchronize_device();
    } catch (...) {
      // a sticky device error: the context's next call reports it
    }
    for (auto it = caches_.lower_bound({sequence, INT32_MIN}); it != caches_.end() && it->first.first == sequence;) {
      if (layer != -1 && it->first.second != layer) {
        ++it;
        continue;
      }
      bool kept = from > 0;
      if (kept) {
        try {
          DeviceScope scope(device_id_);
          // after the work that may read the cache, on any stream, and before what follows
          synchronize_device();
          const dm::CacheView c = it->second->view();
          for_each_index(nullptr, 0, static_cast<int64_t>(it->second->heads()) * c.n_slots, dm::DropFrom{c, from});
          synchronize_device();
          it->second->drop_windows_from(from);
        } catch (...) {
          kept = false;  // the cache may be half changed: it goes
        }
      }
      it = kept ? std::next(it) : caches_.erase(it);
    }
  }

  void release_caches(const void* sequence) noexcept override {
    std::lock_guard<std::mutex> lock(caches_mutex_);
    try {  // work still reading the sequence's memory finishes before it goes
      DeviceScope scope(device_id_);
      synchronize_device();
    } catch (...) {
      // a sticky device error: the context's next call reports it
    }
    caches_.erase(caches_.lower_bound({sequence, INT32_MIN}), caches_.upper_bound({sequence, INT32_MAX}));
    mirrors_.erase(mirrors_.lower_bound({sequence, INT32_MIN}), mirrors_.upper_bound({sequence, INT32_MAX}));
    crush_mirrors_.erase(crush_mirrors_.lower_bound({sequence, INT32_MIN}),
                         crush_mirrors_.upper_bound({sequence, INT32_MAX}));
    loaded_.erase(sequence);
    fetch_counts_.erase(sequence);
    page_tables_.forget(sequence, -1);
  }

  CacheUse take_cache_use(const void* sequence) noexcept override {
    std::lock_guard<std::mutex> lock(caches_mutex_);
    CacheUse use;
    const auto loaded = loaded_.find(sequence);
    if (loaded != loaded_.end()) {
      use.loaded_bytes = loaded->second;
      loaded_.erase(loaded);
    }
    for (auto it = caches_.lower_bound({sequence, INT32_MIN}); it != caches_.end() && it->first.first == sequence; ++it)
      use.held_bytes += it->second->bytes();
    for (auto it = mirrors_.lower_bound({sequence, INT32_MIN}); it != mirrors_.end() && it->first.first == sequence;
         ++it)
      use.held_bytes += it->second.bytes();
    for (auto it = crush_mirrors_.lower_bound({sequence, INT32_MIN});
         it != crush_mirrors_.end() && it->first.first == sequence; ++it)
      use.held_bytes += it->second.bytes();
    return use;
  }

  std::shared_ptr<const ClusterSegmentBuilder> cluster_builder() const override { return cluster_builder_; }
  int64_t cluster_upload_bytes() const noexcept override { return cluster_upload_bytes_.load(); }

  bool selects_on_device(const Retriever& retriever, const TensorView& q, const TensorView& out,
                         const TensorView* scores) const override {
    const auto on_device = [](const TensorView& t) { return t.device().device_type == KVRET_DEVICE_CUDA; };
    const Retriever* index = retriever.selects_as();  // a wrapper that selects as one of kvret's own: that one
    const auto* pq = dynamic_cast<const PqRetriever*>(index);
    const bool kind = dynamic_cast<const PageRetriever*>(index) != nullptr ||
                      dynamic_cast<const ClusterRetriever*>(index) != nullptr ||
                      dynamic_cast<const QuantRetriever*>(index) != nullptr || pq != nullptr ||
                      dynamic_cast<const ExactRetriever*>(index) != nullptr;
    return kind && on_device(q) && on_device(out) && (scores == nullptr || on_device(*scores));
  }

  /// The selects fused: one set of passes for the jobs of each kind, budget and shape (a batch's sequences whose
  /// middle holds the budget share one; with KVCrush's representatives, which QUANT leaves to the host, the
  /// representatives' passes follow for the set) whose middles are within a factor of two of each other (so that the
  /// padding of the shorter rows to the longest costs less than the rows themselves). Every other job is selected
  /// alone, as is a set of one; a job whose index or signatures' copy cannot be made is not done (the host selects).
  void select_batch_on_device(const DeviceSelectJob* const* jobs, size_t n, bool* done, kvret_stream stream) override {
    const auto middle = [&](size_t i) { return jobs[i]->request.mid_end - jobs[i]->request.mid_begin; };
    // by kind, budget, shape and KVCrush, then by middle (longest first)
    std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int32_t, bool>, std::vector<size_t>> by_shape;
    for (size_t i = 0; i < n; ++i) {
      const DeviceSelectJob& job = *jobs[i];
      const bool crush = job.crush != nullptr;
      const int kind = device_kind(job);
      if (kind != 0 && !(crush && kind == kFusedQuant))
        by_shape[{kind, job.request.budget, fused_candidates(job), job.request.n_q_heads, job.q->dim(1),
                  job.request.fold, crush}]
            .push_back(i);
      else
        done[i] = select_on_device(job, stream);
    }
    std::vector<std::pair<int, std::vector<size_t>>> fused;  // kind, jobs
    for (auto& [shape, members] : by_shape) {
      std::stable_sort(members.begin(), members.end(), [&](size_t a, size_t b) { return middle(a) > middle(b); });
      const size_t first = fused.size();
      for (const size_t i : members) {
        if (fused.size() == first || 2 * middle(i) < middle(fused.back().second.front()))
          fused.emplace_back(std::get<0>(shape), std::vector<size_t>{});
        fused.back().second.push_back(i);
      }
    }
    for (const auto& [kind, members] : fused) {
      if (members.size() == 1) {
        done[members[0]] = select_on_device(*jobs[members[0]], stream);
        continue;
      }
      DeviceScope scope(device_id_);
      std::vector<const DeviceSelectJob*> group;
      for (const size_t i : members) group.push_back(jobs[i]);
      const int64_t unit =  // PAGE counts pages (one page size: one context)
          kind == kFusedPage ? dynamic_cast<const PageRetriever*>(group[0]->retriever->selects_as())->page_size() : 1;
      auto fj = std::make_unique<FusedJobs>(group, stream, unit);
      const SelectRequest& r = fj->job(0).request;
      const auto d = static_cast<int32_t>(fj->job(0).q->dim(1));
      const int64_t per_job = r.n_q_heads * d;
      auto q = std::make_unique<DeviceArray<float>>(static_cast<size_t>(per_job * fj->size()), stream);
      const auto load = [&] {
        for_each_index(stream, r.n_threads, per_job * static_cast<int64_t>(fj->size()),
                       dm::LoadQueries{fj->q(), q->get(), per_job, d});
      };
      load();
      // a non-finite q is refused before anything changes (KVCrush's signatures are brought up to date below)
      if (fj->job(0).check_finite)
        check_finite_queries(q->get(), per_job * static_cast<int64_t>(fj->size()), r.n_threads, stream);
      std::vector<const DeviceSelectJob*> selected;
      std::vector<const IndexMirror*> mirrors;  // PAGE's, CLUSTER's, PQ's and QUANT's copies
      std::vector<const CrushMirror*> crushes;  // the signatures' copies
      for (const size_t i : members) {
        const DeviceSelectJob& job = *jobs[i];
        const Retriever* index = job.retriever->selects_as();
        const CrushMirror* crush = nullptr;
        if (job.crush != nullptr) {
          if (!job.crush->prepare || !job.crush->prepare(*job.crush)) continue;  // the host selects
          crush = crush_mirror(*job.crush, job.sequence, job.layer, stream);
          if (crush == nullptr) continue;  // over config.device_bytes_limit, or the device is full: the host selects
        }
        if (kind != kFusedExact) {
          const IndexMirror* m =
              kind == kFusedPage
                  ? page_mirror(*dynamic_cast<const PageRetriever*>(index), job.sequence, job.layer, stream)
              : kind == kFusedQuant
                  ? quant_mirror(*dynamic_cast<const QuantRetriever*>(index), job.sequence, job.layer, stream)
              : kind == kFusedPq || kind == kFusedPqTokens
                  ? pq_mirror(*dynamic_cast<const PqRetriever*>(index), job.sequence, job.layer, stream)
                  : cluster_mirror(*dynamic_cast<const ClusterRetriever*>(index), job.sequence, job.layer, stream);
          if (m == nullptr) continue;  // over config.device_bytes_limit, or the device is full: the host selects
          mirrors.push_back(m);
        }
        crushes.push_back(crush);
        selected.push_back(&job);
        done[i] = true;
      }
      if (selected.empty()) continue;
      if (selected.size() != group.size()) {  // some go to the host: the rest's values and queries again
        fj = std::make_unique<FusedJobs>(selected, stream, unit);
        q = std::make_unique<DeviceArray<float>>(static_cast<size_t>(per_job * fj->size()), stream);
        load();
      }
      if (kind == kFusedPage)
        page_select(*fj, mirrors, q->get(), stream);
      else if (kind == kFusedQuant)
        quant_select(*fj, mirrors, q->get(), stream);
      else if (kind == kFusedPq || kind == kFusedPqTokens)
        pq_select(*fj, mirrors, q->get(), stream);
      else if (kind == kFusedCluster)
        cluster_select(*fj, mirrors, q->get(), stream);
      else
        exact_select(*fj, q->get(), stream);
      if (crushes[0] != nullptr) crush_passes(selected, crushes, stream);
    }
  }

  bool select_on_device(const DeviceSelectJob& job, kvret_stream stream) override {
    const int kind = device_kind(job);
    if (kind == 0) return false;
    const Retriever* target = job.retriever->selects_as();
    // QUANT adds no KVCrush representatives on the device: with them the host selects
    if (kind == kFusedQuant)
      return job.crush == nullptr && quant_select(*dynamic_cast<const QuantRetriever*>(target), job, stream);
    const auto* page = dynamic_cast<const PageRetriever*>(target);
    const auto* cluster = dynamic_cast<const ClusterRetriever*>(target);
    const auto* pq = dynamic_cast<const PqRetriever*>(target);
    const auto* exact = dynamic_cast<const ExactRetriever*>(target);
    const SelectRequest& r = job.request;
    DeviceScope scope(device_id_);
    const int32_t d = static_cast<int32_t>(job.q->dim(1));
    const int64_t q_heads = r.n_q_heads;
    const int threads = r.n_threads;
    const DeviceArray<float> q(static_cast<size_t>(q_heads * d), stream);
    load_query(*job.q, q.get(), q_heads, d, job.check_finite, threads, stream);
    // KVCrush: the signatures' copy first, so that a refused one leaves the tensors unwritten
    const CrushMirror* crush = nullptr;
    if (job.crush != nullptr) {
      if (!job.crush->prepare || !job.crush->prepare(*job.crush)) return false;
      crush = crush_mirror(*job.crush, job.sequence, job.layer, stream);
      if (crush == nullptr) return false;  // over config.device_bytes_limit, or the device is full: the host selects
    }
    if (exact != nullptr) {
      exact_select(FusedJobs({&job}, stream), q.get(), stream);
    } else if (cluster != nullptr) {
      if (!cluster_select(*cluster, job, q.get(), stream)) return false;
    } else if (pq != nullptr) {
      if (!pq_select(*pq, job, q.get(), stream)) return false;
    } else {
      const IndexMirror* mirror = page_mirror(*page, job.sequence, job.layer, stream);
      if (mirror == nullptr) return false;  // over config.device_bytes_limit, or the device is full: the host selects
      page_select(FusedJobs({&job}, stream, page->page_size()), {mirror}, q.get(), stream);
    }
    if (crush != nullptr) crush_passes({&job}, {crush}, stream);
    return true;  // the temporaries are freed in stream order after the passes
  }

 private:
  /// q [q_heads, d] where it is (any float type and strides) into f32 `out` [q_heads, d], the first pass of every
  /// select on the device; with check_finite (config.check_finite) a NaN or Inf in it is KVRET_ERR_NONFINITE, thrown
  /// before the select writes anything.
  void load_query(const TensorView& q, float* out, int64_t q_heads, int32_t d, bool check_finite, int threads,
                  kvret_stream stream) {
    const int64_t n = q_heads * d;
    for_each_index(stream, threads, n, dm::PageLoadQuery{device_tensor(q), out, d});
    if (check_finite) check_finite_queries(out, n, threads, stream, q.name());
  }

  /// KVRET_ERR_NONFINITE when the n loaded query values hold a NaN or an Inf (the host waits for the count).
  void check_finite_queries(const float* q, int64_t n, int threads, kvret_stream stream,
                            const std::string& name = "q") {
    int64_t bad = 0;
    with_policy(stream, threads, n, [&](const auto& policy) {
      bad = static_cast<int64_t>(thrust::count_if(policy, q, q + n, dm::PageNonFinite{}));
      note_wait();  // the count comes back to the host
    });
    require(bad == 0, KVRET_ERR_NONFINITE, name + ": contains NaN or Inf");
  }

  /// Values the device passes read (one per job: layouts, page tables), on the host and, sent with one copy, in
  /// device memory, a temporary of one call on `stream`.
  template <class T>
  struct Uploaded {
    Uploaded(std::vector<T> values, kvret_stream stream) : host(std::move(values)), device(host.size(), stream) {
      // (a copy from pageable memory returns once its bytes are staged, so the host array may go)
      upload(device.get(), host.data(), host.size() * sizeof(T), stream);
    }
    std::vector<T> host;
    DeviceArray<T> device;
  };

  /// The per-job values of a select on the device over `jobs` (one select, or a fused batch of one kind, budget and
  /// shape) in device memory, sent with one copy: each job's middle in units of `unit` tokens (n_of: tokens, or
  /// PAGE's pages, the last one partial), its middle tokens (tokens_of) and first middle position (base_of), and its
  /// q, out and scores tensors (a scores tensor's base null without one). width() is the most units of a job: a
  /// fused pass gives every job a row of that width, the shorter ones padded.
  class FusedJobs {
   public:
    FusedJobs(std::vector<const DeviceSelectJob*> jobs, kvret_stream stream, int64_t unit = 1)
        : jobs_(std::move(jobs)), data_(bytes_for(jobs_.size()), stream) {
      const size_t n = jobs_.size();
      std::vector<int64_t> counts(3 * n);
      std::vector<dm::DeviceTensor> tensors(3 * n);
      for (size_t i = 0; i < n; ++i) {
        const SelectRequest& r = jobs_[i]->request;
        counts[i] = (r.mid_end - r.mid_begin + unit - 1) / unit;
        counts[n + i] = r.mid_begin;
        counts[2 * n + i] = r.mid_end - r.mid_begin;
        width_ = std::max(width_, counts[i]);
        tensors[i] = device_tensor(*jobs_[i]->q);
        tensors[n + i] = device_tensor(*jobs_[i]->out);
        if (jobs_[i]->scores != nullptr) tensors[2 * n + i] = device_tensor(*jobs_[i]->scores);
      }
      std::vector<std::byte> host(bytes_for(n));
      std::memcpy(host.data(), counts.data(), counts.size() * sizeof(int64_t));
      std::memcpy(host.data() + counts.size() * sizeof(int64_t), tensors.data(),
                  tensors.size() * sizeof(dm::DeviceTensor));
      // (a copy from pageable memory returns once its bytes are staged, so the host array may go)
      upload(data_.get(), host.data(), host.size(), stream);
    }
    size_t size() const noexcept { return jobs_.size(); }
    const DeviceSelectJob& job(size_t i) const noexcept { return *jobs_[i]; }
    int64_t width() const noexcept { return width_; }
    const int64_t* n_of() const noexcept { return reinterpret_cast<const int64_t*>(data_.get()); }
    const int64_t* base_of() const noexcept { return n_of() + size(); }
    const int64_t* tokens_of() const noexcept { return n_of() + 2 * size(); }
    const dm::DeviceTensor* q() const noexcept {
      return reinterpret_cast<const dm::DeviceTensor*>(data_.get() + 3 * size() * sizeof(int64_t));
    }
    const dm::DeviceTensor* outs() const noexcept { return q() + size(); }
    const dm::DeviceTensor* scores() const noexcept { return q() + 2 * size(); }

   private:
    static size_t bytes_for(size_t n) noexcept { return n * (3 * sizeof(int64_t) + 3 * sizeof(dm::DeviceTensor)); }
    std::vector<const DeviceSelectJob*> jobs_;
    DeviceArray<std::byte> data_;
    int64_t width_ = 0;
  };

  /// The candidates per head of a QUANT select with re-ranking (min(middle, quant_rerank x budget)); the budget of
  /// any other select.
  static int64_t fused_candidates(const DeviceSelectJob& job) {
    const auto* quant = dynamic_cast<const QuantRetriever*>(job.retriever->selects_as());
    const SelectRequest& r = job.request;
    return quant != nullptr && quant->rerank() > 1 ? std::min(r.mid_end - r.mid_begin, r.budget * quant->rerank())
                                                   : r.budget;
  }

  static constexpr int kFusedExact = 1, kFusedPage = 2, kFusedQuant = 3, kFusedPq = 4, kFusedPqTokens = 5,
                       kFusedCluster = 6;
  /// The kind of a select the device can run (the request fits the index, which holds something to select; PQ's
  /// two paths apart), the key by which select_batch_on_device fuses selects; 0 where the host must select.
  static int device_kind(const DeviceSelectJob& job) {
    const Retriever* index = job.retriever != nullptr ? job.retriever->selects_as() : nullptr;
    const SelectRequest& r = job.request;
    if (index == nullptr || job.sequence == nullptr || job.q == nullptr || job.out == nullptr ||
        index->indexed_begin() != r.mid_begin || index->indexed_end() != r.mid_end || r.budget <= 0 ||
        r.budget > r.mid_end - r.mid_begin)
      return 0;
    if (dynamic_cast<const ExactRetriever*>(index) != nullptr)
      return job.store != nullptr && job.store->size() >= r.mid_end ? kFusedExact : 0;
    if (const auto* page = dynamic_cast<const PageRetriever*>(index)) return page->pages() > 0 ? kFusedPage : 0;
    if (const auto* quant = dynamic_cast<const QuantRetriever*>(index))
      return quant->head(0).size() == r.mid_end - r.mid_begin && (quant->rerank() == 1 || job.store != nullptr)
                 ? kFusedQuant
                 : 0;
    if (const auto* pq = dynamic_cast<const PqRetriever*>(index))
      return pq->size() > 0 ? (pq->scores_cells() ? kFusedPq : kFusedPqTokens) : 0;
    if (const auto* cluster = dynamic_cast<const ClusterRetriever*>(index))
      return cluster->clusters() + cluster->exacts() + cluster->pending() > 0 &&
                     (cluster->pending() == 0 || job.store != nullptr)
                 ? kFusedCluster
                 : 0;
    return 0;
  }

  /// EXACT's select on the device (exact_select_ops.hpp) for every job of `jobs` (EXACT selects of one budget and
  /// shape) in one set of passes, q already loaded ([jobs, n_q_heads, d]): every middle token's key read in place
  /// from its store's pinned, mapped pages (no device copy), the logits, the fold and the top-k of select_top, the
  /// positions and scores written. The key bytes read over the bus count as each sequence's loaded bytes
  /// (stats.bytes_h2d).
  /// Every job's key pages up to the one holding its last middle token, as the device addresses them: one table of
  /// page addresses and one dm::ExactKeyPages per job, in device memory (EXACT's logits, QUANT's re-ranked keys).
  class JobKeyPages {
   public:
    JobKeyPages(const FusedJobs& jobs, PageTables& tables, kvret_stream stream)
        : views_(views(jobs, tables, stream), stream) {}
    const dm::ExactKeyPages* get() const noexcept { return views_.device.get(); }

   private:
    static std::vector<dm::ExactKeyPages> views(const FusedJobs& jobs, PageTables& tables, kvret_stream stream) {
      std::vector<dm::ExactKeyPages> out;
      for (size_t i = 0; i < jobs.size(); ++i) {
        const DeviceSelectJob& job = jobs.job(i);
        const HostKvStore& store = *job.store;
        out.push_back({tables.of(store, page_key(job.sequence, store), job.layer, stream).keys,
                       HostKvStore::kPageTokens, static_cast<int64_t>(store.row_bytes()),
                       static_cast<int32_t>(store.dtype())});
      }
      return out;
    }
    Uploaded<dm::ExactKeyPages> views_;
  };

  void exact_select(const FusedJobs& jobs, const float* q, kvret_stream stream) {
    const SelectRequest& r = jobs.job(0).request;
    const HostKvStore& first = *jobs.job(0).store;
    const int64_t heads = first.n_kv_heads(), width = jobs.width(),
                  segments = heads * static_cast<int64_t>(jobs.size());
    const int threads = r.n_threads;
    const JobKeyPages keys(jobs, page_tables_, stream);
    const DeviceArray<float> logits(static_cast<size_t>(segments * r.group * width), stream);
    for_each_index(stream, threads, segments * width,
                   dm::ExactLogits{keys.get(), q, logits.get(), jobs.n_of(), jobs.base_of(), width, heads,
                                   first.head_dim(), r.group, r.scale});
    top_and_write(jobs, segments, logits.get(), stream);
    std::lock_guard<std::mutex> lock(caches_mutex_);
    for (size_t i = 0; i < jobs.size(); ++i) {  // the keys read from host memory
      const DeviceSelectJob& job = jobs.job(i);
      loaded_[job.sequence] +=
          heads * (job.request.mid_end - job.request.mid_begin) * static_cast<int64_t>(job.store->row_bytes());
    }
  }

  /// Makes `m`, the mirror of (sequence, layer), anew with `bytes` of device memory (caches_mutex_ held; the old
  /// copy goes first: the new one may need its share of the budget). False, with no mirror kept, when it would pass
  /// config.device_bytes_limit or the device cannot hold it.
  bool remake_mirror(IndexMirror& m, const void* sequence, int32_t layer, size_t bytes) {
    m = IndexMirror{};
    try {
      m.share = std::make_unique<BudgetShare>(bytes, budget_);
      m.data = std::make_unique<DeviceArray<std::byte>>(bytes);
    } catch (const std::bad_alloc&) {
      mirrors_.erase({sequence, layer});
      return false;
    } catch (const Error& e) {
      mirrors_.erase({sequence, layer});
      if (e.status() != KVRET_ERR_CAPACITY) throw;
      return false;
    }
    return true;
  }

  /// send() into the mirror of (sequence, layer), which then holds `retriever`'s `version`; a failed copy drops
  /// the mirror (caches_mutex_ held).
  template <class Send>
  IndexMirror* update_mirror(IndexMirror& m, const void* sequence, int32_t layer, const void* retriever,
                             uint64_t version, const Send& send) {
    try {
      send();
    } catch (...) {
      mirrors_.erase({sequence, layer});
      throw;
    }
    m.retriever = retriever;
    m.version = version;
    return &m;
  }

  /// The mirror of (sequence, layer) brought up to `page`'s bounds: the pages changed since the version it holds
  /// are copied in (every page when it was made or grown, or when that version is too old to know). Null, with no
  /// mirror kept, when it would pass config.device_bytes_limit or the device cannot hold it.
  const IndexMirror* page_mirror(const PageRetriever& page, const void* sequence, int32_t layer, kvret_stream stream) {
    const int64_t n = page.pages();
    std::lock_guard<std::mutex> lock(caches_mutex_);
    IndexMirror& m = mirrors_[{sequence, layer}];
    int64_t from = m.retriever == &page && m.data ? page.pages_changed_since(m.version) : 0;
    const int64_t row = 2 * static_cast<int64_t>(page.head_dim());
    const int64_t n_heads = page.n_kv_heads();
    if (n > m.capacity) {
      const int64_t capacity = std::max<int64_t>({n, m.capacity + m.capacity / 2, 16});
      if (!remake_mirror(m, sequence, layer, static_cast<size_t>(n_heads * capacity * row) * sizeof(float)))
        return nullptr;
      m.capacity = capacity;
      from = 0;
    }
    return update_mirror(m, sequence, layer, &page, page.version(), [&] {
      if (from < n)
        for (int64_t h = 0; h < n_heads; ++h)
          upload(m.bounds() + (h * m.capacity + from) * row, page.page_min(static_cast<int>(h), from),
                 static_cast<size_t>((n - from) * row) * sizeof(float), stream);
    });
  }

  /// The mirror of (sequence, layer) holding `cluster`'s clusters. Only what changed since the version it holds
  /// is copied: the segments after the ones it still holds (those whose stamps it has; a decode interval sends its
  /// own clusters, a cut sends nothing); everything when it is new (with room for half as much again) or has no room
  /// left (it grows by half).
  /// Null, with no mirror kept, when it would pass config.device_bytes_limit or the device cannot hold it.
  const IndexMirror* cluster_mirror(const ClusterRetriever& cluster, const void* sequence, int32_t layer,
                                    kvret_stream stream) {
    const ClusterCounts n(cluster);
    std::lock_guard<std::mutex> lock(caches_mutex_);
    IndexMirror& m = mirrors_[{sequence, layer}];
    if (m.retriever == &cluster && m.data && m.version == cluster.version()) return &m;
    const std::vector<ClusterRetriever::Segment>& segments = cluster.segments();
    size_t keep = 0;  // the segments the mirror holds still
    if (m.retriever == &cluster && m.data)
      while (keep < m.held.size() && keep < segments.size() &&
             m.held[keep] == std::make_pair(cluster.segment_stamp(keep), segments[keep]))
        ++keep;
    if (!m.data || !m.room.fits(n)) {
      // room for half as much again (decode intervals), or the old room grown by half
      const auto grow = [](int64_t need, int64_t had) { return std::max(need + need / 2 + 8, had + had / 2); };
      ClusterCounts room = n;
      room.clusters = grow(n.clusters, m.data ? m.room.clusters : 0);
      room.ids = grow(n.ids, m.data ? m.room.ids : 0);
      room.exacts = grow(n.exacts, m.data ? m.room.exacts : 0);
      if (!remake_mirror(m, sequence, layer, room.bytes())) return nullptr;
      m.room = room;
      keep = 0;
    }
    m.held.clear();  // until the copy is done
    return update_mirror(m, sequence, layer, &cluster, cluster.version(), [&] {
      const dm::ClusterLayout l = cluster_layout(m.data->get(), n, m.room);
      const int64_t c0 = keep < segments.size() ? segments[keep].first_cluster : n.clusters;
      const int64_t e0 = keep < segments.size() ? segments[keep].first_exact : n.exacts;
      const int64_t i0 = cluster.offsets(0)[static_cast<size_t>(c0)];  // every head has as many ids per segment
      const int64_t o0 = keep == 0 ? 0 : c0 + 1;                       // offsets[0] = 0 goes with the first copy
      const auto d = static_cast<int64_t>(n.d);
      int64_t sent = 0;
      // elements [from, count) of head h's array, `width` 4-byte words each, at dst + h * stride
      const auto per_head = [&](auto* dst, auto get, int64_t stride, int64_t from, int64_t count, int64_t width) {
        for (int64_t h = 0; h < n.heads && count > from; ++h) {
          const auto bytes = static_cast<size_t>((count - from) * width) * 4;
          upload(dst + (h * stride + from) * width, get(static_cast<int>(h)).data() + from * width, bytes, stream);
          sent += static_cast<int64_t>(bytes);
        }
      };
      per_head(
          const_cast<float*>(l.centroids), [&](int h) -> const auto& { return cluster.centroids(h); }, m.room.clusters,
          c0, n.clusters, d);
      per_head(
          const_cast<int32_t*>(l.sizes), [&](int h) -> const auto& { return cluster.sizes(h); }, m.room.clusters, c0,
          n.clusters, 1);
      per_head(
          const_cast<int32_t*>(l.offsets), [&](int h) -> const auto& { return cluster.offsets(h); },
          m.room.clusters + 1, o0, n.clusters + 1, 1);
      per_head(
          const_cast<int32_t*>(l.ids), [&](int h) -> const auto& { return cluster.sorted_ids(h); }, m.room.ids, i0,
          n.ids, 1);
      per_head(
          const_cast<int32_t*>(l.exact_pos), [&](int h) -> const auto& { return cluster.exact_positions(h); },
          m.room.exacts, e0, n.exacts, 1);
      per_head(
          const_cast<float*>(l.exact_keys), [&](int h) -> const auto& { return cluster.exact_keys(h); }, m.room.exacts,
          e0, n.exacts, d);
      for (size_t i = 0; i < segments.size(); ++i) m.held.emplace_back(cluster.segment_stamp(i), segments[i]);
      cluster_upload_bytes_ += sent;
    });
  }

  /// CLUSTER's select on the device (cluster_select_ops.hpp), q already loaded: false, having written nothing,
  /// where the mirror cannot be made.
  bool cluster_select(const ClusterRetriever& cluster, const DeviceSelectJob& job, const float* q,
                      kvret_stream stream) {
    const IndexMirror* mirror = cluster_mirror(cluster, job.sequence, job.layer, stream);
    if (mirror == nullptr) return false;  // over config.device_bytes_limit, or the device is full: the host selects
    cluster_select(FusedJobs({&job}, stream), {mirror}, q, stream);
    return true;
  }

  /// CLUSTER's select on the device for every job of `jobs` (CLUSTER selects of one budget and shape; `mirrors`
  /// their copies) in one set of passes, q already loaded ([jobs, n_q_heads, d]): the groups' logits, the fold and
  /// grouped take, the taken tokens by (head, position), the write. The pending tails' keys are read from the stores
  /// by the host and copied in (one wait for the batch).
  void cluster_select(const FusedJobs& jobs, const std::vector<const IndexMirror*>& mirrors, const float* q,
                      kvret_stream stream) {
    const SelectRequest& r = jobs.job(0).request;
    const int64_t heads = r.n_q_heads / r.group, jobs_n = static_cast<int64_t>(jobs.size());
    // every job's layout, and its pending tail's keys, f32, from its store (at most cluster_decode_interval - 1
    // per head), every job's in one array
    std::vector<dm::ClusterLayout> layouts;
    std::vector<float> pending;
    std::vector<size_t> pending_at;
    int64_t width = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const auto& cluster = *dynamic_cast<const ClusterRetriever*>(jobs.job(i).retriever->selects_as());
      dm::ClusterLayout l = cluster_layout(mirrors[i]->data->get(), ClusterCounts(cluster), mirrors[i]->room);
      l.pending = cluster.pending();
      l.first_pending = cluster.clustered_end();
      pending_at.push_back(pending.size());
      pending.resize(pending.size() + static_cast<size_t>(heads * l.pending * l.d));
      for (int64_t h = 0; h < heads && l.pending > 0; ++h)
        jobs.job(i).store->keys_f32(static_cast<int>(h), l.first_pending, cluster.indexed_end(),
                                    pending.data() + pending_at.back() + h * l.pending * l.d);
      width = std::max(width, l.groups());
      layouts.push_back(l);
    }
    const DeviceArray<float> pending_keys(pending.size(), stream);
    if (!pending.empty()) upload(pending_keys.get(), pending.data(), pending.size() * sizeof(float), stream);
    for (size_t i = 0; i < layouts.size(); ++i) layouts[i].pending_keys = pending_keys.get() + pending_at[i];
    const Uploaded<dm::ClusterLayout> l(std::move(layouts), stream);

    const int64_t segments = heads * jobs_n, rows = r.n_q_heads * jobs_n, entries = segments * width;
    const int threads = r.n_threads;
    const DeviceArray<float> logits(static_cast<size_t>(rows * width), stream),
        folded(static_cast<size_t>(entries), stream);
    const DeviceArray<cuda::math::PageSoftmax> softmax(static_cast<size_t>(rows), stream);
    const DeviceArray<int64_t> taken(static_cast<size_t>(entries), stream), offset(taken.size(), stream);
    for_each_index(stream, threads, rows * width,
                   dm::ClusterLogits{l.device.get(), q, logits.get(), width, r.n_q_heads, r.group, r.scale});
    if (r.fold != KVRET_FOLD_MAX_LOGIT)
      for_each_index(stream, threads, rows,
                     dm::ClusterSoftmaxes{l.device.get(), logits.get(), softmax.get(), width, r.n_q_heads, r.group});
    take_passes(
        segments, width, r, logits.get(), softmax.get(), folded.get(), taken.get(), offset.get(),
        [&](const int64_t* index, int64_t* weight) {
          for_each_index(stream, threads, entries,
                         dm::ClusterSortedWeights{l.device.get(), index, weight, width, heads});
        },
        stream);
    // the taken tokens by (head, position), then into the caller's tensors
    const int64_t picked = segments * r.budget;
    const DeviceArray<uint64_t> keys(static_cast<size_t>(picked), stream);
    const DeviceArray<float> score(static_cast<size_t>(picked), stream);
    for_each_index(stream, threads, entries,
                   dm::ClusterPick{l.device.get(), taken.get(), offset.get(), folded.get(), keys.get(), score.get(),
                                   width, heads, r.budget});
    with_policy(stream, threads, picked,
                [&](const auto& policy) { thrust::sort_by_key(policy, keys.get(), keys.get() + picked, score.get()); });
    for_each_index(stream, threads, picked,
                   dm::TopWrite{keys.get(), score.get(), jobs.outs(), jobs.scores(), r.budget, heads});
  }

  /// The mirror of (sequence, layer) brought up to `quant`'s low-bit copy: the key blocks (and their value rows)
  /// changed since the version it holds are copied in (every block when it was made or grown, or when that version
  /// is too old to know), and the f16 residual window whole; the bytes copied count as the sequence's loaded bytes
  /// (stats.bytes_h2d). Null, with no mirror kept, when it would pass config.device_bytes_limit or the device cannot
  /// hold it.
  const IndexMirror* quant_mirror(const QuantRetriever& quant, const void* sequence, int32_t layer,
                                  kvret_stream stream) {
    const KiviParams& p = quant.params();
    const int64_t heads = quant.n_kv_heads(), blocks = quant.blocks();
    const int32_t d = quant.head_dim();
    const int64_t res_cap = int64_t{p.residual} + p.group - 1;  // a head's residual never holds more rows
    std::lock_guard<std::mutex> lock(caches_mutex_);
    IndexMirror& m = mirrors_[{sequence, layer}];
    int64_t from = m.retriever == &quant && m.data ? quant.blocks_changed_since(m.version) : 0;
    if (!m.data || blocks > m.capacity) {
      // room for a quarter more blocks: decode steps then send their change, not the whole copy
      const int64_t capacity = std::max<int64_t>({blocks + blocks / 4, m.capacity + m.capacity / 2, 16});
      if (!remake_mirror(m, sequence, layer, dm::QuantLayout::bytes_for(heads, capacity, res_cap, d, p.group, p.bits)))
        return nullptr;
      m.capacity = capacity;
      from = 0;
    }
    return update_mirror(m, sequence, layer, &quant, quant.version(), [&] {
      const dm::QuantLayout l = dm::quant_layout(m.data->get(), heads, m.capacity, res_cap, d, p.group, p.bits);
      size_t sent = 0;
      const auto send = [&](const void* dst, const void* src, size_t bytes) {
        if (bytes == 0) return;
        upload(const_cast<void*>(dst), src, bytes, stream);
        sent += bytes;
      };
      for (int64_t h = 0; h < heads; ++h) {
        const KiviHead& head = quant.head(static_cast<int>(h));
        const int64_t rows = head.residual_tokens();
        if (from < blocks) {
          const auto b = static_cast<size_t>(blocks - from);
          const auto t0 = from * p.group;
          send(l.block_codes(h, from), head.key_codes(from), b * head.key_block_codes());
          send(l.block_params(h, from), head.key_params(from), b * 2 * static_cast<size_t>(d) * 2);
          send(l.value_codes + (h * l.cap_blocks * p.group + t0) * l.value_row_bytes(), head.value_codes(t0),
               b * p.group * head.value_row_codes());
          send(l.value_params + (h * l.cap_blocks * p.group + t0) * l.value_row_params(), head.value_params(t0),
               b * p.group * head.value_row_params() * 2);
        }
        send(l.res_k + h * res_cap * d, head.residual_key_array().data(), static_cast<size_t>(rows * d) * 2);
        send(l.res_v + h * res_cap * d, head.residual_value_array().data(), static_cast<size_t>(rows * d) * 2);
      }
      loaded_[sequence] += static_cast<int64_t>(sent);
    });
  }

  /// QUANT's select on the device (quant_select_ops.hpp): false, having written nothing, where it cannot run (the
  /// mirror cannot be made; device_kind has checked the request); the passes are those of a fused batch of one.
  bool quant_select(const QuantRetriever& quant, const DeviceSelectJob& job, kvret_stream stream) {
    const SelectRequest& r = job.request;
    DeviceScope scope(device_id_);
    const int32_t d = quant.head_dim();
    const int64_t q_heads = quant.n_kv_heads() * r.group;
    const DeviceArray<float> q(static_cast<size_t>(q_heads * d), stream);
    load_query(*job.q, q.get(), q_heads, d, job.check_finite, r.n_threads, stream);
    const IndexMirror* mirror = quant_mirror(quant, job.sequence, job.layer, stream);
    if (mirror == nullptr) return false;  // over config.device_bytes_limit, or the device is full: the host selects
    quant_select(FusedJobs({&job}, stream), {mirror}, q.get(), stream);
    return true;  // the temporaries are freed in stream order after the passes
  }

  /// The layout of `quant`'s copy in `mirror`, with the blocks and residual rows it holds in use.
  static dm::QuantLayout quant_in_use(const QuantRetriever& quant, const IndexMirror& mirror) {
    const KiviParams& p = quant.params();
    dm::QuantLayout l = dm::quant_layout(mirror.data->get(), quant.n_kv_heads(), mirror.capacity,
                                         int64_t{p.residual} + p.group - 1, quant.head_dim(), p.group, p.bits);
    l.blocks = quant.blocks();
    l.residual = quant.head(0).residual_tokens();
    return l;
  }

  /// The low-bit logits [jobs * heads * group, width] of the copies `l` (one per job) at `scale`, from q [jobs *
  /// heads * group, d] (select's first passes); a job's row past its tokens is -inf.
  void quant_low_logits(const Uploaded<dm::QuantLayout>& l, const float* q, float* logits, int64_t width, int32_t group,
                        float scale, int threads, kvret_stream stream) {
    const int64_t q_heads = l.host[0].heads * group, rows = q_heads * static_cast<int64_t>(l.host.size());
    int64_t max_blocks = 0, first = width;
    for (const dm::QuantLayout& x : l.host) {
      max_blocks = std::max(max_blocks, x.blocks);
      first = std::min(first, x.blocks * x.group);
    }
    if (max_blocks > 0)
      for_each_index(stream, threads, rows * max_blocks,
                     dm::QuantBlockLogits{l.device.get(), q, logits, width, max_blocks, q_heads, group, scale});
    if (width > first)
      for_each_index(stream, threads, rows * (width - first),
                     dm::QuantResidualLogits{l.device.get(), q, logits, width, first, q_heads, group, scale});
  }

  /// QUANT's select on the device for every job of `jobs` (QUANT selects of one budget, shape and candidate count;
  /// `mirrors` their copies) in one set of passes, q already loaded ([jobs, n_q_heads, d]): the low-bit logits,
  /// the fold and top-k of select_top, the positions and scores written. With re-ranking (quant_rerank r > 1) the
  /// top r x budget by the low-bit logits are the candidates: their exact keys are read on the device from the
  /// stores' pinned pages (counted as each sequence's loaded bytes), and the top of EXACT's logits over them is the
  /// selection; no host wait.
  void quant_select(const FusedJobs& jobs, const std::vector<const IndexMirror*>& mirrors, const float* q,
                    kvret_stream stream) {
    const SelectRequest& r = jobs.job(0).request;
    const auto& quant = *dynamic_cast<const QuantRetriever*>(jobs.job(0).retriever->selects_as());
    std::vector<dm::QuantLayout> layouts;
    for (size_t i = 0; i < jobs.size(); ++i)
      layouts.push_back(
          quant_in_use(*dynamic_cast<const QuantRetriever*>(jobs.job(i).retriever->selects_as()), *mirrors[i]));
    const int64_t heads = layouts[0].heads, segments = heads * static_cast<int64_t>(jobs.size()),
                  rows = segments * r.group, width = jobs.width();
    const int32_t d = layouts[0].d;
    const int threads = r.n_threads;
    const Uploaded<dm::QuantLayout> l(std::move(layouts), stream);
    const DeviceArray<float> logits(static_cast<size_t>(rows * width), stream);
    quant_low_logits(l, q, logits.get(), width, r.group, r.scale, threads, stream);
    if (quant.rerank() == 1) {
      top_and_write(jobs, segments, logits.get(), stream);
      return;
    }
    // the candidates by the maximum over each group's heads, whatever the fold (QuantRetriever), ascending per head
    const int64_t candidates = fused_candidates(jobs.job(0));  // every job's (select_batch_on_device's sets)
    const DeviceArray<int32_t> cand(static_cast<size_t>(segments * candidates), stream);
    {
      const DeviceArray<float> folded(static_cast<size_t>(segments * width), stream);
      select_top(static_cast<int64_t>(jobs.size()), threads, segments, width, candidates, KVRET_FOLD_MAX_LOGIT, r.group,
                 middles(jobs, false), middles(jobs, true), logits.get(), nullptr, folded.get(), cand.get(), stream);
    }
    // their exact keys, read from the stores' pages on the device; EXACT's logits; the top of them
    const JobKeyPages pages(jobs, page_tables_, stream);
    const DeviceArray<float> exact_keys(static_cast<size_t>(segments * candidates * d), stream);
    for_each_index(stream, threads, segments * candidates * d,
                   dm::QuantCandidateKeys{cand.get(), pages.get(), exact_keys.get(), candidates, heads, d});
    {
      std::lock_guard<std::mutex> lock(caches_mutex_);
      for (size_t i = 0; i < jobs.size(); ++i)
        loaded_[jobs.job(i).sequence] += heads * candidates * static_cast<int64_t>(jobs.job(i).store->row_bytes());
    }
    const DeviceArray<float> exact(static_cast<size_t>(rows * candidates), stream);
    for_each_index(stream, threads, rows * candidates,
                   dm::QuantExactLogits{q, exact_keys.get(), exact.get(), candidates, d, r.group, r.scale});
    top_and_write(jobs, segments, exact.get(), stream, candidates, cand.get());
  }

 public:
  /// Quantized attention on the device (quant_attend_ops.hpp), attend_dense's rule: the low-bit logits from the
  /// device copy, the candidates by select's passes (their positions copied to the host, which maps the exact
  /// rows), the exact rows (sink, local, selected) and candidate keys read on the device from the store's pinned
  /// pages, then the logits, weights and weighted sums in double on the device.
  bool attend_quantized_on_device(const QuantAttendJob& job, int64_t* key_rows, kvret_stream stream) override {
    const auto* quant =
        dynamic_cast<const QuantRetriever*>(job.retriever != nullptr ? job.retriever->selects_as() : nullptr);
    const auto on_device = [](const TensorView* t) {
      return t != nullptr && t->device().device_type == KVRET_DEVICE_CUDA;
    };
    if (quant == nullptr || job.store == nullptr || job.sequence == nullptr || !on_device(job.q) || !on_device(job.out))
      return false;
    const HostKvStore& store = *job.store;
    const int64_t n = store.size(), begin = quant->indexed_begin(), end = quant->indexed_end(), middle = end - begin;
    if (!quant->indexed() || middle <= 0 || quant->head(0).size() != middle || n <= 0) return false;
    DeviceScope scope(device_id_);
    const int32_t d = quant->head_dim(), group = job.group;
    const int64_t heads = quant->n_kv_heads(), q_heads = heads * group;
    const int threads = job.n_threads;
    const IndexMirror* mirror = quant_mirror(*quant, job.sequence, job.layer, stream);
    if (mirror == nullptr) return false;  // over config.device_bytes_limit, or the device is full: the host attends
    const dm::QuantLayout l = quant_in_use(*quant, *mirror);
    const DeviceArray<float> q(static_cast<size_t>(q_heads * d), stream);
    load_query(*job.q, q.get(), q_heads, d, false, threads, stream);
    // the low-bit logits at select's scale, and the candidates (select's, from a copy of them)
    const float select_scale = 1.0f / std::sqrt(static_cast<float>(d));
    const DeviceArray<float> low(static_cast<size_t>(q_heads * middle), stream);
    quant_low_logits(Uploaded<dm::QuantLayout>({l}, stream), q.get(), low.get(), middle, group, select_scale, threads,
                     stream);
    const int64_t candidates = quant->rerank() > 1 && job.count > 0 ? std::min(middle, job.count * quant->rerank()) : 0;
    std::vector<int32_t> cand(static_cast<size_t>(heads * candidates));
    if (candidates > 0) {  // select's candidates (QuantRetriever::low_bit_candidates): by the maximum logit
      const DeviceArray<int32_t> positions(cand.size(), stream);
      const DeviceArray<float> folded(static_cast<size_t>(heads * middle), stream);
      select_top(1, threads, heads, middle, candidates, KVRET_FOLD_MAX_LOGIT, group, {static_cast<int32_t>(middle)},
                 {static_cast<int32_t>(begin)}, low.get(), nullptr, folded.get(), positions.get(), stream);
      copy_bytes(cand.data(), positions.get(), cand.size() * sizeof(int32_t), stream, true);
    }
    // the rows read exactly: per head its slot map and its rows' keys (and values where exact), as attend_dense
    // decides them
    std::vector<int32_t> slot(static_cast<size_t>(heads * n));
    std::vector<uint8_t> kind(static_cast<size_t>(heads * n));  // 0 low-bit, 1 exact key, 2 exact row
    int64_t key_only = 0, rows = 0;
    for (int64_t h = 0; h < heads; ++h) {
      uint8_t* k = kind.data() + h * n;
      for (int64_t t = 0; t < n; ++t) k[t] = t >= begin && t < end ? 0 : 2;
      for (int64_t i = 0; i < candidates; ++i) k[cand[static_cast<size_t>(h * candidates + i)]] = 1;
      int64_t head_key_only = candidates;
      for (int64_t i = 0; i < job.count; ++i) {
        const int32_t t = job.selected[h][i];
        if (t < begin || t >= end) continue;
        head_key_only -= k[t] == 1;
        k[t] = 2;
      }
      key_only += head_key_only;
      int64_t exact = 0;
      for (int64_t t = 0; t < n; ++t) exact += k[t] != 0;
      rows = std::max(rows, exact);
    }
    std::vector<uint8_t> exact_value(static_cast<size_t>(heads * rows), 0);
    std::vector<int32_t> exact_row(static_cast<size_t>(heads * rows), 0), exact_count(static_cast<size_t>(heads), 0);
    std::vector<dm::RowCopy> copies;  // the exact rows, read from the pinned pages on the device
    int64_t spans = 1;
    for (int64_t h = 0; h < heads; ++h) {
      int32_t next = 0;
      int32_t& exact_rows = exact_count[static_cast<size_t>(h)];
      for (int64_t t = 0; t < n; ++t) {
        const uint8_t k = kind[static_cast<size_t>(h * n + t)];
        if (k == 0) {
          slot[static_cast<size_t>(h * n + t)] = -1;
          continue;
        }
        exact_value[static_cast<size_t>(h * rows + next)] = k == 2 ? 1 : 0;
        if (k == 2) exact_row[static_cast<size_t>(h * rows + exact_rows++)] = next;
        copies.push_back({store.key_row(static_cast<int>(h), t), store.value_row(static_cast<int>(h), t), h, next,
                          static_cast<int32_t>(t)});
        slot[static_cast<size_t>(h * n + t)] = next++;
      }
      const int64_t span = cuda::math::attend_span_rows(exact_rows);
      spans = std::max(spans, (exact_rows + span - 1) / span);
    }
    const DeviceArray<int32_t> slot_d(slot.size(), stream), exact_row_d(exact_row.size(), stream),
        exact_count_d(exact_count.size(), stream);
    const DeviceArray<uint8_t> exact_value_d(exact_value.size(), stream);
    const DeviceArray<float> keys_d(static_cast<size_t>(heads * rows * d), stream), values_d(keys_d.size(), stream);
    const DeviceArray<dm::RowCopy> copies_d(copies.size(), stream);
    upload(slot_d.get(), slot.data(), slot.size() * sizeof(int32_t), stream);
    upload(exact_row_d.get(), exact_row.data(), exact_row.size() * sizeof(int32_t), stream);
    upload(exact_count_d.get(), exact_count.data(), exact_count.size() * sizeof(int32_t), stream);
    upload(exact_value_d.get(), exact_value.data(), exact_value.size(), stream);
    upload(copies_d.get(), copies.data(), copies.size() * sizeof(dm::RowCopy), stream);
    for_each_index(stream, threads, static_cast<int64_t>(copies.size()) * d,
                   dm::QuantExactLoad{copies_d.get(), exact_value_d.get(), keys_d.get(), values_d.get(), rows,
                                      static_cast<int32_t>(store.dtype()), d});
    const dm::QuantExactRows x{slot_d.get(), exact_value_d.get(), keys_d.get(),        values_d.get(),
                               rows,         exact_row_d.get(),   exact_count_d.get(), spans};
    // the exact rows: attend's spans (scores, the online softmax's steps, the weighted values)
    const DeviceArray<float> weights(static_cast<size_t>(q_heads * rows), stream),
        alpha(static_cast<size_t>(q_heads * dm::QuantExactState::blocks(rows)), stream),
        span_max(static_cast<size_t>(q_heads * spans), stream),
        span_acc(static_cast<size_t>(q_heads * spans * d), stream);
    const DeviceArray<double> span_sum(span_max.size(), stream), exact_max(static_cast<size_t>(q_heads), stream),
        share(exact_max.size(), stream);
    const DeviceArray<uint8_t> nan(exact_max.size(), stream);
    const dm::QuantExactState st{weights.get(),  alpha.get(),     span_max.get(), span_sum.get(),
                                 span_acc.get(), exact_max.get(), share.get(),    nan.get()};
    for_each_index(stream, threads, q_heads * rows, dm::QuantExactScores{x, st, q.get(), d, group, job.scale});
    for_each_index(stream, threads, q_heads * spans, dm::QuantExactSpans{x, st, group});
    for_each_index(stream, threads, q_heads * spans * d, dm::QuantExactValues{x, st, d, group});
    // the other tokens' logits, the weights and the output
    const DeviceArray<double> logits(static_cast<size_t>(q_heads * n), stream), z(static_cast<size_t>(q_heads), stream);
    for_each_index(stream, threads, q_heads * n,
                   dm::QuantAttendLogits{x, q.get(), low.get(), logits.get(), n, begin, middle, d, group, job.scale,
                                         cuda::math::quant_rescale(job.scale, select_scale)});
    for_each_index(stream, threads, q_heads, dm::QuantAttendWeights{x, st, logits.get(), z.get(), n, group});
    for_each_index(stream, threads, q_heads * d,
                   dm::QuantAttendOutput{l, x, st, logits.get(), z.get(), device_tensor(*job.out), n, begin, group});
    *key_rows = key_only;
    return true;  // the temporaries are freed in stream order after the passes
  }

 private:
  /// The best `k` entries of each of n_jobs jobs' `segments` rows of `width` (per job segments / n_jobs rows):
  /// the rows folded to the KV heads into `folded` [segments, width] (one pass over `logits` [segments x group,
  /// width], `fold`: MAX_LOGIT the logits, SUM_PROB the softmax's terms with `softmax` per query head), then per row
  /// its k best entries into `out` [segments, k], ascending, each plus its job's `offsets` entry (none where
  /// empty): score descending, every NaN lowest, -0 as +0, ties to the lower entry (kernels/math/topk_math.h's order
  /// keys: the CPU's order, gqa_fold.cpp's fold_logits and topk.hpp's take_top_tokens bit for bit). A job's rows are
  /// read to its `tokens[job]` entries (>= k), never into the padding. On a GPU the top-k kernel of
  /// kernels/topk_select selects, one launch for every row; elsewhere (Thrust's host system, or rows past its int32
  /// fields) reference_top, the same contract in Thrust passes.
  void select_top(int64_t n_jobs, int n_threads, int64_t segments, int64_t width, int64_t k, int32_t fold,
                  int32_t group, std::vector<int32_t> tokens, const std::vector<int32_t>& offsets, const float* logits,
                  const cuda::math::PageSoftmax* softmax, float* folded, int32_t* out, kvret_stream stream) {
    for (const int32_t n : tokens)  // every caller takes at most a row's tokens: a bug otherwise
      if (n < k)
        throw Error(KVRET_ERR_INTERNAL, "token top-k of " + std::to_string(k) + " from a row of " + std::to_string(n));
    tokens.insert(tokens.end(), offsets.begin(), offsets.end());
    const Uploaded<int32_t> per_job(std::move(tokens), stream);  // tokens, then the offsets
    const int32_t* offset_of = offsets.empty() ? nullptr : per_job.device.get() + n_jobs;
    for_each_index(stream, n_threads, segments * width,
                   dm::TokenFold{logits, softmax, folded, width, group, fold == KVRET_FOLD_MAX_LOGIT});
#if KVRET_ON_GPU
    if (width <= INT32_MAX && segments <= INT32_MAX && k <= INT32_MAX) {
      cuda::TopkParams p;
      p.n_seqs = static_cast<int32_t>(n_jobs);
      p.n_kv_heads = static_cast<int32_t>(segments / n_jobs);
      p.scores = folded;
      p.score_stride = width;
      p.n_tokens = per_job.device.get();
      p.k = static_cast<int32_t>(k);
      p.position_offset = offset_of;
      p.positions = out;
      p.positions_stride = k;
      note_pass();
      check_cuda(cuda::launch_topk_positions(p, cuda_stream(stream)), "launch_topk_positions");
      return;  // the temporaries are freed in stream order after the launch
    }
#endif
    reference_top(n_threads, segments, width, k, segments / n_jobs, per_job.device.get(), offset_of, folded, out,
                  stream);
  }

  /// Sorts each row of `width` entries of `keys` [rows x width] ascending: one sort of every key with its entry
  /// index, then a stable sort by the index's row (`row`: scratch of the same size). Afterwards `keys` holds each
  /// row's keys in order and `index` their entries' indexes; `index` comes in as the identity.
  void sort_in_rows(uint64_t* keys, int64_t* index, int64_t* row, int64_t entries, int64_t width, int n_threads,
                    kvret_stream stream) {
    with_policy(stream, n_threads, entries,
                [&](const auto& policy) { thrust::sort_by_key(policy, keys, keys + entries, index); });
    for_each_index(stream, n_threads, entries, dm::PageHeadOfIndex{index, row, width});
    with_policy(stream, n_threads, entries, [&](const auto& policy) {
      thrust::stable_sort_by_key(policy, row, row + entries,
                                 thrust::make_zip_iterator(thrust::make_tuple(keys, index)));
    });
  }

  /// The top-k kernel's contract (kernels/topk_select.h) in Thrust passes, select_top's reference: per row of
  /// `width` folded scores (rows of a job `heads` in a row, read to its `tokens` entries) the order keys (padding
  /// last), one sort of them with their entry, a stable sort by row (each row's entries best first), the first k of
  /// each row, and a sort of those (ascending per row) into `out` [segments, k], plus the job's offset.
  void reference_top(int n_threads, int64_t segments, int64_t width, int64_t k, int64_t heads, const int32_t* tokens,
                     const int32_t* offsets, const float* folded, int32_t* out, kvret_stream stream) {
    const int64_t entries = segments * width, picked = segments * k;
    const DeviceArray<uint64_t> keys(static_cast<size_t>(entries), stream), pick(static_cast<size_t>(picked), stream);
    const DeviceArray<int64_t> index(keys.size(), stream), row(keys.size(), stream);
    for_each_index(stream, n_threads, entries,
                   dm::TopkOrderKeys{folded, tokens, keys.get(), index.get(), width, heads});
    sort_in_rows(keys.get(), index.get(), row.get(), entries, width, n_threads, stream);
    for_each_index(stream, n_threads, picked, dm::TopkPick{index.get(), pick.get(), width, k});
    with_policy(stream, n_threads, picked,
                [&](const auto& policy) { thrust::sort(policy, pick.get(), pick.get() + picked); });
    for_each_index(stream, n_threads, picked, dm::TopkEntries{pick.get(), offsets, out, heads});
  }

  /// The jobs' middle lengths (first = false) or first positions (first = true), as select_top takes them
  /// (positions are int32 in every kvret tensor).
  static std::vector<int32_t> middles(const FusedJobs& jobs, bool first) {
    std::vector<int32_t> v;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const SelectRequest& r = jobs.job(i).request;
      v.push_back(static_cast<int32_t>(first ? r.mid_begin : r.mid_end - r.mid_begin));
    }
    return v;
  }

  /// The request.budget best tokens of each of the jobs' `segments` rows of `width` logits (`softmax` as select_top
  /// takes it; each job's row read to its middle, or to `tokens` > 0 entries), and one pass writing each job's
  /// positions and folded scores (`positions` [segments, width]: each entry's position; null: its job's middle
  /// start plus the entry).
  void top_write(const FusedJobs& jobs, int64_t segments, int64_t width, int64_t tokens, const float* logits,
                 const cuda::math::PageSoftmax* softmax, const int32_t* positions, kvret_stream stream) {
    const SelectRequest& r = jobs.job(0).request;
    const DeviceArray<float> folded(static_cast<size_t>(segments * width), stream);
    const DeviceArray<int32_t> index(static_cast<size_t>(segments * r.budget), stream);
    select_top(static_cast<int64_t>(jobs.size()), r.n_threads, segments, width, r.budget, r.fold, r.group,
               tokens > 0 ? std::vector<int32_t>(jobs.size(), static_cast<int32_t>(tokens)) : middles(jobs, false), {},
               logits, softmax, folded.get(), index.get(), stream);
    for_each_index(stream, r.n_threads, segments * r.budget,
                   dm::TopkWrite{index.get(), folded.get(), positions, jobs.base_of(), jobs.outs(), jobs.scores(),
                                 r.budget, segments / static_cast<int64_t>(jobs.size()), width});
  }

  /// The top request.budget tokens of each of the jobs' `segments` rows of logits (top_write after the softmax under
  /// SUM_PROB, which replaces the logits by its terms), their positions and scores written into each job's tensors:
  /// rows of jobs.width(), each job's read to its middle (EXACT's and QUANT's selects), or with `candidates` > 0
  /// rows of that many entries whose positions are `positions` [segments, candidates] (QUANT's re-ranking).
  void top_and_write(const FusedJobs& jobs, int64_t segments, float* logits, kvret_stream stream,
                     int64_t candidates = 0, const int32_t* positions = nullptr) {
    const SelectRequest& r = jobs.job(0).request;
    const int64_t heads = segments / static_cast<int64_t>(jobs.size());
    const int64_t width = candidates > 0 ? candidates : jobs.width();
    const DeviceArray<cuda::math::PageSoftmax> softmax(static_cast<size_t>(segments * r.group), stream);
    if (r.fold != KVRET_FOLD_MAX_LOGIT)
      for_each_index(
          stream, r.n_threads, segments * r.group,
          dm::QuantSoftmaxes{logits, softmax.get(), width, candidates > 0 ? nullptr : jobs.n_of(), heads * r.group});
    top_write(jobs, segments, width, candidates, logits, softmax.get(), positions, stream);
  }

  /// The KVCrush signatures' copy of (sequence, layer) brought up to `c`: the rows appended since the epoch it holds
  /// are copied in (every row when it was made or grown, or when the epoch changed). Null, with no copy kept, when it
  /// would pass config.device_bytes_limit or the device cannot hold it.
  const CrushMirror* crush_mirror(const DeviceCrush& c, const void* sequence, int32_t layer, kvret_stream stream) {
    std::lock_guard<std::mutex> lock(caches_mutex_);
    CrushMirror& m = crush_mirrors_[{sequence, layer}];
    int64_t from = m.bits && m.epoch == c.epoch && m.words == c.words && m.tokens <= c.tokens ? m.tokens : 0;
    if (c.tokens > m.capacity || m.words != c.words) {
      const int64_t capacity = std::max<int64_t>({c.tokens, m.capacity + m.capacity / 2, 256});
      m = CrushMirror{};  // the old copy goes first: the new one may need its share of the budget
      try {
        const size_t words = static_cast<size_t>(capacity) * static_cast<size_t>(c.words);
        m.share = std::make_unique<BudgetShare>(words * sizeof(uint64_t), budget_);
        m.bits = std::make_unique<DeviceArray<uint64_t>>(words);
      } catch (const std::bad_alloc&) {
        crush_mirrors_.erase({sequence, layer});
        return nullptr;
      } catch (const Error& e) {
        crush_mirrors_.erase({sequence, layer});
        if (e.status() != KVRET_ERR_CAPACITY) throw;
        return nullptr;
      }
      m.capacity = capacity;
      m.words = c.words;
      from = 0;
    }
    try {
      if (from < c.tokens)
        upload(m.bits->get() + from * c.words, c.bits + from * c.words,
               static_cast<size_t>((c.tokens - from) * c.words) * sizeof(uint64_t), stream);
    } catch (...) {
      crush_mirrors_.erase({sequence, layer});
      throw;
    }
    m.epoch = c.epoch;
    m.tokens = c.tokens;
    return &m;
  }

  /// KVCrush's representatives added on the device (kvcrush_select_ops.hpp) to the important part the select's
  /// passes wrote (request.budget per head) for every job of `jobs` (one select, or a fused batch of one kind,
  /// budget and shape; `mirrors` their signatures' copies) in one set of passes, ordered on `stream`: each row
  /// becomes kvcrush_selected_count entries.
  void crush_passes(const std::vector<const DeviceSelectJob*>& jobs, const std::vector<const CrushMirror*>& mirrors,
                    kvret_stream stream) {
    const SelectRequest& r = jobs[0]->request;
    const int64_t n_important = r.budget, heads = jobs[0]->out->dim(0);
    std::vector<dm::CrushJob> work;
    int64_t width = 0, buckets = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const DeviceSelectJob& job = *jobs[i];
      const int64_t m = job.request.mid_end - job.request.mid_begin;
      const int64_t b = cuda::math::kvcrush_bucket_count(job.crush->representatives, m);
      dm::CrushJob c{};
      c.bits = mirrors[i]->bits->get();
      c.out = device_tensor(*job.out);
      if (job.scores != nullptr) c.scores = device_tensor(*job.scores);
      c.m = m;
      c.mid_begin = job.request.mid_begin;
      c.buckets = b > 0 && n_important < m ? b : 0;  // else no candidate: the important row is the row
      c.words = job.crush->words;
      c.heads = job.crush->heads;
      width = std::max(width, m);
      buckets = std::max(buckets, c.buckets);
      work.push_back(c);
    }
    if (buckets == 0) return;
    const int threads = r.n_threads;
    const Uploaded<dm::CrushJob> on_device(std::move(work), stream);
    const dm::CrushJob* cj = on_device.device.get();
    const auto n_jobs = static_cast<int64_t>(jobs.size());
    const int64_t entries = n_jobs * width, rows = n_jobs * heads, cells = rows * width;
    const dm::CrushShape shape{heads, width, buckets};
    const DeviceArray<uint64_t> keys(static_cast<size_t>(entries), stream);
    const DeviceArray<int64_t> index(keys.size(), stream), job_of(keys.size(), stream);
    const DeviceArray<int64_t> important(static_cast<size_t>(cells), stream), chosen(important.size(), stream),
        is_free(important.size(), stream), free_before(important.size(), stream), rep(important.size(), stream),
        important_below(rep.size(), stream), rep_below(rep.size(), stream),
        none(static_cast<size_t>(rows * buckets), stream), missing(static_cast<size_t>(rows), stream);
    const DeviceArray<float> score(static_cast<size_t>(cells), stream);
    // each job's middle in the grouping's order
    for_each_index(stream, threads, entries, dm::CrushOrderKeys{cj, keys.get(), index.get(), width});
    sort_in_rows(keys.get(), index.get(), job_of.get(), entries, width, threads, stream);
    for_each_index(stream, threads, cells, dm::CrushClear{important.get(), chosen.get(), rep.get()});
    if (n_important > 0)
      for_each_index(stream, threads, rows * n_important,
                     dm::CrushMarkImportant{cj, important.get(), score.get(), shape, n_important});
    for_each_index(stream, threads, rows * buckets,
                   dm::CrushBuckets{cj, keys.get(), important.get(), chosen.get(), none.get(), shape});
    for_each_index(stream, threads, rows, dm::CrushMissing{none.get(), missing.get(), buckets});
    for_each_index(stream, threads, cells,
                   dm::CrushFree{cj, keys.get(), important.get(), chosen.get(), is_free.get(), shape});
    const auto scan = [&](const int64_t* in, int64_t* below) {  // exclusive, per (job, head)
      with_policy(stream, threads, cells, [&](const auto& policy) {
        const auto row_of = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), dm::HeadOf{width});
        thrust::exclusive_scan_by_key(policy, row_of, row_of + cells, in, below);
      });
    };
    scan(is_free.get(), free_before.get());
    for_each_index(stream, threads, cells,
                   dm::CrushChoose{cj, keys.get(), chosen.get(), is_free.get(), free_before.get(), missing.get(),
                                   rep.get(), shape});
    scan(important.get(), important_below.get());
    scan(rep.get(), rep_below.get());
    for_each_index(
        stream, threads, cells,
        dm::CrushWrite{cj, important.get(), rep.get(), important_below.get(), rep_below.get(), score.get(), shape});
  }

  /// The mirror of (sequence, layer) brought up to `pq`'s index: while the index only appended since the version
  /// it holds (the same layout_version), the new tokens' items and exact keys are sent, with the cell counts and
  /// exact counts; after a training, a cut or a restore, or when it no longer fits (grown by half), all of it.
  /// Null, with no mirror kept, when it would pass config.device_bytes_limit or the device cannot hold it.
  const IndexMirror* pq_mirror(const PqRetriever& pq, const void* sequence, int32_t layer, kvret_stream stream) {
    const int64_t heads = pq.n_kv_heads(), n = pq.size();
    int64_t max_exact = 0;
    for (int h = 0; h < heads; ++h)
      max_exact = std::max<int64_t>(max_exact, static_cast<int64_t>(pq.exact_positions(h).size()));
    std::lock_guard<std::mutex> lock(caches_mutex_);
    IndexMirror& m = mirrors_[{sequence, layer}];
    if (m.retriever == &pq && m.data && m.version == pq.version()) return &m;
    bool whole = m.retriever != &pq || !m.data || m.pq.layout_version != pq.layout_version() || m.pq.tokens > n;
    if (!m.data || n > m.pq.token_capacity || max_exact > m.pq.exact_capacity) {
      const int64_t tokens = std::max<int64_t>({n, m.pq.token_capacity + m.pq.token_capacity / 2, 256});
      const int64_t exacts = std::max<int64_t>({max_exact, m.pq.exact_capacity + m.pq.exact_capacity / 2, 16});
      if (!remake_mirror(m, sequence, layer, pq_mirror_bytes(pq, tokens, exacts))) return nullptr;
      m.pq.token_capacity = tokens;
      m.pq.exact_capacity = exacts;
      whole = true;
    }
    return update_mirror(m, sequence, layer, &pq, pq.version(), [&] {
      const dm::PqLayout l = pq_layout(m.data->get(), pq, m.pq.token_capacity, m.pq.exact_capacity);
      const int64_t book = int64_t{l.m} * l.k * l.dsub;
      if (whole) {
        m.pq.tokens = 0;
        m.pq.exacts.assign(static_cast<size_t>(heads), 0);
        for (int h = 0; h < heads; ++h)
          upload(const_cast<float*>(l.codebook) + h * book, pq.centroids(h, 0), static_cast<size_t>(book) * 4, stream);
      }
      std::vector<int32_t> counts(static_cast<size_t>(heads * l.cells)), exacts(static_cast<size_t>(heads));
      std::vector<int32_t> items(static_cast<size_t>(n - m.pq.tokens));
      for (int h = 0; h < heads; ++h) {
        if (l.cells > 0) std::copy(pq.cell_counts(h).begin(), pq.cell_counts(h).end(), counts.begin() + h * l.cells);
        if (l.cells == 0 && n > m.pq.tokens)  // the new tokens' codes
          upload(const_cast<uint8_t*>(l.codes) + (h * l.capacity + m.pq.tokens) * l.m, pq.codes(h) + m.pq.tokens * l.m,
                 static_cast<size_t>((n - m.pq.tokens) * l.m), stream);
        const auto e = static_cast<int64_t>(pq.exact_positions(h).size());
        exacts[static_cast<size_t>(h)] = static_cast<int32_t>(e);
        if (!items.empty()) {
          pq.items(h, m.pq.tokens, n, items.data());  // (a copy from pageable memory returns once its bytes are
                                                      // staged, so the host array may change or go)
          upload(const_cast<int32_t*>(l.items) + h * l.capacity + m.pq.tokens, items.data(), items.size() * 4, stream);
        }
        const int64_t sent = m.pq.exacts[static_cast<size_t>(h)];
        if (e > sent) {
          const std::vector<float> keys = pq.exact_keys_f32(h, sent);
          upload(const_cast<float*>(l.exact_keys) + (h * l.exact_capacity + sent) * l.d, keys.data(), keys.size() * 4,
                 stream);
        }
        m.pq.exacts[static_cast<size_t>(h)] = e;
      }
      if (!counts.empty()) upload(const_cast<int32_t*>(l.counts), counts.data(), counts.size() * 4, stream);
      upload(const_cast<int32_t*>(l.n_exact), exacts.data(), exacts.size() * 4, stream);
      m.pq.tokens = n;
      m.pq.layout_version = pq.layout_version();
    });
  }

  /// The layout of `pq`'s copy in `mirror`, with its tokens and most exact tokens of a head set.
  static dm::PqLayout pq_in_use(const PqRetriever& pq, const IndexMirror& mirror) {
    dm::PqLayout l = pq_layout(mirror.data->get(), pq, mirror.pq.token_capacity, mirror.pq.exact_capacity);
    l.tokens = pq.size();
    for (int h = 0; h < pq.n_kv_heads(); ++h)
      l.max_exact = std::max<int64_t>(l.max_exact, static_cast<int64_t>(pq.exact_positions(h).size()));
    return l;
  }

  /// PQ's select on the device (pq_select_ops.hpp), q already loaded: false, having written nothing, where the
  /// mirror cannot be made.
  bool pq_select(const PqRetriever& pq, const DeviceSelectJob& job, const float* q, kvret_stream stream) {
    const IndexMirror* mirror = pq_mirror(pq, job.sequence, job.layer, stream);
    if (mirror == nullptr) return false;  // over config.device_bytes_limit, or the device is full: the host selects
    pq_select(FusedJobs({&job}, stream), {mirror}, q, stream);
    return true;
  }

  /// PQ's select on the device (pq_select_ops.hpp) for every job of `jobs` (PQ selects of one budget and shape;
  /// `mirrors` their copies) in one set of passes, q already loaded ([jobs, n_q_heads, d]): the tables, then the
  /// cell path (the items' logits, the fold and grouped take over the items, then per token whether it is taken and
  /// where it goes) or the per-token path (every token's logit, the fold, a top-k), and the write of the positions
  /// and scores.
  void pq_select(const FusedJobs& jobs, const std::vector<const IndexMirror*>& mirrors, const float* q,
                 kvret_stream stream) {
    const SelectRequest& r = jobs.job(0).request;
    std::vector<dm::PqLayout> layouts;
    int64_t max_exact = 0, max_tokens = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      layouts.push_back(pq_in_use(*dynamic_cast<const PqRetriever*>(jobs.job(i).retriever->selects_as()), *mirrors[i]));
      max_exact = std::max(max_exact, layouts.back().max_exact);
      max_tokens = std::max(max_tokens, layouts.back().tokens);
    }
    const Uploaded<dm::PqLayout> l(std::move(layouts), stream);
    const dm::PqLayout& first = l.host[0];
    const int64_t jobs_n = static_cast<int64_t>(jobs.size());
    const int64_t heads = r.n_q_heads / r.group, segments = heads * jobs_n, rows = r.n_q_heads * jobs_n;
    const int64_t mk = int64_t{first.m} * first.k;
    const int threads = r.n_threads;
    const DeviceArray<float> lut(static_cast<size_t>(rows * mk), stream);
    for_each_index(stream, threads, rows * mk,
                   dm::PqLut{l.device.get(), q, lut.get(), r.n_q_heads, mk, r.group, r.scale});
    const dm::PqLayout* layout = l.device.get();
    if (first.cells == 0) {  // the per-token path
      const int64_t width = max_tokens;
      const bool pq4 = first.m == 4 && first.k <= 64 && r.fold == KVRET_FOLD_SUM_PROB;
      const DeviceArray<float> logits(static_cast<size_t>(rows * width), stream);
      const DeviceArray<dm::PqTokenHead> head(static_cast<size_t>(rows), stream);
      const DeviceArray<cuda::math::PageSoftmax> softmax(static_cast<size_t>(rows), stream);
      for_each_index(stream, threads, rows * width,
                     dm::PqTokenLogits{layout, q, lut.get(), logits.get(), width, r.n_q_heads, r.group, r.scale});
      if (r.fold != KVRET_FOLD_MAX_LOGIT) {
        for_each_index(stream, threads, rows,
                       dm::PqTokenHeads{layout, lut.get(), logits.get(), head.get(), width, r.n_q_heads, r.group, pq4});
        for_each_index(stream, threads, rows * width,
                       dm::PqTokenTerms{layout, lut.get(), head.get(), logits.get(), width, r.n_q_heads, r.group, pq4});
        for_each_index(
            stream, threads, rows,
            dm::PqTokenSums{layout, head.get(), logits.get(), softmax.get(), width, r.n_q_heads, r.group, pq4});
      }
      top_write(jobs, segments, width, 0, logits.get(), softmax.get(), nullptr, stream);
      return;
    }
    const int64_t items = first.cells + max_exact, entries = segments * items, tokens = segments * max_tokens;
    const DeviceArray<float> logits(static_cast<size_t>(rows * items), stream),
        folded(static_cast<size_t>(entries), stream);
    const DeviceArray<cuda::math::PageSoftmax> softmax(static_cast<size_t>(rows), stream);
    const DeviceArray<int64_t> taken(static_cast<size_t>(entries), stream), offset(taken.size(), stream);
    for_each_index(stream, threads, rows * items,
                   dm::PqItemLogits{layout, q, lut.get(), logits.get(), items, r.n_q_heads, r.group, r.scale});
    if (r.fold != KVRET_FOLD_MAX_LOGIT)
      for_each_index(stream, threads, rows,
                     dm::PqSoftmaxes{layout, logits.get(), softmax.get(), items, r.n_q_heads, r.group});
    take_passes(
        segments, items, r, logits.get(), softmax.get(), folded.get(), taken.get(), offset.get(),
        [&](const int64_t* index, int64_t* weight) {
          for_each_index(stream, threads, entries, dm::PqSortedWeights{layout, index, weight, items, heads});
        },
        stream);
    // per token: the rank in the trimmed cell, then whether it is taken and where it goes
    const DeviceArray<int64_t> flag(static_cast<size_t>(tokens), stream), scan(flag.size(), stream);
    const auto scan_per_head = [&](const int64_t* in, int64_t* out) {
      with_policy(stream, threads, tokens, [&](const auto& policy) {
        const auto head_of =
            thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), dm::HeadOf{max_tokens});
        thrust::exclusive_scan_by_key(policy, head_of, head_of + tokens, in, out);
      });
    };
    for_each_index(stream, threads, tokens, dm::PqTrimmed{layout, taken.get(), flag.get(), items, max_tokens, heads});
    scan_per_head(flag.get(), scan.get());
    for_each_index(stream, threads, tokens,
                   dm::PqTaken{layout, taken.get(), scan.get(), flag.get(), items, max_tokens, heads});
    scan_per_head(flag.get(), scan.get());
    for_each_index(stream, threads, tokens,
                   dm::PqWrite{layout, flag.get(), scan.get(), folded.get(), jobs.outs(), jobs.scores(), jobs.base_of(),
                               items, max_tokens, heads});
  }

  /// The passes PAGE and CLUSTER share, over n groups per KV head whose logits (MAX_LOGIT) or softmax terms and
  /// softmaxes (SUM_PROB) are computed: the fold and order keys, the two stable sorts (per head the groups best
  /// first), sorted_weights(index, weight) writing each sorted group's tokens, the inclusive scan, the take and the
  /// exclusive scan: taken [heads, n] in group order and offset, where each group's tokens go in its head's row.
  template <class SortedWeights>
  void take_passes(int64_t heads, int64_t n, const SelectRequest& r, const float* logits,
                   const cuda::math::PageSoftmax* softmax, float* folded, int64_t* taken, int64_t* offset,
                   const SortedWeights& sorted_weights, kvret_stream stream) {
    const int64_t entries = heads * n;
    const int threads = r.n_threads;
    const DeviceArray<uint64_t> keys(static_cast<size_t>(entries), stream);
    const DeviceArray<int64_t> index(keys.size(), stream), head(keys.size(), stream), weight(keys.size(), stream),
        upto(keys.size(), stream);
    for_each_index(
        stream, threads, entries,
        dm::PageFold{logits, softmax, folded, keys.get(), index.get(), n, r.group, r.fold == KVRET_FOLD_MAX_LOGIT});
    with_policy(stream, threads, entries, [&](const auto& policy) {
      thrust::stable_sort_by_key(policy, keys.get(), keys.get() + entries, index.get());
    });
    for_each_index(stream, threads, entries, dm::PageHeadOfIndex{index.get(), head.get(), n});
    with_policy(stream, threads, entries, [&](const auto& policy) {
      thrust::stable_sort_by_key(policy, head.get(), head.get() + entries, index.get());
    });
    sorted_weights(static_cast<const int64_t*>(index.get()), weight.get());
    with_policy(stream, threads, entries, [&](const auto& policy) {
      const auto head_of = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), dm::HeadOf{n});
      thrust::inclusive_scan_by_key(policy, head_of, head_of + entries, weight.get(), upto.get());
    });
    for_each_index(stream, threads, entries, dm::PageTake{index.get(), weight.get(), upto.get(), taken, r.budget});
    with_policy(stream, threads, entries, [&](const auto& policy) {
      const auto head_of = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), dm::HeadOf{n});
      thrust::exclusive_scan_by_key(policy, head_of, head_of + entries, taken, offset);
    });
  }

  /// PAGE's select on the device (page_select_ops.hpp) for every job of `jobs` (PAGE selects of one budget and
  /// shape, made with FusedJobs' unit = page_size; `mirrors` theirs) in one set of passes, q already loaded
  /// ([jobs, n_q_heads, d]), ordered on `stream`.
  void page_select(const FusedJobs& jobs, const std::vector<const IndexMirror*>& mirrors, const float* q,
                   kvret_stream stream) {
    const auto* page = dynamic_cast<const PageRetriever*>(jobs.job(0).retriever->selects_as());
    const SelectRequest& r = jobs.job(0).request;
    const int32_t d = page->head_dim(), group = r.group, page_size = page->page_size();
    const int64_t heads = page->n_kv_heads(), width = jobs.width();
    const int64_t segments = heads * static_cast<int64_t>(jobs.size()), q_heads = segments * group;
    const int64_t entries = segments * width;
    const int threads = r.n_threads;
    std::vector<dm::PageBounds> bounds;
    for (const IndexMirror* m : mirrors) bounds.push_back({m->bounds(), m->capacity});
    const Uploaded<dm::PageBounds> device_bounds(std::move(bounds), stream);
    const DeviceArray<float> split(static_cast<size_t>(q_heads * 2 * d), stream);
    for_each_index(stream, threads, q_heads, dm::PageSplitQuery{q, split.get(), d});
    const DeviceArray<float> logits(static_cast<size_t>(q_heads * width), stream),
        folded(static_cast<size_t>(entries), stream);
    const DeviceArray<cuda::math::PageSoftmax> softmax(static_cast<size_t>(q_heads), stream);
    const DeviceArray<int64_t> taken(static_cast<size_t>(entries), stream), offset(taken.size(), stream);
    for_each_index(stream, threads, q_heads * width,
                   dm::PageLogits{split.get(), device_bounds.device.get(), logits.get(), jobs.n_of(), width, heads, d,
                                  group, r.scale});
    if (r.fold != KVRET_FOLD_MAX_LOGIT)
      for_each_index(stream, threads, q_heads,
                     dm::PageSoftmaxes{logits.get(), softmax.get(), jobs.n_of(), jobs.tokens_of(), width, heads * group,
                                       page_size});
    take_passes(
        segments, width, r, logits.get(), softmax.get(), folded.get(), taken.get(), offset.get(),
        [&](const int64_t* index, int64_t* weight) {
          for_each_index(stream, threads, entries,
                         dm::PageSortedWeights{index, weight, jobs.n_of(), jobs.tokens_of(), width, heads, page_size});
        },
        stream);
    for_each_index(stream, threads, entries,
                   dm::PageWrite{taken.get(), offset.get(), folded.get(), jobs.outs(), jobs.scores(), jobs.base_of(),
                                 width, heads, page_size});
  }

  void synchronize_device() {
    note_wait();
#if KVRET_ON_GPU
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
  }

  /// The cache of (sequence, layer), made at its first use, its table covering the layer's complete blocks; null
  /// without one (no slots, no sequence, or no room for it under config.device_bytes_limit or on the device: that
  /// fetch reads every row from the host store, and a later one tries again).
  LayerCache* cache_of(const HostKvStore& store, const void* sequence, int32_t layer, kvret_stream stream,
                       int n_threads) {
    if (n_slots_ <= 0 || sequence == nullptr) return nullptr;
    LayerCache* cache = nullptr;
    {
      std::lock_guard<std::mutex> lock(caches_mutex_);
      const auto it = caches_.find({sequence, layer});
      if (it != caches_.end()) cache = it->second.get();
    }
    if (cache == nullptr) {
      std::unique_ptr<LayerCache> made;
      try {
        made = std::make_unique<LayerCache>(store.n_kv_heads(), n_slots_, block_tokens_, store.row_bytes(), sink_rows_,
                                            local_rows_, budget_, stream, n_threads);
      } catch (const std::bad_alloc&) {
        return nullptr;
      } catch (const Error& e) {
        if (e.status() != KVRET_ERR_CAPACITY) throw;
        return nullptr;
      }
      std::lock_guard<std::mutex> lock(caches_mutex_);
      cache = (caches_[{sequence, layer}] = std::move(made)).get();
    }
    cache->cover(store.size() / block_tokens_, stream, n_threads);
    return cache;
  }

  /// cache_of for a gather: the cache's windows loaded with the rows they are to hold (their bytes added to the
  /// sequence's loaded bytes). A failure takes the cache (its windows may be half loaded); out of device memory
  /// the gather runs without one.
  LayerCache* gather_cache_of(const HostKvStore& store, const void* sequence, int32_t layer, kvret_stream stream,
                              int n_threads) {
    LayerCache* cache = cache_of(store, sequence, layer, stream, n_threads);
    if (cache == nullptr) return nullptr;
    try {
      const int64_t bytes =
          cache->refresh_windows(store, page_tables_.of(store, sequence, layer, stream).keys, stream, n_threads);
      std::lock_guard<std::mutex> lock(caches_mutex_);
      if (bytes > 0) loaded_[sequence] += bytes;
    } catch (const std::bad_alloc&) {
      forget(sequence, layer);
      return nullptr;
    } catch (...) {
      forget(sequence, layer);
      throw;
    }
    return cache;
  }

  /// The device counters (fetch_counters) where `sequence`'s gathers may use a block cache; null otherwise.
  int64_t* counters_of(const void* sequence, const HostKvStore& store, kvret_stream stream, int n_threads) {
    if (n_slots_ <= 0 || sequence == nullptr) return nullptr;
    return fetch_counters(sequence, store.row_bytes(), stream, n_threads);
  }

  /// Adds the rows a gather served from a cache (hit[0, n), 1 each) to *counter on the device, without a host wait.
  void add_hits(const uint8_t* hit, int64_t n, int64_t* counter, kvret_stream stream, int n_threads) {
    const DeviceArray<int64_t> scanned(static_cast<size_t>(n), stream);
    with_policy(stream, n_threads, n, [&](const auto& policy) {
      const auto as_i64 = thrust::make_transform_iterator(hit, dm::HitAsI64{});
      thrust::inclusive_scan(policy, as_i64, as_i64 + n, scanned.get());
    });
    for_each_index(stream, n_threads, 1, dm::AddLast{scanned.get(), n, counter});
  }  // scanned is freed in stream order after the passes

  /// The device counters of `sequence`'s gathers from device positions ([0] rows served by its caches, [1] bytes
  /// loaded into them), made zero at its first use.
  int64_t* fetch_counters(const void* sequence, size_t row_bytes, kvret_stream stream, int n_threads) {
    std::lock_guard<std::mutex> lock(caches_mutex_);
    FetchCounts& f = fetch_counts_[sequence];
    if (!f.counters) {
      try {
        f.counters = std::make_unique<DeviceArray<int64_t>>(2);
      } catch (...) {
        fetch_counts_.erase(sequence);
        throw;
      }
      f.row_bytes = static_cast<int64_t>(row_bytes);
      with_policy(stream, n_threads, 2, [&](const auto& policy) { thrust::fill_n(policy, f.counters->get(), 2, 0); });
    }
    return f.counters->get();
  }

  /// Forgets the cache of (sequence, layer) (after a failed update, which may have left it half changed).
  void forget(const void* sequence, int32_t layer) noexcept {
    std::lock_guard<std::mutex> lock(caches_mutex_);
    caches_.erase({sequence, layer});
  }

  /// The update after a fetch (or a prefetch): the rule of kernels/block_cache.h in the Thrust passes of
  /// block_cache_ops.hpp, ordered on `stream`; the bytes it copies in are added to the sequence's loaded bytes. A
  /// fetch admits up to a quarter of the slots (at least 1) per head, a prefetch up to every slot. Out of device
  /// memory for its temporaries, the layer's cache goes and the call succeeds; another failure takes it too.
  void update(const HostKvStore& store, const int32_t* const* selected, int64_t count, const void* sequence,
              int32_t layer, LayerCache& cache, bool prefetch, kvret_stream stream, int n_threads) {
    try {
      if (cache.view().max_blocks == 0) return;  // no complete block yet
      const int64_t heads = store.n_kv_heads();
      std::vector<int32_t> items(static_cast<size_t>(heads * count));
      for (int64_t h = 0; h < heads; ++h)
        std::copy(selected[h], selected[h] + count, items.begin() + h * count);  // ascending per head
      const DeviceArray<int32_t> device_items(items.size(), stream);
      upload(device_items.get(), items.data(), items.size() * sizeof(int32_t), stream);
      int64_t* counters = fetch_counters(sequence, store.row_bytes(), stream, n_threads);
      update_passes(store, page_tables_.of(store, sequence, layer, stream).keys, device_items.get(), count, count,
                    cache, prefetch, stream, n_threads, counters + 1);
    } catch (const std::bad_alloc&) {
      forget(sequence, layer);
    } catch (...) {
      forget(sequence, layer);
      throw;
    }
  }

  /// The update's passes over `items`, device memory [heads, stride] holding `count` ascending positions per head.
  /// The bytes loaded are added to *loaded on the device, with no host wait: the copy into the slots covers the most
  /// any head may admit and skips the rest.
  void update_passes(const HostKvStore& store, const std::byte* const* pages, const int32_t* items, int64_t stride,
                     int64_t count, LayerCache& cache, bool prefetch, kvret_stream stream, int n_threads,
                     int64_t* loaded) {
    const dm::CacheView c = cache.view();
    if (c.max_blocks == 0) return;  // no complete block yet
    const int64_t heads = store.n_kv_heads();
    const int64_t n_blocks = heads * c.max_blocks;
    const int64_t n_slot_entries = heads * c.n_slots;
    const uint32_t step = cache.tick();
    const int32_t max_admit = prefetch ? c.n_slots : std::max(1, c.n_slots / 4);
    const DeviceArray<int32_t> counts(static_cast<size_t>(n_blocks), stream), sorted_blocks(counts.size(), stream),
        marks(counts.size(), stream), ranks(counts.size(), stream),
        victims(static_cast<size_t>(n_slot_entries), stream), admit(heads, stream);
    const DeviceArray<uint64_t> slot_keys(victims.size(), stream), block_keys(counts.size(), stream);
    const DeviceArray<dm::BlockLoad> loads(victims.size(), stream);
    for_each_index(stream, n_threads, n_blocks,
                   dm::CountSelected{items, count, stride, c.max_blocks, c.block_tokens, prefetch, counts.get()});
    for_each_index(stream, n_threads, n_slot_entries,
                   dm::UseSlots{c, counts.get(), policy_, step, prefetch, slot_keys.get(), victims.get()});
    for_each_index(stream, n_threads, n_blocks,
                   dm::CandidateKeys{c.table, counts.get(), c.max_blocks, c.block_tokens, store.size(),
                                     block_keys.get(), sorted_blocks.get()});
    for_each_index(stream, n_threads, n_blocks, dm::ZeroI32{marks.get()});
    with_policy(stream, n_threads, std::max(n_blocks, n_slot_entries), [&](const auto& policy) {
      thrust::stable_sort_by_key(policy, slot_keys.get(), slot_keys.get() + n_slot_entries, victims.get());
      thrust::stable_sort_by_key(policy, block_keys.get(), block_keys.get() + n_blocks, sorted_blocks.get());
    });
    for_each_index(stream, n_threads, heads,
                   dm::AdmitCounts{block_keys.get(), slot_keys.get(), c.max_blocks, c.n_slots, max_admit, admit.get()});
    for_each_index(stream, n_threads, n_blocks,
                   dm::MarkAdmitted{sorted_blocks.get(), admit.get(), c.max_blocks, marks.get()});
    with_policy(stream, n_threads, n_blocks, [&](const auto& policy) {
      const auto head_of =
          thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), dm::HeadOf{int64_t{c.max_blocks}});
      thrust::exclusive_scan_by_key(policy, head_of, head_of + n_blocks, marks.get(), ranks.get());
    });
    for_each_index(stream, n_threads, n_blocks,
                   dm::Install{c, marks.get(), ranks.get(), victims.get(), policy_, step, prefetch, loads.get()});
    for_each_index(stream, n_threads, 1,
                   dm::AddAdmittedBytes{admit.get(), heads, c.block_tokens * c.row_bytes, loaded});
    // the admitted blocks' rows, from the store's pages into their slots (max_admit per head, the rest skipped)
    const int64_t page_tokens = HostKvStore::kPageTokens;
    const int32_t unit_bytes = static_cast<int32_t>(dm::elem_bytes(static_cast<int32_t>(store.dtype())));
    const auto units = static_cast<int32_t>(c.row_bytes / unit_bytes);
    for_each_index(stream, n_threads, heads * max_admit * c.block_tokens * units,
                   dm::FillSlots{c, loads.get(), admit.get(), pages, heads, page_tokens, max_admit, units, unit_bytes});
  }  // the temporaries are freed in stream order

  /// The working set's rows: the rows the cache holds from it (their count added to *hits on the device), the
  /// others from the host store.
  void gather_rows(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                   int64_t count, int64_t rows, const WorkingSetViews& out, int n_threads, LayerCache* cache,
                   int64_t* hits, kvret_stream stream) {
    const int heads = store.n_kv_heads();
#if KVRET_ON_GPU
    if (tuned_gather(store, mid_begin, mid_end, selected, count, rows, out, cache, hits, stream)) return;
#endif
    std::vector<dm::RowCopy> copies;
    copies.reserve(static_cast<size_t>(heads * rows));
    std::vector<int32_t> order(static_cast<size_t>(rows));
    for (int h = 0; h < heads; ++h) {
      working_set_positions(mid_begin, mid_end, store.size(), count > 0 ? selected[h] : nullptr, count, order.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t p = order[static_cast<size_t>(r)];
        copies.push_back({store.key_row(h, p), store.value_row(h, p), h, r, p});
      }
    }
    if (copies.empty()) return;
    const DeviceArray<dm::RowCopy> device_copies(copies.size(), stream);
    upload(device_copies.get(), copies.data(), copies.size() * sizeof(dm::RowCopy), stream);
    const dm::GatherRows gather{device_copies.get(),
                                device_tensor(out.k),
                                device_tensor(out.v),
                                device_tensor(out.positions),
                                static_cast<int32_t>(store.dtype()),
                                store.head_dim()};
    const int64_t n = static_cast<int64_t>(copies.size()) * store.head_dim();
    note_gather_pass();
    if (cache == nullptr || hits == nullptr || !cache->view().serves()) {
      for_each_index(stream, n_threads, n, gather);
      return;  // device_copies is freed in stream order after the gather
    }
    const DeviceArray<uint8_t> hit(copies.size(), stream);
    for_each_index(stream, n_threads, n, dm::GatherCachedRows{gather, cache->view(), hit.get()});
    add_hits(hit.get(), static_cast<int64_t>(copies.size()), hits, stream, n_threads);
  }

  /// The rows of the `fused` jobs (rows set, caches from cache_of) in one gather pass; the rows each job's cache
  /// served are added on the device to its counter (hits[f]; the job of a cache has one).
  void gather_fused(GatherJob* jobs, const std::vector<size_t>& fused, const std::vector<LayerCache*>& caches,
                    const std::vector<int64_t*>& hits, int n_threads, kvret_stream stream) {
#if KVRET_ON_GPU
    if (tuned_gather_batch(jobs, fused, caches, hits, stream)) return;
#endif
    const HostKvStore& first = *jobs[fused[0]].store;
    const int heads = first.n_kv_heads();
    const int32_t d = first.head_dim();
    std::vector<dm::RowCopy> copies;
    std::vector<int32_t> job_of_row;
    std::vector<int64_t> ends(fused.size());
    std::vector<dm::BatchGatherJob> views(fused.size());
    bool cached = false;
    for (size_t f = 0; f < fused.size(); ++f) {
      const GatherJob& j = jobs[fused[f]];
      const HostKvStore& store = *j.store;
      std::vector<int32_t> order(static_cast<size_t>(j.rows));
      for (int h = 0; h < heads; ++h) {
        working_set_positions(j.mid_begin, j.mid_end, store.size(), j.count > 0 ? j.selected[h] : nullptr, j.count,
                              order.data());
        for (int64_t r = 0; r < j.rows; ++r) {
          const int32_t p = order[static_cast<size_t>(r)];
          copies.push_back({store.key_row(h, p), store.value_row(h, p), h, r, p});
          job_of_row.push_back(static_cast<int32_t>(f));
        }
      }
      ends[f] = static_cast<int64_t>(copies.size());
      views[f] = {device_tensor(j.out->k), device_tensor(j.out->v), device_tensor(j.out->positions), {}};
      if (caches[f] != nullptr && hits[f] != nullptr && caches[f]->view().serves()) {
        views[f].cache = caches[f]->view();
        cached = true;
      }
    }
    if (copies.empty()) return;
    const auto entries = static_cast<int64_t>(copies.size());
    const DeviceArray<dm::RowCopy> device_copies(copies.size(), stream);
    const DeviceArray<int32_t> device_jobs_of_rows(job_of_row.size(), stream);
    const DeviceArray<dm::BatchGatherJob> device_views(views.size(), stream);
    const DeviceArray<uint8_t> hit(copies.size(), stream);
    upload(device_copies.get(), copies.data(), copies.size() * sizeof(dm::RowCopy), stream);
    upload(device_jobs_of_rows.get(), job_of_row.data(), job_of_row.size() * sizeof(int32_t), stream);
    upload(device_views.get(), views.data(), views.size() * sizeof(dm::BatchGatherJob), stream);
    note_gather_pass();
    for_each_index(stream, n_threads, entries * d,
                   dm::GatherBatchRows{device_copies.get(), device_jobs_of_rows.get(), device_views.get(),
                                       static_cast<int32_t>(first.dtype()), d, hit.get()});
    if (!cached) return;  // the temporaries are freed in stream order after the gather
    // the rows each job's cache served: a scan of the hits, each job's share of it, added to its counter
    const DeviceArray<int64_t> scanned(copies.size(), stream);
    const DeviceArray<int64_t> device_ends(ends.size(), stream);
    const DeviceArray<int64_t> device_hits(ends.size(), stream);
    upload(device_ends.get(), ends.data(), ends.size() * sizeof(int64_t), stream);
    with_policy(stream, n_threads, entries, [&](const auto& policy) {
      const auto as_i64 = thrust::make_transform_iterator(hit.get(), dm::HitAsI64{});
      thrust::inclusive_scan(policy, as_i64, as_i64 + entries, scanned.get());
    });
    for_each_index(stream, n_threads, static_cast<int64_t>(ends.size()),
                   dm::JobHits{scanned.get(), device_ends.get(), device_hits.get()});
    add_job_counts(device_hits.get(), 1, hits, stream, n_threads);
  }  // the temporaries are freed in stream order after the passes

  /// Adds counts[f * stride] to *targets[f] (none where null) on the device, in one pass after the work before it.
  template <class Count>
  void add_job_counts(const Count* counts, int64_t stride, const std::vector<int64_t*>& targets, kvret_stream stream,
                      int n_threads) {
    const DeviceArray<int64_t*> device_targets(targets.size(), stream);
    upload(device_targets.get(), targets.data(), targets.size() * sizeof(int64_t*), stream);
    for_each_index(stream, n_threads, 1,
                   dm::AddJobCounts<Count>{counts, stride, device_targets.get(), static_cast<int64_t>(targets.size())});
  }

#if KVRET_ON_GPU
  /// Whether the tuned gather (tuned_gather) takes the `rows` rows per head of `store` into `out`.
  static bool tuned_fits(const HostKvStore& store, int64_t rows, const WorkingSetViews& out) {
    const int d = store.head_dim();
    const int64_t capacity = out.k.dim(1);
    const bool contiguous = out.k.stride(2) == 1 && out.k.stride(1) == d && out.k.stride(0) == capacity * d &&
                            out.v.stride(2) == 1 && out.v.stride(1) == d && out.v.stride(0) == capacity * d &&
                            out.v.dim(1) == capacity && out.positions.dim(1) == capacity &&
                            out.positions.stride(1) == 1 && out.positions.stride(0) == capacity;
    return out.k.dtype() == store.dtype() && out.v.dtype() == store.dtype() && contiguous &&
           (d == 64 || d == 128 || d == 256) && rows > 0 && rows <= INT32_MAX && store.size() > 0;
  }
  cuda::KvGeometry tuned_geometry(const HostKvStore& store) const {
    cuda::KvGeometry geo;
    geo.n_kv_heads = store.n_kv_heads();
    geo.head_dim = store.head_dim();
    geo.block_tokens = block_tokens_;
    geo.elem_type = store.dtype() == DType::F16    ? cuda::ElemType::kF16
                    : store.dtype() == DType::BF16 ? cuda::ElemType::kBF16
                                                   : cuda::ElemType::kF32;
    return geo;
  }

  /// The fused jobs of gather_batch in one launch of the tuned gather (one WorkingSetGatherSeq per job), where it
  /// takes every one of them (tuned_fits); false (nothing enqueued) otherwise. The rows each job's cache served are
  /// added on the device to hits[f].
  bool tuned_gather_batch(GatherJob* jobs, const std::vector<size_t>& fused, const std::vector<LayerCache*>& caches,
                          const std::vector<int64_t*>& hits, kvret_stream stream) {
    int64_t max_rows = 0;
    for (const size_t i : fused) {
      if (!tuned_fits(*jobs[i].store, jobs[i].rows, *jobs[i].out)) return false;
      max_rows = std::max(max_rows, jobs[i].rows);
    }
    if (fused.size() > INT32_MAX) return false;
    const HostKvStore& first = *jobs[fused[0]].store;
    const int heads = first.n_kv_heads();
    const int64_t page_tokens = HostKvStore::kPageTokens;
    const int64_t row_bytes = static_cast<int64_t>(first.row_bytes());
    // every job's page table (kept between calls) and its positions, one array for the batch
    std::vector<PageTables::Table> tables(fused.size());
    std::vector<int32_t> positions;
    std::vector<size_t> positions_at(fused.size());
    for (size_t f = 0; f < fused.size(); ++f) {
      const GatherJob& j = jobs[fused[f]];
      const HostKvStore& store = *j.store;
      tables[f] = page_tables_.of(store, page_key(j.sequence, store), j.layer, stream);
      positions_at[f] = positions.size();
      positions.resize(positions.size() + static_cast<size_t>(heads * j.rows));
      for (int h = 0; h < heads; ++h)
        working_set_positions(j.mid_begin, j.mid_end, store.size(), j.count > 0 ? j.selected[h] : nullptr, j.count,
                              positions.data() + positions_at[f] + static_cast<size_t>(h * j.rows));
    }
    const DeviceArray<int32_t> device_positions(positions.size(), stream);
    const DeviceArray<cuda::WorkingSetGatherSeq> device_seqs(fused.size(), stream);
    const DeviceArray<unsigned long long> counters(3 * fused.size(), stream);
    std::vector<cuda::WorkingSetGatherSeq> seqs(fused.size());
    bool cached = false;
    for (size_t f = 0; f < fused.size(); ++f) {
      const GatherJob& j = jobs[fused[f]];
      const HostKvStore& store = *j.store;
      cuda::WorkingSetGatherSeq& seq = seqs[f];
      seq.host.k_pages = reinterpret_cast<const void* const*>(tables[f].keys);
      seq.host.v_pages = reinterpret_cast<const void* const*>(tables[f].values);
      seq.host.page_tokens = page_tokens;
      seq.host.token_stride = row_bytes;
      seq.host.head_stride = page_tokens * row_bytes;
      seq.host.n_tokens = store.size();
      seq.positions = device_positions.get() + positions_at[f];
      seq.positions_stride = j.rows;
      seq.n_rows = static_cast<int32_t>(j.rows);
      seq.out_k = j.out->k.data();
      seq.out_v = j.out->v.data();
      seq.out_positions = reinterpret_cast<int32_t*>(j.out->positions.data());
      seq.out_capacity = j.out->k.dim(1);
      if (caches[f] != nullptr && hits[f] != nullptr && caches[f]->view().serves()) {
        const dm::CacheView c = caches[f]->view();
        seq.cache.window_k = c.window_k;
        seq.cache.window_v = c.window_v;
        seq.cache.window = c.window;
        seq.cache.block_table = c.max_blocks > 0 ? c.table : nullptr;
        seq.cache.slot_block = c.slot_block;
        seq.cache.slot_stamp = c.stamp;
        seq.cache.slot_prefetched = c.prefetched;
        seq.cache.k = c.k;
        seq.cache.v = c.v;
        seq.cache.max_blocks = c.max_blocks;
        seq.cache.n_slots = c.n_slots;
        seq.counters = counters.get() + 3 * f;
        cached = true;
      }
    }
    if (cached)
      check_cuda(cudaMemsetAsync(counters.get(), 0, 3 * fused.size() * sizeof(unsigned long long), cuda_stream(stream)),
                 "cudaMemsetAsync");
    upload(device_positions.get(), positions.data(), positions.size() * sizeof(int32_t), stream);
    upload(device_seqs.get(), seqs.data(), seqs.size() * sizeof(cuda::WorkingSetGatherSeq), stream);
    note_gather_pass();
    check_cuda(
        cuda::launch_working_set_gather(device_seqs.get(), static_cast<int32_t>(fused.size()),
                                        static_cast<int32_t>(max_rows), tuned_geometry(first), cuda_stream(stream)),
        "launch_working_set_gather");
    if (cached)  // rows from the caches (each job's first counter), after the gather
      add_job_counts(counters.get(), 3, hits, stream, 0);
    return true;  // the device arrays are freed in stream order after the gather
  }

  /// The working-set gather of kernels/working_set_gather (16-byte pieces of rows straight from the mapped pinned
  /// pages) where the outputs allow it: the store's element type, a head_dim of 64, 128 or 256, contiguous
  /// [H, capacity, D] and [H, capacity] outputs. Returns false (nothing enqueued) otherwise: the Thrust gather
  /// does the rest (f32 outputs of an f16 or bf16 store, strided outputs). tuned_gather_batch for one job.
  bool tuned_gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                    int64_t count, int64_t rows, const WorkingSetViews& out, LayerCache* cache, int64_t* hits,
                    kvret_stream stream) {
    GatherJob job;
    job.store = &store;
    job.mid_begin = mid_begin;
    job.mid_end = mid_end;
    job.selected = selected;
    job.count = count;
    job.out = &out;
    job.rows = rows;
    return tuned_gather_batch(&job, {0}, {cache}, {hits}, stream);
  }
#endif

 public:
  void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
              float scale, const TensorView& out, int n_threads, kvret_stream stream) override {
    check_attend(config, q, k, v, rows, scale, out);
    for (const TensorView* t : {&q, &k, &v, &out}) check_kernel_access(*t);
    DeviceScope scope(device_id_);
    const int32_t d = config.head_dim;
    const int64_t heads = config.n_q_heads;
    const int32_t group = config.n_q_heads / config.n_kv_heads;
    const float s = attend_scale(config, scale);
    if (tuned_attend(config, q, k, v, rows, s, out, n_threads, stream)) return;
    const DeviceArray<float> weights(static_cast<size_t>(heads * rows), stream),
        inv_z(static_cast<size_t>(heads), stream);
    float* w = weights.get();
    float* z = inv_z.get();
    for_each_index(stream, n_threads, heads * rows,
                   dm::AttentionLogits{device_tensor(q), device_tensor(k), w, rows, d, group, s});
    for_each_index(stream, n_threads, heads, dm::AttentionNormaliser{w, z, rows});
    for_each_index(stream, n_threads, heads * d,
                   dm::AttentionOutput{device_tensor(v), device_tensor(out), w, z, rows, d, group});
  }

  /// The decode-attention kernel of kernels/decode_attention (flash-decoding over 32-row tiles, 16-byte cp.async
  /// loads; equal to the reference passes within float rounding, not bit for bit) where the tensors allow it: k and
  /// v of one element type, contiguous [n_kv_heads, capacity, head_dim] and 16-byte aligned, out contiguous, a
  /// head_dim of 64, 128 or 256, at most 16 query heads per KV head. q of another type or layout is loaded into f32
  /// first. Returns false (nothing enqueued) otherwise, and always on Thrust's host system (no kernels there): the
  /// reference passes attend.
  bool tuned_attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                    int64_t rows, float s, const TensorView& out, int n_threads, kvret_stream stream) {
#if KVRET_ON_GPU
    const int32_t d = config.head_dim;
    const int64_t capacity = k.dim(1);
    const auto dense = [&](const TensorView& t, int64_t rows_per_head) {
      return t.stride(t.ndim() - 1) == 1 && (t.ndim() < 2 || t.stride(t.ndim() - 2) == d) &&
             (t.ndim() < 3 || t.stride(0) == rows_per_head * d);
    };
    const auto aligned = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; };
    const bool f32_out = out.dtype() == DType::F32;  // else the kernel writes f32 and a pass rounds it into out
    if (k.dtype() != v.dtype() || v.dim(1) != capacity || !dense(k, capacity) || !dense(v, capacity) ||
        (f32_out && !dense(out, 1)) || !aligned(k) || !aligned(v) || rows > INT32_MAX)
      return false;
    cuda::DecodeAttentionParams p;
    p.n_seqs = 1;
    p.n_q_heads = config.n_q_heads;
    p.n_kv_heads = config.n_kv_heads;
    p.head_dim = d;
    p.kv_type = k.dtype() == DType::F16    ? cuda::ElemType::kF16
                : k.dtype() == DType::BF16 ? cuda::ElemType::kBF16
                                           : cuda::ElemType::kF32;
    p.max_rows = static_cast<int32_t>(rows);
    p.scale = s;
    const size_t workspace_bytes = cuda::decode_attention_workspace_bytes(p);
    if (workspace_bytes == 0) return false;     // a geometry the kernel does not take (head_dim, group size)
    std::unique_ptr<DeviceArray<float>> q_f32;  // q as the kernel reads it: f32 [n_q_heads, head_dim]
    const float* q_data = reinterpret_cast<const float*>(q.data());
    if (q.dtype() != DType::F32 || !dense(q, 1)) {
      q_f32 = std::make_unique<DeviceArray<float>>(static_cast<size_t>(config.n_q_heads) * d, stream);
      for_each_index(stream, n_threads, int64_t{config.n_q_heads} * d,
                     dm::PageLoadQuery{device_tensor(q), q_f32->get(), d});
      q_data = q_f32->get();
    }
    cuda::DecodeAttentionSeq seq;
    seq.q = q_data;
    seq.k = k.data();
    seq.v = v.data();
    seq.kv_capacity = capacity;
    seq.n_rows = static_cast<int32_t>(rows);
    std::unique_ptr<DeviceArray<float>> out_f32;
    if (!f32_out) out_f32 = std::make_unique<DeviceArray<float>>(static_cast<size_t>(config.n_q_heads) * d, stream);
    seq.out = f32_out ? reinterpret_cast<float*>(out.data()) : out_f32->get();
    const DeviceArray<cuda::DecodeAttentionSeq> device_seq(1, stream);
    const DeviceArray<std::byte> workspace(workspace_bytes, stream);
    upload(device_seq.get(), &seq, sizeof seq, stream);  // staged: the host struct may go
    p.seqs = device_seq.get();
    check_cuda(cuda::launch_decode_attention(p, workspace.get(), workspace_bytes, cuda_stream(stream)),
               "launch_decode_attention");
    if (!f32_out)
      for_each_index(stream, n_threads, int64_t{config.n_q_heads} * d,
                     dm::StoreRows{out_f32->get(), device_tensor(out), d});
    return true;
#else
    (void)config, (void)q, (void)k, (void)v, (void)rows, (void)s, (void)out, (void)n_threads, (void)stream;
    return false;
#endif
  }

 private:
  int device_id_;
  DeviceBudget budget_;
  int32_t block_tokens_;
  int32_t n_slots_;  // per (sequence, layer, KV head): cache_capacity_tokens / block_tokens, at most 2048
  int32_t policy_;
  int32_t sink_rows_, local_rows_;  // rows of each device window per (sequence, layer, KV head)
  std::mutex caches_mutex_;
  std::map<std::pair<const void*, int32_t>, std::unique_ptr<LayerCache>> caches_;  // by (sequence, layer)
  std::map<std::pair<const void*, int32_t>, IndexMirror> mirrors_;  // PAGE bounds or clusters, by (sequence, layer)
  std::map<std::pair<const void*, int32_t>, CrushMirror> crush_mirrors_;  // KVCrush signatures, by (sequence, layer)
  std::map<const void*, int64_t> loaded_;  // bytes copied into a sequence's caches since take_cache_use
  struct FetchCounts {
    std::unique_ptr<DeviceArray<int64_t>> counters;  // [2]: rows the caches served, bytes loaded into them
    int64_t row_bytes = 0;
  };
  std::map<const void*, FetchCounts> fetch_counts_;  // a sequence's gathers from device positions (by sequence)
  PageTables page_tables_;                           // the device addresses of the stores' pages, kept
  [[maybe_unused]] bool pageable_access_ = false;    // the GPU reads pageable host memory (HMM or ATS)
  PinnedPages pages_;
  std::shared_ptr<const ClusterSegmentBuilder> cluster_builder_ = std::make_shared<CudaClusterBuilder>(device_id_);
  std::atomic<int64_t> cluster_upload_bytes_{0};  // bytes copied into CLUSTER mirrors
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const kvret_config& config) {
#if KVRET_ON_GPU
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  (void)cudaGetLastError();
  require(e == cudaSuccess && devices > 0, KVRET_ERR_CUDA,
          std::string("no CUDA device: config.device_type = KVRET_DEVICE_CUDA needs one (cudaGetDeviceCount: ") +
              cudaGetErrorString(e) + ", " + std::to_string(devices) + " devices)");
#else
  const int devices = 1;  // Thrust's host system: one "device", the host
#endif
  require(config.device_id >= 0 && config.device_id < devices, KVRET_ERR_CUDA,
          "config.device_id " + std::to_string(config.device_id) + ": there are " + std::to_string(devices) +
              " CUDA devices");
#if KVRET_ON_GPU
  // A device the build has no code for (neither real code of its family nor PTX it can compile) would fail every
  // kernel launch: refused here, naming its sm_XY and the architectures built (cuda_arch.hpp).
  cudaDeviceProp props{};
  check_cuda(cudaGetDeviceProperties(&props, config.device_id),
             "cudaGetDeviceProperties(" + std::to_string(config.device_id) + ")");
  props.name[sizeof(props.name) - 1] = '\0';
  const std::string why =
      cuda_arch::check_device(props.major, props.minor, cuda_arch::built_arch_list(),
                              "config.device_id " + std::to_string(config.device_id) + " (" + props.name + ")");
  require(why.empty(), KVRET_ERR_UNSUPPORTED, why);
#endif
  return std::make_unique<CudaBackend>(config);
}

const char* cuda_backend_system_name() noexcept { return KVRET_ON_GPU ? "cuda" : "thrust-omp"; }

}  // namespace kvret
