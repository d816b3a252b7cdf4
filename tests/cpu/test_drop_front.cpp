// kvret_seq_drop_front (context-window truncation): a sequence that dropped tokens equals a fresh one given the
// tokens that stay (lengths, stats, index bytes, selections, working sets), for every index kind, with keys before
// RoPE (rotated again at their new positions) and with keys given rotated; layers shorter than keep or keep + count;
// KVCrush, cluster reuse and prefetch state; a background build; bad arguments and allocation failures change
// nothing.
#include <gtest/gtest.h>

#include <new>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "core/rope.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

constexpr int64_t kTokens = 2400;

/// Tokens [0, keep) and [keep + count, end) of k ([T, H, D]), as one tensor.
F32 without(const F32& k, int64_t keep, int64_t count, int64_t end) {
  const int64_t kept = keep + std::max<int64_t>(0, end - keep - count);
  F32 out({kept, kHeads, kDim});
  const auto row = static_cast<std::ptrdiff_t>(kHeads * kDim);
  std::copy(k.data.begin(), k.data.begin() + keep * row, out.data.begin());
  if (end > keep + count)
    std::copy(k.data.begin() + (keep + count) * row, k.data.begin() + end * row, out.data.begin() + keep * row);
  return out;
}

std::vector<float> read_keys(kvret_seq* s, int32_t layer) {
  int64_t n = 0;
  expect_ok(kvret_seq_length(s, layer, &n));
  F32 k({n, kHeads, kDim}), v({n, kHeads, kDim});
  expect_ok(kvret_seq_read(s, layer, 0, n, &k, &v));
  std::vector<float> out = k.data;
  out.insert(out.end(), v.data.begin(), v.data.end());
  return out;
}

/// (index kind, rope_keys)
class DropFront : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  DropFront() : config(small_config(std::get<0>(GetParam()))), k({kTokens, kHeads, kDim}), v({kTokens, kHeads, kDim}) {
    config.rope_keys = std::get<1>(GetParam());
    clustered_kv(kTokens, kHeads, kDim, 21, k, v);
  }
  /// Prefills every layer of `s` with tokens [0, end) with k/v `without`(keep, count).
  void fresh(kvret_seq* s, int64_t keep, int64_t count, int64_t end) {
    const F32 kk = without(k, keep, count, end), vv = without(v, keep, count, end);
    for (int32_t layer = 0; layer < kLayers; ++layer) prefill(s, layer, kk, vv, 0, kk.shape[0]);
  }
  kvret_config config;
  F32 k, v;
};

// The must-show: after dropping, the keys are RoPE applied fresh to the truncated sequence at the new positions,
// and the sequence selects as a fresh one of the tokens that stay; both go on alike.
TEST_P(DropFront, EqualsAFreshSequenceOfTheTokensThatStay) {
  auto ctx = make_context(config);
  for (const auto& [keep, count] : {std::pair<int64_t, int64_t>{4, 700}, {0, 1000}, {300, 257}, {1000, 1}}) {
    Seq a(ctx.get()), b(ctx.get());
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      prefill(a.s, layer, k, v, 0, 2000);
      decode(a.s, layer, k, v, 2000, 2030);
    }
    expect_ok(kvret_seq_drop_front(a.s, keep, count));
    fresh(b.s, keep, count, 2030);
    ASSERT_EQ(observe(a.s), observe(b.s)) << "keep " << keep << " count " << count;
    for (int32_t layer = 0; layer < kLayers; ++layer) EXPECT_EQ(read_keys(a.s, layer), read_keys(b.s, layer));
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      decode(a.s, layer, k, v, 2100, 2120);  // new tokens after the drop
      decode(b.s, layer, k, v, 2100, 2120);
    }
    EXPECT_EQ(observe(a.s), observe(b.s)) << "keep " << keep << " count " << count;
  }
}

// The rotated keys against the test's own rotation of the pre-RoPE keys at their new positions (keys given rotated
// are kept as given).
TEST_P(DropFront, KeysAreRotatedAtTheirNewPositions) {
  auto ctx = make_context(config);
  Seq a(ctx.get());
  prefill(a.s, 0, k, v, 0, 1200);
  expect_ok(kvret_seq_drop_front(a.s, 4, 500));
  const rope::Rope r(kDim, rope::kNeox, 10000.0);
  F32 got({700, kHeads, kDim}), gv({700, kHeads, kDim});
  expect_ok(kvret_seq_read(a.s, 0, 0, 700, &got, &gv));
  int moved_differs = 0;
  for (int64_t t = 0; t < 700; ++t) {
    const int64_t source = t < 4 ? t : t + 500;
    for (int h = 0; h < kHeads; ++h) {
      const auto at = static_cast<size_t>((t * kHeads + h) * kDim),
                 from = static_cast<size_t>((source * kHeads + h) * kDim);
      std::vector<float> want(k.data.begin() + static_cast<std::ptrdiff_t>(from),
                              k.data.begin() + static_cast<std::ptrdiff_t>(from + kDim));
      std::vector<float> old_position = want;
      if (config.rope_keys == 1) {
        r.rotate_at(want.data(), t);
        r.rotate_at(old_position.data(), source);
      }
      for (int i = 0; i < kDim; ++i) {
        ASSERT_EQ(got.data[at + static_cast<size_t>(i)], want[static_cast<size_t>(i)])
            << "token " << t << " head " << h;
        ASSERT_EQ(gv.data[at + static_cast<size_t>(i)], v.data[from + static_cast<size_t>(i)]);
      }
      if (t >= 4 && want != old_position) ++moved_differs;
    }
  }
  if (config.rope_keys == 1) {
    EXPECT_GT(moved_differs, 1000) << "the moved keys are not those of their old positions";
  }
}

// Layers of different lengths: one at most `keep` is unchanged; one shorter than keep + count keeps `keep` tokens.
TEST_P(DropFront, ShortLayers) {
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  prefill(a.s, 0, k, v, 0, 1500);
  prefill(a.s, 1, k, v, 0, 300);
  const std::vector<float> layer1 = read_keys(a.s, 1);
  expect_ok(kvret_seq_drop_front(a.s, 300, 600));
  const F32 k0 = without(k, 300, 600, 1500), v0 = without(v, 300, 600, 1500);
  prefill(b.s, 0, k0, v0, 0, k0.shape[0]);
  prefill(b.s, 1, k, v, 0, 300);
  EXPECT_EQ(observe(a.s), observe(b.s));
  EXPECT_EQ(read_keys(a.s, 1), layer1);
  // a layer holding fewer than keep + count tokens keeps its first `keep`
  Seq c(ctx.get()), d(ctx.get());
  prefill(c.s, 0, k, v, 0, 1500);
  prefill(c.s, 1, k, v, 0, 800);
  expect_ok(kvret_seq_drop_front(c.s, 500, 1000));
  prefill(d.s, 0, k, v, 0, 500);
  prefill(d.s, 1, k, v, 0, 500);
  EXPECT_EQ(observe(c.s), observe(d.s));
  // everything: every layer empty, and a new prefill starts afresh
  Seq e(ctx.get()), f(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(e.s, layer, k, v, 0, 900);
  expect_ok(kvret_seq_drop_front(e.s, 0, INT64_MAX));
  EXPECT_EQ(observe(e.s), observe(f.s));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(e.s, layer, k, v, 0, 400);
    prefill(f.s, layer, k, v, 0, 400);
  }
  EXPECT_EQ(observe(e.s), observe(f.s));
}

// Negative arguments are refused and change nothing; count 0 and keep at or beyond every layer change nothing.
TEST_P(DropFront, BadAndNoOpArguments) {
  auto ctx = make_context(config);
  Seq a(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(a.s, layer, k, v, 0, 800);
  const Observed before = observe(a.s);
  EXPECT_EQ(kvret_seq_drop_front(a.s, -1, 10), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("keep"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(kvret_seq_drop_front(a.s, 4, -1), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("count"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(kvret_seq_drop_front(a.s, INT64_MIN, INT64_MIN), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(observe(a.s), before);
  expect_ok(kvret_seq_drop_front(a.s, 4, 0));
  expect_ok(kvret_seq_drop_front(a.s, 800, 100));
  expect_ok(kvret_seq_drop_front(a.s, INT64_MAX, INT64_MAX));
  EXPECT_EQ(observe(a.s), before);
  EXPECT_EQ(kvret_seq_drop_front(nullptr, 0, 1), KVRET_ERR_INVALID_HANDLE);
}

// Strong guarantee: with each allocation of the call failing in turn, a failed drop leaves the sequence as it was.
TEST_P(DropFront, FailedDropChangesNothing) {
  config.n_threads = 1;  // every allocation on the calling thread, where the injection applies
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(a.s, layer, k, v, 0, 900);
    decode(a.s, layer, k, v, 900, 903);
  }
  fresh(b.s, 4, 300, 903);
  const Observed before = observe(a.s);
  const auto call = [&] {  // the C layer reports an allocation failure as KVRET_ERR_OUT_OF_MEMORY
    const kvret_status status = kvret_seq_drop_front(a.s, 4, 300);
    if (status == KVRET_ERR_OUT_OF_MEMORY) throw std::bad_alloc();
    expect_ok(status);
  };
  const int failures = fail_each_allocation(call, [&](int64_t) { ASSERT_EQ(observe(a.s), before); });
  EXPECT_GT(failures, 0) << "the new pages are allocated";
  EXPECT_EQ(observe(a.s), observe(b.s));
}

// A fork shares its pages with its source: dropping from one leaves the other as it was.
TEST_P(DropFront, ForkedSequencesStayApart) {
  auto ctx = make_context(config);
  Seq a(ctx.get()), fresh_b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(a.s, layer, k, v, 0, 1800);
  const Observed before = observe(a.s);
  kvret_seq* forked = nullptr;
  expect_ok(kvret_seq_fork(a.s, &forked));
  Seq b(forked);
  expect_ok(kvret_seq_drop_front(b.s, 300, 700));  // the first page is shared, the rest rewritten
  fresh(fresh_b.s, 300, 700, 1800);
  EXPECT_EQ(observe(b.s), observe(fresh_b.s));
  EXPECT_EQ(observe(a.s), before);
  for (int32_t layer = 0; layer < kLayers; ++layer) {  // appends to either copy their shared pages first
    decode(a.s, layer, k, v, 2000, 2010);
    decode(b.s, layer, k, v, 2000, 2010);
    decode(fresh_b.s, layer, k, v, 2000, 2010);
  }
  EXPECT_EQ(observe(b.s), observe(fresh_b.s));
  Seq c(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(c.s, layer, k, v, 0, 1800);
    decode(c.s, layer, k, v, 2000, 2010);
  }
  EXPECT_EQ(observe(a.s), observe(c.s));
}

// A background build still running is waited for.
TEST_P(DropFront, WaitsForABackgroundBuild) {
  config.background_build = 1;
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(a.s, layer, k, v, 0, 2400);
  expect_ok(kvret_seq_drop_front(a.s, 4, 800));
  fresh(b.s, 4, 800, 2400);
  EXPECT_EQ(observe(a.s), observe(b.s));
}

INSTANTIATE_TEST_SUITE_P(Kinds, DropFront,
                         ::testing::Combine(::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE,
                                                              KVRET_INDEX_STREAMING, KVRET_INDEX_CLUSTER,
                                                              KVRET_INDEX_QUANT),
                                            ::testing::Values(0, 1)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& i) {
                           return kind_name(std::get<0>(i.param)) + (std::get<1>(i.param) ? "PreRope" : "Rotated");
                         });

// State kept between steps: KVCrush's signatures (recomputed from the keys that stay), ClusterKV's resident
// clusters and a prefetched selection (dropped: their positions moved).
TEST(DropFrontState, KvCrushClusterReuseAndPrefetch) {
  kvret_config c = small_config(KVRET_INDEX_CLUSTER);
  c.rope_keys = 1;
  c.hamming_fraction = 0.25f;
  F32 k({kTokens, kHeads, kDim}), v({kTokens, kHeads, kDim});
  clustered_kv(kTokens, kHeads, kDim, 5, k, v);
  auto ctx = make_context(c);
  Seq a(ctx.get()), b(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(a.s, layer, k, v, 0, 2000);
  // steps before the drop: signatures, resident clusters and a prefetch exist
  F32 q({kQHeads, kDim});
  q.data = random_vector(static_cast<size_t>(kQHeads * kDim), 8);
  q.refresh();
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    F32 o({kQHeads, kDim});
    expect_ok(kvret_seq_attend(a.s, layer, &q, 200, 0.0f, &o, nullptr));
    expect_ok(kvret_prefetch_async(a.s, layer, &q, 200, nullptr));
  }
  expect_ok(kvret_seq_drop_front(a.s, 4, 900));
  const F32 kk = without(k, 4, 900, 2000), vv = without(v, 4, 900, 2000);
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(b.s, layer, kk, vv, 0, kk.shape[0]);
  kvret_stats before;
  kvret_stats_init(&before);
  expect_ok(kvret_seq_stats(a.s, &before));
  EXPECT_EQ(observe(a.s), observe(b.s));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    F32 oa({kQHeads, kDim}), ob({kQHeads, kDim});
    expect_ok(kvret_seq_attend(a.s, layer, &q, 200, 0.0f, &oa, nullptr));
    expect_ok(kvret_seq_attend(b.s, layer, &q, 200, 0.0f, &ob, nullptr));
    EXPECT_EQ(oa.data, ob.data);
  }
  kvret_stats after;
  kvret_stats_init(&after);
  expect_ok(kvret_seq_stats(a.s, &after));
  EXPECT_EQ(after.prefetch_hits, before.prefetch_hits) << "a prefetch of the old positions counts no hits";
}

}  // namespace
