// launch_block_cache_update / launch_block_cache_prefetch against a CPU model of the documented rules, step by
// step: the tables must be equal after every call, and every occupied slot must hold its block's stored bytes.
#include <algorithm>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "block_cache.h"
#include "gpu_test_util.h"
#include "kv_test_store.h"

namespace kvret::cuda::testing {
namespace {

constexpr int kBlockTokens = 128;
constexpr uint32_t kPinned = 0xffffffffu;

/// The cache of one (sequence, head), following block_cache.h literally.
struct CpuCache {
  int max_blocks;
  int n_slots;
  std::vector<int32_t> table;
  std::vector<int32_t> slot_block;
  std::vector<uint32_t> stamp;
  std::vector<uint8_t> prefetched;

  CpuCache(int max_blocks_, int n_slots_)
      : max_blocks(max_blocks_),
        n_slots(n_slots_),
        table(max_blocks_, -1),
        slot_block(n_slots_, -1),
        stamp(n_slots_, 0),
        prefetched(n_slots_, 0) {}

  /// launch_max_blocks: the launch's bound; blocks at or beyond it are neither counted nor admitted.
  void apply(const std::vector<int32_t>& items, bool prefetch, CachePolicy policy, uint32_t step, int max_admit,
             int64_t n_tokens, int launch_max_blocks) {
    const int considered = std::min(max_blocks, launch_max_blocks);
    std::vector<int> counts(max_blocks, 0);
    for (const int32_t item : items) {
      if (item < 0) continue;
      const int64_t b = prefetch ? item : item / kBlockTokens;
      if (b >= considered) continue;
      counts[b] = prefetch ? 1 : counts[b] + 1;
    }
    std::vector<std::pair<uint32_t, int>> victims;  // (key, slot)
    for (int slot = 0; slot < n_slots; ++slot) {
      const int32_t b = slot_block[slot];
      uint32_t key;
      if (b < 0) {
        key = 0;
      } else if (counts[b] > 0) {
        if (!prefetch) {
          if (policy == CachePolicy::kLru) {
            stamp[slot] = step;
          } else if (stamp[slot] < kPinned - 1) {
            ++stamp[slot];
          }
          prefetched[slot] = 0;
        }
        key = kPinned;
      } else {
        key = std::min(stamp[slot], kPinned - 2) + 1;
      }
      if (key != kPinned) victims.emplace_back(key, slot);
    }
    std::vector<std::pair<int, int>> candidates;  // (-count, block)
    for (int b = 0; b < considered; ++b) {
      if (counts[b] > 0 && table[b] < 0 && (static_cast<int64_t>(b) + 1) * kBlockTokens <= n_tokens) {
        candidates.emplace_back(-std::min(counts[b], 255), b);
      }
    }
    const size_t n_admit = std::min({static_cast<size_t>(max_admit), candidates.size(), victims.size()});
    std::sort(candidates.begin(), candidates.end());
    std::vector<int> admitted;
    for (size_t r = 0; r < n_admit; ++r) admitted.push_back(candidates[r].second);
    std::sort(admitted.begin(), admitted.end());
    std::sort(victims.begin(), victims.end());
    for (size_t r = 0; r < n_admit; ++r) {
      const int slot = victims[r].second;
      const int b = admitted[r];
      if (slot_block[slot] >= 0) table[slot_block[slot]] = -1;
      slot_block[slot] = b;
      table[b] = slot;
      stamp[slot] = policy == CachePolicy::kLru ? step : 1u;
      prefetched[slot] = prefetch ? 1 : 0;
    }
  }
};

/// A selection with locality: most positions fall in a few hot blocks, some anywhere (the incomplete last block
/// included), none repeated.
std::vector<int32_t> selection(int64_t n_tokens, std::mt19937_64& rng) {
  const int64_t n_blocks = ceil_div(n_tokens, kBlockTokens);
  std::uniform_int_distribution<int64_t> any(0, n_tokens - 1);
  std::uniform_int_distribution<int64_t> block(0, n_blocks - 1);
  std::uniform_int_distribution<int> count(1, 60);
  std::set<int32_t> chosen;
  for (int hot = 0; hot < 6; ++hot) {
    const int64_t b = block(rng);
    const int c = count(rng);
    for (int i = 0; i < c; ++i) {
      const int64_t p = b * kBlockTokens + static_cast<int64_t>(rng() % kBlockTokens);
      if (p < n_tokens) chosen.insert(static_cast<int32_t>(p));
    }
  }
  for (int i = 0; i < 40; ++i) chosen.insert(static_cast<int32_t>(any(rng)));
  chosen.insert(static_cast<int32_t>(n_tokens - 1));
  return {chosen.begin(), chosen.end()};
}

/// launch_cut: the launch's max_blocks is this much below the largest cache's max_blocks (the kernel clamps each
/// cache's max_blocks to the launch's).
void run_case(CachePolicy policy, int max_admit, uint64_t seed, int launch_cut = 0) {
  const KvGeometry geo{2, 128, ElemType::kF16, kBlockTokens};
  const int64_t row_bytes = kv_row_bytes(geo);
  const int n_seqs = 2;
  const int64_t n_tokens[n_seqs] = {40 * kBlockTokens + 50, 17 * kBlockTokens};
  const int n_slots[n_seqs] = {8, 5};
  std::vector<std::unique_ptr<HostKvStore>> stores;
  std::vector<std::unique_ptr<DeviceBlockCache>> caches;
  std::vector<std::vector<CpuCache>> models(n_seqs);
  int32_t max_blocks = 0;
  for (int s = 0; s < n_seqs; ++s) {
    stores.push_back(std::make_unique<HostKvStore>(geo, n_tokens[s], 1024, seed + static_cast<uint64_t>(s)));
    const auto blocks = static_cast<int32_t>(ceil_div(n_tokens[s], kBlockTokens));
    max_blocks = std::max(max_blocks, blocks);
    caches.push_back(std::make_unique<DeviceBlockCache>(geo, blocks, n_slots[s]));
    for (int h = 0; h < geo.n_kv_heads; ++h) models[s].emplace_back(blocks, n_slots[s]);
  }

  BlockCacheUpdateParams params;
  params.n_seqs = n_seqs;
  params.geo = geo;
  params.policy = policy;
  params.max_admit = max_admit;
  params.max_blocks = max_blocks - launch_cut;
  DeviceBuffer<unsigned char> workspace(block_cache_workspace_bytes(params));
  std::mt19937_64 rng(seed);

  for (uint32_t step = 1; step <= 12; ++step) {
    const bool prefetch = step % 4 == 0;
    std::vector<std::vector<std::vector<int32_t>>> items(n_seqs);
    std::vector<DeviceBuffer<int32_t>> d_items;
    std::vector<BlockCacheUpdateSeq> seqs(n_seqs);
    for (int s = 0; s < n_seqs; ++s) {
      int32_t width = 0;
      for (int h = 0; h < geo.n_kv_heads; ++h) {
        if (prefetch) {  // blocks: some cached, some repeated, one out of range
          const int32_t blocks = caches[s]->max_blocks;
          items[s].push_back({static_cast<int32_t>(rng() % blocks), static_cast<int32_t>(rng() % blocks), 3, 3,
                              blocks + 2, static_cast<int32_t>(rng() % blocks)});
        } else {
          items[s].push_back(selection(n_tokens[s], rng));
        }
        width = std::max(width, static_cast<int32_t>(items[s][h].size()));
      }
      std::vector<int32_t> flat(static_cast<size_t>(geo.n_kv_heads) * width, -1);  // -1 pads: ignored
      for (int h = 0; h < geo.n_kv_heads; ++h)
        std::copy(items[s][h].begin(), items[s][h].end(), flat.begin() + h * width);
      d_items.emplace_back(flat);
      seqs[s].cache = caches[s]->view();
      seqs[s].host = stores[s]->view();
      seqs[s].items = d_items.back().get();
      seqs[s].items_stride = width;
      seqs[s].n_items = width;
      seqs[s].step = step;
      for (int h = 0; h < geo.n_kv_heads; ++h) {
        models[s][h].apply(items[s][h], prefetch, policy, step, max_admit, n_tokens[s], params.max_blocks);
      }
    }
    DeviceBuffer<BlockCacheUpdateSeq> d_seqs(seqs);
    params.seqs = d_seqs.get();
    if (prefetch) {
      KVRET_LAUNCH_AND_SYNC(launch_block_cache_prefetch(params, workspace.get(), workspace.size(), nullptr));
    } else {
      KVRET_LAUNCH_AND_SYNC(launch_block_cache_update(params, workspace.get(), workspace.size(), nullptr));
    }

    for (int s = 0; s < n_seqs; ++s) {
      const auto table = caches[s]->block_table.download();
      const auto slot_block = caches[s]->slot_block.download();
      const auto stamp = caches[s]->slot_stamp.download();
      const auto prefetched = caches[s]->slot_prefetched.download();
      const auto cache_k = caches[s]->k.download();
      const auto cache_v = caches[s]->v.download();
      const int32_t blocks = caches[s]->max_blocks;
      for (int h = 0; h < geo.n_kv_heads; ++h) {
        const CpuCache& model = models[s][h];
        const auto head_slice = [&](const auto& v, int width) {
          using T = typename std::decay_t<decltype(v)>::value_type;
          return std::vector<T>(v.begin() + h * width, v.begin() + (h + 1) * width);
        };
        ASSERT_EQ(head_slice(table, blocks), model.table) << "step " << step << " seq " << s << " head " << h;
        ASSERT_EQ(head_slice(slot_block, n_slots[s]), model.slot_block) << "step " << step << " seq " << s;
        ASSERT_EQ(head_slice(stamp, n_slots[s]), model.stamp) << "step " << step << " seq " << s;
        ASSERT_EQ(head_slice(prefetched, n_slots[s]), model.prefetched) << "step " << step << " seq " << s;
        for (int slot = 0; slot < n_slots[s]; ++slot) {
          const int b = model.slot_block[slot];
          if (b < 0) continue;
          for (int r = 0; r < kBlockTokens; ++r) {
            const size_t offset = static_cast<size_t>(((h * n_slots[s] + slot) * kBlockTokens + r) * row_bytes);
            const int64_t position = static_cast<int64_t>(b) * kBlockTokens + r;
            ASSERT_EQ(std::memcmp(&cache_k[offset], stores[s]->key_row(position, h), static_cast<size_t>(row_bytes)), 0)
                << "step " << step << " seq " << s << " head " << h << " block " << b;
            ASSERT_EQ(std::memcmp(&cache_v[offset], stores[s]->value_row(position, h), static_cast<size_t>(row_bytes)),
                      0);
          }
        }
      }
    }
  }
}

class BlockCacheTest : public GpuTest {};

TEST_F(BlockCacheTest, LruFollowsTheModelWithFewAdmissionsPerStep) { run_case(CachePolicy::kLru, 3, 51); }
TEST_F(BlockCacheTest, LruFollowsTheModelFillingTheCache) { run_case(CachePolicy::kLru, 8, 52); }
TEST_F(BlockCacheTest, CacheLargerThanTheLaunchBoundIsClamped) {
  // the first sequence's cache has 41 blocks, the launch's bound is 21: its blocks 21.. are ignored
  run_case(CachePolicy::kLru, 8, 55, 20);
}

TEST_F(BlockCacheTest, LfuFollowsTheModel) { run_case(CachePolicy::kLfu, 3, 53); }
TEST_F(BlockCacheTest, LfuFollowsTheModelFillingTheCache) { run_case(CachePolicy::kLfu, 8, 54); }

}  // namespace
}  // namespace kvret::cuda::testing
