#pragma once
// Per-element math of KVCrush's grouping (select/kvcrush.hpp, engine/kvcrush_layer.hpp): the Hamming distance of
// two signatures, the alternating anchor, and the buckets of an ordered range. The CPU code calls these; a device
// path can share them (one thread per token: its distance; one per bucket: its boundaries).
#include "hd.h"

namespace kvret::cuda::math {

/// Set bits of a 64-bit word.
KVRET_HD int popcount64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

/// The Hamming distance of two signatures of `words` 64-bit words (popcount of their xor): 0..64 * words.
KVRET_HD int kvcrush_hamming(const uint64_t* a, const uint64_t* b, int words) {
  int d = 0;
  for (int w = 0; w < words; ++w) d += popcount64(a[w] ^ b[w]);
  return d;
}

/// The bits of word `w` that belong to a signature of `heads` bits (no bit past the last head).
KVRET_HD uint64_t kvcrush_word_mask(int w, int heads) {
  const int below = heads - 64 * w;  // heads in this word and after
  return below >= 64 ? ~uint64_t{0} : below <= 0 ? uint64_t{0} : (uint64_t{1} << below) - 1u;
}

/// Word `w` of the alternating anchor 0101...: bit h set for odd h, none past the heads.
KVRET_HD uint64_t kvcrush_alternating_word(int w, int heads) {
  return 0xaaaaaaaaaaaaaaaaull & kvcrush_word_mask(w, heads);
}

/// Bucket b of n ordered entries cut into `buckets` buckets (b in 0..buckets): entries [begin(b), begin(b + 1)),
/// begin(b) = floor(b * n / buckets). Sizes differ by at most one; none is empty when n >= buckets.
/// b * n must fit in 64 bits (positions are int32: it does).
KVRET_HD int64_t kvcrush_bucket_begin(int64_t b, int64_t n, int64_t buckets) { return b * n / buckets; }

/// The bucket of entry k < n (the b with begin(b) <= k < begin(b + 1)): floor(((k + 1) * buckets - 1) / n).
KVRET_HD int64_t kvcrush_bucket_of(int64_t k, int64_t n, int64_t buckets) { return ((k + 1) * buckets - 1) / n; }

}  // namespace kvret::cuda::math
