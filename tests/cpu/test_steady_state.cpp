// The steady state of a decode step on the CUDA backend (KVRET_TEST_DEVICE=cuda; in CI the build on Thrust's
// OpenMP host system, which counts what a GPU would do): after a warm-up, a step of every sequence of a batch
// (kvret_append_decode, then kvret_seq_attend with q and out in device memory), for every index kind at batch 1, 8
// and 64, makes no allocation (its temporaries come from the stream's workspace), no pageable copy (its uploads go
// through the stream's pinned staging ring) and no page lookup (the page tables are kept), and its passes per
// sequence do not grow with the context. Each run prints its counts per step (the table of docs/cuda_backend.md).
#include <gtest/gtest.h>

#include <cstdio>
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
  }
};

TEST_P(SteadyState, DecodeStepAllocatesNothingAfterWarmUp) {
  const auto [kind, batch] = GetParam();
  kvret_config c = test::small_config(kind);
  c.n_layers = 1;
  c.device_type = KVRET_DEVICE_CUDA;
  c.background_build = 0;
  c.cluster_reuse_steps = 0;  // ClusterKV's resident clusters serve rows on the host
  c.block_tokens = 16;
  c.cache_capacity_tokens = 8 * 16;
  test::ContextPtr ctx = test::make_context(c);
  ASSERT_NE(ctx, nullptr);

  std::vector<kvret_seq*> seqs(static_cast<size_t>(batch), nullptr);
  F32 k({kPrefill, kHeads, kDim}), v({kPrefill, kHeads, kDim});
  for (int i = 0; i < batch; ++i) {
    test::clustered_kv(kPrefill, kHeads, kDim, 100 + static_cast<uint64_t>(i), k, v);
    test::expect_ok(kvret_seq_open(ctx.get(), &seqs[static_cast<size_t>(i)]));
    test::expect_ok(kvret_append_prefill(seqs[static_cast<size_t>(i)], 0, &k.t, &v.t));
  }
  F32 q({kQHeads, kDim}), out({kQHeads, kDim}), dk({1, kHeads, kDim}), dv({1, kHeads, kDim});  // labelled CUDA

  const auto step = [&](int s) {
    for (int i = 0; i < batch; ++i) {
      const uint64_t seed = 1000 * static_cast<uint64_t>(s) + static_cast<uint64_t>(i);
      dk.data = test::random_vector(dk.data.size(), seed);
      dv.data = test::random_vector(dv.data.size(), seed + 1);
      q.data = test::random_vector(q.data.size(), seed + 2);
      dk.refresh();
      dv.refresh();
      q.refresh();
      kvret_seq* seq = seqs[static_cast<size_t>(i)];
      test::expect_ok(kvret_append_decode(seq, 0, &dk.t, &dv.t));
      test::expect_ok(kvret_seq_attend(seq, 0, &q.t, kBudget, 0.0f, &out.t, nullptr));
    }
  };
  const Backend::DeviceCounts cold = counts_of(ctx.get());
  step(0);
  EXPECT_GT(minus(counts_of(ctx.get()), cold).allocations, 0) << "the first step sizes the workspace";
  for (int s = 1; s < kWarmSteps; ++s) step(s);

  std::vector<Backend::DeviceCounts> per_step;
  for (int s = 0; s < kSteps; ++s) {
    const Backend::DeviceCounts before = counts_of(ctx.get());
    step(kWarmSteps + s);
    per_step.push_back(minus(counts_of(ctx.get()), before));
  }
  for (int s = 0; s < kSteps; ++s) {
    const Backend::DeviceCounts& d = per_step[static_cast<size_t>(s)];
    EXPECT_EQ(d.allocations, 0) << kind_name(kind) << " batch " << batch << " step " << s;
    EXPECT_EQ(d.pageable_copies, 0) << "uploads go through the stream's pinned staging ring";
    EXPECT_EQ(d.page_lookups, 0) << "the page tables are kept: no page was added";
    EXPECT_EQ(d.passes, per_step[0].passes) << "the passes of a step do not grow with the context";
    EXPECT_EQ(d.passes % batch, 0) << "every sequence's step makes the same passes";
  }
  const Backend::DeviceCounts& d = per_step[0];
  std::printf(
      "steady step %-7s batch %2d: per sequence %lld waits, %lld passes, %lld allocations, %lld pageable "
      "copies, %.1f uploads\n",
      kind_name(kind), batch, static_cast<long long>(d.host_waits / batch), static_cast<long long>(d.passes / batch),
      static_cast<long long>(d.allocations / batch), static_cast<long long>(d.pageable_copies / batch),
      static_cast<double>(d.uploads) / batch);
  for (kvret_seq* seq : seqs) kvret_seq_close(seq);
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
