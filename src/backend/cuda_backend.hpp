#pragma once
// The CUDA backend: KV pages in pinned, device-mapped host memory; a block cache in device memory per (sequence,
// layer, KV head) that the gather reads and a fetch or prefetch fills (docs/cuda_backend.md); the working-set gather,
// the cache's bookkeeping and the reference attention as Thrust algorithms on the caller's stream; the parts of a
// call that run on the CPU (argument checks, the index and its selection) read device tensors through copies. The same
// source builds with nvcc (Thrust's CUDA system) and with a host compiler on Thrust's OpenMP system (KVRET_THRUST_OMP),
// where "device" memory is host memory: that build runs every call of this backend without a GPU.
#include <memory>

#include "backend/backend.hpp"
#include "kvret.h"

#ifndef KVRET_CUDA_BACKEND
#define KVRET_CUDA_BACKEND 0
#endif

namespace kvret {

#if KVRET_CUDA_BACKEND
/// Throws KVRET_ERR_CUDA when config.device_id names no usable CUDA device ("no CUDA device" when there is none).
std::unique_ptr<Backend> make_cuda_backend(const kvret_config& config);
/// "cuda" (nvcc, Thrust's CUDA system) or "thrust-omp" (Thrust's OpenMP host system).
const char* cuda_backend_system_name() noexcept;
#endif

}  // namespace kvret
