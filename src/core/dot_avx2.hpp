#pragma once
// The horizontal sums of the AVX2 dot products that must equal the scalar dot() bit for bit (vec_math's scaled
// dots, the CPU decode attention): lane l of an accumulator is dot()'s acc[l], and the lanes are added in dot()'s
// order, ((0+4)+(1+5))+((2+6)+(3+7)).

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace kvret {

/// The sum of the eight lanes in dot()'s order.
__attribute__((target("avx2"))) inline float reduce_like_dot(__m256 acc) noexcept {
  const __m128 w = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // w_l = a_l + a_(l+4)
  const __m128 h = _mm_hadd_ps(w, w);                                                       // w0 + w1, w2 + w3
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));                                  // (w0+w1) + (w2+w3)
}

/// reduce_like_dot of eight accumulators at once, in their order: the lane halves of two accumulators added in
/// one register, then two rounds of horizontal adds (w0 + w1, w2 + w3, then their sum), as reduce_like_dot.
__attribute__((target("avx2"))) inline __m256 reduce8_like_dot(const __m256* acc) noexcept {
  __m256 w[4];  // w[p] = [w of acc 2p | w of acc 2p + 1], w_l = a_l + a_(l+4)
  for (int p = 0; p < 4; ++p)
    w[p] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * p], acc[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(acc[2 * p], acc[2 * p + 1], 0x31));
  // [(w0+w1), (w2+w3) of acc 0, 2 | of acc 1, 3] and of acc 4..7, then [acc 0, 2, 4, 6 | acc 1, 3, 5, 7]
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3]));
  return _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // back to acc order 0..7
}

}  // namespace kvret
#endif
