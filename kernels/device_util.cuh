#pragma once
// Small device helpers shared by the kernels: element conversion, warp reductions, order-preserving float keys.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kvret::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

/// The 16-byte unit every copy kernel moves.
using Vec16 = uint4;

}  // namespace kvret::cuda
