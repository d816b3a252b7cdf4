#pragma once
// One layer's KVCrush state (config.hamming_fraction > 0): a signature per token, one bit per KV head, and each
// head's importance of every token, from a proxy observation window: the last kWindow keys the layer held at its
// first select (the end of the prompt), used as queries of their own KV head. A selection spends the important part
// of its budget on the retriever's choice and adds one representative per bucket of the tokens left out.
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

  /// Brings the signatures up to the store's tokens: at the first call, the window (the store's last kWindow
  /// keys), every token's importance and bits, and each head's threshold (the importance of the last token it
  /// marked); later tokens are scored against the same window and marked when at or above the threshold. The first
  /// call runs the KV heads on n_threads threads when its window logits (window rows x tokens x heads) reach
  /// SelectRequest::kParallelLogits.
  void update(const HostKvStore& store, float scale, int n_threads = 1);
  /// Forgets the tokens from `length` on; everything when the window lay beyond it (recomputed at the next
  /// update). Never throws.
  void truncate(int64_t length) noexcept;

  /// Adds the representatives of KV head h to its selection row[0..n_important) (distinct, ascending middle
  /// positions in [mid_begin, mid_end)), in place: the other middle tokens ordered by (Hamming distance of their
  /// signature to the alternating anchor, position), cut into min(n_rep, their count) buckets by bucket_begin, and
  /// from each its token of the largest importance for head h (ties to the lower position): the rule of
  /// representatives() in select/kvcrush.hpp, from lists kept in that order. The row stays ascending; scores
  /// (when not null) follow their positions and representatives score -infinity. Returns the row's new count.
  /// row and scores hold n_important + n_rep.
  int64_t add_representatives(int h, int64_t mid_begin, int64_t mid_end, int32_t* row, float* scores,
                              int64_t n_important, int64_t n_rep) const;

  int64_t tokens() const noexcept { return n_; }
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

  int heads_ = 0;
  int words_ = 0;
  int d_ = 0;
  int w_ = 0;  ///< window rows per head (kWindow, or fewer tokens)
  float scale_ = 1.0f;
  std::vector<float> window_;     ///< [heads, w, d]
  std::vector<float> lse_;        ///< [heads, w]: each window row's log-normalizer
  std::vector<float> threshold_;  ///< [heads]
  std::vector<uint64_t> anchor_;  ///< [words]: the alternating anchor
  std::vector<uint64_t> bits_;    ///< [n, words]
  /// Per Hamming distance to the anchor (0..heads): its tokens in ascending position, and their importance
  /// ([count, heads]); one pass over them in distance order gives the candidates in the grouping's order.
  std::vector<std::vector<int32_t>> by_distance_;
  std::vector<std::vector<float>> importance_by_distance_;
  int64_t window_end_ = 0;  ///< the window is the keys [window_end_ - w, window_end_); 0: none yet
  int64_t n_ = 0;           ///< tokens with a signature
};

}  // namespace kvret
