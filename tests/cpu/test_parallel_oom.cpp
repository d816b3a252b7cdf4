// An allocation that fails inside one of the library's parallel loops (PQ training and encoding, the select of every
// index, the working-set gather, attend) reaches the caller as KVRET_ERR_OUT_OF_MEMORY and leaves the sequence as
// it was: an exception leaving an OpenMP region would make the runtime call std::terminate. The failures are
// injected on the calling thread, which runs its share of every loop (test_util.hpp's allocation hook).
#include <gtest/gtest.h>

#include <vector>

#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;
using test::I32;

/// Runs call() with the calling thread's n-th allocation failing, for n = 0, 1, ..., 63 and then every 8th, until
/// a run succeeds: every failed run must report KVRET_ERR_OUT_OF_MEMORY, and check() must hold after it. Returns
/// the number of failed runs.
template <class Call, class Check>
int run_until_ok(Call&& call, Check&& check) {
  int failed = 0;
  for (int64_t fail_at = 0; fail_at < 200000; fail_at += fail_at < 64 ? 1 : 8) {
    test::g_allocations_until_failure = fail_at;
    const kvret_status status = call();
    test::g_allocations_until_failure = -1;
    if (status == KVRET_OK) return failed;
    EXPECT_EQ(status, KVRET_ERR_OUT_OF_MEMORY) << "allocation " << fail_at << ": " << kvret_last_error();
    ++failed;
    check();
    if (::testing::Test::HasFailure()) return failed;
  }
  ADD_FAILURE() << "never succeeded";
  return failed;
}

TEST(ParallelOutOfMemory, BuildSelectFetchAndAttendReportItAndChangeNothing) {
  for (const int kind : {KVRET_INDEX_PQ, KVRET_INDEX_EXACT, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT}) {
    SCOPED_TRACE("index kind " + std::to_string(kind));
    kvret_config c = test::small_config(kind);
    c.n_layers = 1;
    c.n_threads = 2;
    c.background_build = 0;
    auto ctx = test::make_context(c);
    kvret_seq* seq = nullptr;
    test::expect_ok(kvret_seq_open(ctx.get(), &seq));
    constexpr int64_t kTokens = 3000;
    F32 k({kTokens, 2, 64}), v({kTokens, 2, 64});
    test::clustered_kv(kTokens, 2, 64, 3, k, v);
    const auto length = [&] {
      int64_t n = -1;
      test::expect_ok(kvret_seq_length(seq, 0, &n));
      return n;
    };
    // the prefill (PQ trains and encodes in parallel loops; PAGE builds its bounds in one)
    run_until_ok([&] { return kvret_append_prefill(seq, 0, &k, &v); }, [&] { EXPECT_EQ(length(), 0); });
    ASSERT_EQ(length(), kTokens);

    F32 q({8, 64});
    q.data = test::random_vector(8 * 64, 9);
    q.refresh();
    constexpr int32_t kBudget = 300;
    I32 want({2, kBudget}), got({2, kBudget});
    int32_t count = 0;
    test::expect_ok(kvret_select(seq, 0, &q, kBudget, &want, &count));
    const int failed_selects = run_until_ok([&] { return kvret_select(seq, 0, &q, kBudget, &got, &count); },
                                            [&] { EXPECT_EQ(length(), kTokens); });
    EXPECT_EQ(got.data, want.data) << "the select that succeeded after the failures";
    EXPECT_GT(failed_selects, 0);

    test::WorkingSetBuffers w(seq, 0, kBudget, 2, 64);
    int64_t rows = 0;
    run_until_ok([&] { return kvret_fetch_async(seq, 0, &want, kBudget, &w.ws, &rows, nullptr); },
                 [&] { EXPECT_EQ(length(), kTokens); });
    ASSERT_EQ(rows, w.capacity);
    w.expect_stored_keys(rows, k.data, 2, 64);  // the fetched rows are the stored ones

    // attend over 2048 rows: 2048 x 8 query heads is above its threshold for a parallel loop
    constexpr int64_t kRows = 2048;
    F32 ak({2, kRows, 64}), av({2, kRows, 64}), out({8, 64});
    ak.data = test::random_vector(static_cast<size_t>(2 * kRows * 64), 10);
    av.data = test::random_vector(static_cast<size_t>(2 * kRows * 64), 11);
    ak.refresh();
    av.refresh();
    EXPECT_GT(run_until_ok([&] { return kvret_attend(ctx.get(), &q, &ak, &av, kRows, 0.0f, &out, nullptr); }, [] {}),
              0);
    test::expect_ok(kvret_seq_close(seq));
  }
}

}  // namespace
}  // namespace kvret
