// KVCrush's CPU core (src/select/kvcrush): signatures, Hamming grouping, representatives, the budget split.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "core/tensor_view.hpp"
#include "engine/kvcrush_layer.hpp"
#include "math/kvcrush_math.h"
#include "select/kvcrush.hpp"
#include "select/topk.hpp"
#include "store/host_kv_store.hpp"
#include "test_util.hpp"

namespace {

using namespace kvret;

std::vector<float> random_scores(int64_t n, uint64_t seed, int distinct = 0) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(static_cast<size_t>(n));
  for (auto& x : s) x = distinct > 0 ? static_cast<float>(g() % static_cast<uint64_t>(distinct)) : u(g);
  return s;
}

/// The reference bits: per head, the tokens sorted by (score descending, index ascending), the first
/// ceil(fraction * n) marked.
std::vector<uint64_t> reference_bits(const std::vector<float>& imp, int heads, int64_t n, float fraction) {
  const int words = (heads + 63) / 64;
  std::vector<uint64_t> bits(static_cast<size_t>(n * words), 0);
  int64_t k = static_cast<int64_t>(std::ceil(static_cast<double>(fraction) * static_cast<double>(n)));
  k = std::max<int64_t>(1, std::min(k, n));
  for (int h = 0; h < heads; ++h) {
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    const float* row = imp.data() + h * n;
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    for (int64_t i = 0; i < k; ++i)
      bits[static_cast<size_t>(idx[static_cast<size_t>(i)] * words + h / 64)] |= 1ull << (h % 64);
  }
  return bits;
}

TEST(KvCrush, SignatureBitsEqualReference) {
  for (int heads : {1, 7, 32, 64, 65, 130})
    for (int64_t n : {1, 2, 9, 100, 1001})
      for (float fraction : {0.5f, 0.25f, 0.1f, 1.0f})
        for (int distinct : {0, 3}) {  // continuous scores and many ties
          const auto imp = random_scores(heads * n, static_cast<uint64_t>(heads * 1000 + n), distinct);
          std::vector<uint64_t> bits(static_cast<size_t>(n * signature_words(heads)), ~0ull);
          signatures(imp.data(), heads, n, fraction, bits.data());
          ASSERT_EQ(bits, reference_bits(imp, heads, n, fraction))
              << "heads " << heads << " n " << n << " fraction " << fraction << " distinct " << distinct;
          // each head marks exactly signature_marked(n, fraction) tokens
          for (int h = 0; h < heads; ++h) {
            int64_t marked = 0;
            for (int64_t t = 0; t < n; ++t)
              marked += (bits[static_cast<size_t>(t * signature_words(heads) + h / 64)] >> (h % 64)) & 1u;
            ASSERT_EQ(marked, signature_marked(n, fraction));
          }
        }
}

TEST(KvCrush, HammingDistanceProperties) {
  for (int heads : {1, 8, 64, 100}) {
    const int words = signature_words(heads);
    const int64_t n = 60;
    const auto imp = random_scores(heads * n, 7u + static_cast<uint64_t>(heads));
    std::vector<uint64_t> bits(static_cast<size_t>(n * words));
    signatures(imp.data(), heads, n, 0.5f, bits.data());
    for (int64_t a = 0; a < n; ++a) {
      const uint64_t* ra = bits.data() + a * words;
      EXPECT_EQ(hamming_distance(ra, ra, words), 0);
      for (int64_t b = 0; b < n; ++b) {
        const uint64_t* rb = bits.data() + b * words;
        const int d = hamming_distance(ra, rb, words);
        EXPECT_GE(d, 0);
        EXPECT_LE(d, heads);
        EXPECT_EQ(d, hamming_distance(rb, ra, words));
        int ref = 0;
        for (int h = 0; h < heads; ++h) ref += ((ra[h / 64] ^ rb[h / 64]) >> (h % 64)) & 1u;
        EXPECT_EQ(d, ref);
      }
      // the complement is at distance heads
      std::vector<uint64_t> inv(ra, ra + words);
      for (int h = 0; h < heads; ++h) inv[static_cast<size_t>(h / 64)] ^= 1ull << (h % 64);
      EXPECT_EQ(hamming_distance(ra, inv.data(), words), heads);
    }
  }
}

TEST(KvCrush, Anchors) {
  const int heads = 70;
  const int words = signature_words(heads);
  std::vector<uint64_t> a(static_cast<size_t>(words)), b(static_cast<size_t>(words));
  make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, a.data());
  for (int h = 0; h < heads; ++h)
    EXPECT_EQ((a[static_cast<size_t>(h / 64)] >> (h % 64)) & 1u, static_cast<uint64_t>(h % 2));
  EXPECT_EQ(a[1] >> (heads % 64), 0u);
  make_anchor(Anchor::kRandom, heads, 42, nullptr, nullptr, 0, a.data());
  make_anchor(Anchor::kRandom, heads, 42, nullptr, nullptr, 0, b.data());
  EXPECT_EQ(a, b);
  make_anchor(Anchor::kRandom, heads, 43, nullptr, nullptr, 0, b.data());
  EXPECT_NE(a, b);
  EXPECT_EQ(a[1] >> (heads % 64), 0u);
  // majority over three tokens
  const int64_t n = 3;
  std::vector<uint64_t> bits(static_cast<size_t>(n * words), 0);
  bits[0] = 0b011;  // token 0: heads 0, 1
  bits[2] = 0b110;  // token 1: heads 1, 2
  bits[4] = 0b100;  // token 2: head 2
  const std::vector<int32_t> all{0, 1, 2}, two{0, 2};
  make_anchor(Anchor::kMajority, heads, 0, bits.data(), all.data(), 3, a.data());
  EXPECT_EQ(a[0], 0b110u);
  EXPECT_EQ(a[1], 0u);
  make_anchor(Anchor::kMajority, heads, 0, bits.data(), two.data(), 2, a.data());  // 1 of 2 is not a majority
  EXPECT_EQ(a[0], 0u);
}

TEST(KvCrush, BucketsPartitionTheCandidates) {
  for (int64_t c : {1, 5, 16, 17, 100, 1003})
    for (int64_t buckets : {1, 2, 3, 7, 16, 100}) {
      std::vector<int> owner(static_cast<size_t>(c), -1);
      int64_t min_size = c, max_size = 0;
      for (int64_t b = 0; b < buckets; ++b) {
        const int64_t lo = bucket_begin(b, c, buckets), hi = bucket_begin(b + 1, c, buckets);
        ASSERT_LE(lo, hi);
        min_size = std::min(min_size, hi - lo);
        max_size = std::max(max_size, hi - lo);
        for (int64_t i = lo; i < hi; ++i) {
          ASSERT_EQ(owner[static_cast<size_t>(i)], -1) << "candidate " << i << " in two buckets";
          owner[static_cast<size_t>(i)] = static_cast<int>(b);
        }
      }
      for (int64_t i = 0; i < c; ++i)
        ASSERT_GE(owner[static_cast<size_t>(i)], 0) << "candidate " << i << " in no bucket";
      EXPECT_LE(max_size - min_size, 1);
      if (c >= buckets) {
        EXPECT_GE(min_size, 1);
      }
    }
}

TEST(KvCrush, OrderByDistanceThenPosition) {
  const int heads = 12;
  const int words = signature_words(heads);
  const int64_t n = 500;
  const auto imp = random_scores(heads * n, 99);
  std::vector<uint64_t> bits(static_cast<size_t>(n * words));
  signatures(imp.data(), heads, n, 0.5f, bits.data());
  std::vector<uint64_t> anchor(static_cast<size_t>(words));
  make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, anchor.data());
  std::vector<int32_t> cand;
  for (int32_t p = 0; p < n; p += 1 + p % 3) cand.push_back(p);
  std::vector<int32_t> ordered(cand.size());
  order_by_distance(bits.data(), words, heads, anchor.data(), cand.data(), static_cast<int64_t>(cand.size()),
                    ordered.data());
  auto dist = [&](int32_t p) { return hamming_distance(bits.data() + p * words, anchor.data(), words); };
  std::vector<int32_t> ref = cand;
  std::sort(ref.begin(), ref.end(),
            [&](int32_t a, int32_t b) { return std::make_pair(dist(a), a) < std::make_pair(dist(b), b); });
  EXPECT_EQ(ordered, ref);
}

/// The properties of the grouping over a range (representatives()), against a reference order (std::sort by
/// (distance, position)): every candidate in exactly one bucket; each bucket that holds a candidate sends its first
/// candidate in the order; the buckets of important tokens only give their places to the first candidates not yet
/// taken; min(buckets, candidates) representatives, distinct, ascending, none important. `adversarial` makes the
/// important set the first tokens of the order, so that whole buckets are important.
TEST(KvCrush, RepresentativesCoverEveryBucket) {
  const int heads = 16;
  const int words = signature_words(heads);
  int64_t filled_places = 0;  // buckets without a candidate seen (the second rule ran)
  for (int64_t n : {40, 333, 2000})
    for (int64_t begin : {int64_t{0}, int64_t{7}})
      for (float share : {0.1f, 0.25f, 0.5f, 0.9f})
        for (bool adversarial : {false, true})
          for (Anchor anchor_kind : {Anchor::kRandom, Anchor::kAlternating, Anchor::kMajority}) {
            const int64_t end = begin + n;
            const auto imp = random_scores(heads * end, static_cast<uint64_t>(n) * 3 + 1);
            const auto score = random_scores(n, static_cast<uint64_t>(n) * 5 + 2);
            std::vector<uint64_t> bits(static_cast<size_t>(end * words)), anchor(static_cast<size_t>(words));
            signatures(imp.data(), heads, end, 0.5f, bits.data());
            std::vector<int32_t> all(static_cast<size_t>(n));
            std::iota(all.begin(), all.end(), static_cast<int32_t>(begin));
            make_anchor(anchor_kind, heads, 5, bits.data(), all.data(), n, anchor.data());
            auto dist = [&](int32_t p) { return hamming_distance(bits.data() + p * words, anchor.data(), words); };
            std::vector<int32_t> ref = all;  // the reference order
            std::sort(ref.begin(), ref.end(),
                      [&](int32_t x, int32_t y) { return std::make_pair(dist(x), x) < std::make_pair(dist(y), y); });
            const int64_t budget = n / 4;
            const BudgetSplit s = split_budget(budget, share);
            ASSERT_EQ(s.important + s.representatives, budget);
            std::vector<int32_t> imp_set(static_cast<size_t>(s.important));
            if (adversarial) {
              std::copy_n(ref.begin(), s.important, imp_set.begin());
              std::sort(imp_set.begin(), imp_set.end());
            } else {
              topk_positions(score.data(), n, s.important, static_cast<int32_t>(begin), imp_set.data());
            }
            std::vector<int32_t> ordered(static_cast<size_t>(n)), reps(static_cast<size_t>(s.representatives));
            const int64_t r = representatives(bits.data(), words, heads, anchor.data(), begin, end, imp_set.data(),
                                              s.important, s.representatives, ordered.data(), reps.data());
            ASSERT_EQ(ordered, ref);
            const int64_t c = n - s.important;
            ASSERT_EQ(r, std::min(c, s.representatives));
            reps.resize(static_cast<size_t>(r));
            const std::set<int32_t> important(imp_set.begin(), imp_set.end());
            EXPECT_TRUE(std::is_sorted(reps.begin(), reps.end()));
            const std::set<int32_t> rep_set(reps.begin(), reps.end());
            EXPECT_EQ(rep_set.size(), reps.size()) << "duplicate representative";
            for (int32_t p : reps) {
              EXPECT_GE(p, begin);
              EXPECT_LT(p, end);
              EXPECT_EQ(important.count(p), 0u) << "representative " << p << " is important";
            }
            // every token in exactly one bucket; each bucket holding a candidate sends its first one
            std::vector<int> owner(static_cast<size_t>(n), -1);
            std::set<int32_t> firsts;
            int64_t places = 0;
            for (int64_t b = 0; b < s.representatives; ++b) {
              const int64_t lo = bucket_begin(b, n, s.representatives), hi = bucket_begin(b + 1, n, s.representatives);
              int32_t first = -1;
              for (int64_t i = lo; i < hi; ++i) {
                ASSERT_EQ(owner[static_cast<size_t>(i)], -1);
                owner[static_cast<size_t>(i)] = static_cast<int>(b);
                const int32_t p = ref[static_cast<size_t>(i)];
                if (first < 0 && important.count(p) == 0) first = p;
              }
              if (first < 0) {
                ++places;
                continue;
              }
              EXPECT_EQ(rep_set.count(first), 1u) << "bucket " << b << " does not send its first candidate";
              firsts.insert(first);
            }
            for (int64_t i = 0; i < n; ++i) ASSERT_GE(owner[static_cast<size_t>(i)], 0) << "token in no bucket";
            // the other representatives: the first candidates in the order not taken by a bucket
            std::vector<int32_t> extra;
            for (const int32_t p : ref)
              if (static_cast<int64_t>(extra.size()) < places && important.count(p) == 0 && firsts.count(p) == 0)
                extra.push_back(p);
            std::set<int32_t> want = firsts;
            want.insert(extra.begin(), extra.end());
            EXPECT_EQ(rep_set, want);
            filled_places += places;
          }
  EXPECT_GT(filled_places, 0) << "no bucket of important tokens only: the second rule was not exercised";
}

TEST(KvCrush, ShareZeroIsTheBaseSelection) {
  const int heads = 8;
  for (int64_t n : {1, 10, 777})
    for (int64_t budget : {int64_t{1}, n / 3 + 1, n}) {
      const auto score = random_scores(n, static_cast<uint64_t>(n + budget), 4);  // ties too
      const auto imp = random_scores(heads * n, 3);
      std::vector<uint64_t> bits(static_cast<size_t>(n)), anchor(1);
      signatures(imp.data(), heads, n, 0.5f, bits.data());
      make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, anchor.data());
      std::vector<int32_t> base(static_cast<size_t>(budget)), crushed(static_cast<size_t>(budget), -1);
      topk_positions(score.data(), n, budget, 0, base.data());
      crush_topk(score.data(), n, budget, 0.0f, 0, bits.data(), heads, anchor.data(), crushed.data());
      EXPECT_EQ(crushed, base);
      // with a share: the same count, distinct, ascending, the important part kept
      crush_topk(score.data(), n, budget, 0.5f, 0, bits.data(), heads, anchor.data(), crushed.data());
      EXPECT_TRUE(std::is_sorted(crushed.begin(), crushed.end()));
      EXPECT_EQ(std::set<int32_t>(crushed.begin(), crushed.end()).size(), static_cast<size_t>(budget));
      const BudgetSplit s = split_budget(budget, 0.5f);
      std::vector<int32_t> top(static_cast<size_t>(s.important));
      topk_positions(score.data(), n, s.important, 0, top.data());
      for (int32_t p : top) EXPECT_TRUE(std::binary_search(crushed.begin(), crushed.end(), p));
    }
}

TEST(KvCrush, SplitBudget) {
  EXPECT_EQ(split_budget(100, 0.25f).representatives, 25);
  EXPECT_EQ(split_budget(100, 0.25f).important, 75);
  EXPECT_EQ(split_budget(3, 0.25f).representatives, 0);
  EXPECT_EQ(split_budget(7, 0.5f).representatives, 3);  // floor
  EXPECT_EQ(split_budget(100, 0.25f, 10).representatives, 10);
  EXPECT_EQ(split_budget(100, 0.25f, 10).important, 90);
  EXPECT_EQ(split_budget(100, 0.0f).important, 100);
  EXPECT_EQ(split_budget(0, 0.5f).important, 0);
}

TEST(KvCrush, MergeSelectionKeepsScores) {
  const std::vector<int32_t> a{2, 5, 9}, b{0, 6, 10};
  const std::vector<float> as{0.5f, 0.25f, 0.125f};
  std::vector<int32_t> out(6);
  std::vector<float> os(6);
  EXPECT_EQ(merge_selection(a.data(), as.data(), 3, b.data(), 3, -1.0f, out.data(), os.data()), 6);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 2, 5, 6, 9, 10}));
  EXPECT_EQ(os, (std::vector<float>{-1.0f, 0.5f, 0.25f, -1.0f, 0.125f, -1.0f}));
  // in place: out holds a in its first entries
  std::vector<int32_t> in_place{2, 5, 9, -7, -7, -7};
  merge_selection(in_place.data(), nullptr, 3, b.data(), 3, 0.0f, in_place.data(), nullptr);
  EXPECT_EQ(in_place, (std::vector<int32_t>{0, 2, 5, 6, 9, 10}));
}

/// A straightforward SnapKV importance in double.
std::vector<double> reference_snapkv(const std::vector<float>& win, int w, const std::vector<float>& keys, int64_t n,
                                     int d, float scale) {
  std::vector<double> imp(static_cast<size_t>(n), 0.0);
  for (int j = 0; j < w; ++j) {
    std::vector<double> l(static_cast<size_t>(n));
    double mx = -1e300;
    for (int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (int e = 0; e < d; ++e)
        s += static_cast<double>(win[static_cast<size_t>(j * d + e)]) * keys[static_cast<size_t>(t * d + e)];
      l[static_cast<size_t>(t)] = s * scale;
      mx = std::max(mx, l[static_cast<size_t>(t)]);
    }
    double z = 0;
    for (double x : l) z += std::exp(x - mx);
    for (int64_t t = 0; t < n; ++t) imp[static_cast<size_t>(t)] += std::exp(l[static_cast<size_t>(t)] - mx) / z;
  }
  return imp;
}

TEST(KvCrush, SnapKvImportance) {
  const int w = 4, d = 16;
  const int64_t n = 300;
  const auto win = random_scores(w * d, 1), keys = random_scores(n * d, 2);
  const float scale = 0.25f;
  std::vector<float> imp(static_cast<size_t>(n)), lse(w), later(50);
  snapkv_importance(win.data(), w, keys.data(), n, d, scale, imp.data(), lse.data());
  const auto ref = reference_snapkv(win, w, keys, n, d, scale);
  double total = 0;
  for (int64_t t = 0; t < n; ++t) {
    EXPECT_NEAR(imp[static_cast<size_t>(t)], ref[static_cast<size_t>(t)], 1e-5 * w);
    total += imp[static_cast<size_t>(t)];
  }
  EXPECT_NEAR(total, w, 1e-3);  // w softmax rows
  // later keys on the same scale: the first keys scored again give the same importance
  window_importance(win.data(), w, lse.data(), keys.data(), 50, d, scale, later.data());
  for (int64_t t = 0; t < 50; ++t) EXPECT_NEAR(later[static_cast<size_t>(t)], imp[static_cast<size_t>(t)], 1e-5);
}

TEST(KvCrush, AttentionAccumulatorAddsSteps) {
  AttentionAccumulator acc(2);
  const std::vector<float> step1{0.5f, 0.5f, 0.25f, 0.75f};                   // [2, 2]
  const std::vector<float> step2{0.25f, 0.25f, 0.5f, 0.125f, 0.125f, 0.75f};  // [2, 3]
  acc.add(step1.data(), 2);
  acc.add(step2.data(), 3);
  EXPECT_EQ(acc.tokens(), 3);
  EXPECT_EQ(acc.importance(), (std::vector<float>{0.75f, 0.75f, 0.5f, 0.375f, 0.875f, 0.75f}));
  acc.add(step1.data(), 2);  // a shorter step adds to the first tokens only
  EXPECT_EQ(acc.importance(), (std::vector<float>{1.25f, 1.25f, 0.5f, 0.625f, 1.625f, 0.75f}));
}

/// The sequence's per-layer state (engine/kvcrush_layer) against the library rules it keeps in lists: the
/// signatures of the first update are signatures() of snapkv_importance over the last 32 keys, and
/// add_representatives is representatives() over the middle (alternating anchor) + merge_selection.
TEST(KvCrush, LayerStateFollowsTheLibraryRules) {
  const int heads = 8, d = 32;
  const int64_t total = 900, prefill = 700, mid_begin = 4, local = 16;
  test::F32 k({total, heads, d}), v({total, heads, d});
  test::clustered_kv(total, heads, d, 17, k, v);
  HostKvStore store{heads, d, DType::F32};
  const auto kv = TensorView::from(&k, "k", kFloatTypes, {3});
  const auto vv = TensorView::from(&v, "v", kFloatTypes, {3});
  store.append(kv, vv, prefill, true);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  KvCrushLayer layer;
  layer.update(store, scale);
  ASSERT_EQ(layer.tokens(), prefill);
  const int words = signature_words(heads);
  {  // the first signatures
    std::vector<float> imp(static_cast<size_t>(heads * prefill)), keys(static_cast<size_t>(prefill * d));
    for (int h = 0; h < heads; ++h) {
      store.keys_f32(h, 0, prefill, keys.data());
      snapkv_importance(keys.data() + (prefill - KvCrushLayer::kWindow) * d, KvCrushLayer::kWindow, keys.data(),
                        prefill, d, scale, imp.data() + h * prefill);
      for (int64_t t = 0; t < prefill; ++t)
        ASSERT_EQ(layer.importance(h, t), imp[static_cast<size_t>(h * prefill + t)]);
    }
    std::vector<uint64_t> bits(static_cast<size_t>(prefill * words));
    signatures(imp.data(), heads, prefill, KvCrushLayer::kMarkedFraction, bits.data());
    ASSERT_TRUE(std::equal(bits.begin(), bits.end(), layer.bits().begin()));
  }
  std::vector<uint64_t> anchor(static_cast<size_t>(words));
  make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, anchor.data());
  auto check = [&](int64_t length, uint64_t seed) {
    const int64_t mid_end = length - local, mid = mid_end - mid_begin;
    std::mt19937_64 g(seed);
    std::vector<int32_t> by_order(static_cast<size_t>(mid));  // the middle in (distance, position) order
    std::iota(by_order.begin(), by_order.end(), static_cast<int32_t>(mid_begin));
    auto dist = [&](int32_t p) { return hamming_distance(layer.bits().data() + p * words, anchor.data(), words); };
    std::stable_sort(by_order.begin(), by_order.end(), [&](int32_t x, int32_t y) { return dist(x) < dist(y); });
    const KvCrushLayer::MiddleOrder order = layer.middle_order(mid_begin, mid_end);
    ASSERT_EQ(order.prefix.back(), mid);
    for (const int64_t budget : {int64_t{1}, int64_t{8}, int64_t{100}, mid})
      for (const float share : {0.25f, 0.5f, 0.9f})
        for (const bool adversarial : {false, true})  // the important set: random, or the first tokens of the order
          for (int h = 0; h < heads; ++h) {
            const BudgetSplit s = split_budget(budget, share);
            std::vector<int32_t> all = by_order;
            if (!adversarial) std::shuffle(all.begin(), all.end(), g);
            std::vector<int32_t> row(all.begin(), all.begin() + s.important);
            std::sort(row.begin(), row.end());
            std::vector<float> scores(row.size());
            for (size_t i = 0; i < row.size(); ++i) scores[i] = static_cast<float>(i);
            // the library's rule
            std::vector<int32_t> ordered(static_cast<size_t>(mid)),
                reps(static_cast<size_t>(std::max<int64_t>(1, s.representatives)));
            const int64_t r = representatives(layer.bits().data(), words, heads, anchor.data(), mid_begin, mid_end,
                                              row.data(), s.important, s.representatives, ordered.data(), reps.data());
            std::vector<int32_t> want(static_cast<size_t>(s.important + r));
            std::vector<float> want_scores(want.size());
            merge_selection(row.data(), scores.data(), s.important, reps.data(), r,
                            -std::numeric_limits<float>::infinity(), want.data(), want_scores.data());
            // the layer's, with its middle order and without
            std::vector<int32_t> row2 = row;
            row.resize(static_cast<size_t>(budget));
            scores.resize(static_cast<size_t>(budget));
            const int64_t n =
                layer.add_representatives(h, order, row.data(), scores.data(), s.important, s.representatives);
            ASSERT_EQ(n, budget);
            row.resize(static_cast<size_t>(n));
            scores.resize(static_cast<size_t>(n));
            ASSERT_EQ(row, want) << "length " << length << " budget " << budget << " share " << share << " head " << h
                                 << " adversarial " << adversarial;
            ASSERT_EQ(scores, want_scores);
            row2.resize(static_cast<size_t>(budget));
            ASSERT_EQ(
                layer.add_representatives(h, mid_begin, mid_end, row2.data(), nullptr, s.important, s.representatives),
                budget);
            row2.resize(static_cast<size_t>(budget));
            ASSERT_EQ(row2, want);
          }
  };
  check(prefill, 1);
  // decode tokens: scored against the same window and thresholds
  test::F32 kt({total - prefill, heads, d}), vt({total - prefill, heads, d});
  std::copy(k.data.begin() + prefill * heads * d, k.data.end(), kt.data.begin());
  std::copy(v.data.begin() + prefill * heads * d, v.data.end(), vt.data.begin());
  store.append(TensorView::from(&kt, "k", kFloatTypes, {3}), TensorView::from(&vt, "v", kFloatTypes, {3}),
               total - prefill, true);
  layer.update(store, scale);
  ASSERT_EQ(layer.tokens(), total);
  check(total, 2);
  // truncation after the window keeps the lists' prefix; into the window, everything goes
  layer.truncate(800);
  store.truncate(800);
  ASSERT_EQ(layer.tokens(), 800);
  check(800, 3);
  layer.truncate(600);
  EXPECT_EQ(layer.tokens(), 0);
}

/// The list search of kvcrush_math.h: the binary search (a device thread per entry) finds the list the CPU's forward
/// walk finds, over prefix counts with empty lists anywhere.
TEST(KvCrush, ListSearchEqualsTheWalk) {
  std::mt19937_64 g(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int dists = 1 + static_cast<int>(g() % 12);
    std::vector<int64_t> prefix(static_cast<size_t>(dists) + 1, 0);
    for (int d = 0; d < dists; ++d)
      prefix[static_cast<size_t>(d) + 1] =
          prefix[static_cast<size_t>(d)] + (g() % 3 == 0 ? 0 : static_cast<int64_t>(g() % 5));
    int walk = 0;
    for (int64_t k = 0; k < prefix.back(); ++k) {
      walk = cuda::math::kvcrush_list_from(prefix.data(), walk, k);
      ASSERT_LE(prefix[static_cast<size_t>(walk)], k);
      ASSERT_LT(k, prefix[static_cast<size_t>(walk) + 1]);
      ASSERT_EQ(cuda::math::kvcrush_list_of(prefix.data(), dists, k), walk) << "trial " << trial << " k " << k;
      ASSERT_EQ(cuda::math::kvcrush_list_from(prefix.data(), 0, k), walk);
    }
  }
}

/// add_representatives in the per-element form a device runs, from kvcrush_math.h alone: each bucket's first entry
/// outside the important row (a binary search per entry), the fill of the buckets without one by the free entries'
/// ranks, and each token's merged slot and score. Returns the row and its scores.
std::pair<std::vector<int32_t>, std::vector<float>> per_element_representatives(
    const std::vector<std::vector<int32_t>>& lists, const KvCrushLayer::MiddleOrder& order,
    const std::vector<int32_t>& row, const std::vector<float>& scores, int64_t n_rep) {
  namespace m = cuda::math;
  const int64_t mid = order.mid_end - order.mid_begin;
  const int dists = static_cast<int>(order.prefix.size()) - 1;
  // the k-th entry's token, from the per-distance lists of every token (what a device copy holds)
  auto token = [&](int64_t k) {
    const int d = m::kvcrush_list_of(order.prefix.data(), dists, k);
    return lists[static_cast<size_t>(d)]
                [static_cast<size_t>(m::kvcrush_list_index(order.begin.data(), order.prefix.data(), d, k))];
  };
  auto important = [&](int32_t t) { return std::binary_search(row.begin(), row.end(), t); };
  const int64_t buckets = m::kvcrush_bucket_count(n_rep, mid);
  std::vector<char> rep_entry(static_cast<size_t>(mid), 0);
  int64_t missing = 0;
  for (int64_t b = 0; b < buckets; ++b) {  // one thread per bucket
    const int64_t lo = m::kvcrush_bucket_begin(b, mid, buckets), hi = m::kvcrush_bucket_begin(b + 1, mid, buckets);
    const int64_t e = m::kvcrush_take_first(lo, hi, [&](int64_t k) { return !important(token(k)); });
    if (e < hi)
      rep_entry[static_cast<size_t>(e)] = 1;
    else
      ++missing;
  }
  int64_t free_before = 0;  // an exclusive scan over the entries still free
  std::vector<char> fill(static_cast<size_t>(mid), 0);
  for (int64_t k = 0; k < mid; ++k) {
    const bool free = !important(token(k)) && rep_entry[static_cast<size_t>(k)] == 0;
    fill[static_cast<size_t>(k)] = free && m::kvcrush_fill_takes(free_before, missing);
    free_before += free;
  }
  std::vector<int32_t> reps;
  for (int64_t k = 0; k < mid; ++k)
    if (rep_entry[static_cast<size_t>(k)] != 0 || fill[static_cast<size_t>(k)] != 0) reps.push_back(token(k));
  std::sort(reps.begin(), reps.end());
  std::vector<int32_t> out(row.size() + reps.size(), -1);
  std::vector<float> out_scores(out.size(), 0.0f);
  for (size_t i = 0; i < row.size(); ++i) {  // one thread per row entry
    const auto below = std::lower_bound(reps.begin(), reps.end(), row[i]) - reps.begin();
    const auto slot = static_cast<size_t>(m::kvcrush_merge_slot(static_cast<int64_t>(i), below));
    out[slot] = row[i];
    out_scores[slot] = m::kvcrush_merged_score(false, scores[i]);
  }
  for (size_t j = 0; j < reps.size(); ++j) {
    const auto below = std::lower_bound(row.begin(), row.end(), reps[j]) - row.begin();
    const auto slot = static_cast<size_t>(m::kvcrush_merge_slot(static_cast<int64_t>(j), below));
    out[slot] = reps[j];
    out_scores[slot] = m::kvcrush_merged_score(true, 0.0f);
  }
  return {out, out_scores};
}

/// The per-element form equals the layer's add_representatives (the CPU walk) bit for bit, positions and scores,
/// over random and adversarial important rows (the first tokens of the order: buckets taken entirely), budgets up
/// to the middle, and middles cut anywhere.
TEST(KvCrush, PerElementRepresentativesEqualTheLayer) {
  const int heads = 8, d = 32;
  const int64_t total = 600;
  test::F32 k({total, heads, d}), v({total, heads, d});
  test::clustered_kv(total, heads, d, 23, k, v);
  HostKvStore store{heads, d, DType::F32};
  store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), total, true);
  KvCrushLayer layer;
  layer.update(store, 1.0f / std::sqrt(static_cast<float>(d)));
  const int words = signature_words(heads);
  std::vector<uint64_t> anchor(static_cast<size_t>(words));
  make_anchor(Anchor::kAlternating, heads, 0, nullptr, nullptr, 0, anchor.data());
  std::mt19937_64 g(5);
  for (const auto& [mid_begin, mid_end] : {std::pair<int64_t, int64_t>{0, total}, {4, 584}, {131, 140}, {300, 301}}) {
    const int64_t mid = mid_end - mid_begin;
    // the middle in (distance, position) order: what the lists hold, and what a device copy holds
    std::vector<int32_t> by_order(static_cast<size_t>(mid));
    std::iota(by_order.begin(), by_order.end(), static_cast<int32_t>(mid_begin));
    auto dist = [&](int32_t p) { return hamming_distance(layer.bits().data() + p * words, anchor.data(), words); };
    std::stable_sort(by_order.begin(), by_order.end(), [&](int32_t x, int32_t y) { return dist(x) < dist(y); });
    std::vector<std::vector<int32_t>> lists(static_cast<size_t>(heads) + 1);  // every token, per distance
    for (int32_t t = 0; t < static_cast<int32_t>(total); ++t) lists[static_cast<size_t>(dist(t))].push_back(t);
    for (const int64_t budget : {int64_t{1}, int64_t{3}, int64_t{40}, mid})
      for (const float share : {0.25f, 0.5f, 0.9f})
        for (const bool adversarial : {false, true}) {
          if (budget > mid) continue;  // a select's budget is at most the middle
          const BudgetSplit s = split_budget(budget, share);
          const KvCrushLayer::MiddleOrder order = layer.middle_order(mid_begin, mid_end, s.representatives);
          std::vector<int32_t> all = by_order;
          if (!adversarial) std::shuffle(all.begin(), all.end(), g);
          std::vector<int32_t> row(all.begin(), all.begin() + s.important);
          std::sort(row.begin(), row.end());
          std::vector<float> scores(row.size());
          for (auto& x : scores) x = static_cast<float>(g() % 1000) * 0.125f;
          const auto [want, want_scores] = per_element_representatives(lists, order, row, scores, s.representatives);
          std::vector<int32_t> got = row;
          std::vector<float> got_scores = scores;
          got.resize(static_cast<size_t>(budget));
          got_scores.resize(static_cast<size_t>(budget));
          const int64_t n =
              layer.add_representatives(0, order, got.data(), got_scores.data(), s.important, s.representatives);
          ASSERT_EQ(n, static_cast<int64_t>(want.size()));
          got.resize(static_cast<size_t>(n));
          got_scores.resize(static_cast<size_t>(n));
          ASSERT_EQ(got, want) << "middle " << mid_begin << ".." << mid_end << " budget " << budget << " share "
                               << share << " adversarial " << adversarial;
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_EQ(std::bit_cast<uint32_t>(got_scores[i]), std::bit_cast<uint32_t>(want_scores[i])) << i;
        }
  }
}

}  // namespace
