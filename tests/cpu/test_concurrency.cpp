// Distinct sequences from distinct threads at once, as the header allows: forks of one source append into the KV
// pages they share (each copies before it writes), truncate, select, fetch and attend, while another thread reads
// the context's stats. Every fetched row must be the row that sequence stored; run under ASan in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

TEST(Concurrency, ForksOfOneSourceRunOnTheirOwnThreads) {
  kvret_config config = small_config(KVRET_INDEX_PQ);
  config.n_threads = 1;
  auto ctx = make_context(config);
  F32 k({1007, kHeads, kDim}), v({1007, kHeads, kDim});
  clustered_kv(1007, kHeads, kDim, 30, k, v);
  Seq source(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(source.s, layer, k, v, 0, 1007);  // last page partial
  constexpr int kThreads = 4, kSteps = 40;
  std::vector<kvret_seq*> forks(kThreads);
  for (auto& f : forks) expect_ok(kvret_seq_fork(source.s, &f));
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::thread reader([&] {  // context-level calls are thread-safe
    while (!done.load()) {
      kvret_stats st;
      kvret_stats_init(&st);
      if (kvret_context_stats(ctx.get(), &st) != KVRET_OK || st.sequences != kThreads + 1) ++failures;
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t)
    workers.emplace_back([&, t] {
      kvret_seq* s = forks[static_cast<size_t>(t)];
      std::mt19937 rng(static_cast<unsigned>(t));
      // this sequence's keys of layer 0, [length, heads, dim]: the source's, then its own
      std::vector<float> keys(k.data.begin(), k.data.end());
      for (int step = 0; step < kSteps; ++step) {
        std::vector<float> kt(static_cast<size_t>(kHeads * kDim)), vt(kt.size());
        for (auto& x : kt) x = static_cast<float>(rng() % 1000) / 250.0f - 2.0f + static_cast<float>(t);
        for (auto& x : vt) x = static_cast<float>(rng() % 1000) / 500.0f;
        F32 kb({kHeads, kDim}), vb({kHeads, kDim});
        kb.data = kt;
        vb.data = vt;
        kb.refresh();
        vb.refresh();
        for (int32_t layer = 0; layer < kLayers; ++layer)
          if (kvret_append_decode(s, layer, &kb, &vb) != KVRET_OK) ++failures;
        keys.insert(keys.end(), kt.begin(), kt.end());
        if (step % 7 == 6) {  // drop the last two tokens again
          const int64_t length = static_cast<int64_t>(keys.size()) / (kHeads * kDim) - 2;
          if (kvret_seq_truncate(s, length) != KVRET_OK) ++failures;
          keys.resize(static_cast<size_t>(length) * kHeads * kDim);
        }
        F32 q({kQHeads, kDim});
        for (auto& x : q.data) x = static_cast<float>(rng() % 1000) / 500.0f - 1.0f;
        q.refresh();
        I32 selected({kHeads, 30});
        int32_t count = 0;
        if (kvret_select(s, 0, &q, 30, &selected, &count) != KVRET_OK) {
          ++failures;
          continue;
        }
        WorkingSetBuffers ws(s, 0, count, kHeads, kDim);
        int64_t rows = 0;
        if (kvret_fetch_async(s, 0, &selected, count, &ws.ws, &rows, nullptr) != KVRET_OK) ++failures;
        for (int h = 0; h < kHeads; ++h)
          for (int64_t r = 0; r < rows; ++r) {
            const int32_t pos = ws.positions.data[static_cast<size_t>(h * ws.capacity + r)];
            for (int i = 0; i < kDim; i += 17)
              if (ws.k.data[static_cast<size_t>((h * ws.capacity + r) * kDim + i)] !=
                  keys[static_cast<size_t>((static_cast<int64_t>(pos) * kHeads + h) * kDim + i)])
                ++failures;
          }
        F32 out({kQHeads, kDim});
        if (kvret_seq_attend(s, 1, &q, KVRET_BUDGET_DEFAULT, 0.0f, &out, nullptr) != KVRET_OK) ++failures;
      }
    });
  for (auto& w : workers) w.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  // the source never saw its forks' tokens
  int64_t length = 0;
  expect_ok(kvret_seq_length(source.s, 0, &length));
  EXPECT_EQ(length, 1007);
  for (auto* f : forks) expect_ok(kvret_seq_close(f));
}

}  // namespace
