#pragma once
// The CUDA backend's device runtime below the passes (cuda_backend.cu includes it once, after choosing the device
// system; KVRET_ON_GPU says which): the counts a steady-state step is held to, device scope and streams, the launch
// of a pass, copies and uploads, and device memory: arrays kept between calls, and the step workspace that holds
// the temporaries of the calls on one stream so that a warmed-up step allocates nothing.
//
// What is counted, process-wide over every CUDA backend (Backend::device_counts; docs/cuda_backend.md):
// - host waits: a copy the host waits for, a stream or device synchronization, a reduction the host reads;
// - passes: for_each_index and with_policy (one kernel, or one Thrust algorithm of a few kernels), and gathers;
// - allocations: every request that reaches the driver's allocator (cudaMalloc, cudaMallocAsync, cudaHostAlloc;
//   device_malloc and the page allocator on Thrust's host system) — a step served from the workspace makes none;
// - uploads: copies from host memory to the device of tables built on the host and of the host index's new rows,
//   sent through the stream's pinned staging ring;
// - pageable copies: copies from host memory that kvret did not pin which bypass the ring (a host fallback's
//   write-back);
// - page lookups: KV pages whose device address was looked up (cudaHostGetDevicePointer; page_tables.hpp).
#include <thrust/device_free.h>
#include <thrust/device_malloc.h>
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/system_error.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"

#ifndef KVRET_ON_GPU
#error "define KVRET_ON_GPU (1: Thrust's CUDA system, 0: its OpenMP host system) before including device_memory.hpp"
#endif
#if KVRET_ON_GPU
#include <cuda_runtime_api.h>
#endif

namespace kvret::device_runtime {

/// The counts of every CUDA backend of the process (Backend::device_counts).
struct Counters {
  std::atomic<int64_t> host_waits{0};
  std::atomic<int64_t> passes{0};
  std::atomic<int64_t> gather_passes{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> pageable_copies{0};
  std::atomic<int64_t> uploads{0};
  std::atomic<int64_t> page_lookups{0};
};
inline Counters g_counts;
inline void note_wait() noexcept { g_counts.host_waits.fetch_add(1, std::memory_order_relaxed); }
inline void note_pass() noexcept { g_counts.passes.fetch_add(1, std::memory_order_relaxed); }
inline void note_gather_pass() noexcept { g_counts.gather_passes.fetch_add(1, std::memory_order_relaxed); }
inline void note_allocation() noexcept { g_counts.allocations.fetch_add(1, std::memory_order_relaxed); }
inline void note_pageable_copy() noexcept { g_counts.pageable_copies.fetch_add(1, std::memory_order_relaxed); }
inline void note_upload() noexcept { g_counts.uploads.fetch_add(1, std::memory_order_relaxed); }
inline void note_page_lookup() noexcept { g_counts.page_lookups.fetch_add(1, std::memory_order_relaxed); }

inline Backend::DeviceCounts device_counts() noexcept {
  Backend::DeviceCounts c;
  c.host_waits = g_counts.host_waits.load();
  c.passes = g_counts.passes.load() + g_counts.gather_passes.load();
  c.allocations = g_counts.allocations.load();
  c.pageable_copies = g_counts.pageable_copies.load();
  c.uploads = g_counts.uploads.load();
  c.page_lookups = g_counts.page_lookups.load();
  return c;
}

#if KVRET_ON_GPU
inline void check_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so that the next call does not report it again
  throw Error(KVRET_ERR_CUDA, what + ": " + cudaGetErrorString(e));
}

inline cudaStream_t cuda_stream(kvret_stream s) noexcept { return reinterpret_cast<cudaStream_t>(s); }

/// Makes `device` current for the scope of a call and restores the caller's current device after it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceScope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

/// Whether the current device allocates in stream order (cudaMallocAsync; cudaDevAttrMemoryPoolsSupported). Where
/// it does not, device memory comes from cudaMalloc and cudaFree.
inline bool stream_ordered_memory() noexcept {
  int device = 0, supported = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return supported != 0;
}

/// `bytes` of device memory in stream order on `stream` (counted); std::bad_alloc when the device is full.
inline void* driver_allocate(size_t bytes, kvret_stream stream) {
  void* p = nullptr;
  const bool ordered = stream_ordered_memory();
  const cudaError_t e = ordered ? cudaMallocAsync(&p, bytes, cuda_stream(stream)) : cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw std::bad_alloc();
  }
  check_cuda(e, ordered ? "cudaMallocAsync" : "cudaMalloc");
  note_allocation();
  return p;
}
/// Frees driver_allocate's memory after the work enqueued on `stream` before it. Never throws.
inline void driver_free(void* p, kvret_stream stream) noexcept {
  if (stream_ordered_memory()) {
    (void)cudaFreeAsync(p, cuda_stream(stream));
  } else {
    (void)cudaFree(p);
  }
}

/// Copies `bytes` between any two memories (device, pinned or pageable host) in stream order; `wait`: the host
/// waits for it (and for everything enqueued before it on `stream`).
inline void copy_bytes(void* dst, const void* src, size_t bytes, kvret_stream stream, bool wait) {
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream(stream)), "cudaMemcpyAsync");
  if (wait) note_wait();
  if (wait) check_cuda(cudaStreamSynchronize(cuda_stream(stream)), "cudaStreamSynchronize");
}
#else
struct DeviceScope {
  explicit DeviceScope(int) noexcept {}
};

inline void* driver_allocate(size_t bytes, kvret_stream) {
  note_allocation();
  return thrust::raw_pointer_cast(thrust::device_malloc<std::byte>(bytes));
}
inline void driver_free(void* p, kvret_stream) noexcept {
  thrust::device_free(thrust::device_pointer_cast(static_cast<std::byte*>(p)));
}

inline void copy_bytes(void* dst, const void* src, size_t bytes, kvret_stream, bool wait) {
  if (wait) note_wait();  // counted as on a GPU, where the host would wait
  std::memcpy(dst, src, bytes);
}
#endif

/// Pinned host memory through which the uploads of the calls on one stream go (a table built on the host, the host
/// index's new rows): each upload is copied into the ring and sent from there with an asynchronous copy, so that the
/// copy is not a pageable one (which the driver stages itself, holding the host). A region is written again only
/// after the copy out of it is done: each copy records an event, and a region still in flight when the ring comes
/// round to it is waited for (counted). The ring holds at least four times the largest upload so far and 1 MiB.
class StagingRing {
 public:
  explicit StagingRing(kvret_stream stream) noexcept : stream_(stream) {}
  ~StagingRing() {  // the stream's work done (Workspaces)
    retire_all();
#if KVRET_ON_GPU
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    if (base_ != nullptr) (void)cudaFreeHost(base_);
#else
    delete[] base_;
#endif
  }
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  /// Enqueues a copy of `bytes` of host memory at `host` to `dst` on the stream; `host` may change once it returns.
  void upload(void* dst, const void* host, size_t bytes) {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
    if (4 * need > size_) grow(std::max<size_t>({4 * need, 2 * size_, size_t{1} << 20}));
    if (head_ + need > size_) head_ = 0;  // the end of the ring stays unused this round
    const size_t begin = head_, end = head_ + need;
    while (!flight_.empty() && flight_.front().begin < end && begin < flight_.front().end) retire_front();
    std::memcpy(base_ + begin, host, bytes);
    copy_bytes(dst, base_ + begin, bytes, stream_, false);
    flight_.push_back({begin, end, record()});
    head_ = end;
  }

 private:
  static constexpr size_t kAlign = 64;
  struct InFlight {
    size_t begin, end;
#if KVRET_ON_GPU
    cudaEvent_t done;
#else
    int done;  // Thrust's host system: every copy is done when it returns
#endif
  };
#if KVRET_ON_GPU
  cudaEvent_t record() {
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    } else {
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      events_.push_back(e);
    }
    check_cuda(cudaEventRecord(e, cuda_stream(stream_)), "cudaEventRecord");
    return e;
  }
#else
  static int record() noexcept { return 0; }
#endif
  /// Waits (where it must) for the oldest copy in flight and frees its region.
  void retire_front() {
#if KVRET_ON_GPU
    cudaEvent_t e = flight_.front().done;
    if (cudaEventQuery(e) == cudaErrorNotReady) {
      note_wait();
      check_cuda(cudaEventSynchronize(e), "cudaEventSynchronize");
    } else {
      (void)cudaGetLastError();
    }
    free_events_.push_back(e);
#endif
    flight_.pop_front();
  }
  void retire_all() noexcept {
    try {
      while (!flight_.empty()) retire_front();
    } catch (...) {
      flight_.clear();
    }
  }
  void grow(size_t size) {
    retire_all();  // nothing reads the old ring any more
#if KVRET_ON_GPU
    void* p = nullptr;
    check_cuda(cudaHostAlloc(&p, size, cudaHostAllocPortable), "cudaHostAlloc");
    if (base_ != nullptr) (void)cudaFreeHost(base_);
    base_ = static_cast<std::byte*>(p);
#else
    auto* p = new std::byte[size];
    delete[] base_;
    base_ = p;
#endif
    note_allocation();
    size_ = size;
    head_ = 0;
  }
  kvret_stream stream_;
  std::mutex mutex_;
  std::byte* base_ = nullptr;
  size_t size_ = 0;
  size_t head_ = 0;
  std::deque<InFlight> flight_;  ///< oldest first: the ring's order
#if KVRET_ON_GPU
  std::vector<cudaEvent_t> events_, free_events_;
#endif
};

/// The temporaries of the calls ordered on one stream, as a stack in one block of device memory kept between calls.
/// Memory a call gives back is taken again only by later calls on the same stream, whose work the stream orders
/// after the giver's, so that reuse needs no wait. A request that does not fit is served by the driver (counted)
/// and raises the block's size, with half again as much room, for the next time the stack is empty: after a step of
/// a shape, the steps of that shape allocate nothing, and a context that grows by a token a step makes the block
/// grow once per half again as many tokens. Thread-safe (calls of several threads on one stream share it).
class StepWorkspace {
 public:
  explicit StepWorkspace(kvret_stream stream) noexcept : stream_(stream), staging_(stream) {}
  ~StepWorkspace() {  // after the stream's work (Workspaces: its stream synchronized, or the device)
#if KVRET_ON_GPU
    if (base_ != nullptr) (void)cudaFree(base_);
#else
    if (base_ != nullptr) driver_free(base_, stream_);
#endif
  }
  StepWorkspace(const StepWorkspace&) = delete;
  StepWorkspace& operator=(const StepWorkspace&) = delete;

  /// `bytes` (256-byte aligned) for work on this stream until give; std::bad_alloc when the device is full.
  void* take(size_t bytes) {
    bytes = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_.empty() && peak_ > size_) {  // grown once the stack is empty: nothing lives in the old block
      if (base_ != nullptr) driver_free(base_, stream_);
      base_ = nullptr;
      size_ = 0;
      const size_t size = (peak_ + peak_ / 2 + kGrain - 1) / kGrain * kGrain;
      base_ = static_cast<std::byte*>(driver_allocate(size, stream_));
      size_ = size;
    }
    held_.reserve(held_.size() + 1);  // before the allocation: push_back cannot throw after it
    const size_t top = held_.empty() ? 0 : held_.back().end;
    demand_ += bytes;
    peak_ = std::max(peak_, demand_);
    if (top + bytes <= size_) {
      held_.push_back({base_ + top, bytes, top + bytes, true, false});
      return base_ + top;
    }
    void* p = nullptr;
    try {
      p = driver_allocate(bytes, stream_);
    } catch (...) {
      demand_ -= bytes;
      throw;
    }
    held_.push_back({static_cast<std::byte*>(p), bytes, top, true, true});
    return p;
  }
  /// Gives back what take returned, once the work that uses it is enqueued on this stream. Never throws.
  void give(void* p) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = held_.size(); i-- > 0;) {
      Held& h = held_[i];
      if (h.p != p || !h.live) continue;
      h.live = false;
      demand_ -= h.bytes;
      if (h.own) driver_free(h.p, stream_);
      break;
    }
    while (!held_.empty() && !held_.back().live) held_.pop_back();
  }
  /// The stream's uploads from host memory.
  StagingRing& staging() noexcept { return staging_; }

 private:
  static constexpr size_t kAlign = 256;
  static constexpr size_t kGrain = size_t{1} << 16;
  struct Held {
    std::byte* p;
    size_t bytes;
    size_t end;  ///< the stack's top above it (its own top for an allocation of the driver: it takes none)
    bool live;
    bool own;  ///< the driver's, not the block's
  };
  kvret_stream stream_;
  StagingRing staging_;
  std::mutex mutex_;
  std::byte* base_ = nullptr;
  size_t size_ = 0;
  size_t demand_ = 0;  ///< bytes taken and not given back
  size_t peak_ = 0;    ///< the most bytes taken at once so far
  std::vector<Held> held_;
};

/// The workspaces of the process, one per (device, stream), kept until released (release_workspace, or the last
/// CUDA backend going).
class Workspaces {
 public:
  static Workspaces& get() {
    static Workspaces* w = new Workspaces;  // never destroyed: the runtime may be gone at exit
    return *w;
  }
  StepWorkspace& of(kvret_stream stream) {
    const Key key = key_of(stream);
    std::lock_guard<std::mutex> lock(mutex_);
    std::unique_ptr<StepWorkspace>& w = map_[key];
    if (!w) w = std::make_unique<StepWorkspace>(stream);
    return *w;
  }
  /// Frees the workspace of `stream` (its work done, or ordered before the free). Never throws.
  void release(kvret_stream stream) noexcept {
    try {
      const Key key = key_of(stream);
      std::lock_guard<std::mutex> lock(mutex_);
      map_.erase(key);
    } catch (...) {
    }
  }
  /// A CUDA backend was made or destroyed; the last one going frees every workspace.
  void backend_made() noexcept { ++backends_; }
  void backend_gone() noexcept {
    if (--backends_ > 0) return;
#if KVRET_ON_GPU
    (void)cudaDeviceSynchronize();  // teardown: the work that uses the workspaces done before they go
    (void)cudaGetLastError();
#endif
    std::lock_guard<std::mutex> lock(mutex_);
    map_.clear();
  }

 private:
  // A stream's handle may be reused by a later stream; its id (cudaStreamGetId) is not.
  using Key = std::pair<int, unsigned long long>;
  static Key key_of(kvret_stream stream) {
#if KVRET_ON_GPU
    int device = 0;
    unsigned long long id = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaStreamGetId(cuda_stream(stream), &id), "cudaStreamGetId");
    return {device, id};
#else
    (void)stream;  // Thrust's host system has no streams: one workspace
    return {0, 0};
#endif
  }
  std::mutex mutex_;
  std::map<Key, std::unique_ptr<StepWorkspace>> map_;
  std::atomic<int> backends_{0};
};

/// Thrust's temporary storage (sorts, scans) from the workspace of the call's stream.
struct WorkspaceTemporaries {
  using value_type = char;
  StepWorkspace* workspace;
  char* allocate(std::ptrdiff_t bytes) const { return static_cast<char*>(workspace->take(static_cast<size_t>(bytes))); }
  void deallocate(char* p, size_t) const noexcept { workspace->give(p); }
};

#if KVRET_ON_GPU
/// f(i) for i in [0, n), in stream order on `stream`; a failed launch is KVRET_ERR_CUDA.
template <class F>
void for_each_index(kvret_stream stream, int, int64_t n, const F& f) {
  note_pass();
  try {
    thrust::for_each_n(thrust::cuda::par_nosync.on(cuda_stream(stream)), thrust::counting_iterator<int64_t>(0), n, f);
  } catch (const thrust::system_error& e) {
    (void)cudaGetLastError();
    throw Error(KVRET_ERR_CUDA, std::string("thrust::for_each_n: ") + e.what());
  }
}

/// f(policy) with the execution policy of `stream` (sorts and scans, their temporaries from the stream's
/// workspace); a failed launch is KVRET_ERR_CUDA.
template <class F>
void with_policy(kvret_stream stream, int, int64_t, const F& f) {
  note_pass();
  try {
    StepWorkspace& workspace = Workspaces::get().of(stream);
    f(thrust::cuda::par_nosync(WorkspaceTemporaries{&workspace}).on(cuda_stream(stream)));
  } catch (const thrust::system_error& e) {
    (void)cudaGetLastError();
    throw Error(KVRET_ERR_CUDA, std::string("thrust: ") + e.what());
  }
}

/// A stream of kvret's own for work off the caller's streams (index builds): non-blocking, so that it neither
/// waits for nor holds up work on the legacy default stream or the caller's streams. Destroyed, with its workspace,
/// when its work is done.
class OwnStream {
 public:
  OwnStream() { check_cuda(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~OwnStream() {
    (void)cudaStreamSynchronize(s_);
    Workspaces::get().release(get());
    (void)cudaStreamDestroy(s_);
  }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  kvret_stream get() const noexcept { return reinterpret_cast<kvret_stream>(s_); }

 private:
  cudaStream_t s_ = nullptr;
};
#else
/// Passes over fewer elements run on the calling thread: an OpenMP team costs more than they do.
constexpr int64_t kSerialBelow = int64_t{1} << 14;

/// f(i) for i in [0, n): on OpenMP's threads, or on the calling thread alone for a one-thread context.
template <class F>
void for_each_index(kvret_stream, int n_threads, int64_t n, const F& f) {
  note_pass();
  if (n_threads == 1 || n < kSerialBelow) {
    thrust::for_each_n(thrust::cpp::par, thrust::counting_iterator<int64_t>(0), n, f);
  } else {
    thrust::for_each_n(thrust::device, thrust::counting_iterator<int64_t>(0), n, f);
  }
}

/// f(policy) for an algorithm over n elements: OpenMP's threads, or the calling thread alone for a one-thread
/// context; its temporaries from the workspace, as on a GPU.
template <class F>
void with_policy(kvret_stream stream, int n_threads, int64_t n, const F& f) {
  note_pass();
  StepWorkspace& workspace = Workspaces::get().of(stream);
  if (n_threads == 1 || n < kSerialBelow) {
    f(thrust::cpp::par(WorkspaceTemporaries{&workspace}));
  } else {
    f(thrust::device(WorkspaceTemporaries{&workspace}));
  }
}

/// Thrust's host system has no streams.
struct OwnStream {
  kvret_stream get() const noexcept { return nullptr; }
};
#endif

/// A copy from host memory kvret did not pin (a table built on the host, the host index) to the device, ordered on
/// `stream`, through the stream's staging ring (counted as an upload); `host` may change once it returns.
inline void upload(void* dst, const void* host, size_t bytes, kvret_stream stream) {
  note_upload();
  Workspaces::get().of(stream).staging().upload(dst, host, bytes);
}

/// n uninitialised elements of device memory; throws std::bad_alloc when the device is out of memory,
/// KVRET_ERR_CUDA on another error. Freeing never throws: an error of the device (sticky) is reported by the
/// context's next call.
/// - DeviceArray(n): memory kept between calls (caches, index copies): cudaMalloc, and cudaFree, which waits for
///   the device.
/// - DeviceArray(n, stream): a temporary of one call, used only by work on `stream`: from the stream's workspace,
///   so that a warmed-up step neither allocates nor waits.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
#if KVRET_ON_GPU
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, (n == 0 ? 1 : n) * sizeof(T));
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw std::bad_alloc();
    }
    check_cuda(e, "cudaMalloc");
    p_ = static_cast<T*>(p);
#else
    p_ = thrust::raw_pointer_cast(thrust::device_malloc<T>(n == 0 ? 1 : n));
#endif
    note_allocation();
  }
  DeviceArray(size_t n, kvret_stream stream) : n_(n), workspace_(&Workspaces::get().of(stream)) {
    p_ = static_cast<T*>(workspace_->take((n == 0 ? 1 : n) * sizeof(T)));
  }
  ~DeviceArray() {
    if (workspace_ != nullptr) {
      workspace_->give(p_);
      return;
    }
#if KVRET_ON_GPU
    (void)cudaFree(p_);
#else
    thrust::device_free(thrust::device_pointer_cast(p_));
#endif
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const noexcept { return p_; }
  size_t size() const noexcept { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_;
  StepWorkspace* workspace_ = nullptr;
};

}  // namespace kvret::device_runtime
