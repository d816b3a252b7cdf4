#pragma once
// The m = 4 PQ code decoding the AVX2 paths of select share (vec_math's pair-table logits, gqa_fold's products).
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace kvret {

/// The pair-table offsets of eight tokens' m = 4 codes (4 bytes per token, from `codes`): ia = c0 + k c1 and
/// ib = c2 + k c3.
__attribute__((target("avx2"))) inline void pq4_pair_offsets_avx2(const uint8_t* codes, int k, __m256i* ia,
                                                                  __m256i* ib) noexcept {
  const __m256i low_byte = _mm256_set1_epi32(0xff);
  const __m256i vk = _mm256_set1_epi32(k);
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i c0 = _mm256_and_si256(w, low_byte);
  const __m256i c1 = _mm256_and_si256(_mm256_srli_epi32(w, 8), low_byte);
  const __m256i c2 = _mm256_and_si256(_mm256_srli_epi32(w, 16), low_byte);
  const __m256i c3 = _mm256_srli_epi32(w, 24);
  *ia = _mm256_add_epi32(c0, _mm256_mullo_epi32(c1, vk));
  *ib = _mm256_add_epi32(c2, _mm256_mullo_epi32(c3, vk));
}

}  // namespace kvret
#endif
