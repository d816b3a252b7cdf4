#pragma once
#include "index/retriever.hpp"

namespace kvret {

/// A retriever whose state is its indexed range alone: it keeps no index of its own.
class RangeOnlyRetriever : public Retriever {
 public:
  std::vector<std::byte> save() const override;  ///< a header and the range
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;

 protected:
  explicit RangeOnlyRetriever(uint32_t tag) noexcept : tag_(tag) {}
  void on_extend(const HostKvStore&, int64_t, int64_t, bool, int) override {}

 private:
  uint32_t tag_;  ///< the kind's tag in saved states
};

/// The quality oracle: exact q.k logits over every middle token, folded, top-k. It stores nothing.
class ExactRetriever final : public RangeOnlyRetriever {
 public:
  ExactRetriever() noexcept : RangeOnlyRetriever(0x45584354u) {}  // "EXCT"
  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows,
                 float* const* out_scores) const override;
  int64_t bytes() const noexcept override { return 0; }
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<ExactRetriever>(*this); }
  const Retriever* selects_as() const noexcept override { return this; }
};

/// The streaming baseline: selects nothing, so the working set is sink + local.
class StreamingRetriever final : public RangeOnlyRetriever {
 public:
  StreamingRetriever() noexcept : RangeOnlyRetriever(0x5354524du) {}  // "STRM"
  int64_t select(const HostKvStore&, const SelectRequest&, int32_t* const*, float* const*) const override { return 0; }
  int64_t bytes() const noexcept override { return 0; }
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<StreamingRetriever>(*this); }
  const Retriever* selects_as() const noexcept override { return this; }
};

}  // namespace kvret
