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

/// Maps a float to a uint32 whose unsigned order is the float's order (-inf < ... < -0 < +0 < ... < +inf; NaNs
/// land beyond the infinities, by their bit pattern).
__device__ __forceinline__ uint32_t float_order_key(float f) {
  const uint32_t bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

/// The 16-byte unit every copy kernel moves.
using Vec16 = uint4;

}  // namespace kvret::cuda
