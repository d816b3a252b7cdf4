// Index kinds: a retriever kind registered from a test runs through the C ABI like a built-in one (select, fetch,
// truncate, fork), with no change to the sequence or the C layer; kvret_select_batch makes one call into the kind
// for the whole batch; a kind that selects nothing behaves as streaming; unregistered values are refused.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "index/retriever.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int32_t kRecency = 1000, kCountedPq = 1001, kNothing = 1002, kNeverRegistered = 1003;

/// Selects the latest `budget` middle tokens of every head: a retriever with no index at all.
class RecencyRetriever final : public Retriever {
 public:
  int64_t select(const HostKvStore&, const SelectRequest& r, int32_t* const* out_rows,
                 float* const* out_scores) const override {
    for (int h = 0; h < r.n_q_heads / r.group; ++h)
      for (int64_t i = 0; i < r.budget; ++i) {
        out_rows[h][i] = static_cast<int32_t>(r.mid_end - r.budget + i);
        if (out_scores != nullptr) out_scores[h][i] = static_cast<float>(out_rows[h][i]);  // later is better
      }
    return r.budget;
  }
  int64_t bytes() const noexcept override { return 0; }
  bool can_cut(int64_t) const noexcept override { return true; }
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<RecencyRetriever>(*this); }

 protected:
  void on_extend(const HostKvStore&, int64_t, int64_t, bool, int) override {}
};

/// A kind that counts its select_batch calls and jobs; its retrievers are `inner`'s, or recency ones.
class CountingKind final : public RetrieverKind {
 public:
  explicit CountingKind(std::shared_ptr<const RetrieverKind> inner = nullptr, bool selects = true)
      : inner_(std::move(inner)), selects_(selects) {}
  const char* name() const noexcept override { return "counting"; }
  std::unique_ptr<Retriever> make(const kvret_config& c, int layer) const override {
    return inner_ ? inner_->make(c, layer) : std::make_unique<RecencyRetriever>();
  }
  bool selects() const noexcept override { return selects_; }
  void select_batch(SelectJob* batch, size_t n, kvret_stream stream) const override {
    ++calls;
    jobs += static_cast<int64_t>(n);
    RetrieverKind::select_batch(batch, n, stream);
  }
  mutable std::atomic<int64_t> calls{0}, jobs{0};

 private:
  std::shared_ptr<const RetrieverKind> inner_;
  bool selects_;
};

/// Registers a kind for the test's lifetime.
struct Registered {
  int32_t value;
  std::shared_ptr<CountingKind> kind;
  Registered(int32_t v, std::shared_ptr<CountingKind> k) : value(v), kind(std::move(k)) {
    register_retriever_kind(value, kind);
  }
  ~Registered() { register_retriever_kind(value, nullptr); }
};

struct Seq {
  kvret_seq* s = nullptr;
  explicit Seq(kvret_context* ctx) { EXPECT_EQ(kvret_seq_open(ctx, &s), KVRET_OK) << kvret_last_error(); }
  ~Seq() { kvret_seq_close(s); }
};

TEST(RetrieverKind, ARegisteredKindRunsThroughTheCAbi) {
  Registered recency(kRecency, std::make_shared<CountingKind>());
  auto ctx = test::make_context(test::small_config(kRecency));
  ASSERT_NE(ctx, nullptr);
  Seq seq(ctx.get());
  F32 k({500, 2, 64}), v({500, 2, 64});
  test::clustered_kv(500, 2, 64, 3, k, v);
  for (int32_t layer = 0; layer < 2; ++layer) test::expect_ok(kvret_append_prefill(seq.s, layer, &k, &v));
  F32 q({8, 64}, 0.5f);
  I32 out({2, 10});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq.s, 0, &q, 10, &out, &count));
  ASSERT_EQ(count, 10);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 10; ++i) EXPECT_EQ(out.data[static_cast<size_t>(h * 10 + i)], 500 - 16 - 10 + i);
  EXPECT_EQ(recency.kind->calls.load(), 1);
  test::WorkingSetBuffers ws(seq.s, 0, count, 2, 64);
  int64_t rows = 0;
  test::expect_ok(kvret_fetch_async(seq.s, 0, &out, count, &ws.ws, &rows, nullptr));
  EXPECT_EQ(rows, 4 + 10 + 16);
  ws.expect_stored_keys(rows, k.data, 2, 64);
  // sequence edits need nothing of the kind beyond the Retriever interface
  kvret_seq* forked = nullptr;
  test::expect_ok(kvret_seq_fork(seq.s, &forked));
  test::expect_ok(kvret_seq_truncate(forked, 300));
  int64_t length = 0;
  test::expect_ok(kvret_seq_length(forked, 1, &length));
  EXPECT_EQ(length, 300);
  test::expect_ok(kvret_seq_close(forked));
}

// kvret_select_batch over n sequences: one select_batch call with n jobs, for a built-in kind (EXACT, counted through
// a wrapper) and for a registered one. On the CUDA backend q and the outputs are labelled pinned host memory: with
// device tensors EXACT's retrievers (as PQ's, PAGE's, CLUSTER's and QUANT's) select on the device without their kind.
TEST(RetrieverKind, SelectBatchIsOneCallIntoTheKind) {
  Registered counted(kCountedPq, std::make_shared<CountingKind>(find_retriever_kind(KVRET_INDEX_EXACT)));
  kvret_config config = test::small_config(kCountedPq);
  config.n_layers = 1;
  auto ctx = test::make_context(config);
  auto plain = test::make_context(test::small_config(KVRET_INDEX_EXACT));
  constexpr int kBatch = 3;
  std::vector<kvret_seq*> seqs(kBatch), plain_seqs(kBatch);
  F32 k({800, 2, 64}), v({800, 2, 64});
  for (int i = 0; i < kBatch; ++i) {
    test::clustered_kv(800, 2, 64, static_cast<uint64_t>(10 + i), k, v);
    test::expect_ok(kvret_seq_open(ctx.get(), &seqs[static_cast<size_t>(i)]));
    test::expect_ok(kvret_seq_open(plain.get(), &plain_seqs[static_cast<size_t>(i)]));
    test::expect_ok(kvret_append_prefill(seqs[static_cast<size_t>(i)], 0, &k, &v));
    test::expect_ok(kvret_append_prefill(plain_seqs[static_cast<size_t>(i)], 0, &k, &v));
  }
  F32 q({kBatch, 8, 64});
  q.data = test::random_vector(static_cast<size_t>(kBatch * 8 * 64), 5);
  q.refresh();
  I32 out({kBatch, 2, 40}), plain_out({kBatch, 2, 40});
  if (test::device_type() == KVRET_DEVICE_CUDA)
    for (kvret_tensor* t : {&q.t, &out.t, &plain_out.t}) t->device = {KVRET_DEVICE_CUDA_HOST, 0};
  std::vector<int32_t> counts(kBatch), plain_counts(kBatch);
  test::expect_ok(kvret_select_batch(ctx.get(), kBatch, seqs.data(), 0, &q, 40, &out, counts.data()));
  EXPECT_EQ(counted.kind->calls.load(), 1);
  EXPECT_EQ(counted.kind->jobs.load(), kBatch);
  // the same selections as EXACT's own kind
  test::expect_ok(
      kvret_select_batch(plain.get(), kBatch, plain_seqs.data(), 0, &q, 40, &plain_out, plain_counts.data()));
  EXPECT_EQ(counts, plain_counts);
  EXPECT_EQ(out.data, plain_out.data);
  for (int i = 0; i < kBatch; ++i) {
    kvret_seq_close(seqs[static_cast<size_t>(i)]);
    kvret_seq_close(plain_seqs[static_cast<size_t>(i)]);
  }
}

// A kind that selects nothing: the working set is sink + local, as with streaming, and no select_batch runs.
TEST(RetrieverKind, AKindThatSelectsNothingIsLikeStreaming) {
  Registered nothing(kNothing, std::make_shared<CountingKind>(nullptr, false));
  auto ctx = test::make_context(test::small_config(kNothing));
  Seq seq(ctx.get());
  F32 k({300, 2, 64}), v({300, 2, 64});
  test::expect_ok(kvret_append_prefill(seq.s, 0, &k, &v));
  int64_t capacity = 0;
  test::expect_ok(kvret_working_set_capacity(seq.s, 0, 50, &capacity));
  EXPECT_EQ(capacity, 4 + 16);
  F32 q({8, 64});
  I32 out({2, 50});
  int32_t count = -1;
  test::expect_ok(kvret_select(seq.s, 0, &q, 50, &out, &count));
  EXPECT_EQ(count, 0);
  EXPECT_EQ(nothing.kind->calls.load(), 0);
}

// An index_kind with no kind registered is refused with a message; so is one whose kind was removed.
TEST(RetrieverKind, UnregisteredValuesAreRefused) {
  kvret_context* ctx = nullptr;
  kvret_config config = test::small_config(kNeverRegistered);
  EXPECT_EQ(kvret_create(&config, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("index_kind"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(ctx, nullptr);
  {
    Registered removed(kNeverRegistered, std::make_shared<CountingKind>());
    test::expect_ok(kvret_create(&config, &ctx));
    kvret_destroy(ctx);
    ctx = nullptr;
  }
  EXPECT_EQ(kvret_create(&config, &ctx), KVRET_ERR_INVALID_ARGUMENT);
}

// Every index kind kvret.h declares is built in, under its name.
TEST(RetrieverKind, EveryDeclaredKindIsBuiltIn) {
  const std::vector<std::pair<int32_t, std::string>> kinds = {
      {KVRET_INDEX_EXACT, "exact"}, {KVRET_INDEX_PQ, "pq"},           {KVRET_INDEX_STREAMING, "streaming"},
      {KVRET_INDEX_PAGE, "page"},   {KVRET_INDEX_CLUSTER, "cluster"}, {KVRET_INDEX_QUANT, "quant"}};
  for (const auto& [value, name] : kinds) {
    const auto kind = find_retriever_kind(value);
    ASSERT_NE(kind, nullptr) << name;
    EXPECT_EQ(std::string(kind->name()), name);
    auto ctx = test::make_context(test::small_config(value));
    EXPECT_NE(ctx, nullptr) << name;
  }
}

}  // namespace
