// kvret_select_scored: the same positions as kvret_select, each with the score the index ranked it by. Properties:
// scores do not depend on the budget (for the quant index, without its exact re-ranking); every selected token
// scores at least as high as every token left out; the exact index's scores are the exact folded scores; with the
// sum-of-probabilities fold every index's scores over the whole middle sum to the group size (a probability per
// query head); bad arguments change nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

constexpr int64_t kTokens = 1300, kMidBegin = 4, kMidEnd = kTokens - 16;  // small_config: 4 sink, 16 local
constexpr int kGroup = kQHeads / kHeads;

struct Scored {
  std::vector<std::vector<int32_t>> positions;  // per head
  std::vector<std::vector<float>> scores;
};

Scored select_scored(kvret_seq* s, const F32& q, int32_t budget) {
  I32 pos({kHeads, budget});
  F32 scores({kHeads, budget}, NAN);
  int32_t count = -1;
  expect_ok(kvret_select_scored(s, 0, &q, budget, &pos, &scores, &count));
  Scored out;
  for (int h = 0; h < kHeads; ++h) {
    const auto row = static_cast<size_t>(h * budget);
    out.positions.emplace_back(pos.data.begin() + row, pos.data.begin() + row + count);
    out.scores.emplace_back(scores.data.begin() + row, scores.data.begin() + row + count);
  }
  return out;
}

class SelectScores : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(SelectScores, RankTheSelectionAndDoNotDependOnTheBudget) {
  const auto [kind, fold] = GetParam();
  kvret_config config = small_config(kind);
  config.gqa_fold = fold;
  config.quant_rerank = 1;  // re-ranked scores depend on the candidates, hence on the budget (test_quant.cpp)
  auto ctx = make_context(config);
  Seq seq(ctx.get());
  F32 k({kTokens, kHeads, kDim}), v({kTokens, kHeads, kDim});
  clustered_kv(kTokens, kHeads, kDim, 5, k, v);
  prefill(seq.s, 0, k, v, 0, kTokens - 3);
  decode(seq.s, 0, k, v, kTokens - 3, kTokens);
  F32 q({kQHeads, kDim});
  q.data = random_vector(static_cast<size_t>(kQHeads * kDim), 77, 2.0f);
  q.refresh();

  // every middle token's score, from a selection of the whole middle
  const Scored all = select_scored(seq.s, q, static_cast<int32_t>(kMidEnd - kMidBegin));
  for (int h = 0; h < kHeads; ++h) {
    ASSERT_EQ(all.positions[static_cast<size_t>(h)].size(), static_cast<size_t>(kMidEnd - kMidBegin));
    double sum = 0;
    for (const float s : all.scores[static_cast<size_t>(h)]) {
      ASSERT_TRUE(std::isfinite(s));
      sum += s;
    }
    if (fold == KVRET_FOLD_SUM_PROB) {
      EXPECT_NEAR(sum, kGroup, 1e-3) << "head " << h;  // one softmax per query head
    }
    if (kind == KVRET_INDEX_EXACT) {
      const std::vector<double> want =
          exact_folded(k.data, kHeads, kDim, q.data, kGroup, h, kMidBegin, kMidEnd, fold == KVRET_FOLD_MAX_LOGIT);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_NEAR(all.scores[static_cast<size_t>(h)][i], want[i], 1e-5 + 1e-5 * std::fabs(want[i])) << i;
    }
  }
  for (const int32_t budget : {1, 37, 300}) {
    // the positions of kvret_select
    I32 plain({kHeads, budget});
    int32_t count = 0;
    expect_ok(kvret_select(seq.s, 0, &q, budget, &plain, &count));
    const Scored got = select_scored(seq.s, q, budget);
    for (int h = 0; h < kHeads; ++h) {
      const auto& pos = got.positions[static_cast<size_t>(h)];
      const auto& sc = got.scores[static_cast<size_t>(h)];
      ASSERT_EQ(pos.size(), static_cast<size_t>(count));
      ASSERT_TRUE(std::equal(pos.begin(), pos.end(), plain.data.begin() + h * budget)) << "budget " << budget;
      // each score is the token's score in the whole-middle selection, bit for bit
      std::vector<bool> taken(static_cast<size_t>(kMidEnd - kMidBegin), false);
      float lowest = INFINITY;
      for (size_t i = 0; i < pos.size(); ++i) {
        const auto t = static_cast<size_t>(pos[i] - kMidBegin);
        ASSERT_EQ(sc[i], all.scores[static_cast<size_t>(h)][t]) << "budget " << budget << " position " << pos[i];
        taken[t] = true;
        lowest = std::min(lowest, sc[i]);
      }
      // nothing left out scores higher than what was taken
      for (size_t t = 0; t < taken.size(); ++t)
        if (!taken[t]) {
          ASSERT_LE(all.scores[static_cast<size_t>(h)][t], lowest) << "budget " << budget << " " << t;
        }
    }
  }
  if (kind == KVRET_INDEX_PAGE) {  // a page's tokens share its score
    const auto& sc = all.scores[0];
    for (size_t t = 1; t < sc.size(); ++t)
      if (t % static_cast<size_t>(config.page_size) != 0) {
        ASSERT_EQ(sc[t], sc[t - 1]) << t;
      }
  }
}

INSTANTIATE_TEST_SUITE_P(KindsAndFolds, SelectScores,
                         ::testing::Combine(::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE,
                                                              KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT),
                                            ::testing::Values(KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& i) {
                           return kind_name(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) == KVRET_FOLD_SUM_PROB ? "_SumProb" : "_MaxLogit");
                         });

TEST(SelectScored, PqCellTokensShareTheirCellScore) {
  kvret_config config = small_config(KVRET_INDEX_PQ);
  config.pq_m = 2;  // 2 x 4 bits: cells are scored once, tokens of a cell share the score
  config.pq_bits = 4;
  auto ctx = make_context(config);
  Seq seq(ctx.get());
  F32 k({kTokens, kHeads, kDim}), v({kTokens, kHeads, kDim});
  clustered_kv(kTokens, kHeads, kDim, 9, k, v);
  prefill(seq.s, 0, k, v, 0, kTokens);
  F32 q({kQHeads, kDim});
  q.data = random_vector(static_cast<size_t>(kQHeads * kDim), 3);
  q.refresh();
  const Scored all = select_scored(seq.s, q, static_cast<int32_t>(kMidEnd - kMidBegin));
  // 256 cells for about 1300 tokens: many tokens share a score exactly
  std::map<float, int> tokens_per_score;
  for (const float s : all.scores[0]) ++tokens_per_score[s];
  EXPECT_LT(tokens_per_score.size(), 300u);
  double sum = 0;
  for (const float s : all.scores[0]) sum += s;
  EXPECT_NEAR(sum, kGroup, 1e-3);
}

TEST(SelectScored, StreamingSelectsNothing) {
  auto ctx = make_context(small_config(KVRET_INDEX_STREAMING));
  Seq seq(ctx.get());
  F32 k({600, kHeads, kDim}), v({600, kHeads, kDim});
  prefill(seq.s, 0, k, v, 0, 600);
  F32 q({kQHeads, kDim}), scores({kHeads, 10}, 5.0f);
  I32 pos({kHeads, 10});
  int32_t count = -1;
  expect_ok(kvret_select_scored(seq.s, 0, &q, 10, &pos, &scores, &count));
  EXPECT_EQ(count, 0);
  EXPECT_EQ(scores.data, std::vector<float>(static_cast<size_t>(kHeads * 10), 5.0f));
}

TEST(SelectScored, BadArgumentsChangeNothing) {
  auto ctx = make_context(small_config(KVRET_INDEX_PQ));
  Seq seq(ctx.get());
  F32 k({600, kHeads, kDim}), v({600, kHeads, kDim});
  clustered_kv(600, kHeads, kDim, 2, k, v);
  prefill(seq.s, 0, k, v, 0, 600);
  const Observed before = observe(seq.s);
  F32 q({kQHeads, kDim}), scores({kHeads, 10}, 7.0f), narrow({kHeads, 9}), heads({kHeads + 1, 10});
  I32 pos({kHeads, 10}, -1), ints({kHeads, 10});
  int32_t count = -1;
  EXPECT_EQ(kvret_select_scored(seq.s, 0, &q, 10, &pos, nullptr, &count), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvret_select_scored(seq.s, 0, &q, 10, &pos, &ints, &count), KVRET_ERR_DTYPE);
  EXPECT_EQ(kvret_select_scored(seq.s, 0, &q, 10, &pos, &narrow, &count), KVRET_ERR_SHAPE);
  EXPECT_EQ(kvret_select_scored(seq.s, 0, &q, 10, &pos, &heads, &count), KVRET_ERR_SHAPE);
  EXPECT_EQ(kvret_select_scored(seq.s, 0, &q, 0, &pos, &scores, &count), KVRET_ERR_BUDGET);
  EXPECT_EQ(kvret_select_scored(seq.s, 0, &q, 10, &pos, &scores, nullptr), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvret_select_scored(nullptr, 0, &q, 10, &pos, &scores, &count), KVRET_ERR_INVALID_HANDLE);
  EXPECT_EQ(count, -1);
  EXPECT_EQ(pos.data, std::vector<int32_t>(static_cast<size_t>(kHeads * 10), -1));
  EXPECT_EQ(scores.data, std::vector<float>(static_cast<size_t>(kHeads * 10), 7.0f));
  EXPECT_EQ(observe(seq.s), before);
}

}  // namespace
