// kvret_seq_fork: a fork equals its source, then each equals a sequence built directly by its own appends (the
// shared KV pages are copied on write, never written through); closing or cutting one leaves the other; the
// strong guarantee under allocation failures and the host limit.
#include <gtest/gtest.h>

#include <new>
#include <string>
#include <thread>
#include <vector>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

class Fork : public ::testing::TestWithParam<int> {
 protected:
  Fork() : config(test::small_config(GetParam())), k({2400, kHeads, kDim}), v({2400, kHeads, kDim}) {
    test::clustered_kv(2400, kHeads, kDim, 9, k, v);
  }
  kvret_config config;
  F32 k, v;
};

int64_t open_sequences(kvret_context* ctx) {
  kvret_stats st;
  kvret_stats_init(&st);
  test::expect_ok(kvret_context_stats(ctx, &st));
  return st.sequences;
}

// Forked mid-page (1000 + 7 tokens: the last KV page is partial and shared), then the two diverge: each equals a
// sequence that received its appends directly, so neither wrote into the other's tokens.
TEST_P(Fork, EachBranchEqualsADirectlyBuiltSequence) {
  auto ctx = test::make_context(config);
  Seq parent(ctx.get()), direct_parent(ctx.get()), direct_child(ctx.get());
  for (Seq* s : {&parent, &direct_parent, &direct_child})
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      prefill(s->s, layer, k, v, 0, 1000);
      decode(s->s, layer, k, v, 1000, 1007);
    }
  kvret_seq* child_handle = nullptr;
  test::expect_ok(kvret_seq_fork(parent.s, &child_handle));
  ASSERT_NE(child_handle, nullptr);
  Seq child(child_handle);
  ASSERT_EQ(observe(child.s), observe(parent.s));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    decode(parent.s, layer, k, v, 1100, 1130);  // into the shared page, then past it
    decode(direct_parent.s, layer, k, v, 1100, 1130);
    decode(child.s, layer, k, v, 1500, 1520);
    decode(direct_child.s, layer, k, v, 1500, 1520);
  }
  EXPECT_EQ(observe(parent.s), observe(direct_parent.s));
  EXPECT_EQ(observe(child.s), observe(direct_child.s));
  // a prefill chunk on one branch (a new build) and a cut on the other
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(child.s, layer, k, v, 1700, 2400);
    prefill(direct_child.s, layer, k, v, 1700, 2400);
  }
  test::expect_ok(kvret_seq_truncate(parent.s, 1010));
  test::expect_ok(kvret_seq_truncate(direct_parent.s, 1010));
  EXPECT_EQ(observe(parent.s), observe(direct_parent.s));
  EXPECT_EQ(observe(child.s), observe(direct_child.s));
}

// Closing the source leaves the fork whole (the pages it shares stay alive).
TEST_P(Fork, OutlivesItsSource) {
  auto ctx = test::make_context(config);
  Seq direct(ctx.get());
  kvret_seq* source = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &source));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(source, layer, k, v, 0, 900);
    prefill(direct.s, layer, k, v, 0, 900);
  }
  kvret_seq* child_handle = nullptr;
  test::expect_ok(kvret_seq_fork(source, &child_handle));
  Seq child(child_handle);
  test::expect_ok(kvret_seq_close(source));
  EXPECT_EQ(observe(child.s), observe(direct.s));
  decode(child.s, 0, k, v, 900, 905);
  decode(direct.s, 0, k, v, 900, 905);
  EXPECT_EQ(observe(child.s), observe(direct.s));
}

// An empty sequence forks into an empty one.
TEST_P(Fork, OfAnEmptySequence) {
  auto ctx = test::make_context(config);
  Seq empty(ctx.get());
  kvret_seq* child_handle = nullptr;
  test::expect_ok(kvret_seq_fork(empty.s, &child_handle));
  Seq child(child_handle);
  EXPECT_EQ(observe(child.s), observe(empty.s));
  prefill(child.s, 0, k, v, 0, 300);
  int64_t length = -1;
  test::expect_ok(kvret_seq_length(empty.s, 0, &length));
  EXPECT_EQ(length, 0);
}

// Strong guarantee: with each allocation failing in turn, a failed fork creates nothing and changes nothing.
TEST_P(Fork, FailedForkCreatesNothing) {
  config.n_threads = 1;
  auto ctx = test::make_context(config);
  Seq parent(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(parent.s, layer, k, v, 0, 700);
  const Observed before = observe(parent.s);
  kvret_seq* child_handle = nullptr;
  const auto call = [&] {
    child_handle = reinterpret_cast<kvret_seq*>(&child_handle);  // overwritten by the call
    const kvret_status status = kvret_seq_fork(parent.s, &child_handle);
    if (status == KVRET_ERR_OUT_OF_MEMORY) throw std::bad_alloc();
    test::expect_ok(status);
  };
  const int failures = test::fail_each_allocation(call, [&](int64_t) {
    ASSERT_EQ(child_handle, nullptr);
    ASSERT_EQ(open_sequences(ctx.get()), 1);
    ASSERT_EQ(observe(parent.s), before);
  });
  EXPECT_GT(failures, 0);
  Seq child(child_handle);
  EXPECT_EQ(observe(child.s), before);
}

// The host limit counts a shared page in each sequence: a fork that would pass it is refused.
TEST_P(Fork, RefusedPastTheHostLimit) {
  auto ctx0 = test::make_context(config);
  Seq probe(ctx0.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(probe.s, layer, k, v, 0, 600);
  kvret_stats st;
  kvret_stats_init(&st);
  test::expect_ok(kvret_seq_stats(probe.s, &st));
  config.host_bytes_limit = st.host_bytes + st.host_bytes / 2;  // room for one, not two
  auto ctx = test::make_context(config);
  Seq parent(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(parent.s, layer, k, v, 0, 600);
  kvret_seq* child_handle = nullptr;
  EXPECT_EQ(kvret_seq_fork(parent.s, &child_handle), KVRET_ERR_CAPACITY);
  EXPECT_EQ(child_handle, nullptr);
  EXPECT_EQ(open_sequences(ctx.get()), 1);
  EXPECT_EQ(kvret_seq_fork(nullptr, &child_handle), KVRET_ERR_INVALID_HANDLE);
  EXPECT_EQ(kvret_seq_fork(parent.s, nullptr), KVRET_ERR_INVALID_ARGUMENT);
}

// Branches on two threads at once: appends that copy the shared page race with reads of it.
TEST_P(Fork, BranchesRunOnTheirOwnThreads) {
  auto ctx = test::make_context(config);
  Seq parent(ctx.get()), direct_a(ctx.get()), direct_b(ctx.get());
  for (Seq* s : {&parent, &direct_a, &direct_b})
    for (int32_t layer = 0; layer < kLayers; ++layer) prefill(s->s, layer, k, v, 0, 1001);
  kvret_seq* child_handle = nullptr;
  test::expect_ok(kvret_seq_fork(parent.s, &child_handle));
  Seq child(child_handle);
  std::thread a([&] {
    for (int32_t layer = 0; layer < kLayers; ++layer) decode(parent.s, layer, k, v, 1100, 1140);
  });
  std::thread b([&] {
    for (int32_t layer = 0; layer < kLayers; ++layer) decode(child.s, layer, k, v, 1300, 1340);
  });
  a.join();
  b.join();
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    decode(direct_a.s, layer, k, v, 1100, 1140);
    decode(direct_b.s, layer, k, v, 1300, 1340);
  }
  EXPECT_EQ(observe(parent.s), observe(direct_a.s));
  EXPECT_EQ(observe(child.s), observe(direct_b.s));
}

INSTANTIATE_TEST_SUITE_P(Kinds, Fork,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                                           KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT),
                         [](const ::testing::TestParamInfo<int>& i) { return kind_name(i.param); });

}  // namespace
