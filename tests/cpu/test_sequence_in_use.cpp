// One sequence in calls on two threads at once (kvret.h forbids it): every call that takes a kvret_seq* marks the
// sequence in use for its duration, and a second thread's call is KVRET_ERR_BUSY with nothing done. A row source
// that blocks inside a fetch holds the first call open, so the status is observed without timing; two threads
// hammering one sequence get OK or KVRET_ERR_BUSY, and every row they fetch is the row stored at its position.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "c_api/handles.hpp"
#include "engine/context.hpp"
#include "fetch/working_set.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

/// Serves nothing; its first serve blocks until release(), so the fetch that called it stays in its call.
class Gate final : public RowSource {
 public:
  const char* name() const noexcept override { return "gate"; }
  int64_t serve(const RowRequest&) const override {
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    return 0;
  }
  void wait_entered() const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void release() const {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable bool entered_ = false, open_ = false;
};

void expect_busy(kvret_status s, const char* call) {
  EXPECT_EQ(s, KVRET_ERR_BUSY) << call << ": " << kvret_status_string(s) << ": " << kvret_last_error();
  if (s == KVRET_ERR_BUSY) {
    EXPECT_NE(std::string(kvret_last_error()).find("another thread"), std::string::npos) << kvret_last_error();
  }
}

TEST(SequenceInUse, ASecondThreadsCallsAreBusyAndChangeNothing) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  auto ctx = test::make_context(c);
  kvret_seq *seq = nullptr, *other = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  test::expect_ok(kvret_seq_open(ctx.get(), &other));
  F32 k({600, 2, 64}), v({600, 2, 64});
  test::clustered_kv(600, 2, 64, 7, k, v);
  for (kvret_seq* s : {seq, other})
    for (int32_t layer = 0; layer < 2; ++layer) test::expect_ok(kvret_append_prefill(s, layer, &k, &v));
  test::expect_ok(kvret_wait_index(seq, -1));
  F32 q({8, 64}, 0.25f);
  I32 selected({2, 40});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq, 0, &q, 40, &selected, &count));
  test::WorkingSetBuffers ws(seq, 0, count, 2, 64);

  auto gate = std::make_shared<Gate>();
  context_from_handle(ctx.get())->add_row_source(gate);
  kvret_status held_status = KVRET_ERR_INTERNAL;
  int64_t held_rows = 0;
  std::thread holder([&] { held_status = kvret_fetch_async(seq, 0, &selected, count, &ws.ws, &held_rows, nullptr); });
  gate->wait_entered();  // the fetch is inside its call now, and stays there until release

  F32 k1({2, 64}, 1.0f), v1({2, 64}, 1.0f);
  int64_t length = -1;
  expect_busy(kvret_append_decode(seq, 0, &k1, &v1), "append_decode");
  expect_busy(kvret_append_prefill(seq, 1, &k, &v), "append_prefill");
  expect_busy(kvret_seq_length(seq, 0, &length), "seq_length");
  EXPECT_EQ(length, -1) << "a busy call writes nothing";
  int32_t budget = -1;
  expect_busy(kvret_seq_budget(seq, 0, &budget), "seq_budget");
  kvret_stats st;
  test::expect_ok(kvret_stats_init(&st));
  expect_busy(kvret_seq_stats(seq, &st), "seq_stats");
  int32_t n = -1;
  expect_busy(kvret_select(seq, 0, &q, 40, &selected, &n), "select");
  EXPECT_EQ(n, -1);
  expect_busy(kvret_seq_truncate(seq, 10), "truncate");
  expect_busy(kvret_seq_drop_front(seq, 4, 10), "drop_front");
  kvret_seq* child = nullptr;
  expect_busy(kvret_seq_fork(seq, &child), "fork");
  EXPECT_EQ(child, nullptr);
  expect_busy(kvret_seq_close(seq), "close");
  expect_busy(kvret_session_save(seq, "held"), "session_save");

  // a batch holding the busy sequence: busy, and the sequences it took before it are released again
  kvret_seq* batch[2] = {other, seq};
  F32 qb({2, 8, 64}, 0.25f);
  I32 outb({2, 2, 40});
  int32_t counts[2] = {-1, -1};
  expect_busy(kvret_select_batch(ctx.get(), 2, batch, 0, &qb, 40, &outb, counts), "select_batch");
  EXPECT_EQ(counts[0], -1);
  const int32_t fetch_counts[2] = {0, 0};
  kvret_working_set outs[2] = {ws.ws, ws.ws};
  int64_t row_counts[2] = {-1, -1};
  expect_busy(kvret_fetch_batch_async(ctx.get(), 2, batch, 0, nullptr, fetch_counts, outs, row_counts, nullptr),
              "fetch_batch");
  EXPECT_EQ(row_counts[0], -1);
  test::expect_ok(kvret_seq_length(other, 0, &length));  // released by the failed batches
  EXPECT_EQ(length, 600);

  gate->release();
  holder.join();
  EXPECT_EQ(held_status, KVRET_OK) << kvret_status_string(held_status);
  EXPECT_GT(held_rows, 0);
  // nothing the busy calls asked for happened
  for (int32_t layer = 0; layer < 2; ++layer) {
    test::expect_ok(kvret_seq_length(seq, layer, &length));
    EXPECT_EQ(length, 600) << "layer " << layer;
  }
  int32_t tier = -1;
  test::expect_ok(kvret_session_where(ctx.get(), "held", &tier));
  EXPECT_EQ(tier, KVRET_TIER_NONE);
  test::expect_ok(kvret_seq_close(seq));
  test::expect_ok(kvret_seq_close(other));
}

/// Two threads append, select and fetch on one sequence as fast as they can: each call is OK or KVRET_ERR_BUSY, the
/// sequence's length counts exactly the appends that succeeded, and every fetched key is the key the sequence
/// holds at that position at the end.
TEST(SequenceInUse, TwoThreadsHammeringOneSequenceGetOkOrBusy) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.n_layers = 1;
  c.background_build = 0;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  constexpr int64_t kPrefill = 300;
  F32 k({kPrefill, 2, 64}), v({kPrefill, 2, 64});
  test::clustered_kv(kPrefill, 2, 64, 11, k, v);
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
  constexpr int32_t kBudget = 16;
  int64_t capacity = 0;
  test::expect_ok(kvret_working_set_capacity(seq, 0, kBudget, &capacity));

  constexpr int kThreads = 2, kSteps = 300;
  std::atomic<int64_t> appended{0}, busy{0}, fetched{0};
  std::atomic<int> wrong_status{0};
  struct Sighting {
    int32_t position, head;
    float key;
  };
  std::vector<std::vector<Sighting>> seen(kThreads);
  std::vector<std::string> first_error(kThreads);
  std::atomic<bool> go{false};
  auto worker = [&](int t) {
    while (!go.load()) std::this_thread::yield();
    F32 kt({2, 64}), vt({2, 64}, 0.5f);
    F32 q({8, 64});
    I32 selected({2, kBudget});
    F32 wk({2, capacity, 64}), wv({2, capacity, 64});
    I32 wp({2, capacity});
    const kvret_working_set ws{wk.t, wv.t, wp.t};
    auto check = [&](kvret_status s, const char* call) {
      if (s == KVRET_ERR_BUSY) {
        ++busy;
        return false;
      }
      if (s != KVRET_OK && wrong_status++ == 0)
        first_error[static_cast<size_t>(t)] =
            std::string(call) + ": " + kvret_status_string(s) + ": " + kvret_last_error();
      return s == KVRET_OK;
    };
    for (int step = 0; step < kSteps; ++step) {
      const float id = static_cast<float>(10000 * (t + 1) + step);  // unique per appended token
      std::fill(kt.data.begin(), kt.data.end(), id);
      kt.refresh();
      if (check(kvret_append_decode(seq, 0, &kt, &vt), "append_decode")) ++appended;
      for (size_t i = 0; i < q.data.size(); ++i)
        q.data[i] = static_cast<float>((i * 7 + static_cast<size_t>(step)) % 13) / 13.0f;
      q.refresh();
      int32_t count = 0;
      if (!check(kvret_select(seq, 0, &q, kBudget, &selected, &count), "select")) continue;
      int64_t rows = 0;
      if (!check(kvret_fetch_async(seq, 0, &selected, count, &ws, &rows, nullptr), "fetch")) continue;
      ++fetched;
      for (int32_t h = 0; h < 2; ++h)
        for (int64_t r = 0; r < rows; ++r) {
          const size_t row = static_cast<size_t>(h * capacity + r);
          seen[static_cast<size_t>(t)].push_back({wp.data[row], h, wk.data[row * 64]});
        }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  go = true;
  for (auto& th : threads) th.join();
  for (const auto& e : first_error) EXPECT_TRUE(e.empty()) << e;
  EXPECT_EQ(wrong_status.load(), 0);
  EXPECT_GT(fetched.load(), 0);

  int64_t length = 0;
  test::expect_ok(kvret_seq_length(seq, 0, &length));
  EXPECT_EQ(length, kPrefill + appended.load()) << "every append that answered OK is in, and no other";
  F32 all_k({length, 2, 64}), all_v({length, 2, 64});
  test::expect_ok(kvret_seq_read(seq, 0, 0, length, &all_k, &all_v));
  int64_t checked = 0;
  for (const auto& rows : seen)
    for (const Sighting& s : rows) {
      ASSERT_GE(s.position, 0);
      ASSERT_LT(s.position, length);
      ASSERT_EQ(s.key, all_k.data[static_cast<size_t>((s.position * 2 + s.head) * 64)])
          << "position " << s.position << " head " << s.head;
      ++checked;
    }
  EXPECT_GT(checked, 0);
  std::printf("[ info ] %lld appends, %lld fetches, %lld busy answers\n", static_cast<long long>(appended.load()),
              static_cast<long long>(fetched.load()), static_cast<long long>(busy.load()));
  test::expect_ok(kvret_seq_close(seq));
}

}  // namespace
