// kvret_fetch_batch_async on the CUDA backend (KVRET_TEST_DEVICE=cuda): the batch is gathered in one pass, and
// what it writes and counts equals one kvret_fetch_async per sequence (another context of the same backend, given
// the same appends) and the CPU backend's working sets, over steps of random appends, truncates and selections of
// different sizes, the block caches cold at first and warm later. With a row source the batch goes through host
// copies (no gather pass on the device), with the same results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "engine/context.hpp"
#include "fetch/working_set.hpp"
#include "kvret.h"
#include "position_rows.hpp"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int kHeads = 2, kDim = 64, kLayer = 0;
constexpr int32_t kN = 4;

int64_t passes(kvret_context* ctx) { return context_from_handle(ctx)->backend().gather_passes(); }

std::vector<int64_t> fetch_stats(const kvret_seq* seq) {
  kvret_stats s;
  kvret_stats_init(&s);
  EXPECT_EQ(kvret_seq_stats(seq, &s), KVRET_OK) << kvret_last_error();
  return {s.fetches, s.fetched_rows, s.cache_hits, s.cache_misses, s.prefetch_hits, s.bytes_h2d, s.host_bytes};
}

/// `t` labelled as CPU memory (the CPU backend's context).
kvret_tensor on_cpu(kvret_tensor t) {
  t.device = {KVRET_DEVICE_CPU, 0};
  return t;
}
kvret_working_set on_cpu(kvret_working_set w) { return {on_cpu(w.k), on_cpu(w.v), on_cpu(w.positions)}; }

/// Every byte of a working set's buffers.
std::vector<std::byte> bytes_of(const test::WorkingSetBuffers& b) {
  std::vector<std::byte> out;
  const auto add = [&](const void* p, size_t n) {
    const auto* q = static_cast<const std::byte*>(p);
    out.insert(out.end(), q, q + n);
  };
  add(b.k.data.data(), b.k.data.size() * sizeof(float));
  add(b.v.data.data(), b.v.data.size() * sizeof(float));
  add(b.positions.data.data(), b.positions.data.size() * sizeof(int32_t));
  return out;
}

std::unique_ptr<test::WorkingSetBuffers> filled(kvret_seq* seq, int32_t count) {
  auto b = std::make_unique<test::WorkingSetBuffers>(seq, kLayer, count, kHeads, kDim);
  std::fill(b->k.data.begin(), b->k.data.end(), -7.0f);
  std::fill(b->v.data.begin(), b->v.data.end(), -7.0f);
  std::fill(b->positions.data.begin(), b->positions.data.end(), -7);
  return b;
}

/// Serves every position divisible by 3: its key row all `position`, its value row all `-position` (f32 rows).
class ThirdPositions final : public RowSource {
 public:
  const char* name() const noexcept override { return "every third position"; }
  int64_t serve(const RowRequest& r) const override { return test::serve_position_rows(r, 3); }
};

/// (kv_dtype, with a row source)
class FusedFetchBatch : public ::testing::TestWithParam<std::tuple<int32_t, bool>> {};

TEST_P(FusedFetchBatch, OnePassEqualToOneFetchPerSequenceAndToTheCpuBackend) {
  if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "the CUDA backend's fused gather";
  const auto [kv_dtype, with_source] = GetParam();
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.n_layers = 1;
  c.kv_dtype = kv_dtype;
  kvret_config cpu = c;
  cpu.device_type = KVRET_DEVICE_CPU;
  test::ContextPtr batched_ctx = test::make_context(c), single_ctx = test::make_context(c),
                   cpu_ctx = test::make_context(cpu);
  if (with_source)
    for (kvret_context* x : {batched_ctx.get(), single_ctx.get(), cpu_ctx.get()})
      context_from_handle(x)->add_row_source(std::make_shared<ThirdPositions>());
  // three copies of each sequence: batched (CUDA), single fetches (CUDA), the CPU backend's
  std::vector<kvret_seq*> batched(kN), single(kN), host(kN);
  for (int32_t i = 0; i < kN; ++i) {
    test::expect_ok(kvret_seq_open(batched_ctx.get(), &batched[i]));
    test::expect_ok(kvret_seq_open(single_ctx.get(), &single[i]));
    test::expect_ok(kvret_seq_open(cpu_ctx.get(), &host[i]));
  }
  std::mt19937_64 rng(static_cast<uint64_t>(kv_dtype) * 1000 + (with_source ? 5 : 17));
  const auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const auto append = [&](int32_t i, int64_t tokens) {
    F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
    k.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), rng());
    v.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), rng());
    k.refresh();
    v.refresh();
    test::expect_ok(kvret_append_prefill(batched[i], kLayer, &k.t, &v.t));
    test::expect_ok(kvret_append_prefill(single[i], kLayer, &k.t, &v.t));
    const kvret_tensor hk = on_cpu(k.t), hv = on_cpu(v.t);
    test::expect_ok(kvret_append_prefill(host[i], kLayer, &hk, &hv));
  };
  std::vector<int64_t> length(kN);
  for (int32_t i = 0; i < kN; ++i) {
    length[i] = uniform(150, 1200);
    append(i, length[i]);
  }
  int64_t hits = 0;
  for (int step = 0; step < 8; ++step) {
    if (step > 0) {
      for (int32_t i = 0; i < kN; ++i) {
        if (uniform(0, 3) == 0) {
          length[i] = std::max<int64_t>(80, length[i] - uniform(1, 90));
          test::expect_ok(kvret_seq_truncate(batched[i], length[i]));
          test::expect_ok(kvret_seq_truncate(single[i], length[i]));
          test::expect_ok(kvret_seq_truncate(host[i], length[i]));
        } else {
          const int64_t t = uniform(1, 40);
          append(i, t);
          length[i] += t;
        }
      }
    }
    // a budget per sequence (0 on some steps), the positions drawn from the middle, ascending per head, by a draw
    // that repeats every third step (so that cached blocks are asked for again)
    std::vector<int32_t> counts(kN);
    for (int32_t i = 0; i < kN; ++i) counts[i] = uniform(0, 4) == 0 ? 0 : static_cast<int32_t>(uniform(1, 48));
    const int32_t width = std::max(1, *std::max_element(counts.begin(), counts.end()));
    I32 positions({kN, kHeads, width}, -1);
    std::vector<I32> rows_of;
    for (int32_t i = 0; i < kN; ++i) {
      I32 row({kHeads, width}, -1);
      const int64_t lo = c.n_sink, hi = length[i] - c.n_local;
      for (int h = 0; h < kHeads; ++h) {
        std::vector<int32_t> all;
        for (int64_t p = lo; p < hi; ++p) all.push_back(static_cast<int32_t>(p));
        std::mt19937_64 pick(static_cast<uint64_t>(i * 7 + h + (step % 3)));  // repeats across steps: warm blocks
        std::shuffle(all.begin(), all.end(), pick);
        all.resize(static_cast<size_t>(counts[i]));
        std::sort(all.begin(), all.end());
        std::copy(all.begin(), all.end(), row.data.begin() + h * width);
      }
      row.refresh();
      std::copy(row.data.begin(), row.data.end(), positions.data.begin() + i * kHeads * width);
      rows_of.push_back(std::move(row));
    }
    positions.refresh();
    std::vector<std::unique_ptr<test::WorkingSetBuffers>> out_b, out_s, out_h;
    std::vector<kvret_working_set> ws_b;
    std::vector<std::vector<int64_t>> before_b, before_s;
    for (int32_t i = 0; i < kN; ++i) {
      out_b.push_back(filled(batched[i], counts[i]));
      out_s.push_back(filled(single[i], counts[i]));
      out_h.push_back(filled(host[i], counts[i]));
      ws_b.push_back(out_b.back()->ws);
      before_b.push_back(fetch_stats(batched[i]));
      before_s.push_back(fetch_stats(single[i]));
    }
    std::vector<int64_t> rows_b(kN, -1), rows_s(kN, -1), rows_h(kN, -1);
    const int64_t passes_before = passes(batched_ctx.get());
    test::expect_ok(kvret_fetch_batch_async(batched_ctx.get(), kN, batched.data(), kLayer, &positions.t, counts.data(),
                                            ws_b.data(), rows_b.data(), nullptr));
    EXPECT_EQ(passes(batched_ctx.get()) - passes_before, with_source ? 0 : 1)
        << "step " << step << (with_source ? ": host copies" : ": one gather pass for the batch");
    for (int32_t i = 0; i < kN; ++i) {
      test::expect_ok(
          kvret_fetch_async(single[i], kLayer, &rows_of[i].t, counts[i], &out_s[i]->ws, &rows_s[i], nullptr));
      const kvret_tensor hp = on_cpu(rows_of[i].t);
      const kvret_working_set hw = on_cpu(out_h[i]->ws);
      test::expect_ok(kvret_fetch_async(host[i], kLayer, &hp, counts[i], &hw, &rows_h[i], nullptr));
    }
    EXPECT_EQ(rows_b, rows_s) << "step " << step;
    EXPECT_EQ(rows_b, rows_h) << "step " << step;
    for (int32_t i = 0; i < kN; ++i) {
      EXPECT_EQ(rows_b[i], c.n_sink + counts[i] + c.n_local);
      std::vector<int64_t> d_b = fetch_stats(batched[i]), d_s = fetch_stats(single[i]);
      for (size_t k = 0; k < d_b.size(); ++k) {
        d_b[k] -= before_b[static_cast<size_t>(i)][k];
        d_s[k] -= before_s[static_cast<size_t>(i)][k];
      }
      EXPECT_EQ(d_b, d_s) << "step " << step << ", sequence " << i;
      hits += d_b[2];
      EXPECT_TRUE(bytes_of(*out_b[i]) == bytes_of(*out_s[i])) << "step " << step << ", sequence " << i;
      EXPECT_TRUE(bytes_of(*out_b[i]) == bytes_of(*out_h[i])) << "step " << step << ", sequence " << i << " (CPU)";
    }
  }
  EXPECT_GT(hits, 0) << "the caches served rows on the later steps";
  for (int32_t i = 0; i < kN; ++i) {
    kvret_seq_close(batched[i]);
    kvret_seq_close(single[i]);
    kvret_seq_close(host[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypesAndSources, FusedFetchBatch,
                         ::testing::Combine(::testing::Values(KVRET_KV_F32, KVRET_KV_F16), ::testing::Bool()));

}  // namespace
