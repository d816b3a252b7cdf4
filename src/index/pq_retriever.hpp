#pragma once
// PQCache's index: keys of every (layer, KV head) split into m sub-spaces, each quantized to one of 2^bits
// centroids learned by k-means; a query scores token t as sum_j <q_j, C_j[code_j(t)]> read from a lookup table.
//
// When 2^(bits*m) <= 65536 (the default m=2, bits=6 gives 4096) the tokens sharing one code tuple ("cell") share
// their score exactly, so select scores, folds and ranks cells instead of tokens: the softmax of each query head
// runs over cells weighted by their token counts (identical to a per-token softmax), whole cells are taken best
// first until the budget, and the last cell is trimmed to its earliest positions. That makes a step O(cells +
// tokens) with one table lookup per token instead of m, and no per-token exp or sort.
//
// Exact outliers (ShadowKV's idea, Params::exact_fraction): the keys PQ reconstructs worst are kept exact. At each
// training, per head, the ceil(fraction * n) tokens with the largest squared reconstruction error ||k - k_hat||^2
// (ties: the earlier position) get a copy of their key (in the store's dtype) and are scored with the exact q.k; a
// token encoded later with the same codebook joins them when its error is strictly above the smallest error of the set
// at training (the head's threshold), so the share stays about constant. A rare, sharp key -- the one a retrieval head
// copies from -- is exactly the kind PQ reconstructs worst, and ranking it by its PQ score can drop it at every
// budget. Exact tokens leave their cells (cell counts exclude them) and compete as single items of count 1 next
// to the cells: each query head's softmax runs over cells and exact tokens together.
#include <cstdint>
#include <vector>

#include "core/config.hpp"
#include "core/large_vector.hpp"
#include "index/retriever.hpp"

namespace kvret {

class PqRetriever final : public Retriever {
 public:
  struct Params {
    int m = 2;
    int bits = 6;
    int iters = 0;  ///< 0 = adaptive
    float tol = 1e-3f;
    int64_t train_sample = 8192;  ///< 0 = all
    uint64_t seed = 42;
    float exact_fraction = kDefaultPqExactFraction;  ///< share of tokens kept exact per head; 0 = off
  };

  /// Exact tokens chosen per head at a training over n tokens: ceil(fraction * n), with a relative slack of 1e-6
  /// so that a fraction not representable in float (0.1f is 0.100000001...) does not round 100.0000015 up to 101.
  static int64_t exact_count(float fraction, int64_t n) noexcept;

  PqRetriever(int n_kv_heads, int head_dim, const Params& params);

  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows,
                 float* const* out_scores) const override;
  int64_t bytes() const noexcept override;
  /// Where the codebook was trained on positions below `end` only: then the codes, cells and exact tokens at or
  /// above it are dropped and the rest is what the same extends up to `end` built.
  bool can_cut(int64_t end) const noexcept override;
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<PqRetriever>(*this); }
  const Retriever* selects_as() const noexcept override { return this; }
  /// The codebook, codes, exact tokens (positions and keys) and thresholds; cells are derived again on restore.
  std::vector<std::byte> save() const override;
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;

  // Introspection (tests, benchmarks).
  bool trained() const noexcept { return trained_on_ > 0; }
  int64_t size() const noexcept { return base_ < 0 ? 0 : end_ - base_; }
  int64_t base() const noexcept { return base_; }
  int n_kv_heads() const noexcept { return n_kv_; }
  int head_dim() const noexcept { return d_; }
  int m() const noexcept { return m_; }
  int k() const noexcept { return k_; }
  int sub_dim() const noexcept { return dsub_; }
  /// Centroids of (head, sub-space j): [k, sub_dim].
  const float* centroids(int head, int j) const noexcept {
    return codebook_.data() + (static_cast<size_t>(head) * m_ + j) * k_ * dsub_;
  }
  /// Codes of a head: [size(), m], token i at position base() + i.
  const uint8_t* codes(int head) const noexcept { return codes_[static_cast<size_t>(head)].data(); }
  /// Unscaled approximate logits sum_j <q_j, C_j[code_j]> of every indexed token of `head` (out: [size()]): the
  /// pure PQ score, exact tokens included (select replaces theirs by the exact q.k).
  void approximate_logits(int head, const float* q, float* out) const;
  /// Positions (absolute, ascending) of the tokens of `head` kept exact.
  const LargeVector<int64_t>& exact_positions(int head) const noexcept { return exact_pos_[static_cast<size_t>(head)]; }
  /// The keys of exact_positions(head) as f32: [exact_positions(head).size(), head_dim]. They are kept in the KV
  /// store's dtype (an f16 store's exact keys take half the bytes of f32 ones and score the same).
  std::vector<float> exact_keys_f32(int head) const;
  /// Whether select scores code cells (pq_bits * pq_m <= 16; kernels/math/pq_math.h's pq_cells), and how many.
  bool scores_cells() const noexcept { return cells_ > 0; }
  int64_t n_cells() const noexcept { return cells_; }
  /// The tokens of each cell of `head` without its exact tokens: [n_cells()] (cell path only).
  const std::vector<int32_t>& cell_counts(int head) const noexcept { return cell_counts_[static_cast<size_t>(head)]; }
  /// The item of each token of `head` at offsets [from, to) of the index: n_cells() + e for the e-th exact token,
  /// else its cell (cell path; pq_math.h's items) or -1 (per-token path).
  void items(int head, int64_t from, int64_t to, int32_t* out) const;
  /// exact_keys_f32 from the `from`-th exact token on: [exact_positions(head).size() - from, head_dim].
  std::vector<float> exact_keys_f32(int head, int64_t from) const;
  /// The version of the index: a new one, unique in the process, after every change (extend, cut, restore).
  uint64_t version() const noexcept { return version_; }
  /// The version of the last change that was not an append (a training, a cut, a restore): while it stays, a
  /// change only appended tokens (their codes, cells and exact tokens) and changed cell counts, so that a copy of
  /// the index of an older version with this layout_version() needs only what came after it.
  uint64_t layout_version() const noexcept { return layout_version_; }
  /// The squared reconstruction error above which a newly encoded token of `head` becomes exact: the smallest
  /// error in the set chosen at the last training (+inf when the set is empty, e.g. fraction 0).
  float exact_threshold(int head) const noexcept { return exact_threshold_[static_cast<size_t>(head)]; }

 protected:
  void on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) override;
  void on_cut(const HostKvStore& store, int64_t end) noexcept override;

 private:
  /// The cell of every token of each head ([n]) and the cells' counts without the exact tokens ([cells]), from
  /// the codes of positions [base, base + n); empty where cells are not used.
  void derive_cells(const std::vector<LargeVector<uint8_t>>& codes, const std::vector<LargeVector<int64_t>>& exact_pos,
                    int64_t base, int64_t n, std::vector<std::vector<int32_t>>& counts,
                    std::vector<LargeVector<uint16_t>>& cells) const;
  std::vector<float> train(const HostKvStore& store, int64_t begin, int64_t end, int n_threads) const;
  /// Codes of [begin, end) into out (per head [n, m]); when errors is not null, also each token's squared
  /// reconstruction error sum_j ||k_j - C_j[code_j]||^2 (per head [n]).
  void encode(const HostKvStore& store, const std::vector<float>& codebook, int64_t begin, int64_t end,
              std::vector<LargeVector<uint8_t>>& out, std::vector<std::vector<float>>* errors, int n_threads) const;
  bool keeps_exact() const noexcept { return params_.exact_fraction > 0.0f; }
  void lookup_table(int head, const float* q, float scale, float* lut) const;
  bool uses_cells() const noexcept { return cells_ > 0; }
  /// Cell id of a code tuple: sum_j code_j * k^j.
  int64_t cell_of(const uint8_t* code) const noexcept {
    int64_t cell = 0;
    for (int j = m_ - 1; j >= 0; --j) cell = cell * k_ + code[j];
    return cell;
  }

  int n_kv_;
  int d_;
  int m_;
  int dsub_;
  int k_;
  int64_t cells_;  ///< k^m when <= 65536, else 0
  Params params_;
  std::vector<float> codebook_;                     ///< [H, m, k, dsub]
  std::vector<LargeVector<uint8_t>> codes_;         ///< per head [n, m]
  std::vector<std::vector<int32_t>> cell_counts_;   ///< per head [cells]
  std::vector<LargeVector<uint16_t>> cells_of_;     ///< per head [n]: the cell of each token (cell path only;
                                                    ///< exact tokens keep theirs but are not counted in it)
  std::vector<LargeVector<int64_t>> exact_pos_;     ///< per head: positions of the exact tokens, ascending
  std::vector<LargeVector<std::byte>> exact_keys_;  ///< per head [exact, d]: their keys, in key_dtype_
  DType key_dtype_ = DType::F32;                    ///< the store's dtype at the last training
  std::vector<float> exact_threshold_;              ///< per head: see exact_threshold()
  int64_t trained_on_ = 0;
  uint64_t version_;
  uint64_t layout_version_;
};

}  // namespace kvret
