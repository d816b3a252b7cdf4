#pragma once
// Quest's index: the middle tokens of every KV head cut into pages of `page_size` consecutive positions, each page
// summarized by the element-wise min and max of its keys. For a query q, sum_i max(q_i * min_i, q_i * max_i) bounds
// q . k from above for every key k of the page, so a page's bound is an upper bound of its best logit.
//
// Select treats each page's (scaled) bound as a logit shared by the page's tokens: the query heads of a KV group
// are folded like PQ cells (for SUM_PROB a softmax over pages weighted by their token counts), whole pages are taken
// best first until the budget, and the page that crosses the budget is trimmed to its earliest tokens.
//
// Decode tokens arrive one at a time: the last page may be partial and fills up as they come.
#include <cstdint>
#include <vector>

#include "core/large_vector.hpp"
#include "index/change_log.hpp"
#include "index/retriever.hpp"

namespace kvret {

class PageRetriever final : public Retriever {
 public:
  PageRetriever(int n_kv_heads, int head_dim, int page_size);

  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows,
                 float* const* out_scores) const override;
  int64_t bytes() const noexcept override;
  /// Always: whole pages are dropped, a page the cut splits is summarized again from the store.
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<PageRetriever>(*this); }
  const Retriever* selects_as() const noexcept override { return this; }
  std::vector<std::byte> save() const override;
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;

  // Introspection (tests, benchmarks).
  int page_size() const noexcept { return page_size_; }
  int n_kv_heads() const noexcept { return n_kv_; }
  int head_dim() const noexcept { return d_; }
  int64_t base() const noexcept { return base_; }
  /// Indexed middle tokens.
  int64_t size() const noexcept { return base_ < 0 ? 0 : end_ - base_; }
  int64_t pages() const noexcept { return (size() + page_size_ - 1) / page_size_; }
  /// Tokens of page p (page_size, or fewer for a partial last page).
  int64_t page_tokens(int64_t p) const noexcept;
  /// Element-wise min and max of the keys of (head, page): [head_dim] each.
  const float* page_min(int head, int64_t p) const noexcept { return bounds(head, p); }
  const float* page_max(int head, int64_t p) const noexcept { return bounds(head, p) + d_; }
  /// Unscaled upper bounds sum_i max(q_i min_i, q_i max_i) of every page of `head` (out: [pages()]).
  void upper_bounds(int head, const float* q, float* out) const;

  /// The version of the bounds: a new one, unique in the process, after every change (extend, cut, restore); a
  /// clone has its original's until either changes. For a copy of the bounds elsewhere (the CUDA backend's device
  /// mirror): pages_changed_since(v) is the first page whose bounds may differ from those of version v (pages()
  /// when none do; 0 when v is unknown: every page).
  uint64_t version() const noexcept { return log_.version(); }
  int64_t pages_changed_since(uint64_t v) const noexcept { return log_.changed_since(v, pages()); }

 protected:
  void on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) override;
  void on_cut(const HostKvStore& store, int64_t end) noexcept override;

 private:
  const float* bounds(int head, int64_t p) const noexcept {
    return bounds_[static_cast<size_t>(head)].data() + static_cast<size_t>(p) * 2 * d_;
  }
  int n_kv_;
  int d_;
  int page_size_;
  std::vector<LargeVector<float>> bounds_;  ///< per head [pages, 2, d]: min row then max row
  ChangeLog log_;                           ///< the changes of the bounds, by page
};

}  // namespace kvret
