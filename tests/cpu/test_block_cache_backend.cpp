// The CUDA backend's block cache, through the C ABI, where the suite runs on that backend (KVRET_TEST_DEVICE=cuda;
// in CI the build on Thrust's OpenMP host system): working sets bit for bit equal to a context without a cache
// over appends, truncates, drop_fronts and forks; hits + misses = rows fetched; a prefetch loads the blocks of its
// selection; LRU and LFU victims as a host model of the rule in kernels/block_cache.h predicts; the last, growing
// block never cached; device_bytes counting the cache under config.device_bytes_limit; the device windows of the
// sink and local rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "device_twin.hpp"
#include "engine/context.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

class BlockCache : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(kvret::cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

constexpr int kHeads = 2;
constexpr int kDim = 64;
constexpr int kBlock = 16;

kvret_config cache_config(int64_t slots, int32_t policy = KVRET_CACHE_LRU) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.block_tokens = kBlock;
  c.cache_capacity_tokens = slots * kBlock;
  c.cache_policy = policy;
  c.background_build = 0;
  return c;
}

using test::twin::length_of;
using test::twin::stats_of;

/// `count` distinct ascending middle positions per head of a layer of `length` tokens, most of them in a few hot
/// blocks; [kHeads, count].
std::vector<int32_t> random_selection(const kvret_config& c, int64_t length, int64_t count, std::mt19937_64& rng) {
  const int64_t lo = c.n_sink, hi = length - c.n_local;
  std::vector<int32_t> out;
  for (int h = 0; h < kHeads; ++h) {
    std::set<int32_t> chosen;
    std::vector<int64_t> hot;
    for (int i = 0; i < 3; ++i) hot.push_back(lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo)));
    while (static_cast<int64_t>(chosen.size()) < count) {
      int64_t p = lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo));
      if (rng() % 4 != 0)
        p = std::clamp<int64_t>(hot[rng() % hot.size()] + static_cast<int64_t>(rng() % 24), lo, hi - 1);
      chosen.insert(static_cast<int32_t>(p));
    }
    out.insert(out.end(), chosen.begin(), chosen.end());
  }
  return out;
}

/// The working set of one fetch, as host vectors.
struct Fetched {
  std::vector<float> k, v;
  std::vector<int32_t> positions;
  int64_t rows = 0;
};

Fetched fetch(kvret_seq* seq, int32_t layer, const std::vector<int32_t>& selection, int64_t count) {
  I32 sel({kHeads, std::max<int64_t>(count, 1)});
  std::copy(selection.begin(), selection.end(), sel.data.begin());
  int64_t capacity = 0;
  EXPECT_EQ(kvret_working_set_capacity(seq, layer, static_cast<int32_t>(count), &capacity), KVRET_OK)
      << kvret_last_error();
  F32 wk({kHeads, capacity, kDim}, -1.0f), wv({kHeads, capacity, kDim}, -1.0f);
  I32 wp({kHeads, capacity}, -1);
  const kvret_working_set ws{wk.t, wv.t, wp.t};
  Fetched f;
  EXPECT_EQ(kvret_fetch_async(seq, layer, &sel.t, static_cast<int32_t>(count), &ws, &f.rows, nullptr), KVRET_OK)
      << kvret_last_error();
  // (no kvret_synchronize needed on Thrust's host system, where every call completes before it returns)
  f.k = wk.data;
  f.v = wv.data;
  f.positions = wp.data;
  return f;
}

void append_tokens(kvret_seq* seq, int32_t layers, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  k.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed);
  v.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed + 1);
  k.refresh();
  v.refresh();
  for (int32_t l = 0; l < layers; ++l) test::expect_ok(kvret_append_prefill(seq, l, &k.t, &v.t));
}

/// Working sets of a context with a block cache equal, bit for bit, those of one without, over random selections
/// with appends, truncates, drop_fronts and forks in between (f32 and f16 stores, with and without RoPE'd keys);
/// hits + misses = rows fetched, and the cache does serve rows.
TEST_F(BlockCache, WorkingSetsEqualAContextWithoutOneUnderEveryChange) {
  for (const int kv : {KVRET_KV_F32, KVRET_KV_F16}) {
    for (const int rope : {0, 1}) {
      SCOPED_TRACE(kv * 10 + rope);
      kvret_config on = cache_config(6), off = on;
      on.kv_dtype = off.kv_dtype = kv;
      on.rope_keys = off.rope_keys = rope;
      off.cache_capacity_tokens = 0;
      auto ctx_on = test::make_context(on), ctx_off = test::make_context(off);
      kvret_seq *a = nullptr, *b = nullptr;
      test::twin::open_both(ctx_on.get(), ctx_off.get(), a, b);
      append_tokens(a, on.n_layers, 300, 11);
      append_tokens(b, on.n_layers, 300, 11);
      std::mt19937_64 rng(5 + static_cast<uint64_t>(kv * 2 + rope));
      int64_t fetched = 0;
      for (int step = 0; step < 120; ++step) {
        const int64_t length = length_of(a);
        ASSERT_EQ(length, length_of(b));
        const uint64_t op = rng() % 20;
        if (op == 0 && length > 120) {
          test::twin::truncate_both(a, b, length, 40, rng);
        } else if (op == 1 && length > 150) {
          test::twin::drop_front_both(a, b, 30, rng);
        } else if (op == 2) {
          kvret_seq *fa = nullptr, *fb = nullptr;
          test::twin::fork_both(a, b, fa, fb);
          if (rng() % 2 == 0) {  // go on with the fork, or with the parent after the fork wrote into its pages
            std::swap(a, fa);
            std::swap(b, fb);
          } else {
            append_tokens(fa, on.n_layers, 5, 100 + static_cast<uint64_t>(step));
            append_tokens(fb, on.n_layers, 5, 100 + static_cast<uint64_t>(step));
          }
          test::expect_ok(kvret_seq_close(fa));
          test::expect_ok(kvret_seq_close(fb));
        } else if (op < 8) {
          const int64_t tokens = 1 + static_cast<int64_t>(rng() % 20);
          append_tokens(a, on.n_layers, tokens, 1000 + static_cast<uint64_t>(step));
          append_tokens(b, on.n_layers, tokens, 1000 + static_cast<uint64_t>(step));
        } else {
          const int32_t layer = static_cast<int32_t>(rng() % 2);
          const int64_t middle = length - on.n_sink - on.n_local;
          const int64_t count = std::min<int64_t>(middle, 1 + static_cast<int64_t>(rng() % 60));
          const std::vector<int32_t> sel = random_selection(on, length, count, rng);
          const kvret_stats before = stats_of(a);
          const Fetched x = fetch(a, layer, sel, count), y = fetch(b, layer, sel, count);
          const kvret_stats after = stats_of(a);
          ASSERT_EQ(x.rows, y.rows);
          ASSERT_EQ(x.positions, y.positions) << "step " << step;
          ASSERT_EQ(x.k, y.k) << "step " << step;
          ASSERT_EQ(x.v, y.v) << "step " << step;
          EXPECT_EQ((after.cache_hits - before.cache_hits) + (after.cache_misses - before.cache_misses),
                    x.rows * kHeads);
          fetched += x.rows * kHeads;
        }
      }
      const kvret_stats sa = stats_of(a), sb = stats_of(b);
      EXPECT_GT(sa.cache_hits, 0) << "the cache served rows";
      EXPECT_EQ(sb.cache_hits, 0) << "capacity 0: no cache";
      EXPECT_EQ(sb.device_bytes, 0);
      EXPECT_GT(fetched, 0);
      test::expect_ok(kvret_seq_close(a));
      test::expect_ok(kvret_seq_close(b));
    }
  }
}

/// Which rows of a working set (sink, selected, local per head) the cache serves: the device windows' (after a
/// fetch's refresh of a layer that only grew: the first n_sink positions and the last n_local) and those in `cached`
/// blocks of their head.
int64_t rows_in(const std::vector<std::set<int64_t>>& cached, const kvret_config& c, int64_t length,
                const std::vector<int32_t>& sel, int64_t count) {
  int64_t n = 0;
  const int64_t mid_end = length - c.n_local;
  const int64_t sink_end = std::min<int64_t>(c.n_sink, length);
  const int64_t local_begin = std::max(sink_end, length - c.n_local);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<int64_t> rows;
    for (int64_t p = 0; p < c.n_sink; ++p) rows.push_back(p);
    for (int64_t i = 0; i < count; ++i) rows.push_back(sel[static_cast<size_t>(h * count + i)]);
    for (int64_t p = mid_end; p < length; ++p) rows.push_back(p);
    for (const int64_t p : rows) {
      const bool windowed = p < sink_end || p >= local_begin;
      n += windowed || cached[static_cast<size_t>(h)].count(p / kBlock) != 0 ? 1 : 0;
    }
  }
  return n;
}

/// kvret_prefetch_async loads the complete blocks its guessed selection touches: the next fetch of the same
/// selection serves every selected row of them (and any sink or local row in them) from the cache; prefetch_hits
/// keeps counting the selected rows the prefetch had guessed; the blocks copied in count in bytes_h2d.
TEST_F(BlockCache, APrefetchLoadsTheBlocksTheNextFetchNeeds) {
  const kvret_config c = cache_config(64);
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  append_tokens(seq, 1, 605, 3);  // the last block (600..604) is incomplete
  F32 q({8, kDim});
  q.data = test::random_vector(8 * kDim, 9);
  q.refresh();
  const int32_t budget = 40;
  test::expect_ok(kvret_prefetch_async(seq, 0, &q.t, budget, nullptr));
  const kvret_stats after_prefetch = stats_of(seq);
  I32 sel({kHeads, budget});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq, 0, &q.t, budget, &sel.t, &count));
  ASSERT_EQ(count, budget);
  std::vector<int32_t> selection(sel.data.begin(), sel.data.end());
  std::vector<std::set<int64_t>> touched(kHeads);
  int64_t loaded_blocks = 0;
  for (int h = 0; h < kHeads; ++h) {
    std::sort(selection.begin() + h * count, selection.begin() + (h + 1) * count);
    for (int i = 0; i < count; ++i) {
      const int64_t b = selection[static_cast<size_t>(h * count + i)] / kBlock;
      if ((b + 1) * kBlock <= 605) touched[static_cast<size_t>(h)].insert(b);
    }
    loaded_blocks += static_cast<int64_t>(touched[static_cast<size_t>(h)].size());
  }
  ASSERT_GT(loaded_blocks, 0);
  EXPECT_EQ(after_prefetch.bytes_h2d, loaded_blocks * kBlock * kDim * 4 * 2) << "the blocks copied in";
  EXPECT_EQ(after_prefetch.cache_hits, 0);
  const Fetched f = fetch(seq, 0, selection, count);
  const kvret_stats s = stats_of(seq);
  const int64_t expected = rows_in(touched, c, 605, selection, count);
  int64_t selected_in_complete = 0;
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < count; ++i)
      selected_in_complete += (selection[static_cast<size_t>(h * count + i)] / kBlock + 1) * kBlock <= 605 ? 1 : 0;
  EXPECT_GE(expected, selected_in_complete);
  EXPECT_EQ(s.cache_hits, expected) << "every row of a prefetched block is a hit, no other row is";
  EXPECT_EQ(s.cache_misses, f.rows * kHeads - expected);
  EXPECT_EQ(s.prefetch_hits, count * kHeads);
  test::expect_ok(kvret_seq_close(seq));
}

/// A host model of the rule of kernels/block_cache.h for one head, written from the rule, not from the backend.
struct ModelCache {
  int n_slots;
  int32_t policy;
  std::map<int64_t, int> table;  // block -> slot
  std::vector<int64_t> slot_block;
  std::vector<uint32_t> stamp;

  ModelCache(int slots, int32_t p) : n_slots(slots), policy(p), slot_block(slots, -1), stamp(slots, 0) {}

  std::set<int64_t> blocks() const {
    std::set<int64_t> s;
    for (const auto& [b, slot] : table) s.insert(b);
    return s;
  }
  /// items: selected positions; prefetch: every touched block counts 1 and used blocks keep their stamp.
  void apply(const std::vector<int32_t>& items, bool prefetch, uint32_t step, int max_admit, int64_t n_tokens) {
    std::map<int64_t, int> counts;
    for (const int32_t p : items) counts[p / kBlock] = prefetch ? 1 : counts[p / kBlock] + 1;
    std::vector<std::pair<uint32_t, int>> victims;  // (key, slot)
    for (int slot = 0; slot < n_slots; ++slot) {
      const int64_t b = slot_block[static_cast<size_t>(slot)];
      uint32_t key = 0;
      if (b >= 0 && counts.count(b) != 0) {
        if (!prefetch)
          stamp[static_cast<size_t>(slot)] = policy == KVRET_CACHE_LRU ? step : stamp[static_cast<size_t>(slot)] + 1;
        continue;  // used: kept
      }
      if (b >= 0) key = stamp[static_cast<size_t>(slot)] + 1;
      victims.emplace_back(key, slot);
    }
    std::vector<std::pair<int, int64_t>> candidates;  // (-count, block)
    for (const auto& [b, n] : counts)
      if (table.count(b) == 0 && (b + 1) * kBlock <= n_tokens) candidates.emplace_back(-std::min(n, 255), b);
    const size_t n_admit = std::min({static_cast<size_t>(max_admit), candidates.size(), victims.size()});
    std::sort(candidates.begin(), candidates.end());
    std::vector<int64_t> admitted;
    for (size_t r = 0; r < n_admit; ++r) admitted.push_back(candidates[r].second);
    std::sort(admitted.begin(), admitted.end());
    std::stable_sort(victims.begin(), victims.end());
    for (size_t r = 0; r < n_admit; ++r) {
      const int slot = victims[r].second;
      if (slot_block[static_cast<size_t>(slot)] >= 0) table.erase(slot_block[static_cast<size_t>(slot)]);
      slot_block[static_cast<size_t>(slot)] = admitted[r];
      table[admitted[r]] = slot;
      stamp[static_cast<size_t>(slot)] = policy == KVRET_CACHE_LRU ? step : 1u;
    }
  }
};

/// Under LRU and LFU, the rows each fetch serves from the cache are the rows in the blocks the model of the rule
/// holds: blocks admitted (the most selected first, up to a quarter of the slots per fetch, every touched one per
/// prefetch) into the victims the policy picks, over many random fetches and prefetches.
TEST_F(BlockCache, VictimsFollowTheRuleUnderLruAndLfu) {
  for (const int32_t policy : {KVRET_CACHE_LRU, KVRET_CACHE_LFU}) {
    SCOPED_TRACE(policy);
    constexpr int kSlots = 8;
    const kvret_config c = cache_config(kSlots, policy);
    auto ctx = test::make_context(c);
    kvret_seq* seq = nullptr;
    test::expect_ok(kvret_seq_open(ctx.get(), &seq));
    append_tokens(seq, 1, 700, 21);
    std::vector<ModelCache> model(kHeads, ModelCache(kSlots, policy));
    std::mt19937_64 rng(17 + static_cast<uint64_t>(policy));
    uint32_t step = 0;
    int64_t total_hits = 0;
    for (int i = 0; i < 80; ++i) {
      const int64_t length = length_of(seq);
      if (i % 10 == 9) {  // a prefetch: its selection is the index's, read back with kvret_select
        F32 q({8, kDim});
        q.data = test::random_vector(8 * kDim, 50 + static_cast<uint64_t>(i));
        q.refresh();
        test::expect_ok(kvret_prefetch_async(seq, 0, &q.t, 30, nullptr));
        I32 sel({kHeads, 30});
        int32_t count = 0;
        test::expect_ok(kvret_select(seq, 0, &q.t, 30, &sel.t, &count));
        ++step;
        for (int h = 0; h < kHeads; ++h) {
          std::vector<int32_t> items(sel.data.begin() + h * count, sel.data.begin() + (h + 1) * count);
          model[static_cast<size_t>(h)].apply(items, true, step, kSlots, length);
        }
        continue;
      }
      if (i % 7 == 6) append_tokens(seq, 1, 1 + static_cast<int64_t>(rng() % 10), 300 + static_cast<uint64_t>(i));
      const int64_t len = length_of(seq);
      const int64_t count = 1 + static_cast<int64_t>(rng() % 50);
      const std::vector<int32_t> sel = random_selection(c, len, count, rng);
      std::vector<std::set<int64_t>> cached;
      for (const ModelCache& m : model) cached.push_back(m.blocks());
      const int64_t expected = rows_in(cached, c, len, sel, count);
      const kvret_stats before = stats_of(seq);
      fetch(seq, 0, sel, count);
      const kvret_stats after = stats_of(seq);
      ASSERT_EQ(after.cache_hits - before.cache_hits, expected) << "fetch " << i;
      total_hits += expected;
      ++step;
      for (int h = 0; h < kHeads; ++h) {
        std::vector<int32_t> items(sel.begin() + h * count, sel.begin() + (h + 1) * count);
        model[static_cast<size_t>(h)].apply(items, false, step, kSlots / 4, len);
      }
    }
    EXPECT_GT(total_hits, 0);
    test::expect_ok(kvret_seq_close(seq));
  }
}

/// The last block of a layer, still growing, is never cached however often it is selected (only the sink rows, from
/// the device window, are hits); once appends complete it, a fetch admits it and the next one hits it.
TEST_F(BlockCache, TheLastGrowingBlockIsNeverCached) {
  kvret_config c = cache_config(8);
  c.n_local = 0;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  append_tokens(seq, 1, 5 * kBlock + 6, 4);  // block 5 holds 6 of its 16 tokens
  std::vector<int32_t> sel;
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < 6; ++i) sel.push_back(5 * kBlock + i);
  for (int i = 0; i < 3; ++i) {
    const kvret_stats before = stats_of(seq);
    fetch(seq, 0, sel, 6);
    EXPECT_EQ(stats_of(seq).cache_hits, before.cache_hits + c.n_sink * kHeads) << "fetch " << i;
    append_tokens(seq, 1, 3, 40 + static_cast<uint64_t>(i));  // 9, 12, 15 tokens: still incomplete
  }
  append_tokens(seq, 1, 1, 60);  // complete: 16 tokens
  fetch(seq, 0, sel, 6);         // admits it
  const kvret_stats before = stats_of(seq);
  fetch(seq, 0, sel, 6);
  EXPECT_EQ(stats_of(seq).cache_hits - before.cache_hits, (6 + c.n_sink) * kHeads) << "the completed block is cached";
  test::expect_ok(kvret_seq_close(seq));
}

/// stats.device_bytes counts the caches a sequence holds (slots, table, windows); a layer whose cache would pass
/// config.device_bytes_limit runs without one (every row from the host store, the fetch succeeds) and the limit holds.
TEST_F(BlockCache, DeviceBytesCountTheCacheAndTheLimitHolds) {
  constexpr int kSlots = 4;
  const int64_t row_bytes = kDim * 4;
  const int64_t slots_bytes = 2 * kHeads * kSlots * kBlock * row_bytes + kHeads * kSlots * 9;
  const int64_t table_bytes = kHeads * 64 * 4;  // the table covers at least 64 blocks
  kvret_config c = cache_config(kSlots);
  const int64_t window_bytes = 2 * kHeads * (c.n_sink + c.n_local) * row_bytes;
  const int64_t one_layer = slots_bytes + table_bytes + window_bytes;
  c.device_bytes_limit = one_layer + one_layer / 2;  // room for one layer's cache, not two
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  append_tokens(seq, 2, 300, 8);
  std::mt19937_64 rng(3);
  const std::vector<int32_t> sel = random_selection(c, 300, 20, rng);
  fetch(seq, 0, sel, 20);
  EXPECT_EQ(stats_of(seq).device_bytes, one_layer) << "layer 0's cache";
  const kvret_stats before = stats_of(seq);
  fetch(seq, 1, sel, 20);
  fetch(seq, 1, sel, 20);
  const kvret_stats after = stats_of(seq);
  EXPECT_EQ(after.device_bytes, one_layer) << "no room for layer 1's cache";
  EXPECT_EQ(after.cache_hits, before.cache_hits) << "layer 1 runs without a cache";
  EXPECT_EQ(after.fetches, before.fetches + 2);
  fetch(seq, 0, sel, 20);
  EXPECT_GT(stats_of(seq).cache_hits, after.cache_hits) << "layer 0 keeps its cache";
  kvret_seq* other = nullptr;  // the limit is the context's: another sequence finds no room either
  test::expect_ok(kvret_seq_open(ctx.get(), &other));
  append_tokens(other, 1, 300, 8);
  fetch(other, 0, sel, 20);
  EXPECT_EQ(stats_of(other).device_bytes, 0);
  test::expect_ok(kvret_seq_close(seq));  // its cache goes with it: room again
  fetch(other, 0, sel, 20);
  EXPECT_EQ(stats_of(other).device_bytes, one_layer);
  test::expect_ok(kvret_seq_close(other));
}

/// The device windows serve every sink and local row of a fetch from device memory and load only the rows they
/// lack: all of them at the layer's first fetch, the new one after a decode, none when nothing changed, the whole
/// local window after a jump past it; after a truncate they keep the rows below the cut (the others come from host
/// memory until appends catch up), after a drop_front the sink; working sets equal a context without a cache.
TEST_F(BlockCache, TheWindowsServeTheSinkAndLocalRowsAndLoadOnlyWhatTheyLack) {
  for (const int kv : {KVRET_KV_F32, KVRET_KV_F16}) {
    SCOPED_TRACE(kv);
    kvret_config on = cache_config(4), off = on;
    on.kv_dtype = off.kv_dtype = kv;
    off.cache_capacity_tokens = 0;
    const int64_t row_bytes = kDim * (kv == KVRET_KV_F32 ? 4 : 2);
    const int64_t sink = on.n_sink, local = on.n_local;
    auto ctx_on = test::make_context(on), ctx_off = test::make_context(off);
    kvret_seq *a = nullptr, *b = nullptr;
    test::twin::open_both(ctx_on.get(), ctx_off.get(), a, b);
    const auto append = [&](int64_t tokens, uint64_t seed) {
      append_tokens(a, 1, tokens, seed);
      append_tokens(b, 1, tokens, seed);
    };
    // one fetch of the sink and local rows only (no selection: no block is admitted); `hits` rows of each head
    // from the device, `loaded` rows per head copied into the windows
    const auto step = [&](int64_t hits, int64_t loaded, const char* what) {
      SCOPED_TRACE(what);
      const kvret_stats before = stats_of(a);
      const Fetched x = fetch(a, 0, {}, 0), y = fetch(b, 0, {}, 0);
      const kvret_stats after = stats_of(a);
      ASSERT_EQ(x.rows, sink + local);
      EXPECT_EQ(x.positions, y.positions);
      EXPECT_EQ(x.k, y.k);
      EXPECT_EQ(x.v, y.v);
      const int64_t misses = (x.rows - hits) * kHeads;
      EXPECT_EQ(after.cache_hits - before.cache_hits, hits * kHeads);
      EXPECT_EQ(after.cache_misses - before.cache_misses, misses);
      EXPECT_EQ(after.bytes_h2d - before.bytes_h2d, 2 * row_bytes * (misses + loaded * kHeads));
    };
    append(300, 1);
    step(sink + local, sink + local, "the first fetch loads the windows");
    append(1, 2);
    step(sink + local, 1, "a decode: the new row");
    step(sink + local, 0, "nothing changed");
    append(3 * local, 3);
    step(sink + local, local, "past the local window: all of it");
    test::expect_ok(kvret_seq_truncate(a, length_of(a) - 5));
    test::expect_ok(kvret_seq_truncate(b, length_of(b) - 5));
    step(sink + local - 5, 0, "after a cut: the rows below it");
    append(5, 4);
    step(sink + local, 5, "appends catch up");
    test::expect_ok(kvret_seq_drop_front(a, sink, 7));
    test::expect_ok(kvret_seq_drop_front(b, sink, 7));
    step(sink + local, local, "after a drop_front: the sink stays");
    EXPECT_EQ(stats_of(a).device_bytes, 2 * kHeads * 4 * kBlock * row_bytes + kHeads * 4 * 9 + kHeads * 64 * 4 +
                                            2 * kHeads * (sink + local) * row_bytes);
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

/// kvret_fetch_async and kvret_fetch_batch_async with a block cache make no host wait when the positions are in
/// pinned host memory: the rows the caches serve (windows and blocks) and the bytes loaded into them are counted on
/// the device, and reading the stats (which waits for the device) folds them in, equal to a host model's counts.
TEST_F(BlockCache, FetchesWithACacheMakeNoHostWait) {
  const kvret_config c = cache_config(8);
  auto ctx = test::make_context(c);
  const Backend& backend = context_from_handle(ctx.get())->backend();
  kvret_seq *a = nullptr, *b = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &a));
  test::expect_ok(kvret_seq_open(ctx.get(), &b));
  append_tokens(a, 1, 500, 31);
  append_tokens(b, 1, 420, 32);
  std::vector<ModelCache> model_a(kHeads, ModelCache(8, KVRET_CACHE_LRU));
  std::mt19937_64 rng(23);
  constexpr int32_t kCount = 24;
  int64_t waits = 0, expected_hits = 0;
  for (int step = 0; step < 12; ++step) {
    append_tokens(a, 1, 1, 100 + static_cast<uint64_t>(step));
    append_tokens(b, 1, 1, 200 + static_cast<uint64_t>(step));
    const int64_t len_a = length_of(a), len_b = length_of(b);
    const std::vector<int32_t> sel_a = random_selection(c, len_a, kCount, rng);
    const std::vector<int32_t> sel_b = random_selection(c, len_b, kCount, rng);
    std::vector<std::set<int64_t>> cached;
    for (const ModelCache& m : model_a) cached.push_back(m.blocks());
    expected_hits += rows_in(cached, c, len_a, sel_a, kCount);
    // pinned host positions: [2, kHeads, kCount] for the batch, whose first entry is the single fetch's
    I32 positions({2, kHeads, kCount});
    std::copy(sel_a.begin(), sel_a.end(), positions.data.begin());
    std::copy(sel_b.begin(), sel_b.end(), positions.data.begin() + kHeads * kCount);
    positions.refresh();
    positions.t.device = {KVRET_DEVICE_CUDA_HOST, 0};
    int64_t capacity_a = 0, capacity_b = 0;
    test::expect_ok(kvret_working_set_capacity(a, 0, kCount, &capacity_a));
    test::expect_ok(kvret_working_set_capacity(b, 0, kCount, &capacity_b));
    F32 ka({kHeads, capacity_a, kDim}), va({kHeads, capacity_a, kDim}), kb({kHeads, capacity_b, kDim}),
        vb({kHeads, capacity_b, kDim});
    I32 pa({kHeads, capacity_a}), pb({kHeads, capacity_b});
    const kvret_working_set outs[2] = {{ka.t, va.t, pa.t}, {kb.t, vb.t, pb.t}};
    kvret_tensor single = positions.t;  // the first entry: [kHeads, kCount]
    single.ndim = 2;
    single.shape = positions.t.shape + 1;
    single.strides = nullptr;  // row-major, as positions
    const int64_t before = backend.host_waits();
    int64_t rows = 0;
    if (step % 2 == 0) {
      test::expect_ok(kvret_fetch_async(a, 0, &single, kCount, &outs[0], &rows, nullptr));
    } else {
      kvret_seq* seqs[2] = {a, b};
      const int32_t counts[2] = {kCount, kCount};
      int64_t row_counts[2] = {0, 0};
      test::expect_ok(kvret_fetch_batch_async(ctx.get(), 2, seqs, 0, &positions.t, counts, outs, row_counts, nullptr));
    }
    waits += backend.host_waits() - before;
    for (int h = 0; h < kHeads; ++h) {
      std::vector<int32_t> items(sel_a.begin() + h * kCount, sel_a.begin() + (h + 1) * kCount);
      model_a[static_cast<size_t>(h)].apply(items, false, static_cast<uint32_t>(step + 1), 8 / 4, len_a);
    }
  }
  EXPECT_EQ(waits, 0) << "fetches with a cache, positions in pinned host memory";
  const int64_t before = backend.host_waits();
  const kvret_stats s = stats_of(a);
  EXPECT_GT(backend.host_waits(), before) << "reading the stats reads the device's counts";
  EXPECT_EQ(s.cache_hits, expected_hits);
  EXPECT_EQ(s.cache_hits + s.cache_misses, s.fetched_rows);
  EXPECT_GT(s.cache_hits, 12 * (c.n_sink + c.n_local) * kHeads) << "blocks served rows too";
  test::expect_ok(kvret_seq_close(a));
  test::expect_ok(kvret_seq_close(b));
}

}  // namespace
