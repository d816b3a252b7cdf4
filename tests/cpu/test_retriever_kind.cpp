// Index kinds: a retriever kind registered from a test runs through the C ABI like a built-in one (select, fetch,
// truncate, fork), with no change to the sequence or the C layer; kvret_select_batch makes one call into the kind
// for the whole batch; a kind that selects nothing behaves as streaming; unregistered values are refused. Every
// built-in retriever selects as itself (Retriever::selects_as), another one as none. On the CUDA backend
// (KVRET_TEST_DEVICE=cuda): a kind whose retrievers wrap a built-in one and forward select verbatim selects on the
// device, equal to the CPU backend under random sequence edits; one whose wrapper changes the selection is never
// run as the wrapped retriever.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "device_twin.hpp"
#include "index/retriever.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int32_t kRecency = 1000, kCountedPq = 1001, kNothing = 1002, kNeverRegistered = 1003, kWrapping = 1004,
                  kPlain = 1005;

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
template <class Kind>
struct Registered {
  int32_t value;
  std::shared_ptr<Kind> kind;
  Registered(int32_t v, std::shared_ptr<Kind> k) : value(v), kind(std::move(k)) {
    register_retriever_kind(value, kind);
  }
  ~Registered() { register_retriever_kind(value, nullptr); }
};

/// A retriever that holds one of a built-in kind's and forwards extend, cut, clone, save and restore to it, and
/// counts its selects. `verbatim`: select is the wrapped one's, unchanged, and so is selects_as(). Otherwise the
/// selection is mirrored (position p becomes mid_begin + mid_end - 1 - p, with its score) and selects_as() is the
/// default.
class WrappingRetriever final : public Retriever {
 public:
  WrappingRetriever(std::unique_ptr<Retriever> inner, bool verbatim, std::shared_ptr<std::atomic<int64_t>> selects)
      : inner_(std::move(inner)), verbatim_(verbatim), selects_(std::move(selects)) {}
  int64_t select(const HostKvStore& store, const SelectRequest& r, int32_t* const* out_rows,
                 float* const* out_scores) const override {
    ++*selects_;
    const int64_t n = inner_->select(store, r, out_rows, out_scores);
    if (!verbatim_)
      for (int h = 0; h < r.n_q_heads / r.group; ++h) {
        std::reverse(out_rows[h], out_rows[h] + n);
        for (int64_t i = 0; i < n; ++i)
          out_rows[h][i] = static_cast<int32_t>(r.mid_begin + r.mid_end - 1 - out_rows[h][i]);
        if (out_scores != nullptr) std::reverse(out_scores[h], out_scores[h] + n);
      }
    return n;
  }
  int64_t bytes() const noexcept override { return inner_->bytes(); }
  const Retriever* selects_as() const noexcept override {
    return verbatim_ ? inner_->selects_as() : Retriever::selects_as();
  }
  bool can_cut(int64_t end) const noexcept override { return inner_->can_cut(end); }
  std::unique_ptr<Retriever> clone() const override {
    auto copy = std::make_unique<WrappingRetriever>(inner_->clone(), verbatim_, selects_);
    copy->set_range({base_, end_});
    return copy;
  }
  std::vector<std::byte> save() const override { return inner_->save(); }
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override {
    inner_->restore(store, data, size);
    set_range(inner_->indexed() ? std::pair{inner_->indexed_begin(), inner_->indexed_end()}
                                : std::pair<int64_t, int64_t>{-1, -1});
  }

 protected:
  void on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) override {
    inner_->extend(store, begin, end, may_retrain, n_threads);
  }
  void on_cut(const HostKvStore& store, int64_t end) noexcept override { inner_->cut(store, end); }

 private:
  std::unique_ptr<Retriever> inner_;
  bool verbatim_;
  std::shared_ptr<std::atomic<int64_t>> selects_;
};

/// The kind of WrappingRetrievers around `inner`'s retrievers; `selects` counts their selects.
class WrappingKind final : public RetrieverKind {
 public:
  WrappingKind(std::shared_ptr<const RetrieverKind> inner, bool verbatim)
      : inner_(std::move(inner)), verbatim_(verbatim) {}
  const char* name() const noexcept override { return "wrapping"; }
  std::unique_ptr<Retriever> make(const kvret_config& c, int layer) const override {
    return std::make_unique<WrappingRetriever>(inner_->make(c, layer), verbatim_, selects);
  }
  const std::shared_ptr<std::atomic<int64_t>> selects = std::make_shared<std::atomic<int64_t>>(0);

 private:
  std::shared_ptr<const RetrieverKind> inner_;
  bool verbatim_;
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

// Every built-in kind's retriever selects as itself; a retriever that does not say otherwise, as none; a wrapper
// as what it says.
TEST(RetrieverKind, BuiltInRetrieversSelectAsThemselves) {
  for (const int32_t value : {KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_STREAMING, KVRET_INDEX_PAGE,
                              KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT}) {
    const auto kind = find_retriever_kind(value);
    ASSERT_NE(kind, nullptr);
    const std::unique_ptr<Retriever> r = kind->make(test::small_config(value), 0);
    EXPECT_EQ(r->selects_as(), r.get()) << kind->name();
    const std::unique_ptr<Retriever> copy = r->clone();
    EXPECT_EQ(copy->selects_as(), copy.get()) << kind->name();
    for (const bool verbatim : {true, false}) {
      const WrappingKind wrapping(kind, verbatim);
      const std::unique_ptr<Retriever> w = wrapping.make(test::small_config(value), 0);
      if (verbatim) {
        EXPECT_NE(w->selects_as(), nullptr) << kind->name();
        EXPECT_NE(w->selects_as(), w.get()) << kind->name();
      } else {
        EXPECT_EQ(w->selects_as(), nullptr) << kind->name();
      }
    }
  }
  EXPECT_EQ(RecencyRetriever().selects_as(), nullptr);
}

/// The wrapped kinds of the device tests: the five the CUDA backend selects on its device.
const int32_t kDeviceKinds[] = {KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_PQ, KVRET_INDEX_QUANT,
                                KVRET_INDEX_EXACT};

kvret_config wrapping_config(int32_t index_kind, int32_t device_type) {
  kvret_config c = test::small_config(index_kind);
  c.device_type = device_type;
  c.background_build = 0;
  return c;
}

class WrappedKindOnDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(kvret::cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

// A wrapper that forwards select verbatim selects on the device (the device's copy of the index is counted, and the
// wrapper's own select never runs there), equal bit for bit to the CPU backend's select through the wrapper, over
// random appends, truncates, drop_fronts, forks and saved sessions.
TEST_F(WrappedKindOnDevice, AVerbatimWrapperSelectsOnTheDevice) {
  for (const int32_t inner : kDeviceKinds) {
    const auto inner_kind = find_retriever_kind(inner);
    SCOPED_TRACE(inner_kind->name());
    Registered dev_kind(kWrapping, std::make_shared<WrappingKind>(inner_kind, true));
    Registered cpu_kind(kPlain, std::make_shared<WrappingKind>(inner_kind, true));
    const kvret_config dc = wrapping_config(kWrapping, KVRET_DEVICE_CUDA);
    const kvret_config cc = wrapping_config(kPlain, KVRET_DEVICE_CPU);
    auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
    kvret_seq *a = nullptr, *b = nullptr;
    test::expect_ok(kvret_seq_open(dev_ctx.get(), &a));
    test::expect_ok(kvret_seq_open(cpu_ctx.get(), &b));
    test::twin::append_both(a, b, dc.n_layers, 300, 17);
    std::mt19937_64 rng(23 + static_cast<uint64_t>(inner));
    test::twin::Walk w;
    w.session = std::string("wrapped-") + inner_kind->name();
    w.reads_keys = inner == KVRET_INDEX_EXACT;  // no device copy: the device reads the keys in place
    const int selects = test::twin::walk(dev_ctx.get(), cpu_ctx.get(), a, b, dc, rng, w, inner_kind->name());
    EXPECT_GT(selects, 0);
    EXPECT_EQ(dev_kind.kind->selects->load(), 0) << "the device ran the wrapped retriever's select";
    EXPECT_EQ(cpu_kind.kind->selects->load(), selects);
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

// A wrapper whose select differs from the wrapped one's is not run as it: on the CUDA backend its own select runs
// (counted; no device copy of an index is made) and gives what the CPU backend gives, which is not what the wrapped
// kind selects.
TEST_F(WrappedKindOnDevice, AChangingWrapperIsNotRunAsTheWrappedOne) {
  for (const int32_t inner : kDeviceKinds) {
    const auto inner_kind = find_retriever_kind(inner);
    SCOPED_TRACE(inner_kind->name());
    Registered dev_kind(kWrapping, std::make_shared<WrappingKind>(inner_kind, false));
    Registered cpu_kind(kPlain, std::make_shared<WrappingKind>(inner_kind, false));
    auto dev_ctx = test::make_context(wrapping_config(kWrapping, KVRET_DEVICE_CUDA));
    auto cpu_ctx = test::make_context(wrapping_config(kPlain, KVRET_DEVICE_CPU));
    auto inner_ctx = test::make_context(wrapping_config(inner, KVRET_DEVICE_CUDA));
    kvret_seq *a = nullptr, *b = nullptr, *c = nullptr;
    test::expect_ok(kvret_seq_open(dev_ctx.get(), &a));
    test::expect_ok(kvret_seq_open(cpu_ctx.get(), &b));
    test::expect_ok(kvret_seq_open(inner_ctx.get(), &c));
    test::twin::append_both(a, b, 2, 300, 29);
    test::twin::append_both(c, nullptr, 2, 300, 29);
    int differs = 0;
    for (int step = 0; step < 12; ++step) {
      const std::string at = "step " + std::to_string(step);
      const std::vector<float> q = test::random_vector(test::twin::kQHeads * test::twin::kDim, 300 + step, 2.0f);
      const int32_t budget = 1 + step * 7;
      const bool scored = step % 2 == 0;
      const auto x = test::twin::select(a, KVRET_DEVICE_CUDA, step % 2, q, budget, budget, scored);
      const auto y = test::twin::select(b, KVRET_DEVICE_CPU, step % 2, q, budget, budget, scored);
      const auto z = test::twin::select(c, KVRET_DEVICE_CUDA, step % 2, q, budget, budget, scored);
      test::twin::expect_same(x, y, at);
      differs += x.positions != z.positions;
      EXPECT_EQ(dev_kind.kind->selects->load(), step + 1) << at << ": the wrapper's select ran";
      EXPECT_EQ(test::twin::stats_of(a).device_bytes, 0) << at << ": no device copy of the wrapped index";
      const kvret_stats inner_stats = test::twin::stats_of(c);  // EXACT keeps no device copy: it reads the keys
      EXPECT_GT(inner == KVRET_INDEX_EXACT ? inner_stats.bytes_h2d : inner_stats.device_bytes, 0)
          << at << ": the wrapped kind itself selects on the device";
      test::twin::append_both(a, b, 2, 1, 400 + static_cast<uint64_t>(step));
      test::twin::append_both(c, nullptr, 2, 1, 400 + static_cast<uint64_t>(step));
    }
    EXPECT_GT(differs, 0) << "the changed selections are those of the wrapped kind";
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
    test::expect_ok(kvret_seq_close(c));
  }
}

}  // namespace
