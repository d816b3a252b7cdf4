// The EXACT index's select on the CUDA backend's device (docs/cuda_backend.md) and the math it shares with the CPU
// retriever (kernels/math/exact_math.h):
// - always: the header's logit is the CPU's dot product (vec_math.hpp's dot and scaled_dots) bit for bit, and
//   ExactRetriever::select's scores are the header's logits, over f32, f16 and bf16 stores and GQA groups;
// - where the suite runs on the CUDA backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's OpenMP host
//   system): positions and scores bit for bit equal to the CPU backend's over f32, f16 and bf16 stores, GQA groups
//   of 1, 2 and 4, both folds, every budget from 1 to the middle, and random appends, truncates, drop_fronts, forks
//   and saved sessions; kvret_select_batch; a non-finite q under check_finite; and that the select did run on the
//   device: it reads every middle key over the bus (stats.bytes_h2d) and keeps no device copy (device_bytes 0).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "cpu_select.hpp"
#include "device_twin.hpp"
#include "index/exact_retriever.hpp"
#include "kvret.h"
#include "math/exact_math.h"
#include "store/host_kv_store.hpp"
#include "test_util.hpp"

using namespace kvret;

namespace {

using namespace test::twin;  // the twin sequences, their selects and the shared checks

/// Random floats of many magnitudes (2^-14 to 2^10, within f16's range) and both signs, some of them zeros and
/// subnormals, so that the order of the sums shows.
std::vector<float> wide_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-14, 10);
  std::vector<float> out(n);
  for (auto& x : out) {
    const uint64_t r = rng() % 32;
    x = r == 0 ? 0.0f : r == 1 ? -0.0f : r == 2 ? 1e-40f : std::ldexp(mantissa(rng), exponent(rng));
  }
  return out;
}

TEST(ExactMath, LogitIsTheCpuDot) {
  std::mt19937_64 rng(3);
  for (const int d : {1, 3, 7, 8, 9, 15, 16, 17, 64, 100, 128, 256}) {
    for (int trial = 0; trial < 200; ++trial) {
      const std::vector<float> q = wide_floats(static_cast<size_t>(d), rng());
      const std::vector<float> k = wide_floats(static_cast<size_t>(d), rng());
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      const float header = cuda::math::exact_logit(scale, q.data(), k.data(), d);
      ASSERT_TRUE(same_bits(header, scale * dot(q.data(), k.data(), d))) << "d " << d << " trial " << trial;
      float blocked = 0.0f;
      scaled_dots(q.data(), d, 1, k.data(), d, 1, d, scale, &blocked, 1);
      ASSERT_TRUE(same_bits(header, blocked)) << "d " << d << " trial " << trial;
    }
  }
}

/// ExactRetriever::select (CPU) scores every middle token by the header's logit: with the whole middle taken under
/// MAX_LOGIT its scores are, per position, the largest of the group's exact_logit on the stored key (as f32).
TEST(ExactMath, CpuSelectScoresAreTheHeaderLogits) {
  constexpr int kH = 2, kD = 64;
  const int64_t n = 700, begin = 4, end = 680;  // the middle crosses pages and ends inside one
  for (const DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    for (const int group : {1, 2, 4}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " group " + std::to_string(group));
      HostKvStore store{kH, kD, dtype};
      F32 k({n, kH, kD}), v({n, kH, kD});
      k.data = wide_floats(static_cast<size_t>(n * kH * kD), 11 + static_cast<uint64_t>(group));
      k.refresh();
      store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), n, true);
      ExactRetriever index;
      index.extend(store, begin, end, true, 2);
      const int q_heads = kH * group;
      const std::vector<float> q = wide_floats(static_cast<size_t>(q_heads * kD), 5 + static_cast<uint64_t>(group));
      const test::HeadsSelected s =
          test::select_heads(index, store, q, kH, kD, group, begin, end, end - begin, KVRET_FOLD_MAX_LOGIT);
      ASSERT_EQ(s.count, s.req.budget);
      const SelectRequest& req = s.req;
      const auto& rows = s.rows;
      const auto& scores = s.scores;
      std::vector<float> key(kD);
      for (int h = 0; h < kH; ++h)
        for (int64_t i = 0; i < req.budget; ++i) {
          ASSERT_EQ(rows[static_cast<size_t>(h)][static_cast<size_t>(i)], begin + i);
          store.keys_f32(h, begin + i, begin + i + 1, key.data());
          float best = -std::numeric_limits<float>::infinity();
          for (int g = 0; g < group; ++g)
            best = std::max(best, cuda::math::exact_logit(req.scale, q.data() + (h * group + g) * kD, key.data(), kD));
          ASSERT_TRUE(same_bits(scores[static_cast<size_t>(h)][static_cast<size_t>(i)], best))
              << "head " << h << " position " << begin + i;
        }
    }
  }
}

// --- the device select -------------------------------------------------------------------------------------------

kvret_config exact_config(int32_t device_type, int kv, int fold, int q_heads) {
  kvret_config c = twin_config(KVRET_INDEX_EXACT, device_type, kv, fold);
  c.n_q_heads = q_heads;
  return c;
}

class DeviceExact : public test::twin::OnDevice {};

/// Positions and scores of the device select equal, bit for bit, the CPU backend's over random steps with appends
/// (prefill chunks and one-token decodes), truncates, drop_fronts, forks and sessions saved and opened; budgets from
/// 1 to past the middle; every store type, GQA group and fold; and each select ran on the device (it read every
/// middle key, and there is no device copy).
TEST_F(DeviceExact, EqualsTheCpuBackendUnderEveryChange) {
  int round = 0;
  for (const int kv : {KVRET_KV_F32, KVRET_KV_F16, KVRET_KV_BF16})
    for (const int q_heads : {2, 4, 8})
      for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
        const std::string where =
            "kv " + std::to_string(kv) + " q heads " + std::to_string(q_heads) + " fold " + std::to_string(fold);
        SCOPED_TRACE(where);
        const kvret_config dc = exact_config(KVRET_DEVICE_CUDA, kv, fold, q_heads);
        const kvret_config cc = exact_config(KVRET_DEVICE_CPU, kv, fold, q_heads);
        Walk w{50, 70, 40, "devexact"};
        w.reads_keys = true;
        const auto r = static_cast<uint64_t>(round++);
        const int selects = walk_twins(dc, cc, 240 + 13 * static_cast<int64_t>(r), 51 + r, 17 + r, w, where);
        ASSERT_FALSE(HasFatalFailure());
        EXPECT_GT(selects, 8);
      }
}

/// Every budget from 1 to the middle (and past it), scored and not, on a middle that spans three store pages.
TEST_F(DeviceExact, EveryBudgetEqualsTheCpuBackend) {
  for (const int kv : {KVRET_KV_BF16, KVRET_KV_F32}) {
    SCOPED_TRACE(kv);
    const kvret_config dc = exact_config(KVRET_DEVICE_CUDA, kv, KVRET_FOLD_SUM_PROB, 4);
    auto dev_ctx = test::make_context(dc);
    auto cpu_ctx = test::make_context(exact_config(KVRET_DEVICE_CPU, kv, KVRET_FOLD_SUM_PROB, 4));
    kvret_seq *a = nullptr, *b = nullptr;
    open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, 1, 560, 61);
    const int64_t middle = 560 - dc.n_sink - dc.n_local;
    const std::vector<float> q = test::random_vector(4 * kDim, 62, 2.0f);
    for (int64_t budget = 1; budget <= middle + 1; ++budget) {
      const bool scored = budget % 2 == 1;
      const int64_t width = std::min(budget, middle) + budget % 3;
      const Selected x = select(a, KVRET_DEVICE_CUDA, 0, q, static_cast<int32_t>(budget), width, scored);
      const Selected y = select(b, KVRET_DEVICE_CPU, 0, q, static_cast<int32_t>(budget), width, scored);
      ASSERT_EQ(x.count, std::min(budget, middle));
      expect_same(x, y, "budget " + std::to_string(budget));
    }
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

/// The select reads the keys where they are: device_bytes stays 0 (no copy), and each device select adds the middle
/// keys' bytes to bytes_h2d, a select of host-labelled tensors (which the host runs) nothing, with the same result.
TEST_F(DeviceExact, ReadsTheKeysInPlaceAndCountsThem) {
  for (const int kv : {KVRET_KV_F16, KVRET_KV_F32}) {
    const kvret_config dc = exact_config(KVRET_DEVICE_CUDA, kv, KVRET_FOLD_MAX_LOGIT, 8);
    auto dev_ctx = test::make_context(dc);
    kvret_seq* a = nullptr;
    test::expect_ok(kvret_seq_open(dev_ctx.get(), &a));
    append_both(a, nullptr, dc.n_layers, 300, 71);
    const std::vector<float> q = test::random_vector(8 * kDim, 72, 2.0f);
    for (int step = 0; step < 3; ++step) {
      const int64_t middle = test::twin::length_of(a) - dc.n_sink - dc.n_local;
      const int64_t before = stats_of(a).bytes_h2d;
      const Selected on_device = select(a, KVRET_DEVICE_CUDA, 1, q, 40, 40, true);
      EXPECT_EQ(stats_of(a).bytes_h2d - before, kHeads * middle * kDim * test::twin::key_bytes(kv)) << "step " << step;
      EXPECT_EQ(stats_of(a).device_bytes, 0);
      const int64_t after = stats_of(a).bytes_h2d;
      const Selected on_host = select(a, KVRET_DEVICE_CUDA_HOST, 1, q, 40, 40, true);
      EXPECT_EQ(stats_of(a).bytes_h2d, after) << "the host selected";
      expect_same(on_device, on_host, "step " + std::to_string(step));
      append_both(a, nullptr, dc.n_layers, 1 + 100 * step, 73 + static_cast<uint64_t>(step));
    }
    test::expect_ok(kvret_seq_close(a));
  }
}

/// kvret_select_batch over several sequences equals one select per sequence, and the CPU backend's batch; the
/// device batch read every middle key (and the CPU one nothing).
TEST_F(DeviceExact, BatchEqualsSingleSelects) {
  for (const int q_heads : {2, 8}) {
    SCOPED_TRACE(q_heads);
    test::twin::Batch w;
    w.q_heads = q_heads;
    w.length_step = 80;
    w.seed = 80;
    w.reads_keys = w.single_on_each = w.compare_backends = w.fused = true;
    ASSERT_NO_FATAL_FAILURE(test::twin::batch_equals_single_selects(
        exact_config(KVRET_DEVICE_CUDA, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, q_heads),
        exact_config(KVRET_DEVICE_CPU, KVRET_KV_F16, KVRET_FOLD_SUM_PROB, q_heads), w));
  }
}

/// A fused batch pads the shorter sequences' rows: a sequence whose q is all NaN (every logit NaN, the lowest order
/// key) still selects its own lowest positions, never the padding, as its single select and the CPU batch do.
TEST_F(DeviceExact, FusedBatchNeverSelectsThePadding) {
  for (const int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
    SCOPED_TRACE(fold);
    test::twin::Batch w;
    w.q_heads = 4;
    w.length_step = 61;
    w.seed = 90;
    w.reads_keys = w.single_on_each = w.compare_backends = w.fused = w.nan_first = true;
    ASSERT_NO_FATAL_FAILURE(
        test::twin::batch_equals_single_selects(exact_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, fold, 4),
                                                exact_config(KVRET_DEVICE_CPU, KVRET_KV_F32, fold, 4), w));
  }
}

/// Sequences whose middles differ more than twofold do not share their passes (the padding would cost more than
/// the rows): middles of about 180, 580 and 980 tokens run as two sets, the two longest together, the shortest
/// alone, with the same results.
TEST_F(DeviceExact, SkewedBatchRunsInSetsOfSimilarLength) {
  test::twin::Batch w;
  w.q_heads = 4;
  w.length_step = 400;
  w.reads_keys = w.single_on_each = w.compare_backends = w.fused = true;
  w.select_sets = 2;
  ASSERT_NO_FATAL_FAILURE(
      test::twin::batch_equals_single_selects(exact_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 4),
                                              exact_config(KVRET_DEVICE_CPU, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 4), w));
}

/// Under check_finite a q with a NaN or an Inf is KVRET_ERR_NONFINITE: nothing written, nothing read or counted;
/// the next select with a finite q runs as before.
TEST_F(DeviceExact, NonFiniteQueryWritesNothing) {
  kvret_config dc = exact_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, KVRET_FOLD_SUM_PROB, 8);
  dc.check_finite = 1;
  auto dev_ctx = test::make_context(dc);
  kvret_seq* a = nullptr;
  test::expect_ok(kvret_seq_open(dev_ctx.get(), &a));
  append_both(a, nullptr, dc.n_layers, 260, 91);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    F32 q({8, kDim});
    q.data = test::random_vector(8 * kDim, 92, 2.0f);
    q.data[5 * kDim + 17] = bad;
    q.refresh();
    I32 out({kHeads, 20}, -7);
    F32 scores({kHeads, 20}, -7.0f);
    const kvret_stats before = stats_of(a);
    int32_t count = -1;
    EXPECT_EQ(kvret_select_scored(a, 0, &q.t, 20, &out.t, &scores.t, &count), KVRET_ERR_NONFINITE);
    EXPECT_EQ(count, -1);
    for (const int32_t p : out.data) EXPECT_EQ(p, -7);
    for (const float s : scores.data) EXPECT_EQ(s, -7.0f);
    EXPECT_EQ(stats_of(a).bytes_h2d, before.bytes_h2d);
    EXPECT_EQ(stats_of(a).selections, before.selections);
  }
  const std::vector<float> q = test::random_vector(8 * kDim, 93, 2.0f);
  EXPECT_EQ(select(a, KVRET_DEVICE_CUDA, 0, q, 20, 20, true).count, 20);
  test::expect_ok(kvret_seq_close(a));
}

}  // namespace
