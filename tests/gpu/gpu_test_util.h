#pragma once
// Helpers of the GPU tests: skipping without a device, RAII device and mapped-host buffers, element conversion,
// seeded random inputs. Each test checks one kernel against a plain CPU reference written in the test itself.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "device_probe.cuh"
#include "kernel_types.h"

namespace kvret::cuda::testing {

/// Skips the calling test when no CUDA device is visible (CI, this repository's build machines).
inline void SkipIfNoCudaDevice() {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
}

/// The fixture of every GPU test: SetUp skips the test when there is no device.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { SkipIfNoCudaDevice(); }
};

/// Throws with the CUDA error string unless err is cudaSuccess (GoogleTest reports the exception as a failure).
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

#define KVRET_CUDA_CHECK(expr) ::kvret::cuda::testing::check((expr), #expr)

/// Launches, then waits for the device and checks for asynchronous errors.
#define KVRET_LAUNCH_AND_SYNC(expr)                  \
  do {                                               \
    ASSERT_EQ((expr), cudaSuccess) << #expr;         \
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); \
  } while (0)

/// An owning device array.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : size_(n) {
    if (n > 0) KVRET_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(size_, other.size_);
    return *this;
  }
  ~DeviceBuffer() { (void)cudaFree(ptr_); }

  T* get() const { return ptr_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

  void upload(const std::vector<T>& host) {
    if (host.size() != size_) throw std::runtime_error("DeviceBuffer::upload: size mismatch");
    if (size_ > 0) KVRET_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(size_);
    if (size_ > 0) KVRET_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  /// Fills every byte with `byte` (poisons outputs so that unwritten elements show).
  void fill_bytes(int byte) {
    if (size_ > 0) KVRET_CUDA_CHECK(cudaMemset(ptr_, byte, bytes()));
  }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

/// Pinned host memory mapped into the device's address space: host() for the CPU, device() for kernels.
class MappedHostBuffer {
 public:
  explicit MappedHostBuffer(size_t bytes) : bytes_(bytes) {
    KVRET_CUDA_CHECK(cudaHostAlloc(&host_, bytes, cudaHostAllocMapped));
    KVRET_CUDA_CHECK(cudaHostGetDevicePointer(&device_, host_, 0));
  }
  MappedHostBuffer(const MappedHostBuffer&) = delete;
  MappedHostBuffer& operator=(const MappedHostBuffer&) = delete;
  ~MappedHostBuffer() { (void)cudaFreeHost(host_); }

  unsigned char* host() const { return static_cast<unsigned char*>(host_); }
  void* device() const { return device_; }
  size_t bytes() const { return bytes_; }

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
  size_t bytes_ = 0;
};

// ---- element conversion on the host ----
template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

inline float to_float(float x) { return x; }
inline float to_float(__half x) { return __half2float(x); }
inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/// `n` normal(0, sigma) values rounded to T.
template <typename T>
std::vector<T> random_normal(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<T> out(n);
  for (auto& x : out) x = from_float<T>(dist(rng));
  return out;
}

template <typename T>
std::vector<float> to_float_vector(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_float(v[i]);
  return out;
}

template <typename T>
constexpr ElemType elem_type_of() {
  if constexpr (std::is_same_v<T, __half>) {
    return ElemType::kF16;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return ElemType::kBF16;
  } else {
    return ElemType::kF32;
  }
}

/// |a - b| <= atol + rtol * |b|
inline bool close(double a, double b, double atol, double rtol) {
  const double diff = a > b ? a - b : b - a;
  const double mag = b < 0 ? -b : b;
  return diff <= atol + rtol * mag;
}

}  // namespace kvret::cuda::testing
