#include "index/retriever.hpp"

#include <map>
#include <mutex>

#include "core/error.hpp"
#include "core/serial.hpp"
#include "core/vec_math.hpp"
#include "index/cluster_retriever.hpp"
#include "index/exact_retriever.hpp"
#include "index/page_retriever.hpp"
#include "index/pq_retriever.hpp"
#include "index/quant_retriever.hpp"

namespace kvret {

void Retriever::extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) {
  if (end <= begin) return;
  KVRET_REQUIRE(base_ < 0 || begin == end_, KVRET_ERR_INTERNAL,
                "index extended out of order: it covers [" + std::to_string(base_) + ", " + std::to_string(end_) +
                    "), the extension starts at " + std::to_string(begin));
  on_extend(store, begin, end, may_retrain, n_threads);
  if (base_ < 0) base_ = begin;
  end_ = end;
}

void Retriever::require_covers(const SelectRequest& r, const char* what) const {
  KVRET_REQUIRE(base_ == r.mid_begin && end_ == r.mid_end, KVRET_ERR_INTERNAL,
                std::string(what) + " index covers [" + std::to_string(base_) + ", " + std::to_string(end_) +
                    "), the middle is [" + std::to_string(r.mid_begin) + ", " + std::to_string(r.mid_end) + ")");
}

void Retriever::cut(const HostKvStore& store, int64_t end) noexcept {
  if (base_ < 0 || end >= end_) return;
  on_cut(store, end);
  if (end <= base_) {
    base_ = end_ = -1;
  } else {
    end_ = end;
  }
}

void Retriever::write_range(ByteWriter& w) const {
  w.value<int64_t>(base_);
  w.value<int64_t>(end_);
}

std::pair<int64_t, int64_t> Retriever::read_range(ByteReader& r, const HostKvStore& store) {
  const auto base = r.value<int64_t>(), end = r.value<int64_t>();
  require_intact((base == -1 && end == -1) || (base >= 0 && base < end && end <= store.size()),
                 "an indexed range outside the store");
  return {base, end};
}

std::vector<std::byte> Retriever::save() const {
  throw Error(KVRET_ERR_UNSUPPORTED, "this index kind cannot be saved");
}

void Retriever::restore(const HostKvStore&, const std::byte*, size_t) {
  throw Error(KVRET_ERR_UNSUPPORTED, "this index kind cannot be restored");
}

std::unique_ptr<Retriever> Retriever::clone() const {
  throw Error(KVRET_ERR_UNSUPPORTED, "this index kind cannot be copied, so its sequences cannot be forked");
}

void RetrieverKind::select_batch(SelectJob* jobs, size_t n, kvret_stream) const {
  for (size_t i = 0; i < n; ++i)
    jobs[i].count = jobs[i].retriever->select(*jobs[i].store, jobs[i].request, jobs[i].out_rows, jobs[i].out_scores);
}

namespace {

template <class R>
class SimpleKind final : public RetrieverKind {
 public:
  SimpleKind(const char* name, bool selects) : name_(name), selects_(selects) {}
  const char* name() const noexcept override { return name_; }
  std::unique_ptr<Retriever> make(const kvret_config&, int) const override { return std::make_unique<R>(); }
  bool selects() const noexcept override { return selects_; }

 private:
  const char* name_;
  bool selects_;
};

class PqKind final : public RetrieverKind {
 public:
  const char* name() const noexcept override { return "pq"; }
  std::unique_ptr<Retriever> make(const kvret_config& c, int layer) const override {
    PqRetriever::Params p;
    p.m = c.pq_m;
    p.bits = c.pq_bits;
    p.iters = c.pq_iters;
    p.tol = c.pq_tol;
    p.train_sample = c.pq_train_sample;
    p.exact_fraction = c.pq_exact_fraction;
    uint64_t state = c.seed ^ (static_cast<uint64_t>(layer) << 32);
    p.seed = splitmix64(state);
    return std::make_unique<PqRetriever>(c.n_kv_heads, c.head_dim, p);
  }
};

class PageKind final : public RetrieverKind {
 public:
  const char* name() const noexcept override { return "page"; }
  std::unique_ptr<Retriever> make(const kvret_config& c, int) const override {
    return std::make_unique<PageRetriever>(c.n_kv_heads, c.head_dim, c.page_size);
  }
};

struct KindRegistry {
  std::mutex mu;
  std::map<int32_t, std::shared_ptr<const RetrieverKind>> kinds{
      {KVRET_INDEX_EXACT, std::make_shared<SimpleKind<ExactRetriever>>("exact", true)},
      {KVRET_INDEX_STREAMING, std::make_shared<SimpleKind<StreamingRetriever>>("streaming", false)},
      {KVRET_INDEX_PQ, std::make_shared<PqKind>()},
      {KVRET_INDEX_PAGE, std::make_shared<PageKind>()},
      {KVRET_INDEX_CLUSTER, make_cluster_kind()},
      {KVRET_INDEX_QUANT, make_quant_kind()},
  };
};

KindRegistry& registry() {
  static KindRegistry r;
  return r;
}

}  // namespace

std::shared_ptr<const RetrieverKind> find_retriever_kind(int32_t index_kind) {
  KindRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.kinds.find(index_kind);
  return it == r.kinds.end() ? nullptr : it->second;
}

void register_retriever_kind(int32_t index_kind, std::shared_ptr<const RetrieverKind> kind) {
  KindRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (kind)
    r.kinds[index_kind] = std::move(kind);
  else
    r.kinds.erase(index_kind);
}

std::unique_ptr<Retriever> make_retriever(const kvret_config& c, int layer) {
  const auto kind = find_retriever_kind(c.index_kind);
  require(kind != nullptr, KVRET_ERR_UNSUPPORTED, "index kind " + std::to_string(c.index_kind) + " is not implemented");
  return kind->make(c, layer);
}

}  // namespace kvret
