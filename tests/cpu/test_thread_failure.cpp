// A thread the system cannot start. The context's background build worker is a std::thread: when pthread_create
// fails, kvret_create returns KVRET_ERR_OUT_OF_MEMORY with a message and leaves no thread and no memory behind
// (the failure is injected through BuildQueue's g_worker_starts_until_failure; without the translation it was
// KVRET_ERR_INTERNAL, and a queue whose second worker failed called std::terminate). OpenMP's threads cannot be
// guarded that way (libgomp exits the process when it cannot start a team), so a context with n_threads = 1 must
// never start one: checked in a fresh process, where no earlier test has left an OpenMP pool.
#include <dirent.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/error.hpp"
#include "engine/build_queue.hpp"
#include "sequence_observer.hpp"
#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;
using test::I32;

/// The threads of this process (the entries of /proc/self/task).
int thread_count() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(dir))
    if (e->d_name[0] != '.') ++n;
  closedir(dir);
  return n;
}

/// thread_count() once it has held still for 20 ms: a thread an earlier test joined may still be listed for a
/// moment while the kernel finishes its exit.
int settled_thread_count() {
  int last = thread_count();
  for (int still = 0, tries = 0; still < 4 && tries < 200; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const int now = thread_count();
    still = now == last ? still + 1 : 0;
    last = now;
  }
  return last;
}

TEST(ThreadFailure, CreateReportsOutOfMemoryAndLeavesNothing) {
  kvret_config c = test::small_config();
  const int before = settled_thread_count();
  ASSERT_GT(before, 0);
  kvret_context* ctx = reinterpret_cast<kvret_context*>(&c);  // a sentinel the failed call must overwrite
  g_worker_starts_until_failure = 0;
  const kvret_status status = kvret_create(&c, &ctx);
  EXPECT_EQ(g_worker_starts_until_failure, -1) << "the injected failure was not reached";
  g_worker_starts_until_failure = -1;
  EXPECT_EQ(status, KVRET_ERR_OUT_OF_MEMORY) << kvret_status_string(status) << ": " << kvret_last_error();
  EXPECT_EQ(ctx, nullptr);
  EXPECT_NE(std::string(kvret_last_error()).find("background build thread"), std::string::npos) << kvret_last_error();
  EXPECT_LE(settled_thread_count(), before);  // no thread left behind (the leak check is the sanitizers')

  // the next create starts its worker, and a background build runs on it
  c.background_build = 1;
  auto good = test::make_context(c);
  ASSERT_NE(good, nullptr);
  test::Seq seq(good.get());
  F32 k({600, test::kHeads, test::kDim}), v({600, test::kHeads, test::kDim});
  test::clustered_kv(600, test::kHeads, test::kDim, 5, k, v);
  test::prefill(seq.s, 0, k, v, 0, 600);
  test::expect_ok(kvret_wait_index(seq.s, 0));
  F32 q({test::kQHeads, test::kDim});
  q.data = test::random_vector(q.data.size(), 6);
  q.refresh();
  I32 out({test::kHeads, 64});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq.s, 0, &q, 64, &out, &count));
  EXPECT_EQ(count, 64);
}

TEST(ThreadFailure, AQueueWhoseSecondWorkerFailsJoinsTheFirst) {
  const int before = settled_thread_count();
  g_worker_starts_until_failure = 1;  // the first worker starts, the second does not
  try {
    BuildQueue queue(3);
    ADD_FAILURE() << "the queue started all its workers";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), KVRET_ERR_OUT_OF_MEMORY) << e.what();
  }
  g_worker_starts_until_failure = -1;
  EXPECT_LE(settled_thread_count(), before);  // the first worker was joined
}

/// In this process: the threads that a prefill, select, fetch and attend of a context with n_threads added to the
/// process (OpenMP keeps the threads of a team it started for the next region), counted while the context lives:
/// its own build worker, and any thread a runtime starts with the first one, are there before. -100: a call failed.
int threads_started_by_the_calls(int32_t n_threads) {
  kvret_config c = test::small_config();
  c.n_layers = 1;
  c.n_threads = n_threads;
  c.background_build = 0;
  constexpr int64_t kTokens = 3000;
  constexpr int32_t kBudget = 300;
  F32 k({kTokens, test::kHeads, test::kDim}), v({kTokens, test::kHeads, test::kDim});
  test::clustered_kv(kTokens, test::kHeads, test::kDim, 7, k, v);
  F32 q({test::kQHeads, test::kDim});
  q.data = test::random_vector(q.data.size(), 8);
  q.refresh();
  I32 selected({test::kHeads, kBudget});
  int32_t count = 0;
  int64_t capacity = 0, rows = 0;
  kvret_context* ctx = nullptr;
  kvret_seq* seq = nullptr;
  if (kvret_create(&c, &ctx) != KVRET_OK) return -100;
  const int before = thread_count();
  if (kvret_seq_open(ctx, &seq) != KVRET_OK || kvret_append_prefill(seq, 0, &k, &v) != KVRET_OK ||
      kvret_select(seq, 0, &q, kBudget, &selected, &count) != KVRET_OK ||
      kvret_working_set_capacity(seq, 0, count, &capacity) != KVRET_OK)
    return -100;
  F32 wk({test::kHeads, capacity, test::kDim}), wv({test::kHeads, capacity, test::kDim});
  F32 out({test::kQHeads, test::kDim});
  I32 wp({test::kHeads, capacity});
  kvret_working_set ws{wk.t, wv.t, wp.t};
  if (kvret_fetch_async(seq, 0, &selected, count, &ws, &rows, nullptr) != KVRET_OK ||
      kvret_attend(ctx, &q, &wk, &wv, rows, 0.0f, &out, nullptr) != KVRET_OK)
    return -100;
  const int started = thread_count() - before;
  if (kvret_destroy(ctx) != KVRET_OK) return -100;
  std::fprintf(stderr, "n_threads %d: %d threads started\n", n_threads, started);
  return started;
}

TEST(ThreadFailure, AOneThreadContextStartsNoOpenMPThread) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child runs the test binary afresh: no OpenMP pool yet
  EXPECT_EXIT(std::exit(threads_started_by_the_calls(1) == 0 ? 0 : 1), ::testing::ExitedWithCode(0), "");
#ifdef _OPENMP
  // the measure sees OpenMP's threads: with two, the calls start one
  EXPECT_EXIT(std::exit(threads_started_by_the_calls(2) > 0 ? 0 : 1), ::testing::ExitedWithCode(0), "");
#endif
}

}  // namespace
}  // namespace kvret
