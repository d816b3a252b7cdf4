// launch_working_set_gather: every gathered row equals the bytes of its source — the device windows where they
// hold the row's position, else the block cache where the row's block is cached, else the mapped pinned host
// store — and the hit/miss/prefetch counters add up.
#include <algorithm>
#include <cstring>
#include <set>
#include <vector>

#include "gpu_test_util.h"
#include "kv_test_store.h"
#include "math/kv_math.h"
#include "working_set_gather.h"

namespace kvret::cuda::testing {
namespace {

constexpr int kBlockTokens = 128;

/// sink + `selected` sorted distinct middle positions + local, as select and fetch compose them.
std::vector<int32_t> working_set_positions(int64_t n_tokens, int n_sink, int n_local, int selected, uint64_t seed) {
  std::vector<int32_t> rows;
  for (int i = 0; i < n_sink; ++i) rows.push_back(i);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> middle(n_sink, n_tokens - n_local - 1);
  std::set<int32_t> chosen;
  while (static_cast<int>(chosen.size()) < selected) chosen.insert(static_cast<int32_t>(middle(rng)));
  rows.insert(rows.end(), chosen.begin(), chosen.end());
  for (int64_t p = n_tokens - n_local; p < n_tokens; ++p) rows.push_back(static_cast<int32_t>(p));
  return rows;
}

struct GatherSeqSetup {
  std::vector<std::vector<int32_t>> positions;      // per head
  std::vector<std::vector<int32_t>> slot_of_block;  // per head, per block: slot or -1
  std::vector<unsigned char> cache_k;               // host mirror of the cache arrays
  std::vector<unsigned char> cache_v;
  WindowRows window;                    // the positions the windows hold (none without windows)
  std::vector<unsigned char> window_k;  // host mirror of the windows
  std::vector<unsigned char> window_v;
};

/// Windows holding `window`'s positions, their bytes a pattern no store or cache row has (a row from them is
/// recognised as such).
void make_windows(GatherSeqSetup& setup, const WindowRows& window, int heads, int64_t row_bytes, int seed) {
  setup.window = window;
  const size_t bytes = static_cast<size_t>(heads) * (window.sink_slots + window.local_slots) * row_bytes;
  setup.window_k.resize(bytes);
  setup.window_v.resize(bytes);
  for (size_t i = 0; i < bytes; ++i) {
    setup.window_k[i] = static_cast<unsigned char>(i * 13 + seed);
    setup.window_v[i] = static_cast<unsigned char>(i * 29 + seed * 3);
  }
}

void run_case(int head_dim, ElemType type, bool sentinel_cache, bool windows = false) {
  const KvGeometry geo{4, head_dim, type, kBlockTokens};
  const int64_t row_bytes = kv_row_bytes(geo);
  const int64_t out_capacity = 400;

  // Sequence 0: 5000 tokens in pages of 1024, a cache of 6 slots per head holding 4 blocks.
  HostKvStore store0(geo, 5000, 1024, 41);
  const int32_t max_blocks = static_cast<int32_t>(ceil_div(5000, kBlockTokens));
  DeviceBlockCache cache0(geo, max_blocks, 6);
  GatherSeqSetup setup0;
  setup0.cache_k.assign(cache0.k.size(), 0);
  setup0.cache_v.assign(cache0.v.size(), 0);
  std::vector<int32_t> table(static_cast<size_t>(geo.n_kv_heads) * max_blocks, -1);
  std::vector<int32_t> slot_block(static_cast<size_t>(geo.n_kv_heads) * 6, -1);
  std::vector<uint8_t> prefetched(static_cast<size_t>(geo.n_kv_heads) * 6, 0);
  for (int h = 0; h < geo.n_kv_heads; ++h) {
    const int blocks[4] = {0, 5 + h, 10 + 2 * h, 38};  // 38 holds the local window's start
    setup0.slot_of_block.emplace_back(max_blocks, -1);
    for (int slot = 0; slot < 4; ++slot) {
      const int b = blocks[slot];
      table[h * max_blocks + b] = slot;
      slot_block[h * 6 + slot] = b;
      setup0.slot_of_block[h][b] = slot;
      for (int r = 0; r < kBlockTokens; ++r) {
        const int64_t position = static_cast<int64_t>(b) * kBlockTokens + r;
        const size_t offset = static_cast<size_t>(((h * 6 + slot) * kBlockTokens + r) * row_bytes);
        for (int64_t byte = 0; byte < row_bytes; ++byte) {
          if (sentinel_cache) {  // differs from the host: proves the row came from the cache
            setup0.cache_k[offset + byte] = static_cast<unsigned char>(h * 31 + slot * 7 + r + byte);
            setup0.cache_v[offset + byte] = static_cast<unsigned char>(h * 17 + slot * 5 + r + 3 * byte);
          } else if (position < store0.n_tokens()) {
            setup0.cache_k[offset + byte] = store0.key_row(position, h)[byte];
            setup0.cache_v[offset + byte] = store0.value_row(position, h)[byte];
          }
        }
      }
    }
    prefetched[h * 6 + 1] = 1;
    setup0.positions.push_back(working_set_positions(5000, 16, 64, 300, 42 + static_cast<uint64_t>(h)));
  }
  cache0.block_table.upload(table);
  cache0.slot_block.upload(slot_block);
  cache0.slot_prefetched.upload(prefetched);
  cache0.k.upload(setup0.cache_k);
  cache0.v.upload(setup0.cache_v);

  // Sequence 1: 3000 tokens in one page, no cache, and one position past the end (a zero row).
  HostKvStore store1(geo, 3000, 3000, 43);
  GatherSeqSetup setup1;
  for (int h = 0; h < geo.n_kv_heads; ++h) {
    setup1.positions.push_back(working_set_positions(3000, 16, 64, 100, 44 + static_cast<uint64_t>(h)));
    setup1.positions.back().push_back(3005);
  }

  // The windows: sequence 0's sink holds 10 of its 16 sink positions (the rest come from cached block 0) and its
  // local rows 40 of the last 64 (the rest from cached block 38); sequence 1's hold every sink and local row.
  std::vector<DeviceBuffer<unsigned char>> d_windows;
  if (windows) {
    make_windows(setup0, WindowRows{16, 10, 64, 5000 - 40, 5000}, geo.n_kv_heads, row_bytes, 5);
    make_windows(setup1, WindowRows{16, 16, 64, 3000 - 64, 3000}, geo.n_kv_heads, row_bytes, 9);
  }
  const HostKvStore* stores[2] = {&store0, &store1};
  GatherSeqSetup* setups[2] = {&setup0, &setup1};
  std::vector<DeviceBuffer<int32_t>> d_positions;
  std::vector<DeviceBuffer<unsigned char>> d_out_k;
  std::vector<DeviceBuffer<unsigned char>> d_out_v;
  std::vector<DeviceBuffer<int32_t>> d_out_positions;
  std::vector<DeviceBuffer<unsigned long long>> d_counters;
  std::vector<WorkingSetGatherSeq> seqs(2);
  int32_t max_rows = 0;
  for (int s = 0; s < 2; ++s) {
    const auto& rows = setups[s]->positions;
    const int32_t n_rows = static_cast<int32_t>(rows[0].size());
    max_rows = std::max(max_rows, n_rows);
    std::vector<int32_t> flat(static_cast<size_t>(geo.n_kv_heads) * n_rows);
    for (int h = 0; h < geo.n_kv_heads; ++h) std::copy(rows[h].begin(), rows[h].end(), flat.begin() + h * n_rows);
    d_positions.emplace_back(flat);
    d_out_k.emplace_back(static_cast<size_t>(geo.n_kv_heads * out_capacity * row_bytes));
    d_out_v.emplace_back(static_cast<size_t>(geo.n_kv_heads * out_capacity * row_bytes));
    d_out_positions.emplace_back(static_cast<size_t>(geo.n_kv_heads * out_capacity));
    d_counters.emplace_back(std::vector<unsigned long long>(3, 0));
    d_out_k.back().fill_bytes(0xab);
    d_out_v.back().fill_bytes(0xab);
    d_out_positions.back().fill_bytes(0xff);
    WorkingSetGatherSeq& q = seqs[s];
    if (s == 0) q.cache = cache0.view();
    if (windows) {
      d_windows.emplace_back(setups[s]->window_k);
      q.cache.window_k = d_windows.back().get();
      d_windows.emplace_back(setups[s]->window_v);
      q.cache.window_v = d_windows.back().get();
      q.cache.window = setups[s]->window;
    }
    q.host = stores[s]->view();
    q.positions = d_positions.back().get();
    q.positions_stride = n_rows;
    q.n_rows = n_rows;
    q.out_k = d_out_k.back().get();
    q.out_v = d_out_v.back().get();
    q.out_positions = d_out_positions.back().get();
    q.out_capacity = out_capacity;
    q.counters = d_counters.back().get();
  }
  DeviceBuffer<WorkingSetGatherSeq> d_seqs(seqs);
  KVRET_LAUNCH_AND_SYNC(launch_working_set_gather(d_seqs.get(), 2, max_rows, geo, nullptr));

  const std::vector<unsigned char> zeros(static_cast<size_t>(row_bytes), 0);
  for (int s = 0; s < 2; ++s) {
    const auto out_k = d_out_k[s].download();
    const auto out_v = d_out_v[s].download();
    const auto out_positions = d_out_positions[s].download();
    const auto counters = d_counters[s].download();
    unsigned long long hits = 0, misses = 0, prefetch_hits = 0;
    for (int h = 0; h < geo.n_kv_heads; ++h) {
      const auto& rows = setups[s]->positions[h];
      for (size_t r = 0; r < rows.size(); ++r) {
        const int32_t position = rows[r];
        const size_t out_offset = static_cast<size_t>((h * out_capacity + static_cast<int64_t>(r)) * row_bytes);
        ASSERT_EQ(out_positions[h * out_capacity + static_cast<int64_t>(r)], position);
        const unsigned char* want_k = zeros.data();
        const unsigned char* want_v = zeros.data();
        if (position < stores[s]->n_tokens()) {
          const WindowRows& w = setups[s]->window;
          const int window = windows ? math::window_slot(w, position) : -1;
          const int slot = s == 0 ? setups[s]->slot_of_block[h][position / kBlockTokens] : -1;
          if (window >= 0) {
            const size_t offset = static_cast<size_t>((h * (w.sink_slots + w.local_slots) + window) * row_bytes);
            want_k = &setups[s]->window_k[offset];
            want_v = &setups[s]->window_v[offset];
            ++hits;
          } else if (slot >= 0) {
            const size_t offset =
                static_cast<size_t>(((h * 6 + slot) * kBlockTokens + position % kBlockTokens) * row_bytes);
            want_k = &setups[s]->cache_k[offset];
            want_v = &setups[s]->cache_v[offset];
            ++hits;
            prefetch_hits += slot == 1 ? 1 : 0;
          } else {
            want_k = stores[s]->key_row(position, h);
            want_v = stores[s]->value_row(position, h);
            ++misses;
          }
        }
        ASSERT_EQ(std::memcmp(&out_k[out_offset], want_k, static_cast<size_t>(row_bytes)), 0)
            << "seq " << s << " head " << h << " row " << r << " position " << position;
        ASSERT_EQ(std::memcmp(&out_v[out_offset], want_v, static_cast<size_t>(row_bytes)), 0)
            << "seq " << s << " head " << h << " row " << r << " position " << position;
      }
      // The row after the working set is untouched.
      const size_t after = static_cast<size_t>((h * out_capacity + static_cast<int64_t>(rows.size())) * row_bytes);
      EXPECT_EQ(out_k[after], 0xab);
    }
    EXPECT_EQ(counters[0], hits) << "seq " << s;
    EXPECT_EQ(counters[1], misses) << "seq " << s;
    EXPECT_EQ(counters[2], prefetch_hits) << "seq " << s;
    if (s == 0) {
      EXPECT_GT(hits, 0u);
    }
  }
}

class WorkingSetGatherTest : public GpuTest {};

TEST_F(WorkingSetGatherTest, F16HeadDim128RowsEqualTheirSource) { run_case(128, ElemType::kF16, false); }
TEST_F(WorkingSetGatherTest, CachedRowsComeFromTheCache) { run_case(128, ElemType::kF16, true); }
TEST_F(WorkingSetGatherTest, F32HeadDim64) { run_case(64, ElemType::kF32, true); }
TEST_F(WorkingSetGatherTest, Bf16HeadDim256) { run_case(256, ElemType::kBF16, false); }
TEST_F(WorkingSetGatherTest, F32HeadDim256OneKilobyteRows) { run_case(256, ElemType::kF32, true); }
TEST_F(WorkingSetGatherTest, WindowRowsComeFromTheWindowsBeforeTheCache) {
  run_case(128, ElemType::kF16, true, true);
  run_case(64, ElemType::kBF16, false, true);
}

}  // namespace
}  // namespace kvret::cuda::testing
