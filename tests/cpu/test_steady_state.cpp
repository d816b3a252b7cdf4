// The steady state of a decode step on the CUDA backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's
// OpenMP host system, which counts what a GPU would do), for every index kind at batch 1, 8 and 64, in the two
// shapes an engine runs it: kvret_append_decode then kvret_seq_attend per sequence (q and out in device memory), or
// kvret_append_decode per sequence then one kvret_select_batch and one kvret_fetch_batch_async for the batch. After
// a warm-up a step makes no allocation (its temporaries come from the stream's workspace), no pageable copy (its
// uploads go through the stream's pinned staging ring) and no page lookup (the page tables are kept), and its passes
// and host waits do not grow with the context. Each run prints its counts per step (docs/cuda_backend.md's table).
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "engine/context.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;

namespace {

constexpr int kHeads = 2, kDim = 64, kQHeads = 8;
constexpr int32_t kBudget = 32;
constexpr int64_t kPrefill = 600;  // the decode steps below stay inside the store's third page (512-767)
constexpr int kWarmSteps = 3, kSteps = 4;

Backend::DeviceCounts counts_of(kvret_context* ctx) { return context_from_handle(ctx)->backend().device_counts(); }

Backend::DeviceCounts minus(const Backend::DeviceCounts& a, const Backend::DeviceCounts& b) {
  return {a.host_waits - b.host_waits,           a.passes - b.passes,   a.allocations - b.allocations,
          a.pageable_copies - b.pageable_copies, a.uploads - b.uploads, a.page_lookups - b.page_lookups};
}

const char* kind_name(int kind) {
  switch (kind) {
    case KVRET_INDEX_EXACT:
      return "exact";
    case KVRET_INDEX_PQ:
      return "pq";
    case KVRET_INDEX_CLUSTER:
      return "cluster";
    case KVRET_INDEX_QUANT:
      return "quant";
    case KVRET_INDEX_PAGE:
      return "page";
    default:
      return "?";
  }
}

class SteadyState : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(kvret::cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
    const auto [kind, batch] = GetParam();
    kind_ = kind;
    batch_ = batch;
    kvret_config c = test::small_config(kind);
    c.n_layers = 1;
    c.device_type = KVRET_DEVICE_CUDA;
    c.background_build = 0;
    c.cluster_reuse_steps = 0;  // ClusterKV's resident clusters serve rows on the host
    c.block_tokens = 16;
    c.cache_capacity_tokens = 8 * 16;
    ctx_ = test::make_context(c);
    ASSERT_NE(ctx_, nullptr);
    seqs_.assign(static_cast<size_t>(batch), nullptr);
    F32 k({kPrefill, kHeads, kDim}), v({kPrefill, kHeads, kDim});
    for (int i = 0; i < batch; ++i) {
      test::clustered_kv(kPrefill, kHeads, kDim, 100 + static_cast<uint64_t>(i), k, v);
      test::expect_ok(kvret_seq_open(ctx_.get(), &seqs_[static_cast<size_t>(i)]));
      test::expect_ok(kvret_append_prefill(seqs_[static_cast<size_t>(i)], 0, &k.t, &v.t));
    }
  }
  void TearDown() override {
    for (kvret_seq* seq : seqs_) kvret_seq_close(seq);
  }

  /// Appends step s's key and value (device memory) to every sequence of the batch.
  void append_step(int s) {
    F32 dk({1, kHeads, kDim}), dv({1, kHeads, kDim});
    for (int i = 0; i < batch_; ++i) {
      const uint64_t seed = 1000 * static_cast<uint64_t>(s) + static_cast<uint64_t>(i);
      dk.data = test::random_vector(dk.data.size(), seed);
      dv.data = test::random_vector(dv.data.size(), seed + 1);
      dk.refresh();
      dv.refresh();
      test::expect_ok(kvret_append_decode(seqs_[static_cast<size_t>(i)], 0, &dk.t, &dv.t));
    }
  }

  /// Runs `step` for the warm-up steps (the first must allocate: it sizes the workspace), then for the measured
  /// ones, asserting the steady state's budget; prints the counts of one step under `label`.
  template <class Step>
  void expect_steady(const char* label, const Step& step) {
    const Backend::DeviceCounts cold = counts_of(ctx_.get());
    step(0);
    EXPECT_GT(minus(counts_of(ctx_.get()), cold).allocations, 0) << "the first step sizes the workspace";
    for (int s = 1; s < kWarmSteps; ++s) step(s);
    std::vector<Backend::DeviceCounts> per_step;
    for (int s = 0; s < kSteps; ++s) {
      const Backend::DeviceCounts before = counts_of(ctx_.get());
      step(kWarmSteps + s);
      per_step.push_back(minus(counts_of(ctx_.get()), before));
    }
    for (int s = 0; s < kSteps; ++s) {
      const Backend::DeviceCounts& d = per_step[static_cast<size_t>(s)];
      EXPECT_EQ(d.allocations, 0) << kind_name(kind_) << " batch " << batch_ << " step " << s;
      EXPECT_EQ(d.pageable_copies, 0) << "uploads go through the stream's pinned staging ring";
      EXPECT_EQ(d.page_lookups, 0) << "the page tables are kept: no page was added";
      EXPECT_EQ(d.passes, per_step[0].passes) << "the passes of a step do not grow with the context";
      EXPECT_EQ(d.host_waits, per_step[0].host_waits) << "nor its host waits";
    }
    const Backend::DeviceCounts& d = per_step[0];
    std::printf(
        "steady %s %-7s batch %2d: %lld waits, %lld passes, %lld allocations, %lld pageable copies, %lld "
        "uploads per step\n",
        label, kind_name(kind_), batch_, static_cast<long long>(d.host_waits), static_cast<long long>(d.passes),
        static_cast<long long>(d.allocations), static_cast<long long>(d.pageable_copies),
        static_cast<long long>(d.uploads));
  }

  int kind_ = 0, batch_ = 0;
  test::ContextPtr ctx_;
  std::vector<kvret_seq*> seqs_;
};

// The step of an engine without a sparse attention of its own: kvret_seq_attend per sequence.
TEST_P(SteadyState, SeqAttendStepAllocatesNothingAfterWarmUp) {
  F32 q({kQHeads, kDim}), out({kQHeads, kDim});  // labelled CUDA
  expect_steady("seq_attend", [&](int s) {
    append_step(s);
    for (int i = 0; i < batch_; ++i) {
      q.data = test::random_vector(q.data.size(), 1000 * static_cast<uint64_t>(s) + static_cast<uint64_t>(i) + 2);
      q.refresh();
      test::expect_ok(kvret_seq_attend(seqs_[static_cast<size_t>(i)], 0, &q.t, kBudget, 0.0f, &out.t, nullptr));
    }
  });
}

// The step of an engine with its own attention over the working sets: one kvret_select_batch and one
// kvret_fetch_batch_async for the batch.
TEST_P(SteadyState, SelectAndFetchBatchStepAllocatesNothingAfterWarmUp) {
  F32 q({batch_, kQHeads, kDim});
  test::I32 positions({batch_, kHeads, kBudget});
  std::vector<int32_t> counts(static_cast<size_t>(batch_));
  std::vector<std::unique_ptr<test::WorkingSetBuffers>> sets;
  std::vector<kvret_working_set> outs;
  for (kvret_seq* seq : seqs_) {
    sets.push_back(std::make_unique<test::WorkingSetBuffers>(seq, 0, kBudget + kWarmSteps + kSteps, kHeads, kDim));
    outs.push_back(sets.back()->ws);
  }
  std::vector<int64_t> rows(static_cast<size_t>(batch_));
  expect_steady("select+fetch batch", [&](int s) {
    append_step(s);
    q.data = test::random_vector(q.data.size(), 7000 + static_cast<uint64_t>(s));
    q.refresh();
    test::expect_ok(
        kvret_select_batch(ctx_.get(), batch_, seqs_.data(), 0, &q.t, kBudget, &positions.t, counts.data()));
    test::expect_ok(kvret_fetch_batch_async(ctx_.get(), batch_, seqs_.data(), 0, &positions.t, counts.data(),
                                            outs.data(), rows.data(), nullptr));
  });
}

INSTANTIATE_TEST_SUITE_P(Kinds, SteadyState,
                         ::testing::Combine(::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_CLUSTER,
                                                              KVRET_INDEX_QUANT, KVRET_INDEX_PAGE),
                                            ::testing::Values(1, 8, 64)),
                         [](const auto& param_info) {
                           return std::string(kind_name(std::get<0>(param_info.param))) + "_batch" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

}  // namespace
