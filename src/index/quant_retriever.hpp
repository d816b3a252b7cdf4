#pragma once
// SpeCache's index: a KIVI low-bit copy of every middle key and value (core/kivi_quant: keys per channel along
// tokens, values per token along channels, groups of 32 or 64, 1 or 2 bits, the most recent tokens in f16). A query
// scores every middle token from the packed key codes (q . zero + (q * step) . codes per key block, no key
// reconstructed; the f16 residual by its dot product), the query heads of a KV group are folded and the top
// `budget` tokens are taken, as EXACT does with the exact keys. With re-ranking (config.quant_rerank = r > 1) the
// top r x budget tokens by the low-bit scores are candidates, scored again from their exact keys in the store, and
// the top `budget` of them are taken. Under quantized attention (attend_dense) those candidates also enter the
// softmax with their exact keys.
//
// The copy is the resident state the engine keeps near the compute (its bytes are the index bytes): keys and values
// at (bits + 32 / group) / 16 of their f16 size, plus the residual window. Without re-ranking select reads only
// the copy, never the host store; with it, the candidates' keys too. The quantized state is a function of the indexed
// tokens (blocks start at the first middle position), so a decode extend, a cut and a rebuild all agree. See
// docs/quant.md.
#include <memory>
#include <vector>

#include "core/kivi_quant.hpp"
#include "index/change_log.hpp"
#include "index/retriever.hpp"

namespace kvret {

class QuantRetriever final : public Retriever {
 public:
  /// rerank: select's candidates per selected token (config.quant_rerank; 1 = the low-bit ranking alone).
  QuantRetriever(int n_kv_heads, int head_dim, const KiviParams& params, int rerank = 1);

  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows,
                 float* const* out_scores) const override;
  int64_t bytes() const noexcept override;
  /// Always: whole blocks are dropped, and the residual the cut leaves is read again from the store.
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<QuantRetriever>(*this); }
  const Retriever* selects_as() const noexcept override { return this; }
  std::vector<std::byte> save() const override;
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;

  /// SpeCache's output rule (config.quant_attention): attention of every query head over every token of the
  /// layer. The sink and local windows and each KV head's `count` selected middle positions (ascending) are the exact
  /// rows of `store`. With re-ranking (rerank() = r > 1) and count > 0, the min(r x count, middle) middle tokens the
  /// low-bit keys score highest (select's candidates: the same logits, maximum over the group and ties) take their
  /// exact keys from `store`, so their logits are exact, and keep the low-bit copy's values unless selected; every
  /// other middle token is the low-bit copy's row (its logit from the packed codes as select scores it, its value
  /// dequantized). q: f32 [n_q_heads, head_dim]; out: f32 [n_q_heads, head_dim]; `group` query heads per KV head;
  /// logits scaled by `scale`. The exact rows (sink, local, selected) are attended as attend does (attend_head: the
  /// blocked attention in position order), joined per query head in double precision to the other tokens' terms in
  /// position order (kernels/math/quant_math.h). count = 0: pure low-bit attention over the middle. Returns the
  /// candidates read key only (not among the selected), summed over KV heads.
  int64_t attend_dense(const HostKvStore& store, const int32_t* const* selected, int64_t count, const float* q,
                       int group, float scale, float* out, int n_threads) const;

  // Introspection (tests, tools).
  const KiviParams& params() const noexcept { return p_; }
  int rerank() const noexcept { return rerank_; }
  const KiviHead& head(int h) const noexcept { return heads_[static_cast<size_t>(h)]; }
  int n_kv_heads() const noexcept { return n_kv_; }
  int head_dim() const noexcept { return d_; }
  /// Quantized key blocks per head (every head has the same).
  int64_t blocks() const noexcept { return heads_.empty() ? 0 : heads_[0].quantized() / p_.group; }

  /// The version of the quantized copy: a new one, unique in the process, after every change (extend, cut,
  /// restore); a clone has its original's until either changes. For a copy elsewhere (the CUDA backend's device
  /// mirror): blocks_changed_since(v) is the first key block (and its group of value rows) that may differ from
  /// version v's (blocks() when none does; 0 when v is unknown: every block). The f16 residual may differ after
  /// any change.
  uint64_t version() const noexcept { return log_.version(); }
  int64_t blocks_changed_since(uint64_t v) const noexcept { return log_.changed_since(v, blocks()); }

 protected:
  void on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) override;
  void on_cut(const HostKvStore& store, int64_t end) noexcept override;

 private:
  int n_kv_;
  int d_;
  KiviParams p_;
  /// Head h's low-bit logits of the n middle tokens ([group][n], scaled by `scale`) and, with k > 0, the k middle
  /// positions they rank highest (ascending, absolute: base + index) into cand: the re-ranking's candidates. They are
  /// ranked by the maximum over the group's query heads (KVRET_FOLD_MAX_LOGIT) whatever the configured fold, which
  /// only the exact re-ranking applies: a token any head rates highly is a candidate, and no low-bit logit goes
  /// through a softmax over every token, where a few over-rated tokens take a head's whole weight (docs/quant.md).
  void low_bit_candidates(int h, const float* qh, int group, float scale, int64_t base, int64_t n, int64_t k,
                          float* logits, int32_t* cand) const;

  int rerank_;
  std::vector<KiviHead> heads_;
  ChangeLog log_;  ///< the changes of the copy, by key block
};

/// The KVRET_INDEX_QUANT kind.
std::shared_ptr<const RetrieverKind> make_quant_kind();

}  // namespace kvret
