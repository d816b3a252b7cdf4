#pragma once
// Small dense kernels the CPU backend's hot loops share. Eight independent partial sums let the compiler vectorize
// without -ffast-math (no reassociation is needed).
#include <cstdint>

namespace kvret {

enum class DType : uint8_t;

inline float dot(const float* a, const float* b, int64_t n) noexcept {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float squared_distance(const float* a, const float* b, int64_t n) noexcept {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      const float d = a[i + l] - b[i + l];
      acc[l] += d * d;
    }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return s;
}

/// e^x for x <= 0 (softmax terms), relative error below 2e-7, written so that a loop over it vectorizes
/// (no libm call). Inputs below -87 give 0; positive ones are taken as 0 (the weighted fold computes terms of
/// weight-0 entries above the maximum, which it never uses); NaN stays NaN.
inline float exp_nonpositive(float x) noexcept {
  x = x > 0.0f ? 0.0f : x;
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;  // x / ln 2
  // round to nearest (t <= 0); a NaN converts as 0 (its int conversion is undefined) and stays NaN through f
  const float fn = static_cast<float>(static_cast<int32_t>((t == t ? t : 0.0f) - 0.5f));
  const float f = t - fn;  // in [-0.5, 0.5]
  // 2^f by its Taylor series in f ln 2 (degree 6)
  const float y = f * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return x <= -87.0f ? 0.0f : p * scale;
}

/// The SIMD paths are chosen once per process from the CPU, capped by the environment variable KVRET_MAX_CPU_ISA
/// (scalar, avx2 or avx512). Scoring, folding, top-k and attention compute the scalar code's bits on every path;
/// k-means' AVX2 path uses FMA, so a cap may move a near-tie of its assignments (and so a codebook).

/// Whether the CPU runs the AVX2 paths of the hot loops (checked once; they compute the same bits as the scalar
/// code they replace, so the choice never changes a result).
bool cpu_has_avx2() noexcept;

/// Whether the CPU (and the OS) run F16C code (f16 <-> f32 conversion), checked by CPUID and XGETBV.
bool cpu_has_f16c() noexcept;  // false under KVRET_MAX_CPU_ISA=scalar

/// Whether the CPU (and the OS) run AVX-512F code: the paths that use it compute the AVX2 paths' bits.
bool cpu_has_avx512f() noexcept;

/// out[g * out_stride + e] = scale * dot(q + g * q_stride, keys + e * key_stride, len) for g < nq and e < n_keys:
/// bit for bit what the scalar dot gives (same eight partial sums, same order), blocked so that each key row is
/// loaded once for several queries (AVX2 where the CPU has it).
void scaled_dots(const float* q, int64_t q_stride, int nq, const float* keys, int64_t key_stride, int64_t n_keys,
                 int64_t len, float scale, float* out, int64_t out_stride) noexcept;

/// scaled_dots of key rows stored as f32, f16 or bf16 (`keys` points at their first element; key_stride counts
/// elements): the bits of scaled_dots on the rows converted to f32. An integer dtype throws KVRET_ERR_INTERNAL.
void scaled_dots(const float* q, int64_t q_stride, int nq, const void* keys, DType key_dtype, int64_t key_stride,
                 int64_t n_keys, int64_t len, float scale, float* out, int64_t out_stride);

/// PQ logits of n tokens for nq query heads: out[g * n + t] = sum_j lut[(g * m + j) * k + codes[t * m + j]] for
/// g < nq, t < n (codes: [n, m]; lut: [nq, m, k]), summed from 0.0f in the order j = 0..m-1 -- for m = 4 as two
/// pairs, ((0 + l0) + l1) + (l2 + l3) -- so that every token gets the bits of the scalar per-token loop. Vectorized
/// across tokens (AVX2 gathers, eight tokens at a time, when m is 4, 8, 12 or 16 and the CPU has AVX2); for m = 4
/// and k <= 64, from the head's two pair tables (k^2 entries each: two gathers per token and head instead of four).
void pq_token_logits(const float* lut, int nq, int m, int k, const uint8_t* codes, int64_t n, float* out) noexcept;

/// splitmix64: the seeded generator behind every randomized step (portable and reproducible across platforms).
inline uint64_t splitmix64(uint64_t& state) noexcept {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Number of OpenMP threads for a config value (0 = all available).
int resolve_threads(int32_t n_threads) noexcept;

}  // namespace kvret
