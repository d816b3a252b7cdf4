#pragma once
// One layer's KVCrush state (config.hamming_fraction > 0): a signature per token, one bit per signature head, and
// each KV head's importance of every token. The importance comes from an observation window, either the prompt's
// last queries (kvret_seq_observe; one bit per query head, a KV head's importance the sum over its query heads) or a
// proxy, the last kWindow keys the layer held at its first select (the end of the prompt), used as queries of their
// own KV head (one bit per KV head); or from accumulated attention sums (rebuild_from_sums). A selection spends the
// important part of its budget on the retriever's choice and adds one representative per bucket of the tokens left
// out.
#include <cstdint>
#include <vector>

#include "store/host_kv_store.hpp"

namespace kvret {

class KvCrushLayer {
 public:
  /// Window queries per KV head (SnapKV's w).
  static constexpr int kWindow = 32;
  /// The share of tokens each head marks in the signatures.
  static constexpr float kMarkedFraction = 0.5f;

  /// Brings the signatures up to the store's tokens: at the first call, the window, every token's importance and
  /// bits, and each signature head's threshold (the importance of the last token it marked); later tokens are scored
  /// against the same window and marked when at or above the threshold. The window: `queries` ([q_heads, w, head_dim],
  /// query head i attending with KV head i / (q_heads / n_kv_heads); one signature bit per query head) when not null,
  /// else the store's last kWindow keys (one bit per KV head). The first call runs the signature heads on n_threads
  /// threads when its window logits (window rows x tokens x heads) reach SelectRequest::kParallelLogits. Strong
  /// guarantee. Must not follow rebuild_from_sums without a reset.
  void update(const HostKvStore& store, float scale, int n_threads = 1, const float* queries = nullptr, int q_heads = 0,
              int w = 0);
  /// Replaces everything with signatures over `length` tokens from accumulated sums: sums [sig_heads, n_sums]
  /// (n_sums <= length; tokens from n_sums on count 0), one bit per sig head (its top kMarkedFraction), a KV head's
  /// importance the sum over its sig_heads / kv_heads heads; `steps` is recorded (sums_steps()). Strong guarantee.
  void rebuild_from_sums(const float* sums, int sig_heads, int64_t n_sums, int kv_heads, int64_t length, int64_t steps);
  /// Whether the state comes from rebuild_from_sums, and the steps it recorded.
  bool from_sums() const noexcept { return from_sums_; }
  int64_t sums_steps() const noexcept { return sums_steps_; }
  /// Bits per signature (0 before the first update).
  int signature_heads() const noexcept { return sig_heads_; }
  /// Forgets the tokens from `length` on; everything when the window lay beyond it (recomputed at the next
  /// update). Never throws.
  void truncate(int64_t length) noexcept;

  /// Where the middle tokens [mid_begin, mid_end) lie in the distance lists: per Hamming distance d, the first of
  /// them in list d (begin[d]), and the count of middle tokens at distances below d (prefix[d], d = 0..sig_heads + 1;
  /// prefix.back() is the middle's size); and, for `buckets` buckets (when > 0), the first token of each bucket
  /// (first[b]). The same for every KV head: computed once per select.
  struct MiddleOrder {
    int64_t mid_begin = 0, mid_end = 0, buckets = 0;
    std::vector<int64_t> begin, prefix;
    std::vector<int32_t> first;
  };
  /// The middle's place in the lists: two short searches per distance (the tokens before mid_begin and from
  /// mid_end on are at the lists' ends), and the first token of each of min(buckets, middle) buckets.
  /// Requires mid_end <= tokens().
  MiddleOrder middle_order(int64_t mid_begin, int64_t mid_end, int64_t buckets = 0) const;

  /// Adds the representatives of KV head h to its selection row[0..n_important) (distinct, ascending middle
  /// positions in [mid_begin, mid_end)), in place, by the rule of representatives() in select/kvcrush.hpp with the
  /// alternating anchor: the middle tokens in (Hamming distance, position) order cut into min(n_rep, middle)
  /// buckets by bucket_begin, from each its first token not in the row, and for each bucket of row tokens only the
  /// first candidate in that order not yet taken. O(n_important + n_rep + middle / 64) per call, from the lists:
  /// nothing is scored (fastest when `order` holds the first token of each of its buckets). The row stays ascending;
  /// scores (when not null) follow their positions and representatives score -infinity. Returns the row's new count,
  /// n_important + min(buckets, candidates) (kvcrush_selected_count of kernels/math/kvcrush_math.h; the same for
  /// every head). row and scores hold that count: n_important + min(n_rep, middle - n_important) entries suffice, so
  /// an n_rep larger than the middle (or than its candidates) is safe and adds the same as n_rep = middle. A negative
  /// n_rep, or an important row longer than the middle, adds nothing. `order` is middle_order(mid_begin, mid_end) of
  /// this state.
  int64_t add_representatives(int h, const MiddleOrder& order, int32_t* row, float* scores, int64_t n_important,
                              int64_t n_rep) const;
  /// The same, computing middle_order itself.
  int64_t add_representatives(int h, int64_t mid_begin, int64_t mid_end, int32_t* row, float* scores,
                              int64_t n_important, int64_t n_rep) const;

  /// KVCrush at unit granularity (config.hamming_granularity g > 1): the middle [mid_begin, mid_end) cut into the
  /// aligned runs [j*g, (j+1)*g) of positions (the first and last clipped to the middle), each run's signature the
  /// per-bit majority of its tokens' (a bit set when more than half of the run's tokens have it; a tie clears it),
  /// the runs ordered by (Hamming distance to the alternating anchor, first position): units[] holds each run's
  /// first position in that order. One pass over the middle's signatures and a counting sort by distance: O(middle
  /// x signature words + units), nothing scored.
  struct UnitOrder {
    int64_t mid_begin = 0, mid_end = 0, granularity = 1;
    std::vector<int32_t> units;
  };
  /// Requires mid_end <= tokens() and granularity >= 2.
  UnitOrder unit_order(int64_t mid_begin, int64_t mid_end, int64_t granularity) const;
  /// Adds representatives at unit granularity to row[0..n_important) (distinct, ascending middle positions), in
  /// place: the units in `order` cut into k = min(floor(n_rep / g), units) buckets as kvcrush_bucket_begin cuts
  /// tokens; each bucket sends its first unit (in order) holding a token not yet taken, with all of that unit's
  /// tokens not yet taken; then, while fewer than min(n_rep, middle - n_important) tokens were added, the units in
  /// order send their tokens not yet taken (whole units, the last one possibly cut, in position order). Returns the
  /// new count n_important + min(n_rep, middle - n_important), the token rule's count. Scores as
  /// add_representatives.
  int64_t add_unit_representatives(const UnitOrder& order, int32_t* row, float* scores, int64_t n_important,
                                   int64_t n_rep) const;

  int64_t tokens() const noexcept { return n_; }
  /// The identity of the token rows: a value of this process that no other state had, renewed whenever rows already
  /// held may change (a new state, a truncate); appends keep it. Rows [0, tokens()) of two looks at one object with
  /// the same epoch are the same where both hold them (a copy keeps its source's epoch until either changes). A
  /// device copy of the signatures uses it to copy only the appended rows.
  uint64_t epoch() const noexcept { return epoch_; }
  /// The signatures, [tokens(), words] (the vector may hold rows past tokens()).
  const std::vector<uint64_t>& bits() const noexcept { return bits_; }
  /// Head h's importance of token t < tokens() (a search of the distance lists: for tests).
  float importance(int h, int64_t t) const noexcept;
  /// Head h's importance of the tokens [begin, end) (begin <= end <= tokens()) into out[0..end - begin): one pass
  /// over the distance lists.
  void importance_range(int h, int64_t begin, int64_t end, float* out) const noexcept;

 private:
  /// Appends tokens [n_, n_ + count) with their bits ([count, words]) and importance ([heads][count]) to the
  /// distance lists. Strong guarantee.
  void append_tokens(const uint64_t* bits, const std::vector<std::vector<float>>& importance, int64_t count);
  /// A fresh state's geometry: sig_heads signature bits, kv_heads KV heads, the anchor and distance lists.
  void init(int sig_heads, int kv_heads);
  /// The KV heads' importance ([kv_heads][count]) from the signature heads' ([sig_heads, count] at `flat`).
  std::vector<std::vector<float>> kv_importance(const float* flat, int64_t count) const;

  int heads_ = 0;      ///< KV heads (importance)
  int sig_heads_ = 0;  ///< signature bits (KV heads, or query heads)
  int group_ = 1;      ///< sig_heads_ / heads_
  int words_ = 0;
  int d_ = 0;
  int w_ = 0;  ///< window rows per signature head (kWindow, or fewer tokens; or the queries' w)
  float scale_ = 1.0f;
  std::vector<float> window_;     ///< [sig_heads, w, d]
  std::vector<float> lse_;        ///< [sig_heads, w]: each window row's log-normalizer
  std::vector<float> threshold_;  ///< [sig_heads]
  std::vector<uint64_t> anchor_;  ///< [words]: the alternating anchor
  std::vector<uint64_t> bits_;    ///< [n, words]
  /// Per Hamming distance to the anchor (0..sig_heads): its tokens in ascending position, and their importance
  /// ([count, heads]); read in distance order they are the tokens in the grouping's order.
  std::vector<std::vector<int32_t>> by_distance_;
  std::vector<std::vector<float>> importance_by_distance_;
  int64_t window_end_ = 0;  ///< the window is the keys [window_end_ - w, window_end_); 0: none yet
  int64_t n_ = 0;           ///< tokens with a signature
  uint64_t epoch_ = 0;      ///< epoch(); 0 before the first init
  bool from_sums_ = false;
  int64_t sums_steps_ = 0;
};

}  // namespace kvret
