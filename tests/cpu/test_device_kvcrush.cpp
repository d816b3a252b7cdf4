// KVCrush's representatives on the CUDA backend's device (docs/kvcrush.md, docs/cuda_backend.md):
// - always: the math kvcrush_math.h adds for the device path (the distance to the alternating anchor, the order
//   keys, the selected count) against the CPU library's own rules, and KvCrushLayer::add_representatives with a
//   representative count past the middle;
// - where the suite runs on the CUDA backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's OpenMP host
//   system): PAGE, CLUSTER, PQ and EXACT selects with hamming_fraction 0.25 and 0.5 give positions and scores bit for
//   bit equal to the CPU backend's over appends, truncates, drop_fronts and forks, f32 and f16 stores, the three
//   sources of importance (the keys' proxy window, an observed query window, accumulated attention) and budgets from 1
//   to the whole middle; the device's copy of the signatures counts in device_bytes and stays under device_bytes_limit
//   (the host selects, with the same result, when it would not fit); kvret_select_batch equals single selects.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/tensor_view.hpp"
#include "device_twin.hpp"
#include "engine/kvcrush_layer.hpp"
#include "kvret.h"
#include "math/kvcrush_math.h"
#include "select/kvcrush.hpp"
#include "store/host_kv_store.hpp"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;
namespace km = kvret::cuda::math;

namespace {

// --- the math (always) -------------------------------------------------------------------------------------------

/// Random signatures of `heads` bits (nothing past the last head).
std::vector<uint64_t> random_signatures(int64_t n, int heads, std::mt19937_64& g) {
  const int words = signature_words(heads);
  std::vector<uint64_t> bits(static_cast<size_t>(n * words));
  for (int64_t t = 0; t < n; ++t)
    for (int w = 0; w < words; ++w) {
      uint64_t x = g();
      if (g() % 4 == 0) x = g() % 2 == 0 ? 0 : ~uint64_t{0};  // all or nothing: distances 0 and heads
      bits[static_cast<size_t>(t * words + w)] = x & km::kvcrush_word_mask(w, heads);
    }
  return bits;
}

TEST(KvCrushDeviceMath, AlternatingDistanceIsTheHammingDistanceToTheAnchor) {
  std::mt19937_64 g(11);
  for (const int heads : {1, 2, 7, 8, 32, 63, 64, 65, 100, 128, 129, 200}) {
    const int words = signature_words(heads);
    std::vector<uint64_t> anchor(static_cast<size_t>(words));
    make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, anchor.data());
    const std::vector<uint64_t> bits = random_signatures(300, heads, g);
    for (int64_t t = 0; t < 300; ++t) {
      const uint64_t* row = bits.data() + t * words;
      const int d = km::kvcrush_alternating_distance(row, words, heads);
      ASSERT_EQ(d, hamming_distance(row, anchor.data(), words)) << heads << " " << t;
      ASSERT_EQ(d, km::kvcrush_hamming(row, anchor.data(), words));
      ASSERT_GE(d, 0);
      ASSERT_LE(d, heads);
    }
  }
}

/// Sorting the middle's order keys gives the CPU's (distance, position) order (order_by_distance, and the layer's
/// distance lists that add_representatives walks).
TEST(KvCrushDeviceMath, SortedOrderKeysAreTheCpuOrder) {
  std::mt19937_64 g(12);
  for (int trial = 0; trial < 200; ++trial) {
    const int heads = 1 + static_cast<int>(g() % 140);
    const int words = signature_words(heads);
    const int64_t n = 1 + static_cast<int64_t>(g() % 500);
    const std::vector<uint64_t> bits = random_signatures(n, heads, g);
    const int64_t begin = static_cast<int64_t>(g() % static_cast<uint64_t>(n));
    const int64_t end = begin + 1 + static_cast<int64_t>(g() % static_cast<uint64_t>(n - begin));
    std::vector<uint64_t> keys;
    for (int64_t t = begin; t < end; ++t)
      keys.push_back(km::kvcrush_order_key(km::kvcrush_alternating_distance(bits.data() + t * words, words, heads), t));
    std::sort(keys.begin(), keys.end());
    std::vector<int32_t> device(keys.size());
    std::transform(keys.begin(), keys.end(), device.begin(), [](uint64_t k) { return km::kvcrush_key_position(k); });
    std::vector<uint64_t> anchor(static_cast<size_t>(words));
    make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, anchor.data());
    std::vector<int32_t> positions(static_cast<size_t>(end - begin)), cpu(positions.size());
    std::iota(positions.begin(), positions.end(), static_cast<int32_t>(begin));
    order_by_distance(bits.data(), words, heads, anchor.data(), positions.data(), end - begin, cpu.data());
    ASSERT_EQ(device, cpu) << "trial " << trial;
  }
  EXPECT_LT(km::kvcrush_order_key(0, 2147483647), km::kvcrush_order_key(1, 0));  // distance first
  EXPECT_EQ(km::kvcrush_key_position(km::kvcrush_order_key(64, 2147483647)), 2147483647);
}

/// A layer over `total` random tokens (8 signature heads).
struct LayerFixture {
  HostKvStore store{8, 32, DType::F32};
  KvCrushLayer layer;
  explicit LayerFixture(int64_t total, uint64_t seed) {
    F32 k({total, 8, 32}), v({total, 8, 32});
    test::clustered_kv(total, 8, 32, seed, k, v);
    store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), total, true);
    layer.update(store, 1.0f / std::sqrt(32.0f));
  }
};

/// add_representatives returns kvcrush_selected_count, the count the device path writes, over random rows.
TEST(KvCrushDeviceMath, SelectedCountIsTheLayersCount) {
  LayerFixture f(400, 31);
  std::mt19937_64 g(13);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t mid_begin = static_cast<int64_t>(g() % 200);
    const int64_t mid_end = mid_begin + 1 + static_cast<int64_t>(g() % static_cast<uint64_t>(400 - mid_begin));
    const int64_t m = mid_end - mid_begin;
    const int64_t n_important = static_cast<int64_t>(g() % static_cast<uint64_t>(m + 1));
    const int64_t n_rep = static_cast<int64_t>(g() % static_cast<uint64_t>(2 * m + 2));
    std::vector<int32_t> all(static_cast<size_t>(m));
    std::iota(all.begin(), all.end(), static_cast<int32_t>(mid_begin));
    std::shuffle(all.begin(), all.end(), g);
    std::vector<int32_t> row(all.begin(), all.begin() + n_important);
    std::sort(row.begin(), row.end());
    row.resize(static_cast<size_t>(n_important + n_rep));
    const int64_t count = f.layer.add_representatives(0, mid_begin, mid_end, row.data(), nullptr, n_important, n_rep);
    ASSERT_EQ(count, km::kvcrush_selected_count(n_important, n_rep, m)) << "trial " << trial;
    ASSERT_LE(count, m);
    ASSERT_LE(count, n_important + std::max<int64_t>(n_rep, 0));
  }
  EXPECT_EQ(km::kvcrush_selected_count(3, -2, 10), 3);
  EXPECT_EQ(km::kvcrush_selected_count(3, 0, 10), 3);
  EXPECT_EQ(km::kvcrush_selected_count(3, 100, 10), 10);
  EXPECT_EQ(km::kvcrush_selected_count(10, 5, 10), 10);
}

/// A representative count past the middle (and past its candidates) writes no more than kvcrush_selected_count
/// entries (the row sized for that only, guarded on both sides) and adds what n_rep = middle adds; a negative count
/// or an important row longer than the middle adds nothing and writes nothing.
TEST(KvCrushDeviceMath, RepresentativesPastTheMiddleAreHandled) {
  LayerFixture f(300, 32);
  std::mt19937_64 g(14);
  constexpr int32_t kGuard = -12345;
  constexpr int64_t kPad = 8;
  for (const auto& [mid_begin, mid_end] : {std::pair<int64_t, int64_t>{4, 284}, {100, 101}, {0, 300}, {250, 263}}) {
    const int64_t m = mid_end - mid_begin;
    for (const int64_t n_important : {int64_t{0}, int64_t{1}, m / 2, m - 1, m}) {
      std::vector<int32_t> all(static_cast<size_t>(m));
      std::iota(all.begin(), all.end(), static_cast<int32_t>(mid_begin));
      std::shuffle(all.begin(), all.end(), g);
      std::vector<int32_t> important(all.begin(), all.begin() + n_important);
      std::sort(important.begin(), important.end());
      std::vector<float> important_scores(important.size());
      for (auto& s : important_scores) s = static_cast<float>(g() % 100) * 0.5f;
      // n_rep = m: the reference
      std::vector<int32_t> want(static_cast<size_t>(n_important + m));
      std::vector<float> want_scores(want.size());
      std::copy(important.begin(), important.end(), want.begin());
      std::copy(important_scores.begin(), important_scores.end(), want_scores.begin());
      const int64_t want_n =
          f.layer.add_representatives(1, mid_begin, mid_end, want.data(), want_scores.data(), n_important, m);
      ASSERT_EQ(want_n, m) << "every middle token: the buckets' and the fill";
      for (const int64_t n_rep : {m + 1, 2 * m, 3 * m + 7, int64_t{1} << 40}) {
        const int64_t count = km::kvcrush_selected_count(n_important, n_rep, m);
        ASSERT_EQ(count, want_n);
        std::vector<int32_t> row(static_cast<size_t>(count + 2 * kPad), kGuard);
        std::vector<float> scores(row.size(), -3.0f);
        std::copy(important.begin(), important.end(), row.begin() + kPad);
        std::copy(important_scores.begin(), important_scores.end(), scores.begin() + kPad);
        const int64_t n = f.layer.add_representatives(1, f.layer.middle_order(mid_begin, mid_end, n_rep),
                                                      row.data() + kPad, scores.data() + kPad, n_important, n_rep);
        ASSERT_EQ(n, want_n) << "n_rep " << n_rep;
        for (int64_t i = 0; i < kPad; ++i) {
          ASSERT_EQ(row[static_cast<size_t>(i)], kGuard);
          ASSERT_EQ(row[static_cast<size_t>(kPad + count + i)], kGuard) << "written past the count";
          ASSERT_EQ(scores[static_cast<size_t>(kPad + count + i)], -3.0f);
        }
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(row[static_cast<size_t>(kPad + i)], want[static_cast<size_t>(i)]) << "n_rep " << n_rep;
          ASSERT_EQ(test::twin::bits(scores[static_cast<size_t>(kPad + i)]),
                    test::twin::bits(want_scores[static_cast<size_t>(i)]));
        }
      }
    }
    // nothing for a negative count, nor for an important row longer than the middle
    std::vector<int32_t> row(static_cast<size_t>(m + 4), kGuard);
    std::iota(row.begin(), row.begin() + m, static_cast<int32_t>(mid_begin));
    EXPECT_EQ(f.layer.add_representatives(0, mid_begin, mid_end, row.data(), nullptr, 0, -5), 0);
    EXPECT_EQ(f.layer.add_representatives(0, mid_begin, mid_end, row.data(), nullptr, m + 1, 3), m + 1);
    for (int64_t i = 0; i < m; ++i) ASSERT_EQ(row[static_cast<size_t>(i)], mid_begin + i);
  }
}

// --- through the C ABI on the CUDA backend -----------------------------------------------------------------------

using test::twin::expect_same;
using test::twin::kDim;
using test::twin::kHeads;
using test::twin::kQHeads;
using test::twin::label;
using test::twin::length_of;
using test::twin::select;
using test::twin::Selected;
using test::twin::stats_of;

/// Where the layer's importance comes from.
enum class Importance { kKeys, kObserved, kAccumulated };
const char* name_of(Importance i) {
  return i == Importance::kKeys ? "keys" : i == Importance::kObserved ? "observed window" : "accumulated";
}

struct Case {
  int32_t index;
  int32_t page_size;     // PAGE
  float exact_fraction;  // CLUSTER
  std::string name() const {
    if (index == KVRET_INDEX_QUANT) return "quant (representatives added on the host)";
    if (index == KVRET_INDEX_PQ) return "pq";
    if (index == KVRET_INDEX_EXACT) return "exact";
    return index == KVRET_INDEX_PAGE ? "page " + std::to_string(page_size)
                                     : "cluster exact " + std::to_string(exact_fraction);
  }
};
const Case kCases[] = {{KVRET_INDEX_PAGE, 16, 0.0f},   {KVRET_INDEX_PAGE, 5, 0.0f}, {KVRET_INDEX_CLUSTER, 0, 0.0f},
                       {KVRET_INDEX_CLUSTER, 0, 0.1f}, {KVRET_INDEX_PQ, 0, 0.0f},   {KVRET_INDEX_QUANT, 0, 0.0f},
                       {KVRET_INDEX_EXACT, 0, 0.0f}};

kvret_config crush_config(const Case& c, int32_t device_type, int kv, float share, Importance imp,
                          int32_t buckets = 0) {
  kvret_config cfg = test::small_config(c.index);
  cfg.device_type = device_type;
  cfg.kv_dtype = kv;
  cfg.background_build = 0;
  cfg.hamming_fraction = share;
  cfg.hamming_buckets = buckets;
  cfg.hamming_importance = imp == Importance::kAccumulated ? KVRET_IMPORTANCE_ACCUMULATED : KVRET_IMPORTANCE_WINDOW;
  if (c.index == KVRET_INDEX_PAGE) {
    cfg.page_size = c.page_size;
  } else if (c.index == KVRET_INDEX_CLUSTER) {
    cfg.cluster_tokens = 12;
    cfg.cluster_decode_interval = 24;
    cfg.cluster_decode_k = 3;
    cfg.cluster_segment_tokens = 96;
    cfg.cluster_exact_fraction = c.exact_fraction;
  }
  return cfg;
}

/// The same call on both sequences (dev's tensors labelled CUDA, cpu's CPU), the same status.
template <class Tensor, class Call>
void both(kvret_seq* dev, kvret_seq* cpu, Tensor& t, const Call& call) {
  label(t, KVRET_DEVICE_CUDA);
  const kvret_status a = call(dev, &t.t);
  label(t, KVRET_DEVICE_CPU);
  const kvret_status b = call(cpu, &t.t);
  ASSERT_EQ(a, KVRET_OK) << kvret_last_error();
  ASSERT_EQ(b, KVRET_OK) << kvret_last_error();
}

void append_both(kvret_seq* dev, kvret_seq* cpu, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  k.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed);
  v.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed + 1);
  k.refresh();
  v.refresh();
  for (const auto& [s, device] : {std::pair{dev, KVRET_DEVICE_CUDA}, std::pair{cpu, KVRET_DEVICE_CPU}}) {
    label(k, device);
    label(v, device);
    for (int32_t l = 0; l < 2; ++l) test::expect_ok(kvret_append_prefill(s, l, &k.t, &v.t));
  }
}

/// The importance inputs of `imp` into both sequences: an observed query window, or one step of attention.
void observe_both(kvret_seq* dev, kvret_seq* cpu, Importance imp, uint64_t seed) {
  const int64_t length = length_of(dev);
  for (int32_t l = 0; l < 2; ++l) {
    if (imp == Importance::kObserved) {
      const int64_t w = std::min<int64_t>(length, 1 + static_cast<int64_t>(seed % 12));
      F32 q({w, kQHeads, kDim});
      q.data = test::random_vector(static_cast<size_t>(w * kQHeads * kDim), seed + static_cast<uint64_t>(l), 2.0f);
      q.refresh();
      both(dev, cpu, q, [&](kvret_seq* s, const kvret_tensor* t) { return kvret_seq_observe(s, l, t); });
    } else if (imp == Importance::kAccumulated) {
      const int64_t n = std::max<int64_t>(1, length - static_cast<int64_t>(seed % 5));
      F32 p({kQHeads, n});
      std::mt19937_64 g(seed + static_cast<uint64_t>(l));
      for (auto& x : p.data) x = static_cast<float>(g() % 1000) / 1000.0f;
      p.refresh();
      both(dev, cpu, p, [&](kvret_seq* s, const kvret_tensor* t) { return kvret_seq_observe_attention(s, l, t); });
    }
  }
}

class DeviceKvCrush : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(kvret::cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

/// One random walk of steps on a device and a CPU sequence: appends (prefill chunks and one-token decodes),
/// truncates, drop_fronts, forks, importance inputs, and selects whose positions and scores must be equal bit for
/// bit. Returns the selects that added representatives.
int random_walk(const Case& c, int kv, float share, Importance imp, int32_t buckets, uint64_t seed, int steps) {
  const std::string where = c.name() + " kv " + std::to_string(kv) + " share " + std::to_string(share) + " " +
                            name_of(imp) + " buckets " + std::to_string(buckets);
  SCOPED_TRACE(where);
  const kvret_config dc = crush_config(c, KVRET_DEVICE_CUDA, kv, share, imp, buckets);
  const kvret_config cc = crush_config(c, KVRET_DEVICE_CPU, kv, share, imp, buckets);
  auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
  kvret_seq *a = nullptr, *b = nullptr;
  test::twin::open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
  append_both(a, b, 160 + c.page_size, seed);
  if (imp != Importance::kKeys) observe_both(a, b, imp, seed + 3);
  std::mt19937_64 rng(seed);
  int with_reps = 0;
  for (int step = 0; step < steps; ++step) {
    const int64_t length = length_of(a);
    EXPECT_EQ(length, length_of(b));
    const uint64_t op = rng() % 24;
    const std::string at = where + " step " + std::to_string(step);
    if (op == 0 && length > 100) {
      test::twin::truncate_both(a, b, length, 40, rng);
    } else if (op == 1 && length > 120) {
      test::twin::drop_front_both(a, b, 30, rng);
    } else if (op == 2) {
      kvret_seq *fa = nullptr, *fb = nullptr;
      test::twin::fork_both(a, b, fa, fb);
      if (rng() % 2 == 0) std::swap(a, fa), std::swap(b, fb);  // go on with the fork, or the parent
      append_both(fa, fb, 3, 500 + static_cast<uint64_t>(step));
      test::expect_ok(kvret_seq_close(fa));
      test::expect_ok(kvret_seq_close(fb));
    } else if (op == 3) {
      // a sequence with KVCrush's state cannot be saved: both refuse alike, and nothing changes
      const std::string id = "devcrush-" + std::to_string(step);
      const kvret_status sa = kvret_session_save(a, id.c_str()), sb = kvret_session_save(b, id.c_str());
      EXPECT_EQ(sa, KVRET_ERR_UNSUPPORTED) << at;
      EXPECT_EQ(sb, KVRET_ERR_UNSUPPORTED) << at;
    } else if (op == 4 && imp != Importance::kKeys) {
      observe_both(a, b, imp, 2000 + static_cast<uint64_t>(step));
    } else if (op < 10) {
      const int64_t tokens = op < 7 ? 1 : 1 + static_cast<int64_t>(rng() % 30);  // decodes and chunks
      append_both(a, b, tokens, 1000 + static_cast<uint64_t>(step));
    } else {
      const int32_t layer = static_cast<int32_t>(rng() % 2);
      const int64_t middle = length - dc.n_sink - dc.n_local;
      const uint64_t kind = rng() % 5;
      const int64_t budget = kind == 0   ? 1
                             : kind == 1 ? length  // past the middle: the whole middle
                             : kind == 2 ? middle
                             : kind == 3 ? 2 + static_cast<int64_t>(rng() % 6)
                                         : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(middle));
      const std::vector<float> q = test::random_vector(kQHeads * kDim, 9000 + static_cast<uint64_t>(step), 2.0f);
      const bool scored = rng() % 4 != 0;
      const int64_t width = std::min(budget, middle) + static_cast<int64_t>(rng() % 3);
      const Selected x = select(a, KVRET_DEVICE_CUDA, layer, q, static_cast<int32_t>(budget), width, scored);
      const Selected y = select(b, KVRET_DEVICE_CPU, layer, q, static_cast<int32_t>(budget), width, scored);
      EXPECT_EQ(x.count, std::min(budget, middle)) << at;
      expect_same(x, y, at);
      if (::testing::Test::HasFatalFailure()) return with_reps;
      const BudgetSplit split = split_budget(std::min(budget, middle), share, buckets);
      if (split.representatives > 0) {
        ++with_reps;
        // (QUANT: the host adds the representatives, and equality is the whole check)
        if (c.index != KVRET_INDEX_QUANT) {
          EXPECT_GT(stats_of(a).device_bytes, 0) << at << ": the select ran on the device";
        }
      }
    }
  }
  test::expect_ok(kvret_seq_close(a));
  test::expect_ok(kvret_seq_close(b));
  return with_reps;
}

TEST_F(DeviceKvCrush, EqualsTheCpuBackendUnderEveryChange) {
  uint64_t seed = 100;
  for (const Case& c : kCases)
    for (const int kv : {KVRET_KV_F32, KVRET_KV_F16})
      for (const float share : {0.25f, 0.5f})
        for (const Importance imp : {Importance::kKeys, Importance::kObserved, Importance::kAccumulated}) {
          const int reps = random_walk(c, kv, share, imp, 0, seed++, 60);
          ASSERT_FALSE(HasFatalFailure());
          EXPECT_GT(reps, 8);
        }
}

/// config.hamming_buckets caps the representatives: the device follows the same split.
TEST_F(DeviceKvCrush, EqualsTheCpuBackendWithBucketCaps) {
  uint64_t seed = 300;
  for (const Case& c : {kCases[0], kCases[3]})
    for (const int32_t buckets : {1, 3}) {
      const int reps = random_walk(c, KVRET_KV_F16, 0.5f, Importance::kKeys, buckets, seed++, 50);
      ASSERT_FALSE(HasFatalFailure());
      EXPECT_GT(reps, 5);
    }
}

/// device_bytes counts the device's copy of the signatures (one 64-bit word per token here: 2 KV heads, the keys'
/// proxy window), on top of the index's copy; a copy that would pass config.device_bytes_limit is not made, and
/// that select runs on the host with the same result.
TEST_F(DeviceKvCrush, DeviceBytesCountTheSignaturesAndTheLimitHolds) {
  const Case c{KVRET_INDEX_PAGE, 16, 0.0f};
  const int64_t tokens = 600;
  const std::vector<float> q = test::random_vector(kQHeads * kDim, 77, 2.0f);
  // the index's copy alone: the same select without representatives
  int64_t index_bytes = 0;
  {
    kvret_config plain = crush_config(c, KVRET_DEVICE_CUDA, KVRET_KV_F32, 0.0f, Importance::kKeys);
    kvret_config cpu = crush_config(c, KVRET_DEVICE_CPU, KVRET_KV_F32, 0.0f, Importance::kKeys);
    auto ctx = test::make_context(plain), cctx = test::make_context(cpu);
    kvret_seq *a = nullptr, *b = nullptr;
    test::twin::open_both(ctx.get(), cctx.get(), a, b);
    append_both(a, b, tokens, 31);
    (void)select(a, KVRET_DEVICE_CUDA, 0, q, 100, 100, true);
    index_bytes = stats_of(a).device_bytes;
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
  ASSERT_GT(index_bytes, 0);
  const int64_t signature_bytes = tokens * 8;  // at least every token's row
  for (const int64_t limit : {int64_t{0}, index_bytes + 2 * signature_bytes, signature_bytes / 2}) {
    SCOPED_TRACE(limit);
    kvret_config dc = crush_config(c, KVRET_DEVICE_CUDA, KVRET_KV_F32, 0.5f, Importance::kKeys);
    dc.device_bytes_limit = limit;
    const kvret_config cc = crush_config(c, KVRET_DEVICE_CPU, KVRET_KV_F32, 0.5f, Importance::kKeys);
    auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
    kvret_seq *a = nullptr, *b = nullptr;
    test::twin::open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, tokens, 31);
    expect_same(select(a, KVRET_DEVICE_CUDA, 0, q, 100, 100, true), select(b, KVRET_DEVICE_CPU, 0, q, 100, 100, true),
                "first select");
    const int64_t held = stats_of(a).device_bytes;
    if (limit != 0 && limit < signature_bytes) {
      EXPECT_EQ(held, 0) << "no copy past the limit: the host selected";
    } else {
      EXPECT_GE(held, index_bytes + signature_bytes);
      EXPECT_EQ((held - index_bytes) % 8, 0);
      if (limit != 0) {
        EXPECT_LE(held, limit);
      }
    }
    // decodes: the copy grows by the appended rows only, the results stay equal
    for (int step = 0; step < 30; ++step) {
      append_both(a, b, 1, 700 + static_cast<uint64_t>(step));
      expect_same(select(a, KVRET_DEVICE_CUDA, 0, q, 50, 52, step % 2 == 0),
                  select(b, KVRET_DEVICE_CPU, 0, q, 50, 52, step % 2 == 0), "decode " + std::to_string(step));
      ASSERT_FALSE(HasFatalFailure());
    }
    if (limit == 0) {  // (under the other limits the grown copy of the bounds may not fit: the host selects)
      EXPECT_GE(stats_of(a).device_bytes, index_bytes + (tokens + 30) * 8);
    } else {
      EXPECT_LE(stats_of(a).device_bytes, limit);
    }
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

/// What a batch of three sequences (200, 237 and 274 tokens: one set of passes) is run with.
struct CrushBatch {
  int64_t device_bytes_limit = 0;
  bool fused = true;       ///< every sequence selected on the device, as the passes of one select
  int host_sequence = -1;  ///< this sequence selected on the host (its signatures' copy was not made)
  bool nan_last = false;   ///< check_finite, and the last sequence's q holds a NaN: the batch is refused
};

/// The device bytes each of a batch's sequences holds after kvret_select_batch (layer 1, budget 50, half of it
/// representatives) on a context of `c`. The batch's positions equal one select per sequence on the device and the
/// CPU backend's batch; with w.fused it ran the passes of the first sequence's single select.
std::vector<int64_t> crush_batch(const Case& c, const CrushBatch& w) {
  constexpr int kSeqs = 3;
  kvret_config dc = crush_config(c, KVRET_DEVICE_CUDA, KVRET_KV_F16, 0.5f, Importance::kKeys);
  kvret_config cc = crush_config(c, KVRET_DEVICE_CPU, KVRET_KV_F16, 0.5f, Importance::kKeys);
  dc.device_bytes_limit = w.device_bytes_limit;
  dc.check_finite = cc.check_finite = w.nan_last ? 1 : 0;
  auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
  std::vector<kvret_seq*> a(kSeqs), b(kSeqs);
  for (int i = 0; i < kSeqs; ++i) {
    const auto u = static_cast<size_t>(i);
    test::twin::open_both(dev_ctx.get(), cpu_ctx.get(), a[u], b[u]);
    append_both(a[u], b[u], 200 + 37 * i, 40 + static_cast<uint64_t>(i));
  }
  const int32_t budget = 50;
  const int64_t width = 52;
  const int64_t per_seq = kQHeads * kDim;
  F32 q({kSeqs, kQHeads, kDim});
  q.data = test::random_vector(static_cast<size_t>(kSeqs * per_seq), 88, 2.0f);
  if (w.nan_last) q.data[static_cast<size_t>((kSeqs - 1) * per_seq + 5)] = std::numeric_limits<float>::quiet_NaN();
  q.refresh();
  std::vector<std::vector<int32_t>> rows[2];
  std::vector<int64_t> held(kSeqs);
  for (const int32_t device_type : {KVRET_DEVICE_CUDA, KVRET_DEVICE_CPU}) {
    const bool dev = device_type == KVRET_DEVICE_CUDA;
    const std::vector<kvret_seq*>& seqs = dev ? a : b;
    label(q, device_type);
    I32 out({kSeqs, kHeads, width}, -7);
    label(out, device_type);
    std::vector<int32_t> counts(kSeqs, -1);
    const int64_t passes_before = test::twin::device_passes(dev_ctx.get());
    const kvret_status status = kvret_select_batch(dev ? dev_ctx.get() : cpu_ctx.get(), kSeqs, seqs.data(), 1, &q.t,
                                                   budget, &out.t, counts.data());
    const int64_t batch_passes = test::twin::device_passes(dev_ctx.get()) - passes_before;
    if (w.nan_last) {  // refused before anything changed
      EXPECT_EQ(status, KVRET_ERR_NONFINITE) << "device " << device_type;
      EXPECT_EQ(counts, std::vector<int32_t>(kSeqs, -1));
      EXPECT_EQ(out.data, std::vector<int32_t>(out.data.size(), -7));
      if (dev)
        for (int i = 0; i < kSeqs; ++i)
          held[static_cast<size_t>(i)] = stats_of(seqs[static_cast<size_t>(i)]).device_bytes;
      continue;
    }
    test::expect_ok(status);
    for (int i = 0; i < kSeqs; ++i) {
      const auto u = static_cast<size_t>(i);
      EXPECT_EQ(counts[u], budget);
      const std::vector<int32_t> batched(out.data.begin() + i * kHeads * width,
                                         out.data.begin() + (i + 1) * kHeads * width);
      rows[dev ? 0 : 1].push_back(batched);
      if (!dev) continue;
      held[u] = stats_of(seqs[u]).device_bytes;
      if (i != w.host_sequence) {
        EXPECT_GT(held[u], 0) << "sequence " << i << " selected on the device";
      }
      const std::vector<float> qi(q.data.begin() + i * per_seq, q.data.begin() + (i + 1) * per_seq);
      const int64_t single_before = test::twin::device_passes(dev_ctx.get());
      const Selected single = select(a[u], KVRET_DEVICE_CUDA, 1, qi, budget, width, false);
      if (w.fused && i == 0) {
        EXPECT_GT(batch_passes, 0);
        EXPECT_EQ(batch_passes, test::twin::device_passes(dev_ctx.get()) - single_before)
            << "the batch of " << kSeqs << " ran the passes of one select";
      }
      EXPECT_EQ(single.count, counts[u]);
      EXPECT_EQ(batched, single.positions) << "sequence " << i;
    }
  }
  EXPECT_EQ(rows[0], rows[1]) << "device batch vs CPU batch";
  if (w.nan_last) {  // the signatures were not computed at the refused batch: later selects still equal the CPU's
    append_both(a[0], b[0], 40, 62);
    const std::vector<float> qi = test::random_vector(static_cast<size_t>(per_seq), 63, 2.0f);
    expect_same(select(a[0], KVRET_DEVICE_CUDA, 1, qi, 40, 40, true),
                select(b[0], KVRET_DEVICE_CPU, 1, qi, 40, 40, true), "after the refused batch");
  }
  for (int i = 0; i < kSeqs; ++i) {
    test::expect_ok(kvret_seq_close(a[static_cast<size_t>(i)]));
    test::expect_ok(kvret_seq_close(b[static_cast<size_t>(i)]));
  }
  return held;
}

/// kvret_select_batch with representatives equals one select per sequence on the device, and the CPU backend's,
/// and runs as the passes of one select (the important part's, then the representatives').
TEST_F(DeviceKvCrush, BatchEqualsSingleSelects) {
  for (const Case& c : {kCases[0], kCases[1], kCases[3], kCases[4], kCases[6]}) {
    SCOPED_TRACE(c.name());
    (void)crush_batch(c, {});
    ASSERT_FALSE(HasFatalFailure());
  }
}

/// A sequence of the batch whose copies (the index's, the signatures') would pass config.device_bytes_limit is
/// selected on the host; the rest of its set still selects on the device, together, with the same results.
TEST_F(DeviceKvCrush, BatchSelectsOnTheHostWhatDoesNotFit) {
  for (const Case& c : {kCases[6], kCases[0]}) {  // EXACT (the signatures' copies only), PAGE
    SCOPED_TRACE(c.name());
    const std::vector<int64_t> all = crush_batch(c, {});
    ASSERT_EQ(all.size(), 3U);
    ASSERT_GT(all[0], 0);
    // the longest two fit (the longest first), the shortest does not
    CrushBatch w;
    w.device_bytes_limit = all[2] + all[1] + all[0] / 2;
    w.fused = false;
    w.host_sequence = 0;
    const std::vector<int64_t> held = crush_batch(c, w);
    EXPECT_LE(held[0] + held[1] + held[2], w.device_bytes_limit);
    EXPECT_LT(held[0], all[0]) << "the shortest sequence's copies did not all fit";
    EXPECT_EQ(held[1], all[1]);
    EXPECT_EQ(held[2], all[2]);
  }
}

/// With check_finite, a batch with a non-finite q is refused before anything changes: no tensor written, no
/// signatures computed or copied (they come from the keys at the first select that goes on, as on the CPU backend).
TEST_F(DeviceKvCrush, NonFiniteQueryInABatchChangesNothing) {
  for (const Case& c : {kCases[0], kCases[6]}) {
    SCOPED_TRACE(c.name());
    CrushBatch w;
    w.nan_last = true;
    const std::vector<int64_t> held = crush_batch(c, w);
    EXPECT_EQ(held, std::vector<int64_t>(3, 0)) << "no copy made at the refused batch";
  }
}

/// A select refused for a non-finite q (config.check_finite) changes nothing: not the tensors, not the layer's
/// signatures (computed at the first select that goes on, from the keys it then holds, as on the CPU backend).
TEST_F(DeviceKvCrush, NonFiniteQueryLeavesTheSignaturesAsTheyWere) {
  for (const Case& c : {kCases[0], kCases[2]}) {
    SCOPED_TRACE(c.name());
    kvret_config dc = crush_config(c, KVRET_DEVICE_CUDA, KVRET_KV_F32, 0.5f, Importance::kKeys);
    kvret_config cc = crush_config(c, KVRET_DEVICE_CPU, KVRET_KV_F32, 0.5f, Importance::kKeys);
    dc.check_finite = cc.check_finite = 1;
    auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
    kvret_seq *a = nullptr, *b = nullptr;
    test::twin::open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, 300, 61);
    for (const auto& [s, device] : {std::pair{a, KVRET_DEVICE_CUDA}, std::pair{b, KVRET_DEVICE_CPU}}) {
      F32 q({kQHeads, kDim});
      q.data = test::random_vector(kQHeads * kDim, 6);
      q.data[static_cast<size_t>(3 * kDim + 1)] = std::numeric_limits<float>::quiet_NaN();
      q.refresh();
      I32 out({kHeads, 40}, -7);
      F32 sc({kHeads, 40}, -7.0f);
      label(q, device);
      label(out, device);
      label(sc, device);
      int32_t count = -1;
      EXPECT_EQ(kvret_select_scored(s, 0, &q.t, 40, &out.t, &sc.t, &count), KVRET_ERR_NONFINITE);
      EXPECT_EQ(count, -1);
      EXPECT_EQ(std::vector<int32_t>(out.data.begin(), out.data.end()), std::vector<int32_t>(2 * 40, -7));
      EXPECT_EQ(std::vector<float>(sc.data.begin(), sc.data.end()), std::vector<float>(2 * 40, -7.0f));
    }
    append_both(a, b, 40, 62);  // the keys' window of the first signatures: the last 32 of these
    const std::vector<float> q = test::random_vector(kQHeads * kDim, 63, 2.0f);
    for (const int32_t budget : {40, 7, 200}) {
      expect_same(select(a, KVRET_DEVICE_CUDA, 0, q, budget, budget, true),
                  select(b, KVRET_DEVICE_CPU, 0, q, budget, budget, true), "budget " + std::to_string(budget));
      ASSERT_FALSE(HasFatalFailure());
    }
    EXPECT_GT(stats_of(a).device_bytes, 0);
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

}  // namespace
