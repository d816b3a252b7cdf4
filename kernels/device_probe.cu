// The smallest CUDA translation unit: it proves the CUDA path compiles and links, and lets the core ask whether a
// device is present without including CUDA headers anywhere else.
#include <cuda_runtime.h>

#include "device_probe.cuh"

namespace kvret::cuda {

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace kvret::cuda
