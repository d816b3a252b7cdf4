#pragma once
// Per-element and decision math of the batched top-k (topk_select.cuh): the order key of a score, the radix
// digits of its three passes, the choice of the digit that holds the k-th key, and the clamp of a row's count.
#include "hd.h"

namespace kvret::cuda::math {

/// The radix-select passes: 11 + 11 + 10 bits, most significant first.
inline constexpr int kTopkPasses = 3;

/// An ascending key of a score: larger scores get larger keys, and the order is the CPU selection's
/// (select/topk.hpp, descending_rank): every NaN counts as -inf (whatever its sign and payload), -0 counts as +0.
/// Equal keys are ranked by position (the lower first), so topk_order_key(a) == ~descending_rank(a) for every float.
KVRET_HD uint32_t topk_order_key(float score) {
  const float f = score == score ? add_rn(score, 0.0f) : neg_inf();  // -0 + 0 == +0; NaN -> -inf
  const uint32_t b = float_bits(f);
  return b ^ ((0u - (b >> 31)) | 0x80000000u);  // negative: every bit flipped; positive: the sign bit set
}

KVRET_HD int topk_pass_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
KVRET_HD int topk_pass_bits(int pass) { return pass == 2 ? 10 : 11; }
KVRET_HD uint32_t topk_digit_mask(int pass) { return (1u << topk_pass_bits(pass)) - 1u; }

/// The digit of `key` in `pass`.
KVRET_HD uint32_t topk_digit(uint32_t key, int pass) { return (key >> topk_pass_shift(pass)) & topk_digit_mask(pass); }

/// Scanning the bins from the largest digit down: a bin holding `in_bin` keys, with `at_or_above` keys in it and the
/// bins above it, holds the `need`-th largest key of the candidates exactly when this is true (one bin per scan).
KVRET_HD bool radix_bin_holds(int64_t at_or_above, int64_t in_bin, int64_t need) {
  return at_or_above >= need && at_or_above - in_bin < need;
}

/// The scores a row really has: the device-side count n_tokens[s], clamped to [0, score_stride] (a count beyond
/// the row's stride would read the next row or past the buffer; a negative one selects nothing).
KVRET_HD int32_t topk_clamp_count(int32_t n_tokens, int64_t score_stride) {
  const int64_t hi = score_stride < 0x7fffffff ? score_stride : 0x7fffffff;
  return static_cast<int32_t>(clamp_i64(n_tokens, 0, hi < 0 ? 0 : hi));
}

}  // namespace kvret::cuda::math
