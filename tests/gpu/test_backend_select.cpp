// The CUDA backend's selects that take the tuned top-k of kernels/topk_select (EXACT, QUANT with and without
// re-ranking, PQ's per-token path) through the C API against the CPU backend's, on a GPU: the positions and scores
// of kvret_select_scored and the positions of kvret_select_batch (one set of passes for three sequences of
// different lengths) must be equal bit for bit, with tied keys and one sequence's q all NaN.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvret.h"

namespace kvret::cuda::testing {
namespace {

constexpr int32_t kQHeads = 8, kKvHeads = 2, kDim = 128;

struct SelectCase {
  const char* name;
  int32_t index, rerank, fold;
};

struct Selections {
  std::vector<int32_t> positions, counts, batch_positions, batch_counts;
  std::vector<float> scores;
};

/// Keys and values [tokens, kKvHeads, kDim] from `seed`; every seventh key repeats the one three before it, so
/// that equal scores must be ordered by position.
std::vector<float> prefill_rows(int64_t tokens, uint64_t seed, bool keys) {
  std::vector<float> x = random_normal<float>(static_cast<size_t>(tokens * kKvHeads * kDim), seed);
  if (keys)
    for (int64_t t = 6; t < tokens; t += 7)
      std::memcpy(&x[static_cast<size_t>(t * kKvHeads * kDim)], &x[static_cast<size_t>((t - 3) * kKvHeads * kDim)],
                  sizeof(float) * kKvHeads * kDim);
  return x;
}

/// A tensor of `shape` over `data` in `device`'s memory.
kvret_tensor tensor(void* data, int32_t device, const std::vector<int64_t>& shape, kvret_dtype dtype) {
  kvret_tensor t{};
  t.data = data;
  t.device = {device, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = shape.data();
  return t;
}

/// Three sequences of `lengths` on a context of `device`: each selected alone (scored), then all in one batch.
Selections select_on(int32_t device, const SelectCase& c, const std::vector<int64_t>& lengths, int32_t budget) {
  kvret_config config;
  EXPECT_EQ(kvret_config_init(&config), KVRET_OK);
  config.n_layers = 1;
  config.n_q_heads = kQHeads;
  config.n_kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.index_kind = c.index;
  config.gqa_fold = c.fold;
  config.background_build = 0;
  if (c.index == KVRET_INDEX_QUANT) config.quant_rerank = c.rerank;
  config.device_type = device;
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&config, &ctx), KVRET_OK) << kvret_last_error();
  Selections out;
  if (ctx == nullptr) return out;
  const bool gpu = device == KVRET_DEVICE_CUDA;
  const kvret_dtype f32{KVRET_DTYPE_FLOAT, 32, 1}, i32{KVRET_DTYPE_INT, 32, 1};
  const auto n = static_cast<int32_t>(lengths.size());
  std::vector<kvret_seq*> seqs(lengths.size(), nullptr);
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(kvret_seq_open(ctx, &seqs[i]), KVRET_OK) << kvret_last_error();
    std::vector<float> k = prefill_rows(lengths[i], 10 + i, true), v = prefill_rows(lengths[i], 20 + i, false);
    DeviceBuffer<float> dk(gpu ? k.size() : 0), dv(gpu ? v.size() : 0);
    if (gpu) {
      dk.upload(k);
      dv.upload(v);
    }
    const std::vector<int64_t> shape = {lengths[i], kKvHeads, kDim};
    const kvret_tensor tk = tensor(gpu ? dk.get() : k.data(), device, shape, f32);
    const kvret_tensor tv = tensor(gpu ? dv.get() : v.data(), device, shape, f32);
    EXPECT_EQ(kvret_append_prefill(seqs[i], 0, &tk, &tv), KVRET_OK) << kvret_last_error();
  }
  std::vector<float> q = random_normal<float>(static_cast<size_t>(n) * kQHeads * kDim, 99, 2.0f);
  for (size_t e = 0; e < static_cast<size_t>(kQHeads * kDim); ++e) q[e] = std::numeric_limits<float>::quiet_NaN();
  const size_t rows = static_cast<size_t>(n) * kKvHeads * budget;
  DeviceBuffer<float> dq(gpu ? q.size() : 0), dscores(gpu ? rows : 0);
  DeviceBuffer<int32_t> dpos(gpu ? rows : 0), dbatch(gpu ? rows : 0);
  if (gpu) {
    dq.upload(q);
    dpos.upload(std::vector<int32_t>(rows, -7));
    dbatch.upload(std::vector<int32_t>(rows, -7));
    dscores.upload(std::vector<float>(rows, -7.0f));
  }
  out.positions.assign(rows, -7);
  out.batch_positions.assign(rows, -7);
  out.scores.assign(rows, -7.0f);
  float* q_base = gpu ? dq.get() : q.data();
  int32_t* pos_base = gpu ? dpos.get() : out.positions.data();
  float* score_base = gpu ? dscores.get() : out.scores.data();
  const std::vector<int64_t> q_shape = {kQHeads, kDim}, row_shape = {kKvHeads, budget};
  out.counts.assign(lengths.size(), -1);
  for (size_t i = 0; i < lengths.size(); ++i) {
    const size_t at = i * kKvHeads * budget;
    const kvret_tensor tq = tensor(q_base + i * kQHeads * kDim, device, q_shape, f32);
    const kvret_tensor tp = tensor(pos_base + at, device, row_shape, i32);
    const kvret_tensor ts = tensor(score_base + at, device, row_shape, f32);
    EXPECT_EQ(kvret_select_scored(seqs[i], 0, &tq, budget, &tp, &ts, &out.counts[i]), KVRET_OK) << kvret_last_error();
  }
  const std::vector<int64_t> batch_q = {n, kQHeads, kDim}, batch_rows = {n, kKvHeads, budget};
  const kvret_tensor tq = tensor(q_base, device, batch_q, f32);
  const kvret_tensor tp = tensor(gpu ? dbatch.get() : out.batch_positions.data(), device, batch_rows, i32);
  out.batch_counts.assign(lengths.size(), -1);
  EXPECT_EQ(kvret_select_batch(ctx, n, seqs.data(), 0, &tq, budget, &tp, out.batch_counts.data()), KVRET_OK)
      << kvret_last_error();
  EXPECT_EQ(kvret_synchronize(ctx, nullptr), KVRET_OK) << kvret_last_error();
  if (gpu) {
    out.positions = dpos.download();
    out.scores = dscores.download();
    out.batch_positions = dbatch.download();
  }
  for (kvret_seq* s : seqs) EXPECT_EQ(kvret_seq_close(s), KVRET_OK);
  EXPECT_EQ(kvret_destroy(ctx), KVRET_OK);
  return out;
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

class BackendSelect : public GpuTest {};

TEST_F(BackendSelect, TunedTopkSelectsAsTheCpuBackend) {
  const SelectCase cases[] = {
      {"exact, sum-prob", KVRET_INDEX_EXACT, 1, KVRET_FOLD_SUM_PROB},
      {"exact, max-logit", KVRET_INDEX_EXACT, 1, KVRET_FOLD_MAX_LOGIT},
      {"quant", KVRET_INDEX_QUANT, 1, KVRET_FOLD_SUM_PROB},
      {"quant, re-ranked 4x", KVRET_INDEX_QUANT, 4, KVRET_FOLD_SUM_PROB},
      {"pq 4 x 6 bits (per token)", KVRET_INDEX_PQ, 1, KVRET_FOLD_SUM_PROB},
  };
  const std::vector<int64_t> lengths = {20000, 15000, 11000};  // within a factor of two: one set of passes
  for (const SelectCase& c : cases)
    for (const int32_t budget : {1, 700}) {
      SCOPED_TRACE(std::string(c.name) + ", budget " + std::to_string(budget));
      const Selections want = select_on(KVRET_DEVICE_CPU, c, lengths, budget);
      const Selections got = select_on(KVRET_DEVICE_CUDA, c, lengths, budget);
      EXPECT_EQ(got.counts, want.counts);
      EXPECT_EQ(got.positions, want.positions);
      EXPECT_EQ(bits_of(got.scores), bits_of(want.scores));
      EXPECT_EQ(got.batch_counts, want.batch_counts);
      EXPECT_EQ(got.batch_positions, want.batch_positions);
      EXPECT_EQ(got.batch_positions, want.positions) << "the batch selects as the single selects";
    }
}

}  // namespace
}  // namespace kvret::cuda::testing
