#pragma once
// KVCrush: part of a selection budget spent on representatives of the tokens left out. Each token gets a signature,
// one bit per head (set when the token is in that head's top fraction by importance); the tokens not otherwise
// selected (the candidates) are grouped by the Hamming distance of their signature to an anchor: the range's tokens
// in that order are cut into buckets of near-equal size, and each bucket sends its first candidate.
#include <cstdint>
#include <vector>

namespace kvret {

/// uint64 words per signature of `heads` bits.
inline int signature_words(int heads) noexcept { return (heads + 63) / 64; }

/// The tokens a head marks: ceil(fraction * n), at least 1 when n > 0, at most n.
int64_t signature_marked(int64_t n, float fraction) noexcept;

/// Signatures of n tokens: bits[t * words + h / 64] has bit h % 64 set when token t is among the
/// signature_marked(n, fraction) tokens of largest importance[h * n + t] for head h (the order of topk: score
/// descending, NaN lowest, ties to the lower token). importance: [heads, n]; bits: [n, signature_words(heads)],
/// overwritten. fraction in (0, 1].
void signatures(const float* importance, int heads, int64_t n, float fraction, uint64_t* bits);

/// The Hamming distance of two signatures of `words` words (popcount of their xor): 0..heads.
/// (kvcrush_hamming of kernels/math/kvcrush_math.h.)
int hamming_distance(const uint64_t* a, const uint64_t* b, int words) noexcept;

/// The unnormalised softmax of n > 0 logits in place: row[t] = exp(row[t] - max); returns the sum (in double) and
/// writes the max to *max_out.
double exp_from_max(float* row, int64_t n, float* max_out);

/// SnapKV-style importance of n keys for one head: importance[t] = sum over the w window queries j of
/// softmax_t(scale * q_j . k_t) (every key visible to every window query, as for queries at the end of a prompt).
/// window: [w, d]; keys: [n, d]; importance: [n], overwritten. Also writes each window query's log-normalizer
/// (log of the sum over t of exp(scale * q_j . k_t)) to lse[j] when lse is not null, so that later keys can be
/// scored on the same scale (window_importance).
void snapkv_importance(const float* window, int w, const float* keys, int64_t n, int d, float scale, float* importance,
                       float* lse = nullptr);

/// The importance of n more keys against a window whose log-normalizers are lse (from snapkv_importance):
/// importance[t] = sum_j exp(scale * q_j . k_t - lse[j]).
void window_importance(const float* window, int w, const float* lse, const float* keys, int64_t n, int d, float scale,
                       float* importance);

/// H2O-style accumulated attention: per head, the sum over decode steps of the attention probabilities each token
/// received. Tokens are added as they arrive (a token's sum starts at 0).
class AttentionAccumulator {
 public:
  explicit AttentionAccumulator(int heads) : heads_(heads) {}
  int heads() const noexcept { return heads_; }
  int64_t tokens() const noexcept { return n_; }
  /// Adds one step's probabilities, probs: [heads, n] over the first n tokens (grown to n when longer).
  void add(const float* probs, int64_t n);
  /// Keeps the first n tokens' sums (no-op when it holds no more). In place; never throws.
  void truncate(int64_t n) noexcept;
  /// Removes the sums of tokens [begin, begin + count) (those it holds); later tokens move count earlier. In place;
  /// never throws.
  void erase(int64_t begin, int64_t count) noexcept;
  /// The sums, [heads, tokens()] (head h's row at h * tokens()).
  const std::vector<float>& importance() const noexcept { return sum_; }

 private:
  int heads_;
  int64_t n_ = 0;
  std::vector<float> sum_;
};

enum class Anchor {
  kRandom,       ///< each bit from splitmix64(seed)
  kAlternating,  ///< 0101...: bit h set for odd h
  kMajority,     ///< bit h set when more than half of the given tokens have it
};

/// The anchor signature (words of signature_words(heads)); kMajority counts over the tokens `positions[0..n)`
/// (rows of bits), the other anchors ignore them.
void make_anchor(Anchor kind, int heads, uint64_t seed, const uint64_t* bits, const int32_t* positions, int64_t n,
                 uint64_t* anchor);

/// Bucket b of c ordered tokens cut into `buckets` buckets: [bucket_begin(b), bucket_begin(b + 1)), with
/// bucket_begin(b) = floor(b * c / buckets). Sizes differ by at most one; none is empty when c >= buckets.
/// (kvcrush_bucket_begin of kernels/math/kvcrush_math.h; b, c < 2^31 as positions are int32: no overflow.)
int64_t bucket_begin(int64_t b, int64_t c, int64_t buckets) noexcept;

/// Orders the candidates positions[0..c) (ascending) by (Hamming distance of their signature to `anchor`,
/// position), writing them to `ordered` (a stable counting sort on the distance: O(c + heads)).
void order_by_distance(const uint64_t* bits, int words, int heads, const uint64_t* anchor, const int32_t* positions,
                       int64_t c, int32_t* ordered);

/// The grouping over the tokens [begin, end) (rows of bits), given the important set (n_important distinct,
/// ascending positions in [begin, end)): the range's tokens ordered by order_by_distance (distance to `anchor`, then
/// position), cut into b = min(buckets, end - begin) buckets by bucket_begin over end - begin tokens, and from each
/// bucket its first token in that order that is not important (a candidate). A bucket of important tokens only sends
/// none; its place goes to the first candidate in the order not yet taken (one per such bucket, while there are
/// candidates left), so the count is min(b, candidates). Writes the representatives ascending to reps and returns
/// their count. ordered: scratch of end - begin entries, left holding the ordered tokens.
int64_t representatives(const uint64_t* bits, int words, int heads, const uint64_t* anchor, int64_t begin, int64_t end,
                        const int32_t* important, int64_t n_important, int64_t buckets, int32_t* ordered,
                        int32_t* reps);

/// The split of a budget: representatives = floor(share * budget) (the float share times the budget, in double), capped
/// at max_buckets when max_buckets > 0; important = budget - representatives. share in [0, 1).
struct BudgetSplit {
  int64_t important = 0;
  int64_t representatives = 0;
};
BudgetSplit split_budget(int64_t budget, float share, int64_t max_buckets = 0) noexcept;

/// The candidates of [begin, end) given the important set (ascending positions in [begin, end)): every other
/// position, ascending. Returns their count.
int64_t complement(int64_t begin, int64_t end, const int32_t* important, int64_t n_important, int32_t* out);

/// Merges two ascending, disjoint selections into `out` (ascending); with scores (all three given or none), the
/// scores follow their positions and representatives get rep_score. Returns n_a + n_b.
int64_t merge_selection(const int32_t* a, const float* a_scores, int64_t n_a, const int32_t* b, int64_t n_b,
                        float b_score, int32_t* out, float* out_scores);

/// The whole composition over scores (the base method: the top-k of scores, ascending positions): for budget B
/// over positions [0, n), split_budget(B, share, max_buckets), the top `important` by score, then the
/// representatives over [0, n) given that important set. share 0 gives topk_positions(scores, n, B) exactly.
/// out: [B] ascending.
void crush_topk(const float* scores, int64_t n, int64_t budget, float share, int64_t max_buckets, const uint64_t* bits,
                int heads, const uint64_t* anchor, int32_t* out);

}  // namespace kvret
