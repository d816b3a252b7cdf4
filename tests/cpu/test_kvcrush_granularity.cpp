// KVCrush representatives at unit granularity (config.hamming_granularity = g > 1): aligned runs of g middle
// positions are the representative units. Properties through the C API: granularity 0 and 1 are the token rule bit
// for bit; at g = 8, 16 (PAGE's page size) and 64 the count equals the token rule's, the positions are distinct,
// ascending and in the middle, the retriever's important part is kept with its scores, and every unit that sends a
// representative sends all its tokens the index did not select (at most one unit, the fill's last, cut short);
// share 0 is the plain select; kvret_seq_retained_set follows the same rule; bad values are refused by field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "kvcrush_fixture.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"
#include "workload_mass.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

// small_config: 4 sink, 16 local
constexpr int64_t kTokens = CrushFixture::kTokens, kMidBegin = 4, kMidEnd = kTokens - 16;

/// The fixture's sequence in a context of `kind` with KVCrush's share and hamming_granularity.
struct Fixture : CrushFixture {
  Fixture(int kind, float share, int32_t granularity)
      : CrushFixture([&] {
          kvret_config c = small_config(kind);
          c.hamming_fraction = share;
          c.hamming_granularity = granularity;
          return c;
        }()) {}
};

struct Rows {
  std::vector<std::vector<int32_t>> pos;
  std::vector<std::vector<float>> scores;
  int32_t count = -1;
};

Rows select_rows(kvret_seq* s, const F32& q, int32_t budget) {
  I32 pos({kHeads, budget}, -1);
  F32 sc({kHeads, budget}, NAN);
  Rows r;
  expect_ok(kvret_select_scored(s, 0, &q, budget, &pos, &sc, &r.count));
  for (int h = 0; h < kHeads; ++h) {
    const auto at = static_cast<size_t>(h * budget);
    r.pos.emplace_back(pos.data.begin() + at, pos.data.begin() + at + std::max(r.count, 0));
    r.scores.emplace_back(sc.data.begin() + at, sc.data.begin() + at + std::max(r.count, 0));
  }
  return r;
}

/// Checks one head's row against the important part `base` at granularity g: distinct ascending middle positions,
/// the base kept, and the representatives (the rest) whole units of g but for at most one.
void check_units(const std::vector<int32_t>& r, const std::vector<int32_t>& base, int64_t g,
                 int64_t mid_begin = kMidBegin, int64_t mid_end = kMidEnd) {
  ASSERT_TRUE(std::is_sorted(r.begin(), r.end()));
  ASSERT_EQ(std::set<int32_t>(r.begin(), r.end()).size(), r.size()) << "duplicate";
  for (const int32_t p : r) ASSERT_TRUE(p >= mid_begin && p < mid_end) << p;
  for (const int32_t p : base) ASSERT_TRUE(std::binary_search(r.begin(), r.end(), p)) << "important " << p << " lost";
  std::map<int64_t, int64_t> reps_in_unit;  // unit -> representatives in it
  for (const int32_t p : r)
    if (!std::binary_search(base.begin(), base.end(), p)) ++reps_in_unit[p / g];
  int64_t cut = 0;
  for (const auto& [u, n] : reps_in_unit) {
    int64_t candidates = 0;  // the unit's middle tokens outside the important part
    for (int64_t t = std::max(mid_begin, u * g); t < std::min(mid_end, (u + 1) * g); ++t)
      candidates += !std::binary_search(base.begin(), base.end(), static_cast<int32_t>(t));
    EXPECT_LE(n, candidates);
    cut += n < candidates;
  }
  EXPECT_LE(cut, 1) << "more than one representative unit cut short at g = " << g;
}

class KvCrushGranularity : public ::testing::TestWithParam<int> {};

TEST_P(KvCrushGranularity, OneAndZeroAreTheTokenRule) {
  const int kind = GetParam();
  Fixture zero(kind, 0.25f, 0), one(kind, 0.25f, 1);
  for (const uint64_t seed : {1u, 2u})
    for (const int32_t budget : {1, 4, 40, 257}) {
      const F32 q = query(seed);
      const Rows a = select_rows(zero.seq->s, q, budget), b = select_rows(one.seq->s, q, budget);
      EXPECT_EQ(a.count, b.count);
      EXPECT_EQ(a.pos, b.pos);
      for (int h = 0; h < kHeads; ++h)
        EXPECT_EQ(std::memcmp(a.scores[static_cast<size_t>(h)].data(), b.scores[static_cast<size_t>(h)].data(),
                              sizeof(float) * a.scores[static_cast<size_t>(h)].size()),
                  0);
    }
}

TEST_P(KvCrushGranularity, WholeUnitsAndTheTokenRulesCount) {
  const int kind = GetParam();
  Fixture plain(kind, 0.0f, 0), token(kind, 0.25f, 0);
  for (const int32_t g : {8, 16, 64}) {
    Fixture unit(kind, 0.25f, g);
    for (const uint64_t seed : {1u, 2u})
      for (const int32_t budget : {1, 4, 40, 257, 1000, static_cast<int32_t>(kMidEnd - kMidBegin)}) {
        const F32 q = query(seed);
        const Rows u = select_rows(unit.seq->s, q, budget), t = select_rows(token.seq->s, q, budget);
        ASSERT_EQ(u.count, t.count) << "g " << g << " budget " << budget;
        const int64_t reps = static_cast<int64_t>(std::floor(0.25 * budget));
        const Rows base = select_rows(plain.seq->s, q, static_cast<int32_t>(budget - reps));
        for (int h = 0; h < kHeads; ++h) {
          const auto i = static_cast<size_t>(h);
          SCOPED_TRACE("g " + std::to_string(g) + " budget " + std::to_string(budget) + " head " + std::to_string(h));
          check_units(u.pos[i], base.pos[i], g);
          // the important part keeps its scores; representatives score -inf
          int64_t minus_inf = 0;
          for (size_t j = 0; j < u.pos[i].size(); ++j) {
            const float s = u.scores[i][j];
            const auto at = std::lower_bound(base.pos[i].begin(), base.pos[i].end(), u.pos[i][j]);
            if (at != base.pos[i].end() && *at == u.pos[i][j]) {
              EXPECT_EQ(s, base.scores[i][static_cast<size_t>(at - base.pos[i].begin())]);
            } else {
              EXPECT_TRUE(std::isinf(s) && s < 0) << s;
              ++minus_inf;
            }
          }
          EXPECT_EQ(minus_inf, reps);
        }
      }
  }
}

TEST_P(KvCrushGranularity, ShareZeroIsThePlainSelect) {
  const int kind = GetParam();
  Fixture plain(kind, 0.0f, 0), unit(kind, 0.0f, 8), tiny(kind, 0.1f, 16);  // floor(0.1 * budget) = 0 below 10
  for (const int32_t budget : {1, 9, 40, 300}) {
    const F32 q = query(9);
    const Rows a = select_rows(plain.seq->s, q, budget), b = select_rows(unit.seq->s, q, budget);
    EXPECT_EQ(a.pos, b.pos);
    EXPECT_EQ(a.scores, b.scores);
    if (budget < 10) {
      EXPECT_EQ(select_rows(tiny.seq->s, q, budget).pos, a.pos);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, KvCrushGranularity,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER,
                                           KVRET_INDEX_QUANT));

TEST(KvCrushGranularity, RepresentativesSpreadOverTheMiddle) {
  // floor(B_rep / g) buckets of units each send a unit: with EXACT at budget 400 and share 0.5, 200 representative
  // tokens at g = 8 come from at least 200 / 8 / 2 distinct units (a unit holds at most 8 of them)
  Fixture f(KVRET_INDEX_EXACT, 0.5f, 8), plain(KVRET_INDEX_EXACT, 0.0f, 0);
  const F32 q = query(5);
  const Rows u = select_rows(f.seq->s, q, 400), base = select_rows(plain.seq->s, q, 200);
  for (int h = 0; h < kHeads; ++h) {
    std::set<int64_t> units;
    for (const int32_t p : u.pos[static_cast<size_t>(h)])
      if (!std::binary_search(base.pos[static_cast<size_t>(h)].begin(), base.pos[static_cast<size_t>(h)].end(), p))
        units.insert(p / 8);
    EXPECT_GE(units.size(), 200u / 8u);
  }
}

TEST(KvCrushGranularity, RetainedSetKeepsWholeUnits) {
  for (const int32_t g : {8, 16}) {
    Fixture token(KVRET_INDEX_STREAMING, 0.25f, 0), unit(KVRET_INDEX_STREAMING, 0.25f, g),
        plain(KVRET_INDEX_STREAMING, 0.0f, 0);
    for (const int32_t budget : {40, 257}) {
      auto retained = [&](kvret_seq* s, int32_t b) {
        I32 out({kHeads, b}, -1);
        int32_t count = -1;
        expect_ok(kvret_seq_retained_set(s, 0, b, &out, &count));
        EXPECT_EQ(count, b);
        std::vector<std::vector<int32_t>> rows;
        for (int h = 0; h < kHeads; ++h) rows.emplace_back(out.data.begin() + h * b, out.data.begin() + h * b + count);
        return rows;
      };
      const auto u = retained(unit.seq->s, budget);
      const auto base = retained(plain.seq->s, budget - static_cast<int32_t>(std::floor(0.25 * budget)));
      for (int h = 0; h < kHeads; ++h) check_units(u[static_cast<size_t>(h)], base[static_cast<size_t>(h)], g);
      EXPECT_NE(u, retained(token.seq->s, budget)) << "g " << g << ": the units changed nothing";
    }
  }
}

TEST(KvCrushGranularity, BadValuesAreRefusedByField) {
  for (const int32_t bad : {3, -1, 8192, 12, 4097}) {
    kvret_config c = small_config(KVRET_INDEX_EXACT);
    c.hamming_fraction = 0.25f;
    c.hamming_granularity = bad;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_EQ(ctx, nullptr);
    EXPECT_NE(std::string(kvret_last_error()).find("hamming_granularity"), std::string::npos) << kvret_last_error();
  }
  for (const int32_t good : {0, 1, 2, 8, 4096}) {
    kvret_config c = small_config(KVRET_INDEX_EXACT);
    c.hamming_granularity = good;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_OK) << good << ": " << kvret_last_error();
    kvret_destroy(ctx);
  }
}

#ifdef KVRET_HAVE_WORKLOAD
TEST(KvCrushGranularity, AttentionMassOnTheSyntheticWorkload) {
  // reported, not a quality claim: the folded mass (of the middle) a budget of 410 holds without representatives
  // and with 25% of them at granularity 1, 8 and 16, on the synthetic workload (8k tokens, 4 decode queries) as in
  // KvCrushSelect.AttentionMassOnTheSyntheticWorkload
  const MassWorkload w;
  const int32_t budget = 410;
  for (const int kind : {KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT}) {
    const float shares[] = {0.0f, 0.25f, 0.25f, 0.25f};
    const int32_t grains[] = {0, 1, 8, 16};
    double mass[4] = {0, 0, 0, 0};
    for (int run = 0; run < 4; ++run) {
      kvret_config c = small_config(kind);
      c.hamming_fraction = shares[run];
      c.hamming_granularity = grains[run];
      w.mass(c, budget, mass[run]);
      if (HasFatalFailure()) return;
    }
    std::printf(
        "[ KvCrush ] workload 8k, %s, budget 410: attention mass %.4f without, with 25%% representatives %.4f "
        "(tokens), %.4f (units of 8), %.4f (units of 16)\n",
        kind_name(kind).c_str(), mass[0], mass[1], mass[2], mass[3]);
    for (int run = 0; run < 4; ++run) {
      EXPECT_GT(mass[run], 0.0);
      EXPECT_LE(mass[run], 1.0 + 1e-6);
      EXPECT_GE(mass[run], 0.5 * mass[0]);
    }
  }
}
#endif

}  // namespace

// The unit rule on a KvCrushLayer of its own (signatures from random sums): checked against the rule recomputed
// here from the signatures (majority, distance to the alternating anchor, buckets of units).
#include "engine/kvcrush_layer.hpp"
#include "select/kvcrush.hpp"

namespace {

TEST(KvCrushGranularity, EveryBucketOfUnitsWithACandidateSendsOne) {
  constexpr int kSig = 8, kKv = 2;
  constexpr int64_t kLen = 700, kBegin = 5, kEnd = 683;
  const std::vector<float> sums = random_vector(static_cast<size_t>(kSig * kLen), 21, 1.0f);
  kvret::KvCrushLayer layer;
  layer.rebuild_from_sums(sums.data(), kSig, kLen, kKv, kLen, 1);
  std::vector<uint64_t> anchor(1);
  kvret::make_anchor(kvret::Anchor::kAlternating, kSig, 0, nullptr, nullptr, 0, anchor.data());
  for (const int64_t g : {8, 16, 64}) {
    const kvret::KvCrushLayer::UnitOrder order = layer.unit_order(kBegin, kEnd, g);
    // the units, recomputed: first position, distance of the majority signature
    std::vector<std::pair<int, int32_t>> expected;
    for (int64_t u = kBegin / g; u * g < kEnd; ++u) {
      const int64_t lo = std::max(kBegin, u * g), hi = std::min(kEnd, (u + 1) * g);
      uint64_t majority = 0;
      for (int b = 0; b < kSig; ++b) {
        int64_t ones = 0;
        for (int64_t t = lo; t < hi; ++t) ones += (layer.bits()[static_cast<size_t>(t)] >> b) & 1u;
        if (2 * ones > hi - lo) majority |= uint64_t{1} << b;
      }
      expected.emplace_back(kvret::hamming_distance(&majority, anchor.data(), 1), static_cast<int32_t>(lo));
    }
    std::stable_sort(expected.begin(), expected.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<int32_t> units;
    for (const auto& e : expected) units.push_back(e.second);
    ASSERT_EQ(order.units, units) << "g " << g;
    for (const uint64_t seed : {1u, 2u, 3u})
      for (const int64_t n_imp : {int64_t{10}, int64_t{200}})
        for (const int64_t n_rep : {g, 5 * g + 3, 20 * g}) {
          // an important row: n_imp random distinct middle positions, ascending
          std::vector<int32_t> all;
          for (int64_t t = kBegin; t < kEnd; ++t) all.push_back(static_cast<int32_t>(t));
          const std::vector<float> r = random_vector(all.size(), seed * 100 + static_cast<uint64_t>(n_imp), 1.0f);
          std::vector<size_t> idx(all.size());
          std::iota(idx.begin(), idx.end(), 0);
          std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return r[a] < r[b]; });
          std::vector<int32_t> base;
          for (int64_t i = 0; i < n_imp; ++i) base.push_back(all[idx[static_cast<size_t>(i)]]);
          std::sort(base.begin(), base.end());
          std::vector<int32_t> row(base);
          row.resize(static_cast<size_t>(kEnd - kBegin), -1);
          const int64_t count = layer.add_unit_representatives(order, row.data(), nullptr, n_imp, n_rep);
          ASSERT_EQ(count, n_imp + std::min(n_rep, (kEnd - kBegin) - n_imp));
          row.resize(static_cast<size_t>(count));
          SCOPED_TRACE("g " + std::to_string(g) + " n_rep " + std::to_string(n_rep));
          check_units(row, base, g, kBegin, kEnd);
          // every bucket of units holding a candidate sends one of its units
          const auto n_units = static_cast<int64_t>(units.size());
          const int64_t buckets = std::min(n_rep / g, n_units);
          for (int64_t b = 0; b < buckets; ++b) {
            bool candidate = false, sent = false;
            for (int64_t u = b * n_units / buckets; u < (b + 1) * n_units / buckets; ++u)
              for (int64_t t = units[static_cast<size_t>(u)];
                   t < std::min(kEnd, (units[static_cast<size_t>(u)] / g + 1) * g); ++t) {
                const auto p = static_cast<int32_t>(t);
                const bool important = std::binary_search(base.begin(), base.end(), p);
                candidate |= !important;
                sent |= !important && std::binary_search(row.begin(), row.end(), p);
              }
            EXPECT_EQ(sent, candidate) << "bucket " << b;
          }
        }
  }
}

}  // namespace
