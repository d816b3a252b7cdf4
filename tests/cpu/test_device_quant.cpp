// The QUANT index's select on the CUDA backend's device (SpeCache's low-bit copy in device memory; docs/quant.md,
// docs/cuda_backend.md) and the single-source math it adds (kernels/math/quant_math.h):
// - the fold's softmax over tokens (token_softmax_terms with page_sum_prob_step, and page_max_step) against the CPU
//   core's fold_logits, bit for bit;
// - where the suite runs on the CUDA backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's OpenMP host
//   system): positions and scores bit for bit equal to the CPU backend's for bits 1 and 2, groups 32 and 64,
//   re-ranking 1 and 4, both folds, f32 and f16 stores, over random steps with appends, truncates, drop_fronts,
//   forks and saved sessions, budgets from 1 to past the middle; device_bytes counting the device's copy and
//   config.device_bytes_limit; the bytes one decode step sends to the copy (the change, not the copy);
//   kvret_select_batch equal to single selects.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "cpu_select.hpp"
#include "device_twin.hpp"
#include "engine/sequence.hpp"
#include "index/quant_retriever.hpp"
#include "kvret.h"
#include "math/quant_math.h"
#include "select/gqa_fold.hpp"
#include "test_util.hpp"

using namespace kvret;
namespace qm = kvret::cuda::math;

namespace {

using namespace test::twin;  // the twin sequences, their selects and the shared checks

/// The special values awkward_floats mixes in (zeros, the exponential's cut-off at -87, NaN, a subnormal, -Inf).
const std::vector<float> kAwkward = {0.0f,
                                     -0.0f,
                                     -87.0f,
                                     std::numeric_limits<float>::quiet_NaN(),
                                     -1e-40f,
                                     1e-30f,
                                     -std::numeric_limits<float>::infinity(),
                                     0.5f};

/// The header's fold of token logits [group, n] (what the device's QuantSoftmaxes and PageFold compute).
std::vector<float> header_token_fold(const std::vector<float>& logits, int group, int64_t n, kvret_gqa_fold fold) {
  return test::header_fold(logits, group, n, fold, [&](float* l) { return qm::token_softmax_terms(l, n); });
}

TEST(QuantMath, TokenFoldIsTheCpuFold) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 400; ++trial) {
    const int group = 1 + static_cast<int>(rng() % 8);
    const int64_t n = 1 + static_cast<int64_t>(rng() % 700);
    const bool awkward = trial % 3 == 0;
    std::vector<float> logits = awkward ? awkward_floats(static_cast<size_t>(group * n), rng(), -30.0f, 30.0f, kAwkward)
                                        : test::random_vector(static_cast<size_t>(group * n), rng(), 8.0f);
    if (trial % 50 == 1)  // a head without a finite maximum
      std::fill(logits.begin(), logits.begin() + n, -std::numeric_limits<float>::infinity());
    for (const kvret_gqa_fold fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
      std::vector<float> cpu(static_cast<size_t>(n));
      fold_logits(logits.data(), group, n, fold, cpu.data());
      const std::vector<float> header = header_token_fold(logits, group, n, fold);
      for (int64_t u = 0; u < n; ++u)
        ASSERT_TRUE(same_bits(header[static_cast<size_t>(u)], cpu[static_cast<size_t>(u)]))
            << "trial " << trial << " fold " << fold << " token " << u << ": " << header[static_cast<size_t>(u)]
            << " vs " << cpu[static_cast<size_t>(u)];
    }
  }
}

/// The version of the low-bit copy (the device mirror's key): every extend and cut makes a new one, and
/// blocks_changed_since names the first key block that may differ from an older version's (the blocks an extend
/// adds, the blocks a cut removes and a later extend quantizes anew), 0 for a version it does not know.
TEST(QuantRetrieverVersion, BlocksChangedSinceCoversEveryChange) {
  kvret_config c = test::small_config(KVRET_INDEX_QUANT);
  c.quant_group_size = 32;
  c.quant_residual = 20;
  c.background_build = 0;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  const auto index = [&]() -> const QuantRetriever& {
    EXPECT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
    return dynamic_cast<const QuantRetriever&>(sequence_from_handle(seq)->index(0));
  };
  const auto append = [&](int64_t tokens, uint64_t seed) {
    F32 k({tokens, 2, 64}), v({tokens, 2, 64});
    k.data = test::random_vector(static_cast<size_t>(tokens * 128), seed);
    v.data = test::random_vector(static_cast<size_t>(tokens * 128), seed + 1);
    k.refresh();
    v.refresh();
    for (int32_t l = 0; l < c.n_layers; ++l) test::expect_ok(kvret_append_prefill(seq, l, &k.t, &v.t));
  };
  append(500, 1);
  const uint64_t v0 = index().version();
  const int64_t b0 = index().blocks();
  ASSERT_GT(b0, 4);
  EXPECT_EQ(index().blocks_changed_since(v0), b0) << "nothing changed";
  EXPECT_EQ(index().blocks_changed_since(0), 0) << "an unknown version: every block";
  append(70, 3);  // at least two more blocks
  const uint64_t v1 = index().version();
  const int64_t b1 = index().blocks();
  EXPECT_NE(v1, v0);
  ASSERT_GT(b1, b0);
  EXPECT_EQ(index().blocks_changed_since(v0), b0) << "an extend changes only the blocks it adds";
  test::expect_ok(kvret_seq_truncate(seq, 450));
  const QuantRetriever& cut = index();
  EXPECT_NE(cut.version(), v1);
  const int64_t b2 = cut.blocks();
  ASSERT_LT(b2, b0);
  EXPECT_EQ(cut.blocks_changed_since(v1), b2) << "a cut changes the blocks from the first it removes";
  EXPECT_EQ(cut.blocks_changed_since(v0), b2);
  const uint64_t v2 = cut.version();
  append(100, 5);
  EXPECT_EQ(index().blocks_changed_since(v2), b2);
  EXPECT_EQ(index().blocks_changed_since(v1), b2) << "the older change counts too";
  test::expect_ok(kvret_seq_close(seq));
}

// --- the device select -------------------------------------------------------------------------------------------

struct QuantCase {
  int32_t bits, group, rerank;
  std::string name() const {
    return "bits " + std::to_string(bits) + " group " + std::to_string(group) + " rerank " + std::to_string(rerank);
  }
};

kvret_config quant_config(int32_t device_type, int kv, int fold, const QuantCase& q) {
  kvret_config c = twin_config(KVRET_INDEX_QUANT, device_type, kv, fold);
  c.quant_bits = q.bits;
  c.quant_group_size = q.group;
  c.quant_residual = 20;
  c.quant_rerank = q.rerank;
  return c;
}

class DeviceQuant : public test::twin::OnDevice {};

/// Positions and scores of the device select equal, bit for bit, the CPU backend's over random steps with appends
/// (prefill chunks and one-token decodes: new key blocks and a moving residual), truncates, drop_fronts, forks and
/// sessions saved and opened; budgets from 1 to past the middle; and the device select did run (its copy counts in
/// device_bytes).
TEST_F(DeviceQuant, EqualsTheCpuBackendUnderEveryChange) {
  const QuantCase cases[] = {{2, 64, 1}, {2, 32, 4}, {1, 32, 1}, {1, 64, 4}, {2, 64, 4}, {1, 32, 4}};
  int round = 0;
  for (const QuantCase& qc : cases) {
    for (const int kv : {KVRET_KV_F32, KVRET_KV_F16}) {
      for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
        const std::string where = qc.name() + " kv " + std::to_string(kv) + " fold " + std::to_string(fold);
        SCOPED_TRACE(where);
        const kvret_config dc = quant_config(KVRET_DEVICE_CUDA, kv, fold, qc);
        const kvret_config cc = quant_config(KVRET_DEVICE_CPU, kv, fold, qc);
        const auto r = static_cast<uint64_t>(round++);
        const int selects =
            walk_twins(dc, cc, 130 + 7 * static_cast<int64_t>(r), 21 + r, 7 + r, {60, 70, 40, "devquant"}, where);
        ASSERT_FALSE(HasFatalFailure());
        EXPECT_GT(selects, 10);
      }
    }
  }
}

/// The bytes of a layer's low-bit copy on the host (every head): what the device's copy holds at least.
int64_t copy_bytes_of(kvret_seq* seq, int32_t layer) {
  EXPECT_EQ(kvret_wait_index(seq, -1), KVRET_OK);
  return dynamic_cast<const QuantRetriever&>(sequence_from_handle(seq)->index(layer)).bytes();
}

/// device_bytes counts the device's copy (at least the host copy's bytes, per selected layer); a copy that would
/// pass config.device_bytes_limit is not made, and that select runs on the host with the same result.
TEST_F(DeviceQuant, DeviceBytesCountTheCopyAndTheLimitHolds) {
  const QuantCase qc{2, 32, 1};
  const int64_t tokens = 700;
  const std::vector<float> q = test::random_vector(8 * kDim, 79, 2.0f);
  auto cpu_ctx = test::make_context(quant_config(KVRET_DEVICE_CPU, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, qc));
  int64_t one_copy = 0;
  for (const int pass : {0, 1, 2}) {
    kvret_config dc = quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, qc);
    dc.device_bytes_limit = pass == 0 ? 0 : pass == 1 ? one_copy - 1 : 3 * one_copy / 2;
    SCOPED_TRACE(dc.device_bytes_limit);
    auto dev_ctx = test::make_context(dc);
    kvret_seq *a = nullptr, *b = nullptr;
    open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, dc.n_layers, tokens, 33);
    EXPECT_EQ(stats_of(a).device_bytes, 0);
    expect_same_select(a, b, 0, q, 90, 90, true, "layer 0");
    const int64_t host = copy_bytes_of(a, 0);
    ASSERT_GT(host, 0);
    const int64_t held = stats_of(a).device_bytes;
    if (pass == 0) {
      EXPECT_GE(held, host);
      one_copy = held;
    } else if (pass == 1) {
      EXPECT_EQ(held, 0) << "no copy past the limit";
    } else {
      EXPECT_EQ(held, one_copy);
    }
    expect_same_select(a, b, 1, q, 90, 90, true, "layer 1");
    const int64_t two = stats_of(a).device_bytes;
    if (pass == 0) {
      EXPECT_EQ(two, 2 * one_copy) << "one copy per layer";
    } else if (pass == 1) {
      EXPECT_EQ(two, 0);
    } else {
      EXPECT_EQ(two, one_copy) << "a second layer's copy would pass the limit";
    }
    test::expect_ok(kvret_seq_close(a));  // frees its copies
    test::expect_ok(kvret_seq_close(b));
  }
}

/// The bytes a select sends to an up-to-date copy after one decode step (stats.bytes_h2d, no re-ranking) are the
/// change: the f16 residual window, plus one key block and its value rows when the step completed a block; never
/// the whole copy.
TEST_F(DeviceQuant, OneDecodeStepSendsTheChange) {
  const QuantCase qc{2, 32, 1};
  const kvret_config dc = quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_MAX_LOGIT, qc);
  auto dev_ctx = test::make_context(dc);
  kvret_seq* a = nullptr;
  test::expect_ok(kvret_seq_open(dev_ctx.get(), &a));
  append_both(a, nullptr, dc.n_layers, 900, 34);
  const std::vector<float> q = test::random_vector(8 * kDim, 80, 2.0f);
  const int64_t block_bytes = kHeads * (int64_t{kDim} * qc.group * qc.bits / 8 + 4 * kDim +
                                        qc.group * (kDim * qc.bits / 8 + 4 * kDim / qc.group));
  int blocks_seen = 0;
  select(a, KVRET_DEVICE_CUDA, 0, q, 50, 50, false);  // the copy is made (with room for a quarter more blocks)
  const int64_t held = stats_of(a).device_bytes;
  for (int step = 0; step < 70; ++step) {
    const auto& index = dynamic_cast<const QuantRetriever&>(sequence_from_handle(a)->index(0));
    const int64_t blocks_before = index.blocks();
    append_both(a, nullptr, dc.n_layers, 1, 2000 + static_cast<uint64_t>(step));
    const int64_t before = stats_of(a).bytes_h2d;
    select(a, KVRET_DEVICE_CUDA, 0, q, 50, 50, false);
    const int64_t sent = stats_of(a).bytes_h2d - before;
    const int64_t residual_bytes = kHeads * index.head(0).residual_tokens() * kDim * 2 * 2;
    const int64_t new_blocks = index.blocks() - blocks_before;
    ASSERT_LE(new_blocks, 1);
    blocks_seen += static_cast<int>(new_blocks);
    EXPECT_EQ(sent, residual_bytes + new_blocks * block_bytes) << "step " << step;
    EXPECT_LT(sent, copy_bytes_of(a, 0) / 4) << "step " << step;
    ASSERT_EQ(stats_of(a).device_bytes, held) << "the copy was not made anew";
  }
  EXPECT_GE(blocks_seen, 2);
  test::expect_ok(kvret_seq_close(a));
}

/// kvret_select_batch over several sequences equals one select per sequence, and the CPU backend's, and runs the
/// passes of one select (the backend fuses it), with and without re-ranking.
TEST_F(DeviceQuant, BatchEqualsSingleSelects) {
  for (const QuantCase& qc : {QuantCase{2, 64, 1}, QuantCase{1, 32, 1}, QuantCase{1, 32, 4}}) {
    SCOPED_TRACE(qc.name());
    test::twin::Batch w;
    w.compare_backends = true;
    w.fused = true;
    ASSERT_NO_FATAL_FAILURE(test::twin::batch_equals_single_selects(
        quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, qc),
        quant_config(KVRET_DEVICE_CPU, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, qc), w));
  }
}

/// With re-ranking, sequences whose middles hold fewer than quant_rerank x budget tokens rank fewer candidates and
/// do not share their passes with the others: at a budget of 50 with 4 x re-ranking, middles of 180, 217 and 254
/// tokens (candidates 180, 200 and 200) run as two sets, with the same results.
TEST_F(DeviceQuant, RerankedBatchRunsInSetsOfOneCandidateCount) {
  test::twin::Batch w;
  w.budget = 50;
  w.width = 52;
  w.compare_backends = w.fused = w.single_on_each = true;
  w.select_sets = 2;
  ASSERT_NO_FATAL_FAILURE(test::twin::batch_equals_single_selects(
      quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, {2, 32, 4}),
      quant_config(KVRET_DEVICE_CPU, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, {2, 32, 4}), w));
}

/// A fused batch pads the shorter sequences' rows (logit -inf): with the first (shortest) sequence's q all NaN it
/// still selects that sequence's own tokens, as its single select and the CPU batch do, under both folds.
TEST_F(DeviceQuant, FusedBatchNeverSelectsThePadding) {
  for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
    SCOPED_TRACE(fold);
    test::twin::Batch w;
    w.length_step = 71;
    w.compare_backends = w.fused = w.nan_first = w.single_on_each = true;
    ASSERT_NO_FATAL_FAILURE(
        test::twin::batch_equals_single_selects(quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, fold, {2, 32, 1}),
                                                quant_config(KVRET_DEVICE_CPU, KVRET_KV_F16, fold, {2, 32, 1}), w));
    ASSERT_NO_FATAL_FAILURE(
        test::twin::batch_equals_single_selects(quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, fold, {1, 32, 4}),
                                                quant_config(KVRET_DEVICE_CPU, KVRET_KV_F16, fold, {1, 32, 4}), w));
  }
}

/// out of kvret_seq_attend into a tensor of `device_type` (q labelled so too), and the call's stats change.
struct Attended {
  std::vector<float> out;
  int64_t fetched_rows = 0;
};

Attended attend(kvret_seq* seq, int32_t device_type, int32_t layer, const std::vector<float>& q, int32_t budget,
                float scale) {
  F32 qt({8, kDim});
  qt.data = q;
  qt.refresh();
  label(qt, device_type);
  F32 out({8, kDim}, -7.0f);
  label(out, device_type);
  const int64_t before = stats_of(seq).fetched_rows;
  EXPECT_EQ(kvret_seq_attend(seq, layer, &qt.t, budget, scale, &out.t, nullptr), KVRET_OK) << kvret_last_error();
  return {out.data, stats_of(seq).fetched_rows - before};
}

/// Quantized attention (quant_attention = 1) with q and out in device memory runs on the device and writes, bit
/// for bit on Thrust's OpenMP system, the CPU backend's output (the same exponential there: std::exp), with the same
/// rows counted, over appends, truncates, forks and budgets from 1 to the whole middle.
TEST_F(DeviceQuant, AttentionEqualsTheCpuBackend) {
  const QuantCase cases[] = {{2, 64, 1}, {1, 32, 4}, {2, 32, 4}, {1, 64, 1}};
  int round = 0;
  for (const QuantCase& qc : cases) {
    for (const int kv : {KVRET_KV_F32, KVRET_KV_F16}) {
      for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
        const std::string where = qc.name() + " kv " + std::to_string(kv) + " fold " + std::to_string(fold);
        SCOPED_TRACE(where);
        kvret_config dc = quant_config(KVRET_DEVICE_CUDA, kv, fold, qc);
        kvret_config cc = quant_config(KVRET_DEVICE_CPU, kv, fold, qc);
        dc.quant_attention = cc.quant_attention = 1;
        auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
        kvret_seq *a = nullptr, *b = nullptr;
        open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
        append_both(a, b, dc.n_layers, 150 + 11 * round, 61 + static_cast<uint64_t>(round));
        std::mt19937_64 rng(17 + static_cast<uint64_t>(round++));
        int attends = 0;
        for (int step = 0; step < 30; ++step) {
          const int64_t length = length_of(a);
          const uint64_t op = rng() % 10;
          if (op == 0 && length > 120) {
            test::twin::truncate_both(a, b, length, 50, rng);
          } else if (op == 1) {
            kvret_seq *fa = nullptr, *fb = nullptr;
            test::twin::fork_both(a, b, fa, fb);
            std::swap(a, fa), std::swap(b, fb);
            test::expect_ok(kvret_seq_close(fa));
            test::expect_ok(kvret_seq_close(fb));
          } else if (op < 5) {
            append_both(a, b, dc.n_layers, op < 4 ? 1 : 1 + static_cast<int64_t>(rng() % 40),
                        3000 + static_cast<uint64_t>(step));
          } else {
            const int32_t layer = static_cast<int32_t>(rng() % 2);
            const int64_t middle = length - dc.n_sink - dc.n_local;
            const uint64_t kind = rng() % 3;
            const auto budget =
                static_cast<int32_t>(kind == 0   ? 1
                                     : kind == 1 ? middle
                                                 : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(middle)));
            const float scale = rng() % 2 == 0 ? 0.0f : 0.07f;
            const std::vector<float> q = test::random_vector(8 * kDim, 7000 + static_cast<uint64_t>(step), 2.0f);
            const Attended x = attend(a, KVRET_DEVICE_CUDA, layer, q, budget, scale);
            const Attended y = attend(b, KVRET_DEVICE_CPU, layer, q, budget, scale);
            const std::string at = where + " step " + std::to_string(step);
            ASSERT_EQ(x.fetched_rows, y.fetched_rows) << at;
            for (size_t i = 0; i < x.out.size(); ++i)
              ASSERT_TRUE(same_bits(x.out[i], y.out[i]))
                  << at << " element " << i << ": " << x.out[i] << " vs " << y.out[i];
            EXPECT_GT(stats_of(a).device_bytes, 0) << at << ": the attention ran on the device";
            ++attends;
          }
        }
        EXPECT_GT(attends, 5);
        test::expect_ok(kvret_seq_close(a));
        test::expect_ok(kvret_seq_close(b));
      }
    }
  }
}

/// Where the device copy would pass config.device_bytes_limit, quantized attention runs on the host, with the same
/// output, and keeps no device memory.
TEST_F(DeviceQuant, AttentionPastTheLimitRunsOnTheHost) {
  const QuantCase qc{2, 32, 4};
  kvret_config dc = quant_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, qc);
  kvret_config cc = quant_config(KVRET_DEVICE_CPU, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, qc);
  dc.quant_attention = cc.quant_attention = 1;
  dc.device_bytes_limit = 1024;  // far below the copy of 400 tokens
  auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
  kvret_seq *a = nullptr, *b = nullptr;
  open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
  append_both(a, b, dc.n_layers, 400, 71);
  ASSERT_GT(copy_bytes_of(a, 0), dc.device_bytes_limit);
  const std::vector<float> q = test::random_vector(8 * kDim, 72, 2.0f);
  const Attended x = attend(a, KVRET_DEVICE_CUDA, 0, q, 40, 0.0f);
  const Attended y = attend(b, KVRET_DEVICE_CPU, 0, q, 40, 0.0f);
  EXPECT_EQ(stats_of(a).device_bytes, 0);
  EXPECT_EQ(x.fetched_rows, y.fetched_rows);
  for (size_t i = 0; i < x.out.size(); ++i) ASSERT_TRUE(same_bits(x.out[i], y.out[i])) << i;
  test::expect_ok(kvret_seq_close(a));
  test::expect_ok(kvret_seq_close(b));
}

}  // namespace
