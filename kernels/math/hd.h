#pragma once
// The vocabulary of the single-source math headers (kernels/math/*.h): functions marked KVRET_HD compile as
// __host__ __device__ under nvcc and as plain inline C++ under a host compiler, so that g++ tests run the very code
// the kernels call. No CUDA header is needed on the host side.
//
// Floating-point operations that must give the same bits on both sides go through add_rn / sub_rn / mul_rn: on the
// device they are __fadd_rn / __fsub_rn / __fmul_rn, which nvcc never contracts into a fused multiply-add; on the
// host they are plain operations (the library and its tests are built without FMA contraction: strict ISO C++ mode
// and no -mfma, plus -ffp-contract=off for the tests).
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVRET_HD __host__ __device__ __forceinline__
#else
#define KVRET_HD inline
#endif

namespace kvret::cuda::math {

KVRET_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

KVRET_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

KVRET_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KVRET_HD double dadd_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

KVRET_HD double dmul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

KVRET_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}

KVRET_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

KVRET_HD float neg_inf() { return bits_float(0xff800000u); }
KVRET_HD float pos_inf() { return bits_float(0x7f800000u); }

KVRET_HD float max_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return a > b ? a : (b == b ? b : a);  // fmaxf: a NaN operand yields the other one
#endif
}

KVRET_HD int64_t clamp_i64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

/// True when `p` is a multiple of 16 bytes: what a 128-bit load or cp.async needs.
KVRET_HD bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace kvret::cuda::math
