// kvret_seq_truncate: a sequence rolled back to `length` tokens equals one given the same appends up to there
// (lengths, stats, index bytes, selections, working sets), for every index kind; PQ rebuilds when the cut falls
// inside its training; the strong guarantee under allocation failures; edge lengths.
#include <gtest/gtest.h>

#include <new>
#include <ostream>
#include <string>
#include <vector>

#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int kHeads = 2, kDim = 64, kQHeads = 8, kLayers = 2;

/// A sequence handle closed at scope exit.
struct Seq {
  kvret_seq* s = nullptr;
  explicit Seq(kvret_context* ctx) { EXPECT_EQ(kvret_seq_open(ctx, &s), KVRET_OK) << kvret_last_error(); }
  ~Seq() { kvret_seq_close(s); }
  Seq(const Seq&) = delete;
  Seq& operator=(const Seq&) = delete;
};

/// Tokens [begin, end) of k/v ([T, H, D]) as a prefill of `layer`.
void prefill(kvret_seq* s, int32_t layer, const F32& k, const F32& v, int64_t begin, int64_t end) {
  F32 kp({end - begin, kHeads, kDim}), vp({end - begin, kHeads, kDim});
  const size_t row = static_cast<size_t>(kHeads * kDim);
  std::copy(k.data.begin() + begin * row, k.data.begin() + end * row, kp.data.begin());
  std::copy(v.data.begin() + begin * row, v.data.begin() + end * row, vp.data.begin());
  test::expect_ok(kvret_append_prefill(s, layer, &kp, &vp));
}

/// Tokens [begin, end) of k/v as decode steps of `layer`.
void decode(kvret_seq* s, int32_t layer, const F32& k, const F32& v, int64_t begin, int64_t end) {
  const size_t row = static_cast<size_t>(kHeads * kDim);
  for (int64_t t = begin; t < end; ++t) {
    F32 kt({kHeads, kDim}), vt({kHeads, kDim});
    std::copy(k.data.begin() + t * row, k.data.begin() + (t + 1) * row, kt.data.begin());
    std::copy(v.data.begin() + t * row, v.data.begin() + (t + 1) * row, vt.data.begin());
    test::expect_ok(kvret_append_decode(s, layer, &kt, &vt));
  }
}

/// What a user can observe of a sequence: lengths, the stats that describe its state, and per layer the
/// selections of a few queries at a few budgets and the working set of one of them.
struct Observed {
  std::vector<int64_t> lengths;
  int64_t tokens = 0, host_bytes = 0, index_bytes = 0;
  std::vector<std::vector<int32_t>> selections;
  std::vector<std::vector<float>> working_sets;
  bool operator==(const Observed&) const = default;
};

Observed observe(kvret_seq* s) {
  Observed o;
  test::expect_ok(kvret_wait_index(s, -1));  // background builds done: the stats are final
  kvret_stats st;
  kvret_stats_init(&st);
  test::expect_ok(kvret_seq_stats(s, &st));
  o.tokens = st.tokens_stored;
  o.host_bytes = st.host_bytes;
  o.index_bytes = st.index_bytes;
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    int64_t length = 0;
    test::expect_ok(kvret_seq_length(s, layer, &length));
    o.lengths.push_back(length);
    if (length == 0) continue;
    for (const uint64_t seed : {3u, 4u}) {
      F32 q({kQHeads, kDim});
      q.data = test::random_vector(static_cast<size_t>(kQHeads * kDim), seed + static_cast<uint64_t>(layer));
      q.refresh();
      for (const int32_t budget : {1, 37, KVRET_BUDGET_DEFAULT}) {
        if (budget != KVRET_BUDGET_DEFAULT && budget > length) continue;
        int32_t width = budget;
        if (budget == KVRET_BUDGET_DEFAULT) test::expect_ok(kvret_seq_budget(s, layer, &width));
        I32 out({kHeads, std::max(width, 1)});
        int32_t count = 0;
        test::expect_ok(kvret_select(s, layer, &q, budget, &out, &count));
        o.selections.push_back(out.data);
        o.selections.back().push_back(count);
        if (budget != 37 || count == 0) continue;
        test::WorkingSetBuffers ws(s, layer, count, kHeads, kDim);
        int64_t rows = 0;
        test::expect_ok(kvret_fetch_async(s, layer, &out, count, &ws.ws, &rows, nullptr));
        std::vector<float> got(ws.k.data.begin(), ws.k.data.end());
        got.insert(got.end(), ws.v.data.begin(), ws.v.data.end());
        for (int32_t p : ws.positions.data) got.push_back(static_cast<float>(p));
        got.push_back(static_cast<float>(rows));
        o.working_sets.push_back(std::move(got));
      }
    }
  }
  return o;
}

void PrintTo(const Observed& o, std::ostream* os) {
  *os << "lengths";
  for (int64_t l : o.lengths) *os << " " << l;
  *os << ", tokens " << o.tokens << ", host bytes " << o.host_bytes << ", index bytes " << o.index_bytes << ", "
      << o.selections.size() << " selections, " << o.working_sets.size() << " working sets";
}

class Truncate : public ::testing::TestWithParam<int> {
 protected:
  Truncate() : config(test::small_config(GetParam())), k({2400, kHeads, kDim}), v({2400, kHeads, kDim}) {
    test::clustered_kv(2400, kHeads, kDim, 7, k, v);
  }
  kvret_config config;
  F32 k, v;
};

// Drafted decode tokens rolled back: the sequence equals one that never saw them, and both go on alike.
TEST_P(Truncate, RollingBackDecodeStepsEqualsNeverTakingThem) {
  auto ctx = test::make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(a.s, layer, k, v, 0, 2000);
    decode(a.s, layer, k, v, 2000, 2040);
    prefill(b.s, layer, k, v, 0, 2000);
    decode(b.s, layer, k, v, 2000, 2015);
  }
  test::expect_ok(kvret_seq_truncate(a.s, 2015));
  ASSERT_EQ(observe(a.s), observe(b.s));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    decode(a.s, layer, k, v, 2100, 2110);  // other tokens than the dropped ones
    decode(b.s, layer, k, v, 2100, 2110);
  }
  EXPECT_EQ(observe(a.s), observe(b.s));
}

// A cut inside the prefill: PQ's codebook was trained on dropped tokens, so the index is rebuilt, and equals the
// index of a prefill of the remaining tokens (the other kinds cut theirs).
TEST_P(Truncate, CuttingIntoThePrefillEqualsAShorterPrefill) {
  auto ctx = test::make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(a.s, layer, k, v, 0, 2000);
    decode(a.s, layer, k, v, 2000, 2005);
    prefill(b.s, layer, k, v, 0, 1500);
  }
  kvret_stats before;
  kvret_stats_init(&before);
  test::expect_ok(kvret_wait_index(a.s, -1));
  test::expect_ok(kvret_seq_stats(a.s, &before));
  test::expect_ok(kvret_seq_truncate(a.s, 1500));
  ASSERT_EQ(observe(a.s), observe(b.s));
  kvret_stats after;
  kvret_stats_init(&after);
  test::expect_ok(kvret_seq_stats(a.s, &after));
  EXPECT_EQ(after.index_builds - before.index_builds, GetParam() == KVRET_INDEX_PQ ? kLayers : 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    decode(a.s, layer, k, v, 2100, 2120);
    decode(b.s, layer, k, v, 2100, 2120);
  }
  EXPECT_EQ(observe(a.s), observe(b.s));
}

// Short lengths: no middle left (inside sink + local), and an empty sequence that takes a new prefill.
TEST_P(Truncate, ShortLengthsAndEmpty) {
  auto ctx = test::make_context(config);
  for (const int64_t length : {int64_t{0}, int64_t{3}, int64_t{10}, int64_t{20}, int64_t{21}, int64_t{300}}) {
    Seq a(ctx.get()), b(ctx.get());
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      prefill(a.s, layer, k, v, 0, 1000);
      if (length > 0) prefill(b.s, layer, k, v, 0, length);
    }
    test::expect_ok(kvret_seq_truncate(a.s, length));
    ASSERT_EQ(observe(a.s), observe(b.s)) << "length " << length;
    if (length == 0) {  // empty again: a decode needs a prefill first, and a prefill starts afresh
      F32 kt({kHeads, kDim}), vt({kHeads, kDim});
      EXPECT_EQ(kvret_append_decode(a.s, 0, &kt, &vt), KVRET_ERR_STATE);
      for (int32_t layer = 0; layer < kLayers; ++layer) {
        prefill(a.s, layer, k, v, 0, 1200);
        prefill(b.s, layer, k, v, 0, 1200);
      }
      ASSERT_EQ(observe(a.s), observe(b.s));
    }
  }
}

// Layers at different lengths (mid-step): only those longer than `length` change.
TEST_P(Truncate, OnlyLongerLayersChange) {
  auto ctx = test::make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  prefill(a.s, 0, k, v, 0, 1000);
  decode(a.s, 0, k, v, 1000, 1010);
  prefill(a.s, 1, k, v, 0, 1000);
  decode(a.s, 1, k, v, 1000, 1003);
  prefill(b.s, 0, k, v, 0, 1000);
  decode(b.s, 0, k, v, 1000, 1005);
  prefill(b.s, 1, k, v, 0, 1000);
  decode(b.s, 1, k, v, 1000, 1003);
  test::expect_ok(kvret_seq_truncate(a.s, 1005));
  EXPECT_EQ(observe(a.s), observe(b.s));
}

// A negative length is refused, a length at or above every layer's changes nothing.
TEST_P(Truncate, BadAndNoOpLengths) {
  auto ctx = test::make_context(config);
  Seq a(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(a.s, layer, k, v, 0, 800);
  const Observed before = observe(a.s);
  EXPECT_EQ(kvret_seq_truncate(a.s, -1), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("length"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(observe(a.s), before);
  test::expect_ok(kvret_seq_truncate(a.s, 800));
  test::expect_ok(kvret_seq_truncate(a.s, INT64_MAX));
  EXPECT_EQ(observe(a.s), before);
  EXPECT_EQ(kvret_seq_truncate(nullptr, 5), KVRET_ERR_INVALID_HANDLE);
}

// Strong guarantee: with each allocation of the call failing in turn, a failed truncate leaves the sequence as it
// was; the one that succeeds equals the shorter prefill.
TEST_P(Truncate, FailedTruncateChangesNothing) {
  config.n_threads = 1;  // every allocation on the calling thread, where the injection applies
  auto ctx = test::make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(a.s, layer, k, v, 0, 1200);
    decode(a.s, layer, k, v, 1200, 1203);
    prefill(b.s, layer, k, v, 0, 900);
  }
  const Observed before = observe(a.s);
  const auto call = [&] {  // the C layer reports an allocation failure as KVRET_ERR_OUT_OF_MEMORY
    const kvret_status status = kvret_seq_truncate(a.s, 900);
    if (status == KVRET_ERR_OUT_OF_MEMORY) throw std::bad_alloc();
    test::expect_ok(status);
  };
  const int failures = test::fail_each_allocation(call, [&](int64_t) { ASSERT_EQ(observe(a.s), before); });
  EXPECT_EQ(observe(a.s), observe(b.s));
  if (GetParam() == KVRET_INDEX_PQ) {
    EXPECT_GT(failures, 0) << "the rebuild allocates";
  }
}

// A background build still running when the sequence is cut is waited for.
TEST_P(Truncate, WaitsForABackgroundBuild) {
  config.background_build = 1;
  auto ctx = test::make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(a.s, layer, k, v, 0, 2400);
    prefill(b.s, layer, k, v, 0, 1700);
  }
  test::expect_ok(kvret_seq_truncate(a.s, 1700));
  EXPECT_EQ(observe(a.s), observe(b.s));
}

INSTANTIATE_TEST_SUITE_P(Kinds, Truncate,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING),
                         [](const ::testing::TestParamInfo<int>& i) {
                           switch (i.param) {
                             case KVRET_INDEX_EXACT:
                               return std::string("Exact");
                             case KVRET_INDEX_PQ:
                               return std::string("Pq");
                             case KVRET_INDEX_PAGE:
                               return std::string("Page");
                             default:
                               return std::string("Streaming");
                           }
                         });

}  // namespace
