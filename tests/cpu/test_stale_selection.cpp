// kvret_fetch_async's contract for a selection made at an earlier length: its positions are still middle positions
// (the middle only grows), so it is accepted and fetches exactly the tokens it names, from the store; positions
// outside the current middle are refused.
#include <gtest/gtest.h>

#include <vector>

#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;
using test::I32;

TEST(StaleSelection, FetchesTheTokensItNamesAfterLaterDecodeSteps) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  F32 k({200, 2, 64}), v({200, 2, 64});
  test::clustered_kv(200, 2, 64, 4, k, v);
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
  F32 q({8, 64});
  q.data = test::random_vector(8 * 64, 5);
  q.refresh();
  constexpr int32_t kBudget = 20;
  I32 sel({2, kBudget});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq, 0, &q, kBudget, &sel, &count));
  // 30 decode steps later the selection is stale
  std::vector<float> keys = k.data;
  F32 k1({2, 64}), v1({2, 64});
  for (int step = 0; step < 30; ++step) {
    k1.data = test::random_vector(128, 50 + static_cast<uint64_t>(step));
    k1.refresh();
    test::expect_ok(kvret_append_decode(seq, 0, &k1, &v1));
    keys.insert(keys.end(), k1.data.begin(), k1.data.end());
  }
  test::WorkingSetBuffers w(seq, 0, kBudget, 2, 64);
  int64_t rows = 0;
  test::expect_ok(kvret_fetch_async(seq, 0, &sel, count, &w.ws, &rows, nullptr));
  ASSERT_EQ(rows, c.n_sink + count + c.n_local);
  for (int h = 0; h < 2; ++h)
    for (int32_t i = 0; i < count; ++i)  // the selected rows, after the sink, are the named tokens
      EXPECT_EQ(w.positions.data[static_cast<size_t>(h * w.capacity + c.n_sink + i)],
                sel.data[static_cast<size_t>(h * kBudget + i)]);
  w.expect_stored_keys(rows, keys, 2, 64);
  // a position in the local window is not a middle position
  I32 bad = sel;
  bad.refresh();
  bad.data[0] = static_cast<int32_t>(230 - 1);
  EXPECT_EQ(kvret_fetch_async(seq, 0, &bad, count, &w.ws, &rows, nullptr), KVRET_ERR_OUT_OF_RANGE)
      << kvret_last_error();
}

}  // namespace
}  // namespace kvret
