#pragma once
// Compile-time dispatch for the launchers: a run-time head_dim or element type becomes a template argument.
// Only 64/128/256 and f16/bf16/f32 are instantiated, which keeps the CUDA compile time of the library small.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <type_traits>

#include "kernel_types.h"

namespace kvret::cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

/// Calls f(std::integral_constant<int, D>{}) for D == head_dim; cudaErrorInvalidValue for any other head_dim.
template <typename F>
cudaError_t dispatch_head_dim(int32_t head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
    default:
      return cudaErrorInvalidValue;
  }
}

/// Calls f(TypeTag<T>{}) with T the CUDA type of `type`.
template <typename F>
cudaError_t dispatch_elem_type(ElemType type, F&& f) {
  switch (type) {
    case ElemType::kF16:
      return f(TypeTag<__half>{});
    case ElemType::kBF16:
      return f(TypeTag<__nv_bfloat16>{});
    case ElemType::kF32:
      return f(TypeTag<float>{});
    default:
      return cudaErrorInvalidValue;
  }
}

/// Lets `Kernel` launch with `bytes` of dynamic shared memory: raises its limit (cudaFuncSetAttribute) when its
/// static plus dynamic shared memory exceed the default 48 KiB; cudaErrorInvalidValue when the device cannot give
/// that much to one block. What was granted is remembered per device, so the common call costs one cudaGetDevice.
template <auto Kernel>
cudaError_t prepare_dynamic_smem(size_t bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<size_t> granted[kMaxDevices] = {};
  static std::mutex raising;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (bytes <= granted[device].load(std::memory_order_acquire)) return cudaSuccess;

  std::lock_guard<std::mutex> lock(raising);  // the limit only ever goes up
  const size_t have = granted[device].load(std::memory_order_relaxed);
  if (bytes <= have) return cudaSuccess;
  cudaFuncAttributes attributes{};
  if ((err = cudaFuncGetAttributes(&attributes, Kernel)) != cudaSuccess) return err;
  if (attributes.sharedSizeBytes + bytes > 48 * 1024) {
    int optin = 0;
    if ((err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess) {
      return err;
    }
    if (attributes.sharedSizeBytes + bytes > static_cast<size_t>(optin)) return cudaErrorInvalidValue;
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
  }
  granted[device].store(bytes, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace kvret::cuda
