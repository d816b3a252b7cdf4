#pragma once
#include "index/retriever.hpp"

namespace kvret {

/// The quality oracle: exact q.k logits over every middle token, folded, top-k. It stores nothing.
class ExactRetriever final : public Retriever {
 public:
  void extend(const HostKvStore&, int64_t, int64_t, bool, int) override {}
  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows) const override;
  int64_t bytes() const noexcept override { return 0; }
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<ExactRetriever>(*this); }
  std::vector<std::byte> save() const override;  ///< a header: there is no index
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;
};

/// The streaming baseline: selects nothing, so the working set is sink + local.
class StreamingRetriever final : public Retriever {
 public:
  void extend(const HostKvStore&, int64_t, int64_t, bool, int) override {}
  int64_t select(const HostKvStore&, const SelectRequest&, int32_t* const*) const override { return 0; }
  int64_t bytes() const noexcept override { return 0; }
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<StreamingRetriever>(*this); }
  std::vector<std::byte> save() const override;
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;
};

}  // namespace kvret
