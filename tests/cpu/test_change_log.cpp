// ChangeLog, the record of an index's recent changes that the CUDA backend's device mirrors read: against a model
// that remembers every change, after random sequences of marks and resets, changed_since(v) covers every unit
// changed after v (or says 0, every unit) and is the oldest first unit of those changes while v is among the last
// kChanges versions; versions strictly increase and are never reused; a copy is independent of its original.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "index/change_log.hpp"

using kvret::ChangeLog;

namespace {

/// Every change a log went through: the version before it and the first unit it changed (nullopt: a reset).
struct History {
  struct Step {
    uint64_t from;
    std::optional<int64_t> first;
  };
  std::vector<Step> steps;

  /// What changed_since(v, units) must say for a log whose version is `now`.
  int64_t expected(uint64_t v, uint64_t now, int64_t units) const {
    if (v == now) return units;
    const auto since = std::find_if(steps.begin(), steps.end(), [&](const Step& s) { return s.from == v; });
    if (since == steps.end() || steps.end() - since > static_cast<std::ptrdiff_t>(ChangeLog::kChanges)) return 0;
    int64_t first = units;
    for (auto s = since; s != steps.end(); ++s) {
      if (!s->first) return 0;  // a reset: nothing before it is known
      first = std::min(first, *s->first);
    }
    return first;
  }
};

TEST(ChangeLog, ChangedSinceCoversEveryLaterChangeAndMatchesTheModel) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    std::mt19937_64 rng(seed);
    ChangeLog log;
    History history;
    std::vector<uint64_t> versions{log.version()};
    int64_t units = 0;
    for (int step = 0; step < 60; ++step) {
      const uint64_t before = log.version();
      if (rng() % 10 == 0) {
        log.reset();
        history.steps.push_back({before, std::nullopt});
      } else {
        // the units grow or shrink; a change starts at or below the new count
        units = std::max<int64_t>(0, units + static_cast<int64_t>(rng() % 9) - 3);
        const int64_t first = static_cast<int64_t>(rng() % static_cast<uint64_t>(units + 1));
        log.mark(first);
        history.steps.push_back({before, first});
      }
      ASSERT_GT(log.version(), before) << "seed " << seed << " step " << step;
      versions.push_back(log.version());
      for (size_t i = 0; i < versions.size(); ++i) {
        const uint64_t v = versions[i];
        const int64_t got = log.changed_since(v, units);
        EXPECT_EQ(got, history.expected(v, log.version(), units)) << "seed " << seed << " step " << step;
        // the safety property on its own: every unit changed after v is at or above the answer
        bool reset_since = false;
        for (size_t j = i; j < history.steps.size(); ++j) {
          if (!history.steps[j].first) reset_since = true;
          if (!reset_since) {
            EXPECT_LE(got, *history.steps[j].first);
          }
        }
        if (reset_since) {
          EXPECT_EQ(got, 0);
        }
        EXPECT_GE(got, 0);
        EXPECT_LE(got, units);
      }
    }
  }
}

TEST(ChangeLog, VersionsStrictlyIncreaseAndAreNeverReused) {
  std::mt19937_64 rng(7);
  std::vector<ChangeLog> logs(4);
  std::set<uint64_t> seen;
  uint64_t last = 0;
  for (const ChangeLog& log : logs) {
    EXPECT_NE(log.version(), 0u);
    EXPECT_GT(log.version(), last);
    last = log.version();
    EXPECT_TRUE(seen.insert(log.version()).second);
  }
  for (int step = 0; step < 200; ++step) {
    ChangeLog& log = logs[rng() % logs.size()];
    const uint64_t before = log.version();
    if (rng() % 5 == 0)
      log.reset();
    else
      log.mark(static_cast<int64_t>(rng() % 16));
    EXPECT_GT(log.version(), before);
    EXPECT_GT(log.version(), last);  // later than every version issued before, by any log
    last = log.version();
    EXPECT_TRUE(seen.insert(log.version()).second);
  }
  // another log's version is unknown to a log: every unit may differ
  for (const ChangeLog& log : logs)
    for (const ChangeLog& other : logs)
      if (&log != &other) {
        EXPECT_EQ(log.changed_since(other.version(), 16), 0);
      }
}

TEST(ChangeLog, ACopyIsIndependentOfItsOriginal) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    ChangeLog original;
    const int64_t units = 32;
    std::vector<uint64_t> versions{original.version()};  // every version the original has had
    for (int i = 0, n = static_cast<int>(rng() % 12); i < n; ++i) {
      original.mark(static_cast<int64_t>(rng() % units));
      versions.push_back(original.version());
    }
    const uint64_t at_copy = original.version();
    const auto answers = [&](const ChangeLog& log) {
      std::vector<int64_t> out;
      for (const uint64_t v : versions) out.push_back(log.changed_since(v, units));
      return out;
    };
    const std::vector<int64_t> before = answers(original);
    ChangeLog copy = original;
    EXPECT_EQ(copy.version(), at_copy);  // a copy has its original's version until either changes
    EXPECT_EQ(answers(copy), before);
    // changes of the copy leave the original as it was
    const int64_t first = static_cast<int64_t>(rng() % units);
    copy.mark(first);
    if (rng() % 2 == 0) copy.reset();
    EXPECT_EQ(original.version(), at_copy);
    EXPECT_EQ(answers(original), before);
    EXPECT_EQ(original.changed_since(copy.version(), units), 0);
    // and changes of the original leave the copy as it was
    const uint64_t copy_version = copy.version();
    const std::vector<int64_t> copy_before = answers(copy);
    EXPECT_LE(copy.changed_since(at_copy, units), first);
    original.mark(static_cast<int64_t>(rng() % units));
    EXPECT_NE(original.version(), copy.version());
    EXPECT_EQ(copy.version(), copy_version);
    EXPECT_EQ(answers(copy), copy_before);
    EXPECT_EQ(copy.changed_since(original.version(), units), 0);
  }
}

}  // namespace
