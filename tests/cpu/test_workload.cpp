// The synthetic workload generator (tools/workload): paragraph structure and determinism.
//
// Paragraph boundaries fall at any token, not on 16-token blocks (which would suit 16-token pages: a page would
// never straddle two topics), and the mean paragraph length is topic_run_tokens.
#ifdef KVRET_HAVE_WORKLOAD
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "workload.hpp"

namespace {

namespace workload = kvret::workload;

/// First positions of the paragraphs that begin in [0, n), ascending (walks back one paragraph at a time).
std::vector<int64_t> paragraph_starts(const workload::Workload& w, int64_t n) {
  std::vector<int64_t> starts;
  for (int64_t t = n - 1; t >= 0;) {
    const int64_t s = w.paragraph_start(t);
    EXPECT_LE(s, t);
    EXPECT_GE(s, 0);
    starts.push_back(s);
    t = s - 1;
  }
  std::reverse(starts.begin(), starts.end());
  return starts;
}

struct ParagraphCase {
  int topic_run_tokens;
  uint64_t seed;
};

void PrintTo(const ParagraphCase& c, std::ostream* os) {
  *os << "topic_run_tokens " << c.topic_run_tokens << ", seed " << c.seed;
}

class WorkloadParagraphs : public ::testing::TestWithParam<ParagraphCase> {};

TEST_P(WorkloadParagraphs, BoundariesFallAtAnyTokenWithTheConfiguredMeanLength) {
  workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = 2;
  wc.n_kv_heads = 1;
  wc.head_dim = 16;
  wc.topic_run_tokens = GetParam().topic_run_tokens;
  wc.seed = GetParam().seed;
  const int64_t n = int64_t{1} << 20;
  wc.n_prefill = n;
  const workload::Workload w(wc);
  const std::vector<int64_t> starts = paragraph_starts(w, n);
  ASSERT_GT(starts.size(), 1000u);
  EXPECT_EQ(starts.front(), 0);
  // boundaries after the first: a page of 16 (or 8, or 32) holds one with the same chance at every offset
  int64_t on16 = 0, on8 = 0, on32 = 0;
  for (size_t i = 1; i < starts.size(); ++i) {
    on16 += starts[i] % 16 == 0 ? 1 : 0;
    on8 += starts[i] % 8 == 0 ? 1 : 0;
    on32 += starts[i] % 32 == 0 ? 1 : 0;
  }
  const auto b = static_cast<double>(starts.size() - 1);
  EXPECT_NEAR(static_cast<double>(on16) / b, 1.0 / 16, 0.25 / 16) << on16 << " of " << b << " on multiples of 16";
  EXPECT_NEAR(static_cast<double>(on8) / b, 1.0 / 8, 0.25 / 8) << on8 << " of " << b << " on multiples of 8";
  EXPECT_NEAR(static_cast<double>(on32) / b, 1.0 / 32, 0.4 / 32) << on32 << " of " << b << " on multiples of 32";
  // mean paragraph length (complete paragraphs only: the last one is cut by n)
  const double mean = static_cast<double>(starts.back()) / static_cast<double>(starts.size() - 1);
  EXPECT_NEAR(mean, wc.topic_run_tokens, 0.05 * wc.topic_run_tokens);
  // the topic is constant within a paragraph, and topic changes happen only at paragraph starts
  for (size_t i = 0; i + 1 < starts.size() && i < 2000; ++i) {
    const int z = w.topic_of(starts[i]);
    for (int64_t t = starts[i]; t < starts[i + 1]; ++t) ASSERT_EQ(w.topic_of(t), z) << "position " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(RunLengths, WorkloadParagraphs,
                         ::testing::Values(ParagraphCase{128, 1}, ParagraphCase{128, 7}, ParagraphCase{40, 2},
                                           ParagraphCase{300, 3}),
                         [](const ::testing::TestParamInfo<ParagraphCase>& i) {
                           return "run" + std::to_string(i.param.topic_run_tokens) + "_seed" +
                                  std::to_string(i.param.seed);
                         });

// Observed through topic_of alone (what the old API offered): the positions where the topic changes are paragraph
// starts, so they too fall on multiples of 16 about 1 time in 16 (they all did when paragraphs began on blocks).
TEST(WorkloadTopics, ChangesAreNotBlockAligned) {
  workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = 2;
  wc.n_kv_heads = 1;
  wc.head_dim = 16;
  wc.n_prefill = 1 << 18;
  const workload::Workload w(wc);
  int64_t changes = 0, on16 = 0;
  int prev = w.topic_of(0);
  for (int64_t t = 1; t < wc.n_prefill; ++t) {
    const int z = w.topic_of(t);
    if (z != prev) {
      ++changes;
      on16 += t % 16 == 0 ? 1 : 0;
    }
    prev = z;
  }
  ASSERT_GT(changes, 1000);
  EXPECT_LT(static_cast<double>(on16) / static_cast<double>(changes), 0.1) << on16 << " of " << changes;
}

// Keys and values of a range are those of the same tokens in a larger range (the generator walks paragraphs
// incrementally within a thread's run of tokens and from scratch at the start of one).
TEST(WorkloadDeterminism, AnyRangeMatchesTheSameTokensOfALargerRange) {
  workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = 4;
  wc.n_kv_heads = 2;
  wc.head_dim = 32;
  wc.n_prefill = 6000;
  const workload::Workload w(wc);
  const int64_t row = static_cast<int64_t>(wc.n_kv_heads) * wc.head_dim;
  std::vector<float> k_all(static_cast<size_t>(wc.n_prefill * row)), v_all(k_all.size());
  w.keys_values(0, 0, wc.n_prefill, k_all.data(), v_all.data());
  for (auto [b, e] : {std::pair<int64_t, int64_t>{1234, 2345}, {4097, 4200}, {0, 7}, {5999, 6000}}) {
    std::vector<float> k(static_cast<size_t>((e - b) * row)), v(k.size());
    w.keys_values(0, b, e, k.data(), v.data());
    for (int64_t i = 0; i < (e - b) * row; ++i) {
      ASSERT_EQ(k[static_cast<size_t>(i)], k_all[static_cast<size_t>(b * row + i)]) << "range " << b << ".." << e;
      ASSERT_EQ(v[static_cast<size_t>(i)], v_all[static_cast<size_t>(b * row + i)]) << "range " << b << ".." << e;
    }
  }
}

}  // namespace
#endif  // KVRET_HAVE_WORKLOAD
