// kvret_seq_truncate: a sequence rolled back to `length` tokens equals one given the same appends up to there
// (lengths, stats, index bytes, selections, working sets), for every index kind; PQ rebuilds when the cut falls
// inside its training; the strong guarantee under allocation failures; edge lengths.
#include <gtest/gtest.h>

#include <new>
#include <ostream>
#include <string>
#include <vector>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

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
  const bool rebuilds = GetParam() == KVRET_INDEX_PQ || GetParam() == KVRET_INDEX_CLUSTER;  // a cut inside a cluster
  EXPECT_EQ(after.index_builds - before.index_builds, rebuilds ? kLayers : 0);
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
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                                           KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT),
                         [](const ::testing::TestParamInfo<int>& i) { return kind_name(i.param); });

}  // namespace
