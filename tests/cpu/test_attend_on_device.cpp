// kvret_seq_attend with its selection kept on the device (docs/cuda_backend.md), where the suite runs on the CUDA
// backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's OpenMP host system). Four twins take the same calls:
// kvret_seq_attend on a CUDA context with q in device memory (the selection stays on the device); kvret_select +
// kvret_fetch_async + kvret_attend on a CUDA context (the select on the device, its positions copied to the host);
// kvret_seq_attend on a CUDA context with q in pinned host memory (the host select); and a CPU context. Over random
// appends, truncates, drop_fronts, forks and budgets the CUDA twins' outputs are equal bit for bit (the CPU's within
// 1e-5: its attention sums in another order), and the stats (read after the steps: hits, misses, bytes loaded into
// the block cache) equal. The backend's host waits are counted: a warm decode step of the device path makes none.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "engine/context.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;

namespace {

constexpr int kQHeads = 8;
constexpr int kHeads = 2;
constexpr int kDim = 64;

class AttendOnDevice : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(kvret::cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

kvret_config twin_config(int kind, int32_t device_type, int kv_dtype, float hamming_fraction = 0.0f) {
  kvret_config c = test::small_config(kind);
  c.device_type = device_type;
  c.kv_dtype = kv_dtype;
  c.hamming_fraction = hamming_fraction;  // > 0: KVCrush's representatives (PAGE, CLUSTER, PQ add them on the device)
  c.block_tokens = 16;
  c.cache_capacity_tokens = 8 * 16;  // few slots: blocks are evicted and admitted again
  c.background_build = 0;
  c.cluster_reuse_steps = 0;  // ClusterKV's resident clusters serve rows on the host: kvret_seq_attend's host path
  return c;
}

int64_t waits(kvret_context* ctx) { return context_from_handle(ctx)->backend().host_waits(); }

int64_t length_of(kvret_seq* seq) {
  int64_t n = 0;
  EXPECT_EQ(kvret_seq_length(seq, 0, &n), KVRET_OK) << kvret_last_error();
  return n;
}

kvret_stats stats_of(kvret_seq* seq) {
  kvret_stats s;
  kvret_stats_init(&s);
  EXPECT_EQ(kvret_seq_stats(seq, &s), KVRET_OK) << kvret_last_error();
  return s;
}

/// One twin: a context, its sequence, and where its q and out say they are.
struct Twin {
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  int32_t q_device = KVRET_DEVICE_CUDA;
  int32_t out_device = KVRET_DEVICE_CUDA;
};

void append(Twin& t, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  k.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed);
  v.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed + 1);
  k.refresh();
  v.refresh();
  k.t.device = v.t.device = {t.out_device, 0};
  for (int32_t l = 0; l < 2; ++l) test::expect_ok(kvret_append_prefill(t.seq, l, &k.t, &v.t));
}

std::vector<float> attend(Twin& t, int32_t layer, const std::vector<float>& q, int32_t budget, float scale) {
  F32 qt({kQHeads, kDim}), out({kQHeads, kDim}, -3.0f);
  qt.data = q;
  qt.refresh();
  qt.t.device = {t.q_device, 0};
  out.t.device = {t.out_device, 0};
  EXPECT_EQ(kvret_seq_attend(t.seq, layer, &qt.t, budget, scale, &out.t, nullptr), KVRET_OK) << kvret_last_error();
  return out.data;
}

/// Today's three calls on a twin: kvret_select into a tensor of the twin's device (the select on the device),
/// kvret_fetch_async (which copies the positions to the host to check them) and kvret_attend.
std::vector<float> select_fetch_attend(Twin& t, int32_t layer, const std::vector<float>& q, int32_t budget,
                                       float scale) {
  F32 qt({kQHeads, kDim}), out({kQHeads, kDim}, -3.0f);
  qt.data = q;
  qt.refresh();
  int32_t width = budget;
  if (budget == KVRET_BUDGET_DEFAULT) {
    EXPECT_EQ(kvret_seq_budget(t.seq, layer, &width), KVRET_OK);
  }
  test::I32 selected({kHeads, std::max(width, 1)});
  int32_t count = 0;
  EXPECT_EQ(kvret_select(t.seq, layer, &qt.t, budget, &selected.t, &count), KVRET_OK) << kvret_last_error();
  test::WorkingSetBuffers ws(t.seq, layer, count, kHeads, kDim);
  int64_t rows = 0;
  EXPECT_EQ(kvret_fetch_async(t.seq, layer, &selected.t, count, &ws.ws, &rows, nullptr), KVRET_OK)
      << kvret_last_error();
  EXPECT_EQ(kvret_attend(t.ctx.get(), &qt.t, &ws.k.t, &ws.v.t, rows, scale, &out.t, nullptr), KVRET_OK)
      << kvret_last_error();
  return out.data;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Outputs bit for bit equal to today's select + fetch + attend with the select on the device and to kvret_seq_attend
/// with q in pinned memory (the host select), and within 1e-5 of the CPU backend's; stats and block-cache counts
/// equal to select + fetch + attend's, over a random walk of edits and budgets; the device path makes at least one
/// host wait fewer per call.
TEST_P(AttendOnDevice, EqualsTheHostPathAndTheCpuBackend) {
  const int kind = GetParam();
  for (const auto& [kv, crush] : {std::pair{KVRET_KV_F32, 0.0f}, {KVRET_KV_F16, 0.0f}, {KVRET_KV_F32, 0.25f}}) {
    SCOPED_TRACE("kv_dtype " + std::to_string(kv) + " hamming_fraction " + std::to_string(crush));
    std::mt19937_64 rng(77 + static_cast<uint64_t>(kind * 10 + kv) + (crush > 0 ? 5 : 0));
    Twin dev{test::make_context(twin_config(kind, KVRET_DEVICE_CUDA, kv, crush))};
    Twin split{test::make_context(twin_config(kind, KVRET_DEVICE_CUDA, kv, crush))};  // select, fetch, attend
    Twin host{test::make_context(twin_config(kind, KVRET_DEVICE_CUDA, kv, crush))};
    host.q_device = KVRET_DEVICE_CUDA_HOST;  // the select runs on the host: positions through the host
    Twin cpu{test::make_context(twin_config(kind, KVRET_DEVICE_CPU, kv, crush)), nullptr, KVRET_DEVICE_CPU,
             KVRET_DEVICE_CPU};
    Twin* twins[] = {&dev, &split, &host, &cpu};
    for (Twin* t : twins) {
      test::expect_ok(kvret_seq_open(t->ctx.get(), &t->seq));
      append(*t, 700, 5);
    }
    int attends = 0;
    int64_t dev_waits = 0, split_waits = 0;
    bool hits = false;
    for (int step = 0; step < 70; ++step) {
      const std::string at = "step " + std::to_string(step);
      const int64_t length = length_of(dev.seq);
      const uint64_t op = rng() % 16;
      if (op == 0 && length > 300) {
        const int64_t to = length - 1 - static_cast<int64_t>(rng() % 60);
        for (Twin* t : twins) test::expect_ok(kvret_seq_truncate(t->seq, to));
      } else if (op == 1 && length > 300) {
        const int64_t keep = static_cast<int64_t>(rng() % 40), count = 1 + static_cast<int64_t>(rng() % 40);
        for (Twin* t : twins) test::expect_ok(kvret_seq_drop_front(t->seq, keep, count));
      } else if (op == 2) {
        const bool child = rng() % 2 == 0;  // go on with the fork, or the parent
        for (Twin* t : twins) {
          kvret_seq* f = nullptr;
          test::expect_ok(kvret_seq_fork(t->seq, &f));
          if (child) std::swap(t->seq, f);
          test::expect_ok(kvret_seq_close(f));
        }
      } else if (op < 8) {
        const int64_t tokens = op < 6 ? 1 : 1 + static_cast<int64_t>(rng() % 40);
        for (Twin* t : twins) append(*t, tokens, 1000 + static_cast<uint64_t>(step));
      } else {
        const int32_t layer = static_cast<int32_t>(rng() % 2);
        const int64_t middle = length - 4 - 16;
        const uint64_t b = rng() % 4;
        const int32_t budget = b == 0   ? 1
                               : b == 1 ? static_cast<int32_t>(length)  // past the middle
                               : b == 2 ? KVRET_BUDGET_DEFAULT
                                        : 1 + static_cast<int32_t>(rng() % static_cast<uint64_t>(middle));
        const float scale = rng() % 2 == 0 ? 0.0f : 0.3f;
        // a few queries again and again: their blocks come back, and the cache serves them
        const std::vector<float> q = test::random_vector(kQHeads * kDim, 9000 + rng() % 3, 2.0f);
        const int64_t w0 = waits(dev.ctx.get());
        const std::vector<float> a = attend(dev, layer, q, budget, scale);
        const int64_t w1 = waits(dev.ctx.get());
        const std::vector<float> s3 = select_fetch_attend(split, layer, q, budget, scale);
        const int64_t w2 = waits(dev.ctx.get());
        const std::vector<float> h = attend(host, layer, q, budget, scale);
        const std::vector<float> c = attend(cpu, layer, q, budget, scale);
        ASSERT_TRUE(same_bits(a, s3)) << at << ": the device path and select + fetch + attend differ";
        ASSERT_TRUE(same_bits(a, h)) << at << ": the device path and the host path differ";
        // the CUDA backend's attention passes sum in another order than the CPU's: within 1e-5 (docs/cuda_backend.md)
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_NEAR(a[i], c[i], 1e-5f * std::max(1.0f, std::fabs(c[i]))) << at << ": element " << i;
        dev_waits += w1 - w0;
        split_waits += w2 - w1;
        ++attends;
      }
      const kvret_stats x = stats_of(dev.seq), y = stats_of(split.seq), z = stats_of(cpu.seq);
      const kvret_stats hs = stats_of(host.seq);
      // the stats' fields `fields` of x and of `other`, one assertion each
      const auto same = [&](const kvret_stats& other, std::initializer_list<int64_t kvret_stats::*> fields,
                            const char* which) {
        for (const auto field : fields) EXPECT_EQ(x.*field, other.*field) << at << " (" << which << ")";
      };
      same(y,
           {&kvret_stats::selections, &kvret_stats::fetches, &kvret_stats::fetched_rows, &kvret_stats::cache_hits,
            &kvret_stats::cache_misses, &kvret_stats::bytes_h2d, &kvret_stats::prefetch_hits,
            &kvret_stats::cluster_reuse_rows},
           "split");
      EXPECT_EQ(x.cache_hits + x.cache_misses, x.fetched_rows) << at;
      hits = hits || x.cache_hits > 0;
      // the host path's select uploads no device copy of the index: its bytes_h2d is not compared
      same(hs, {&kvret_stats::cache_hits, &kvret_stats::cache_misses, &kvret_stats::fetched_rows}, "host");
      same(z, {&kvret_stats::selections, &kvret_stats::fetches, &kvret_stats::fetched_rows}, "cpu");
      if (::testing::Test::HasFailure()) return;
    }
    EXPECT_GT(attends, 10);
    EXPECT_TRUE(hits) << "the block cache served rows";
    // select + fetch waits for the select's outputs and the positions it checks; the device path does not
    if (kind != KVRET_INDEX_QUANT || crush == 0.0f) {  // QUANT adds no representatives on the device: host path
      EXPECT_LE(dev_waits + attends, split_waits) << "the device path ran";
    }
    for (Twin* t : twins) test::expect_ok(kvret_seq_close(t->seq));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, AttendOnDevice,
                         ::testing::Values(KVRET_INDEX_PAGE, KVRET_INDEX_PQ, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT),
                         [](const ::testing::TestParamInfo<int>& p) {
                           switch (p.param) {
                             case KVRET_INDEX_PAGE:
                               return std::string("Page");
                             case KVRET_INDEX_PQ:
                               return std::string("Pq");
                             case KVRET_INDEX_CLUSTER:
                               return std::string("Cluster");
                             default:
                               return std::string("Quant");
                           }
                         });

/// A steady decode step of kvret_seq_attend (the index's device copy and the block cache warm) makes no host wait
/// for PAGE, QUANT (re-ranking its candidates by keys read on the device), PQ, CLUSTER and EXACT, whose selects run
/// on the device without one (AttendOnDevice.EqualsTheHostPathAndTheCpuBackend checks that the device path runs);
/// nor does the same step with q in pinned host memory (the host select reads q in place, and the gather from host
/// positions counts the block cache's rows on the device). Reading the stats afterwards waits, and folds the
/// device's counts in.
TEST_F(AttendOnDevice, SteadyDecodeStepMakesNoHostWait) {
  for (const int kind : {KVRET_INDEX_PAGE, KVRET_INDEX_QUANT, KVRET_INDEX_PQ, KVRET_INDEX_CLUSTER, KVRET_INDEX_EXACT}) {
    SCOPED_TRACE(kind);
    kvret_config c = twin_config(kind, KVRET_DEVICE_CUDA, KVRET_KV_F16);
    Twin dev{test::make_context(c)};
    test::expect_ok(kvret_seq_open(dev.ctx.get(), &dev.seq));
    append(dev, 1200, 3);
    const int32_t budget = 64;
    for (int step = 0; step < 12; ++step) {
      append(dev, 1, 100 + static_cast<uint64_t>(step));
      for (int32_t layer = 0; layer < 2; ++layer) {
        const std::vector<float> q = test::random_vector(kQHeads * kDim, 7, 2.0f);  // one query: the same blocks
        const int64_t before = waits(dev.ctx.get());
        attend(dev, layer, q, budget, 0.0f);
        if (step >= 2) {
          EXPECT_EQ(waits(dev.ctx.get()) - before, 0) << "step " << step << " layer " << layer;
        }
        dev.q_device = KVRET_DEVICE_CUDA_HOST;  // the path through host positions
        const int64_t host_before = waits(dev.ctx.get());
        attend(dev, layer, q, budget, 0.0f);
        if (step >= 2) {
          EXPECT_EQ(waits(dev.ctx.get()) - host_before, 0) << "step " << step << " layer " << layer << ", host path";
        }
        dev.q_device = KVRET_DEVICE_CUDA;
      }
    }
    const int64_t before = waits(dev.ctx.get());
    const kvret_stats s = stats_of(dev.seq);
    EXPECT_GT(waits(dev.ctx.get()), before) << "reading the stats reads the device's counts";
    EXPECT_GT(s.cache_hits, 0);
    EXPECT_EQ(s.cache_hits + s.cache_misses, s.fetched_rows);
    test::expect_ok(kvret_seq_close(dev.seq));
  }
}

}  // namespace
