// kvret_seq_attend: one call gives what kvret_select + kvret_fetch_async + kvret_attend give, bit for bit, for every
// index kind and budget; bad arguments are refused before anything runs.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/half.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

class SeqAttend : public ::testing::TestWithParam<int> {};

TEST_P(SeqAttend, EqualsSelectFetchAttend) {
  kvret_config config = small_config(GetParam());
  config.kv_dtype = KVRET_KV_F16;
  auto ctx = make_context(config);
  Seq seq(ctx.get());
  F32 k({1500, kHeads, kDim}), v({1500, kHeads, kDim});
  clustered_kv(1500, kHeads, kDim, 21, k, v);
  prefill(seq.s, 0, k, v, 0, 1400);
  decode(seq.s, 0, k, v, 1400, 1403);
  for (const int32_t budget : {1, 50, KVRET_BUDGET_DEFAULT})
    for (const float scale : {0.0f, 0.3f}) {
      F32 q({kQHeads, kDim});
      q.data = random_vector(static_cast<size_t>(kQHeads * kDim), static_cast<uint64_t>(budget + 7));
      q.refresh();
      F32 got({kQHeads, kDim}, -1.0f), want({kQHeads, kDim}, -2.0f);
      expect_ok(kvret_seq_attend(seq.s, 0, &q, budget, scale, &got, nullptr));
      // the three calls
      int32_t width = budget;
      if (budget == KVRET_BUDGET_DEFAULT) expect_ok(kvret_seq_budget(seq.s, 0, &width));
      I32 selected({kHeads, std::max(width, 1)});
      int32_t count = 0;
      expect_ok(kvret_select(seq.s, 0, &q, budget, &selected, &count));
      WorkingSetBuffers ws(seq.s, 0, count, kHeads, kDim);
      int64_t rows = 0;
      expect_ok(kvret_fetch_async(seq.s, 0, &selected, count, &ws.ws, &rows, nullptr));
      expect_ok(kvret_attend(ctx.get(), &q, &ws.k, &ws.v, rows, scale, &want, nullptr));
      ASSERT_EQ(std::memcmp(got.data.data(), want.data.data(), got.data.size() * sizeof(float)), 0)
          << "budget " << budget << " scale " << scale;
    }
  kvret_stats st;
  kvret_stats_init(&st);
  expect_ok(kvret_seq_stats(seq.s, &st));
  EXPECT_EQ(st.selections, 12);  // six kvret_seq_attend and six kvret_select
  EXPECT_EQ(st.fetches, 12);
}

TEST_P(SeqAttend, BadArgumentsChangeNothing) {
  auto ctx = make_context(small_config(GetParam()));
  Seq seq(ctx.get());
  F32 k({600, kHeads, kDim}), v({600, kHeads, kDim});
  prefill(seq.s, 0, k, v, 0, 600);
  const Observed before = observe(seq.s);
  F32 q({kQHeads, kDim}), out({kQHeads, kDim}), narrow({kQHeads, kDim / 2});
  I32 ints({kQHeads, kDim});
  EXPECT_EQ(kvret_seq_attend(seq.s, 0, &q, 10, 0.0f, &narrow, nullptr), KVRET_ERR_SHAPE);
  EXPECT_EQ(kvret_seq_attend(seq.s, 0, &q, 10, 0.0f, &ints, nullptr), KVRET_ERR_DTYPE);
  EXPECT_EQ(kvret_seq_attend(seq.s, 0, &q, 10, NAN, &out, nullptr), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvret_seq_attend(seq.s, 0, &q, 601, 0.0f, &out, nullptr), KVRET_ERR_BUDGET);
  EXPECT_EQ(kvret_seq_attend(seq.s, 5, &q, 10, 0.0f, &out, nullptr), KVRET_ERR_OUT_OF_RANGE);
  EXPECT_EQ(kvret_seq_attend(seq.s, 1, &q, 10, 0.0f, &out, nullptr), KVRET_ERR_STATE);  // layer 1 holds nothing
  EXPECT_EQ(kvret_seq_attend(seq.s, 0, nullptr, 10, 0.0f, &out, nullptr), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvret_seq_attend(nullptr, 0, &q, 10, 0.0f, &out, nullptr), KVRET_ERR_INVALID_HANDLE);
  EXPECT_EQ(observe(seq.s), before);
}

// An f16 or bf16 out is the f32 out rounded to nearest even, bit for bit, on either backend (quantized attention
// included).
TEST_P(SeqAttend, HalfOutputIsTheFloatOutputRounded) {
  for (const int quant_attention : {0, 1}) {
    if (quant_attention == 1 && GetParam() != KVRET_INDEX_QUANT) continue;
    kvret_config config = small_config(GetParam());
    config.kv_dtype = KVRET_KV_F16;
    config.quant_attention = quant_attention;
    auto ctx = make_context(config);
    // three sequences with the same tokens, one per output dtype, so that no select sees another's effects
    Seq f32_seq(ctx.get()), f16_seq(ctx.get()), bf16_seq(ctx.get());
    F32 k({900, kHeads, kDim}), v({900, kHeads, kDim});
    clustered_kv(900, kHeads, kDim, 5, k, v);
    for (kvret_seq* s : {f32_seq.s, f16_seq.s, bf16_seq.s}) {
      prefill(s, 0, k, v, 0, 880);
      decode(s, 0, k, v, 880, 882);
    }
    F32 q({kQHeads, kDim});
    q.data = random_vector(static_cast<size_t>(kQHeads * kDim), 31);
    q.refresh();
    F32 want({kQHeads, kDim});
    Buffer<uint16_t> f16({kQHeads, kDim}, 7), bf16({kQHeads, kDim}, 7);
    bf16.t.dtype = {KVRET_DTYPE_BFLOAT, 16, 1};
    expect_ok(kvret_seq_attend(f32_seq.s, 0, &q, 40, 0.0f, &want, nullptr));
    const kvret_status s16 = kvret_seq_attend(f16_seq.s, 0, &q, 40, 0.0f, &f16, nullptr);
    const kvret_status sb16 = kvret_seq_attend(bf16_seq.s, 0, &q, 40, 0.0f, &bf16, nullptr);
    ASSERT_EQ(s16, KVRET_OK) << kvret_last_error();
    ASSERT_EQ(sb16, KVRET_OK) << kvret_last_error();
    for (size_t i = 0; i < want.data.size(); ++i) {
      ASSERT_EQ(f16.data[i], f32_to_f16(want.data[i])) << i << " quant_attention " << quant_attention;
      ASSERT_EQ(bf16.data[i], f32_to_bf16(want.data[i])) << i << " quant_attention " << quant_attention;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, SeqAttend,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                                           KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT),
                         [](const ::testing::TestParamInfo<int>& i) { return kind_name(i.param); });

}  // namespace
