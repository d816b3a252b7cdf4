// The CUDA backend (see cuda_backend.hpp). One source, two device systems: nvcc builds it on Thrust's CUDA system;
// KVRET_THRUST_OMP builds it with the host compiler on Thrust's OpenMP system, where the same algorithms run on the
// CPU and "device" memory is host memory.
#include <thrust/copy.h>
#include <thrust/device_free.h>
#include <thrust/device_malloc.h>
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/system_error.h>

#include <atomic>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "backend/cuda_backend.hpp"
#include "backend/device_math.hpp"
#include "core/attention.hpp"
#include "core/error.hpp"
#include "fetch/working_set.hpp"

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cuda_runtime_api.h>

#include "store/host_kv_store.hpp"
#include "working_set_gather.h"  // kernels/: the tuned gather
#define KVRET_ON_GPU 1
#else
#define KVRET_ON_GPU 0
#endif

namespace kvret {

namespace {

namespace dm = device_math;

#if KVRET_ON_GPU
void check_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so that the next call does not report it again
  throw Error(KVRET_ERR_CUDA, what + ": " + cudaGetErrorString(e));
}

cudaStream_t cuda_stream(kvret_stream s) noexcept { return reinterpret_cast<cudaStream_t>(s); }

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

/// f(i) for i in [0, n), in stream order on `stream`; a failed launch is KVRET_ERR_CUDA.
template <class F>
void for_each_index(kvret_stream stream, int, int64_t n, const F& f) {
  try {
    thrust::for_each_n(thrust::cuda::par_nosync.on(cuda_stream(stream)), thrust::counting_iterator<int64_t>(0), n, f);
  } catch (const thrust::system_error& e) {
    (void)cudaGetLastError();
    throw Error(KVRET_ERR_CUDA, std::string("thrust::for_each_n: ") + e.what());
  }
}

/// Copies `bytes` between any two memories (device, pinned or pageable host) in stream order; `wait`: the host
/// waits for it (and for everything enqueued before it on `stream`).
void copy_bytes(void* dst, const void* src, size_t bytes, kvret_stream stream, bool wait) {
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream(stream)), "cudaMemcpyAsync");
  if (wait) check_cuda(cudaStreamSynchronize(cuda_stream(stream)), "cudaStreamSynchronize");
}
#else
struct DeviceScope {
  explicit DeviceScope(int) noexcept {}
};

/// f(i) for i in [0, n): on OpenMP's threads, or on the calling thread alone for a one-thread context.
template <class F>
void for_each_index(kvret_stream, int n_threads, int64_t n, const F& f) {
  if (n_threads == 1) {
    thrust::for_each_n(thrust::cpp::par, thrust::counting_iterator<int64_t>(0), n, f);
  } else {
    thrust::for_each_n(thrust::device, thrust::counting_iterator<int64_t>(0), n, f);
  }
}

void copy_bytes(void* dst, const void* src, size_t bytes, kvret_stream, bool) { std::memcpy(dst, src, bytes); }
#endif

/// n uninitialised elements of device memory (nothing runs on the device to make or free them); throws
/// std::bad_alloc when the device is out of memory, KVRET_ERR_CUDA on another error. Freeing never throws: an error
/// of the device (sticky) is reported by the context's next call.
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
  }
  ~DeviceArray() {
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
};

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
    return static_cast<std::byte*>(p);
#else
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

dm::DeviceTensor device_tensor(const TensorView& t) {
  dm::DeviceTensor d;
  d.base = t.data();
  d.type = static_cast<int32_t>(t.dtype());
  for (int i = 0; i < t.ndim() && i < 3; ++i) d.stride[i] = t.stride(i);
  return d;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const kvret_config& config) : device_id_(config.device_id), budget_(config.device_bytes_limit) {
#if KVRET_ON_GPU
    int pageable = 0;
    if (cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device_id_) != cudaSuccess) {
      (void)cudaGetLastError();
      pageable = 0;
    }
    pageable_access_ = pageable != 0;
#endif
  }

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
    copy_bytes(t.data(), host.data(), t.extent_bytes(), nullptr, true);
  }
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
    if (served_by_sources != nullptr) *served_by_sources = 0;
    const int heads = store.n_kv_heads();
    const int64_t rows = mid_begin + count + (store.size() - mid_end);
#if KVRET_ON_GPU
    if (tuned_gather(store, mid_begin, mid_end, selected, count, rows, out, stream)) return rows;
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
    if (copies.empty()) return rows;
    const DeviceArray<dm::RowCopy> device_copies(copies.size());
    copy_bytes(device_copies.get(), copies.data(), copies.size() * sizeof(dm::RowCopy), stream, false);
    const dm::GatherRows gather{device_copies.get(),
                                device_tensor(out.k),
                                device_tensor(out.v),
                                device_tensor(out.positions),
                                static_cast<int32_t>(store.dtype()),
                                store.head_dim()};
    for_each_index(stream, n_threads, static_cast<int64_t>(copies.size()) * store.head_dim(), gather);
    return rows;  // device_copies is freed after the gather (cudaFree waits for the device)
  }

#if KVRET_ON_GPU
  /// The working-set gather of kernels/working_set_gather (16-byte pieces of rows straight from the mapped pinned
  /// pages) where the outputs allow it: the store's element type, a head_dim of 64, 128 or 256, contiguous
  /// [H, capacity, D] and [H, capacity] outputs. Returns false (nothing enqueued) otherwise: the Thrust gather
  /// does the rest (f32 outputs of an f16 or bf16 store, strided outputs).
  bool tuned_gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                    int64_t count, int64_t rows, const WorkingSetViews& out, kvret_stream stream) {
    const int heads = store.n_kv_heads();
    const int d = store.head_dim();
    const int64_t capacity = out.k.dim(1);
    const bool contiguous = out.k.stride(2) == 1 && out.k.stride(1) == d && out.k.stride(0) == capacity * d &&
                            out.v.stride(2) == 1 && out.v.stride(1) == d && out.v.stride(0) == capacity * d &&
                            out.v.dim(1) == capacity && out.positions.dim(1) == capacity &&
                            out.positions.stride(1) == 1 && out.positions.stride(0) == capacity;
    if (out.k.dtype() != store.dtype() || out.v.dtype() != store.dtype() || !contiguous ||
        (d != 64 && d != 128 && d != 256) || rows <= 0 || rows > INT32_MAX || store.size() == 0) {
      return false;
    }
    cuda::KvGeometry geo;
    geo.n_kv_heads = heads;
    geo.head_dim = d;
    geo.elem_type = store.dtype() == DType::F16    ? cuda::ElemType::kF16
                    : store.dtype() == DType::BF16 ? cuda::ElemType::kBF16
                                                   : cuda::ElemType::kF32;
    // the pages of the store, as the device addresses them (each page is one mapped pinned allocation: keys of
    // every head, then values)
    const int64_t page_tokens = HostKvStore::kPageTokens;
    const int64_t n_pages = (store.size() + page_tokens - 1) / page_tokens;
    const int64_t row_bytes = static_cast<int64_t>(store.row_bytes());
    std::vector<const void*> pages(static_cast<size_t>(2 * n_pages));
    for (int64_t i = 0; i < n_pages; ++i) {
      void* device = nullptr;
      check_cuda(cudaHostGetDevicePointer(&device, const_cast<std::byte*>(store.key_row(0, i * page_tokens)), 0),
                 "cudaHostGetDevicePointer");
      pages[static_cast<size_t>(i)] = device;
      pages[static_cast<size_t>(n_pages + i)] = static_cast<const std::byte*>(device) + heads * page_tokens * row_bytes;
    }
    std::vector<int32_t> positions(static_cast<size_t>(heads * rows));
    for (int h = 0; h < heads; ++h)
      working_set_positions(mid_begin, mid_end, store.size(), count > 0 ? selected[h] : nullptr, count,
                            positions.data() + static_cast<size_t>(h * rows));
    const DeviceArray<const void*> device_pages(pages.size());
    const DeviceArray<int32_t> device_positions(positions.size());
    const DeviceArray<cuda::WorkingSetGatherSeq> device_seq(1);
    cuda::WorkingSetGatherSeq seq;
    seq.host.k_pages = device_pages.get();
    seq.host.v_pages = device_pages.get() + n_pages;
    seq.host.page_tokens = page_tokens;
    seq.host.token_stride = row_bytes;
    seq.host.head_stride = page_tokens * row_bytes;
    seq.host.n_tokens = store.size();
    seq.positions = device_positions.get();
    seq.positions_stride = rows;
    seq.n_rows = static_cast<int32_t>(rows);
    seq.out_k = out.k.data();
    seq.out_v = out.v.data();
    seq.out_positions = reinterpret_cast<int32_t*>(out.positions.data());
    seq.out_capacity = capacity;
    copy_bytes(device_pages.get(), pages.data(), pages.size() * sizeof(const void*), stream, false);
    copy_bytes(device_positions.get(), positions.data(), positions.size() * sizeof(int32_t), stream, false);
    copy_bytes(device_seq.get(), &seq, sizeof seq, stream, false);
    // (a copy from pageable memory returns once its bytes are staged, so the host arrays may go)
    check_cuda(
        cuda::launch_working_set_gather(device_seq.get(), 1, static_cast<int32_t>(rows), geo, cuda_stream(stream)),
        "launch_working_set_gather");
    return true;  // the device arrays are freed after the gather (cudaFree waits for the device)
  }
#endif

  void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
              float scale, const TensorView& out, int n_threads, kvret_stream stream) override {
    check_attend(config, q, k, v, rows, scale, out);
    for (const TensorView* t : {&q, &k, &v, &out}) check_kernel_access(*t);
    DeviceScope scope(device_id_);
    const int32_t d = config.head_dim;
    const int64_t heads = config.n_q_heads;
    const int32_t group = config.n_q_heads / config.n_kv_heads;
    const float s = attend_scale(config, scale);
    const DeviceArray<float> weights(static_cast<size_t>(heads * rows)), inv_z(static_cast<size_t>(heads));
    float* w = weights.get();
    float* z = inv_z.get();
    for_each_index(stream, n_threads, heads * rows,
                   dm::AttentionLogits{device_tensor(q), device_tensor(k), w, rows, d, group, s});
    for_each_index(stream, n_threads, heads, dm::AttentionNormaliser{w, z, rows});
    for_each_index(stream, n_threads, heads * d,
                   dm::AttentionOutput{device_tensor(v), device_tensor(out), w, z, rows, d, group});
  }

 private:
  int device_id_;
  DeviceBudget budget_;
  [[maybe_unused]] bool pageable_access_ = false;  // the GPU reads pageable host memory (HMM or ATS)
  PinnedPages pages_;
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
  return std::make_unique<CudaBackend>(config);
}

const char* cuda_backend_system_name() noexcept { return KVRET_ON_GPU ? "cuda" : "thrust-omp"; }

}  // namespace kvret
