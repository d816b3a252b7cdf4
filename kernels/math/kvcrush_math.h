#pragma once
// Per-element math of KVCrush's grouping (select/kvcrush.hpp, engine/kvcrush_layer.hpp): the Hamming distance of
// two signatures, the alternating anchor, the buckets of an ordered range, and the representatives' decisions (where
// an order entry lies in the per-distance lists, the walk past taken tokens, the fill, the merged row). The CPU code
// calls these; a device path shares them (one thread per token: its distance; one per bucket: its boundaries and
// first free entry; one per row entry: its merged slot).
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

/// The Hamming distance of a signature of `heads` bits (`words` words) to the alternating anchor: a token's place in
/// the grouping's order. The CPU's distance lists and the device's order keys both come from it.
KVRET_HD int kvcrush_alternating_distance(const uint64_t* bits, int words, int heads) {
  int d = 0;
  for (int w = 0; w < words; ++w) d += popcount64(bits[w] ^ kvcrush_alternating_word(w, heads));
  return d;
}

/// A token's key in the grouping's (distance, position) order: ascending keys are that order (distance first, then
/// position; distance >= 0, position >= 0).
KVRET_HD uint64_t kvcrush_order_key(int distance, int64_t position) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(distance)) << 32) |
         static_cast<uint64_t>(static_cast<uint32_t>(position));
}

/// The position of an order key.
KVRET_HD int32_t kvcrush_key_position(uint64_t key) { return static_cast<int32_t>(static_cast<uint32_t>(key)); }

/// Bucket b of n ordered entries cut into `buckets` buckets (b in 0..buckets): entries [begin(b), begin(b + 1)),
/// begin(b) = floor(b * n / buckets). Sizes differ by at most one; none is empty when n >= buckets.
/// b * n must fit in 64 bits (positions are int32: it does).
KVRET_HD int64_t kvcrush_bucket_begin(int64_t b, int64_t n, int64_t buckets) { return b * n / buckets; }

/// The bucket of entry k < n (the b with begin(b) <= k < begin(b + 1)): floor(((k + 1) * buckets - 1) / n).
KVRET_HD int64_t kvcrush_bucket_of(int64_t k, int64_t n, int64_t buckets) { return ((k + 1) * buckets - 1) / n; }

/// Buckets for n_rep representatives over m middle tokens: min(n_rep, m).
KVRET_HD int64_t kvcrush_bucket_count(int64_t n_rep, int64_t m) { return n_rep < m ? n_rep : m; }

// The middle's (distance, position) order is held as per-distance lists: prefix[d] middle tokens lie at distances
// below d (prefix[0] = 0, prefix[dists] the middle's size, nondecreasing), and list d's first middle token is at
// begin[d]. Entry k of the order (0 <= k < prefix[dists]) is list d's token begin[d] + k - prefix[d], for the one d
// with prefix[d] <= k < prefix[d + 1].

/// The list of order entry k, walking forward from list d (prefix[d] <= k): the CPU's walk, k ascending.
KVRET_HD int kvcrush_list_from(const int64_t* prefix, int d, int64_t k) {
  while (prefix[d + 1] <= k) ++d;
  return d;
}

/// The list of order entry k < prefix[dists] by a binary search over prefix[0..dists]: one thread per entry or
/// bucket. Equals kvcrush_list_from(prefix, 0, k).
KVRET_HD int kvcrush_list_of(const int64_t* prefix, int dists, int64_t k) {
  int lo = 0, hi = dists;  // prefix[lo] <= k < prefix[hi]
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (prefix[mid] <= k)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/// Order entry k's index in its list d.
KVRET_HD int64_t kvcrush_list_index(const int64_t* begin, const int64_t* prefix, int d, int64_t k) {
  return begin[d] + k - prefix[d];
}

/// The walk past taken tokens: the first order entry in [k, hi) that take(entry) accepts (take takes it when it
/// can), or hi when none does. A bucket's representative is the first of its entries the selection left free.
template <class Take>
KVRET_HD int64_t kvcrush_take_first(int64_t k, int64_t hi, Take&& take) {
  for (; k < hi; ++k)
    if (take(k)) break;
  return k;
}

/// The fill of buckets the selection took entirely: the order entry still free after the buckets' pass with
/// `free_before` such entries before it is taken when free_before < missing (the places of the `missing` buckets go
/// to the first free entries in the order).
KVRET_HD bool kvcrush_fill_takes(int64_t free_before, int64_t missing) { return free_before < missing; }

/// The row's count after the representatives: n_important + min(buckets, candidates), where buckets =
/// kvcrush_bucket_count(n_rep, m) and the candidates are the m - n_important middle tokens outside the important row
/// (0 <= n_important <= m). Never more than n_important + n_rep, nor than m: an n_rep past the middle adds no more.
KVRET_HD int64_t kvcrush_selected_count(int64_t n_important, int64_t n_rep, int64_t m) {
  const int64_t buckets = n_rep > 0 ? kvcrush_bucket_count(n_rep, m) : 0;
  const int64_t candidates = m - n_important;
  return n_important + (buckets < candidates ? buckets : candidates);
}

/// The merged row: a token's slot is its index among its own kind (important, or representative; both ascending)
/// plus the count of the other kind's tokens below it.
KVRET_HD int64_t kvcrush_merge_slot(int64_t own_index, int64_t other_below) { return own_index + other_below; }

/// The merged row's score: a representative scores -infinity, an important token keeps its score.
KVRET_HD float kvcrush_merged_score(bool representative, float important_score) {
  return representative ? neg_inf() : important_score;
}

}  // namespace kvret::cuda::math
