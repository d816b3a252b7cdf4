// The grouped take (PQ cells, PAGE pages) against a reference that sorts the groups and takes them one by one:
// the same states and trim quota over random scores with ties, NaN, -0 and -inf, counts with zeros, and every
// budget from 0 past the total.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "select/grouped_take.hpp"

namespace kvret {
namespace {

struct Taken {
  std::vector<uint8_t> state;
  int64_t quota = 0;
};

Taken reference_take(const std::vector<float>& scores, const std::vector<int32_t>& counts, int64_t budget) {
  const auto rank = [](float s) { return s == s ? s : -std::numeric_limits<float>::infinity(); };
  std::vector<int64_t> order;
  for (size_t u = 0; u < scores.size(); ++u)
    if (counts[u] > 0) order.push_back(static_cast<int64_t>(u));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return rank(scores[static_cast<size_t>(a)]) > rank(scores[static_cast<size_t>(b)]);
  });
  Taken t;
  t.state.assign(scores.size(), kSkip);
  int64_t rem = budget;
  for (int64_t u : order) {
    if (rem <= 0) break;
    if (counts[static_cast<size_t>(u)] <= rem) {
      t.state[static_cast<size_t>(u)] = kTake;
      rem -= counts[static_cast<size_t>(u)];
    } else {
      t.state[static_cast<size_t>(u)] = kTrim;
      t.quota = rem;
      break;
    }
  }
  return t;
}

TEST(GroupedTake, EqualsTakingTheSortedGroupsOneByOne) {
  std::mt19937_64 rng(5);
  std::vector<uint64_t> keys;
  for (const int64_t groups : {1, 2, 5, 17, 64, 300, 4096}) {
    for (int variant = 0; variant < 4; ++variant) {
      std::vector<float> scores(static_cast<size_t>(groups));
      std::vector<int32_t> counts(static_cast<size_t>(groups));
      std::normal_distribution<float> normal;
      int64_t total = 0;
      for (int64_t u = 0; u < groups; ++u) {
        float s = normal(rng);
        if (variant == 1) s = std::round(s * 2.0f);  // many ties
        if (variant == 2) s = 0.0f;                  // all tied
        if (u % 11 == 3) s = std::nanf("");
        if (u % 13 == 5) s = -0.0f;
        if (u % 17 == 7) s = -std::numeric_limits<float>::infinity();
        scores[static_cast<size_t>(u)] = s;
        const auto c = static_cast<int32_t>(rng() % (variant == 3 ? 2u : 9u));  // variant 3: counts 0 and 1
        counts[static_cast<size_t>(u)] = c;
        total += c;
      }
      for (const int64_t budget : {int64_t{0}, int64_t{1}, total / 7, total / 2, total - 1, total, total + 5}) {
        if (budget < 0) continue;
        std::vector<uint8_t> state(static_cast<size_t>(groups), 77);
        const int64_t quota = grouped_take(scores.data(), counts.data(), groups, budget, keys, state.data());
        const Taken want = reference_take(scores, counts, budget);
        ASSERT_EQ(state, want.state) << "groups " << groups << " variant " << variant << " budget " << budget;
        ASSERT_EQ(quota, want.quota) << "groups " << groups << " variant " << variant << " budget " << budget;
        int64_t selected = quota;
        for (int64_t u = 0; u < groups; ++u)
          if (state[static_cast<size_t>(u)] == kTake) selected += counts[static_cast<size_t>(u)];
        ASSERT_EQ(selected, std::min(budget, total));
      }
    }
  }
}

}  // namespace
}  // namespace kvret
