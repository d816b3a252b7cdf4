#pragma once
// PQCache's index: keys of every (layer, KV head) split into m sub-spaces, each quantized to one of 2^bits
// centroids learned by k-means; a query scores token t as sum_j <q_j, C_j[code_j(t)]> read from a lookup table.
//
// When 2^(bits*m) <= 65536 (the default m=2, bits=6 gives 4096) the tokens sharing one code tuple ("cell") share
// their score exactly, so select scores, folds and ranks cells instead of tokens: the softmax of each query head
// runs over cells weighted by their token counts (identical to a per-token softmax), whole cells are taken best
// first until the budget, and the last cell is trimmed to its earliest positions. That makes a step O(cells +
// tokens) with one table lookup per token instead of m, and no per-token exp or sort.
#include <cstdint>
#include <vector>

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
  };

  PqRetriever(int n_kv_heads, int head_dim, const Params& params);

  void extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) override;
  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows) const override;
  int64_t bytes() const noexcept override;

  // Introspection (tests, benchmarks).
  bool trained() const noexcept { return trained_on_ > 0; }
  int64_t size() const noexcept { return base_ < 0 ? 0 : end_ - base_; }
  int64_t base() const noexcept { return base_; }
  int m() const noexcept { return m_; }
  int k() const noexcept { return k_; }
  int sub_dim() const noexcept { return dsub_; }
  /// Centroids of (head, sub-space j): [k, sub_dim].
  const float* centroids(int head, int j) const noexcept {
    return codebook_.data() + (static_cast<size_t>(head) * m_ + j) * k_ * dsub_;
  }
  /// Codes of a head: [size(), m], token i at position base() + i.
  const uint8_t* codes(int head) const noexcept { return codes_[static_cast<size_t>(head)].data(); }
  /// Unscaled approximate logits sum_j <q_j, C_j[code_j]> of every indexed token of `head` (out: [size()]).
  void approximate_logits(int head, const float* q, float* out) const;

 private:
  std::vector<float> train(const HostKvStore& store, int64_t begin, int64_t end, int n_threads) const;
  void encode(const HostKvStore& store, const std::vector<float>& codebook, int64_t begin, int64_t end,
              std::vector<std::vector<uint8_t>>& out, int n_threads) const;
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
  std::vector<float> codebook_;                    ///< [H, m, k, dsub]
  std::vector<std::vector<uint8_t>> codes_;        ///< per head [n, m]
  std::vector<std::vector<int32_t>> cell_counts_;  ///< per head [cells]
  std::vector<std::vector<uint16_t>> cells_of_;    ///< per head [n]: the cell of each token (cell path only)
  int64_t base_ = -1;
  int64_t end_ = -1;
  int64_t trained_on_ = 0;
};

}  // namespace kvret
