// Where KVCrush's importance comes from: the prompt's queries given to kvret_seq_observe (one signature bit per query
// head), or the attention accumulated per query head and token under config.hamming_importance =
// KVRET_IMPORTANCE_ACCUMULATED (steps from kvret_seq_attend and kvret_seq_observe_attention). Properties: a query
// window equal to the keys of the keys' rule gives its bits, selections and retained sets exactly; bits follow a
// reference computed from the queries; the sums equal the probabilities handed in, summed; attend's steps are its
// softmax over its working set; signatures, representatives and retained sets come from the sums; share 0 is the
// base method; truncate, drop_front and fork carry the state; every bad input is refused with nothing changed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "c_api/handles.hpp"
#include "engine/sequence.hpp"
#include "kvret.h"
#include "select/kvcrush.hpp"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

constexpr int64_t kTokens = 700;  // small_config: 4 sink, 16 local
constexpr int kW = 32;

kvret_config config(int q_heads, float share, int importance = KVRET_IMPORTANCE_WINDOW) {
  kvret_config c = small_config(KVRET_INDEX_EXACT);
  c.n_q_heads = q_heads;
  c.hamming_fraction = share;
  c.hamming_importance = importance;
  return c;
}

struct Model {
  ContextPtr ctx;
  int q_heads;
  F32 k{{kTokens, kHeads, kDim}}, v{{kTokens, kHeads, kDim}};
  Model(int q, float share, int importance = KVRET_IMPORTANCE_WINDOW)
      : ctx(make_context(config(q, share, importance))), q_heads(q) {
    clustered_kv(kTokens, kHeads, kDim, 11, k, v);
  }
  /// A sequence holding the first `n` tokens of layer 0 as a prefill.
  std::unique_ptr<Seq> open(int64_t n = kTokens - 40) const {
    auto s = std::make_unique<Seq>(ctx.get());
    prefill(s->s, 0, k, v, 0, n);
    return s;
  }
};

Sequence& seq_of(const Seq& s) { return *sequence_from_handle(s.s); }

F32 random_tensor(std::vector<int64_t> shape, uint64_t seed, float scale = 1.0f) {
  F32 t(std::move(shape));
  t.data = random_vector(t.data.size(), seed, scale);
  t.refresh();
  return t;
}

/// The layer's last `w` keys as a query window [w, n_q_heads = n_kv_heads, head_dim].
F32 keys_window(const F32& k, int64_t length, int w) {
  F32 q({w, kHeads, kDim});
  const size_t row = static_cast<size_t>(kHeads * kDim);
  std::copy(k.data.begin() + (length - w) * row, k.data.begin() + length * row, q.data.begin());
  return q;
}

std::vector<std::vector<int32_t>> retained(const Seq& s, int32_t budget) {
  I32 out({kHeads, budget}, -1);
  int32_t count = -1;
  EXPECT_EQ(kvret_seq_retained_set(s.s, 0, budget, &out, &count), KVRET_OK) << kvret_last_error();
  std::vector<std::vector<int32_t>> rows;
  for (int h = 0; h < kHeads; ++h)
    rows.emplace_back(out.data.begin() + h * budget, out.data.begin() + h * budget + std::max(count, 0));
  return rows;
}

std::vector<std::vector<int32_t>> selected(const Seq& s, const F32& q, int32_t budget) {
  I32 out({kHeads, budget}, -1);
  int32_t count = -1;
  EXPECT_EQ(kvret_select(s.s, 0, &q, budget, &out, &count), KVRET_OK) << kvret_last_error();
  std::vector<std::vector<int32_t>> rows;
  for (int h = 0; h < kHeads; ++h)
    rows.emplace_back(out.data.begin() + h * budget, out.data.begin() + h * budget + std::max(count, 0));
  return rows;
}

int64_t length_of(const Seq& s) {
  int64_t n = 0;
  EXPECT_EQ(kvret_seq_length(s.s, 0, &n), KVRET_OK);
  return n;
}

/// The signature bits of layer 0's select state as a vector (tokens() rows).
std::vector<uint64_t> bits_of(const Seq& s) {
  const KvCrushLayer* c = seq_of(s).crush(0);
  const int words = signature_words(c->signature_heads());
  return std::vector<uint64_t>(c->bits().begin(), c->bits().begin() + c->tokens() * words);
}

/// Reference SnapKV importance, in double, of tokens [0, n) for query head rows window ([w, d]) against keys of
/// KV head h, normalized over the first `norm` tokens.
std::vector<double> window_reference(const std::vector<float>& window, int w, const F32& k, int h, int64_t n,
                                     int64_t norm) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  std::vector<double> imp(static_cast<size_t>(n), 0.0);
  for (int j = 0; j < w; ++j) {
    std::vector<double> l(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (int i = 0; i < kDim; ++i)
        s += static_cast<double>(window[static_cast<size_t>(j * kDim + i)]) *
             k.data[static_cast<size_t>((t * kHeads + h) * kDim + i)];
      l[static_cast<size_t>(t)] = s * scale;
    }
    const double mx = *std::max_element(l.begin(), l.begin() + norm);
    double z = 0;
    for (int64_t t = 0; t < norm; ++t) z += std::exp(l[static_cast<size_t>(t)] - mx);
    for (int64_t t = 0; t < n; ++t) imp[static_cast<size_t>(t)] += std::exp(l[static_cast<size_t>(t)] - mx) / z;
  }
  return imp;
}

/// The top ceil(n/2) tokens of `score` (descending, ties to the lower position), as a membership mask.
template <class T>
std::vector<bool> top_half(const std::vector<T>& score) {
  const auto n = static_cast<int64_t>(score.size());
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return score[static_cast<size_t>(a)] > score[static_cast<size_t>(b)]; });
  std::vector<bool> in(static_cast<size_t>(n), false);
  for (int64_t i = 0; i < (n + 1) / 2; ++i) in[static_cast<size_t>(order[static_cast<size_t>(i)])] = true;
  return in;
}

bool bit(const std::vector<uint64_t>& bits, int words, int64_t t, int h) {
  return (bits[static_cast<size_t>(t * words + h / 64)] >> (h % 64)) & 1u;
}

// --- the prompt's queries -------------------------------------------------------------------------------------

TEST(KvCrushImportance, QueryWindowOfTheLastKeysIsTheKeysRule) {
  for (const float share : {0.0f, 0.25f, 0.5f}) {
    const Model m(kHeads, share);  // n_q_heads == n_kv_heads: one query head per KV head
    const auto keys_rule = m.open(), queries = m.open();
    const int64_t n = length_of(*keys_rule);
    const F32 window = keys_window(m.k, n, kW);
    KVRET_ASSERT_OK(kvret_seq_observe(queries->s, 0, &window));
    for (const int32_t budget : {1, 7, 60, 300})
      EXPECT_EQ(retained(*queries, budget), retained(*keys_rule, budget)) << "share " << share << " budget " << budget;
    if (share == 0.0f) continue;
    const F32 q = random_tensor({kHeads, kDim}, 3, 2.0f);
    for (int step = 0; step < 3; ++step) {  // selects, then decode steps extending the signatures
      for (const int32_t budget : {8, 60, 300})
        EXPECT_EQ(selected(*queries, q, budget), selected(*keys_rule, q, budget));
      EXPECT_EQ(bits_of(*queries), bits_of(*keys_rule));
      decode(keys_rule->s, 0, m.k, m.v, n + step * 5, n + step * 5 + 5);
      decode(queries->s, 0, m.k, m.v, n + step * 5, n + step * 5 + 5);
    }
  }
}

TEST(KvCrushImportance, BitsFollowTheQueriesPerQueryHead) {
  const Model m(kQHeads, 0.25f);
  const auto s = m.open();
  const int64_t n = length_of(*s);
  const int w = 20;
  const F32 window = random_tensor({w, kQHeads, kDim}, 21, 1.5f);
  KVRET_ASSERT_OK(kvret_seq_observe(s->s, 0, &window));
  const F32 q = random_tensor({kQHeads, kDim}, 4);
  selected(*s, q, 40);  // computes the signatures
  decode(s->s, 0, m.k, m.v, n, n + 12);
  selected(*s, q, 40);  // extends them to the decoded tokens
  const KvCrushLayer& c = *seq_of(*s).crush(0);
  ASSERT_EQ(c.signature_heads(), kQHeads);
  ASSERT_EQ(c.tokens(), n + 12);
  const int words = signature_words(kQHeads);
  const std::vector<uint64_t> bits = bits_of(*s);
  std::vector<std::vector<double>> kv(kHeads, std::vector<double>(static_cast<size_t>(n + 12), 0.0));
  for (int i = 0; i < kQHeads; ++i) {
    const int h = i / (kQHeads / kHeads);
    std::vector<float> rows(static_cast<size_t>(w * kDim));
    for (int j = 0; j < w; ++j)
      std::copy_n(window.data.begin() + (j * kQHeads + i) * kDim, kDim, rows.begin() + j * kDim);
    const std::vector<double> ref = window_reference(rows, w, m.k, h, n + 12, n);
    for (int64_t t = 0; t < n + 12; ++t)
      kv[static_cast<size_t>(h)][static_cast<size_t>(t)] += ref[static_cast<size_t>(t)];
    // prompt tokens: the top half of the reference, but for near-ties at the cut
    std::vector<double> prompt(ref.begin(), ref.begin() + n);
    std::vector<double> sorted = prompt;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const double cut = sorted[static_cast<size_t>((n + 1) / 2 - 1)];
    int64_t marked = 0, threshold_checked = 0;
    for (int64_t t = 0; t < n + 12; ++t) {
      const double r = ref[static_cast<size_t>(t)];
      marked += t < n && bit(bits, words, t, i);
      if (std::abs(r - cut) <= 1e-5 * cut + 1e-12) continue;
      EXPECT_EQ(bit(bits, words, t, i), r > cut) << "query head " << i << " token " << t;
      threshold_checked += t >= n;
    }
    EXPECT_EQ(marked, (n + 1) / 2) << "query head " << i;
    EXPECT_GT(threshold_checked, 0);
  }
  for (int h = 0; h < kHeads; ++h)  // a KV head's importance: the sum over its query heads
    for (int64_t t = 0; t < n + 12; t += 7)
      EXPECT_NEAR(c.importance(h, t), kv[static_cast<size_t>(h)][static_cast<size_t>(t)],
                  1e-4 * kv[static_cast<size_t>(h)][static_cast<size_t>(t)] + 1e-9);
}

TEST(KvCrushImportance, RetainedSetFromTheQueries) {
  const Model m(kQHeads, 0.0f);
  const auto s = m.open();
  const int64_t n = length_of(*s);
  const F32 window = random_tensor({kW, kQHeads, kDim}, 5, 1.5f);
  const auto before = retained(*s, 50);
  KVRET_ASSERT_OK(kvret_seq_observe(s->s, 0, &window));
  const auto rows = retained(*s, 50);
  EXPECT_NE(rows, before);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<double> kv(static_cast<size_t>(n), 0.0);
    for (int g = 0; g < kQHeads / kHeads; ++g) {
      const int i = h * (kQHeads / kHeads) + g;
      std::vector<float> r(static_cast<size_t>(kW * kDim));
      for (int j = 0; j < kW; ++j)
        std::copy_n(window.data.begin() + (j * kQHeads + i) * kDim, kDim, r.begin() + j * kDim);
      const auto ref = window_reference(r, kW, m.k, h, n, n);
      for (int64_t t = 0; t < n; ++t) kv[static_cast<size_t>(t)] += ref[static_cast<size_t>(t)];
    }
    std::vector<double> middle(kv.begin() + 4, kv.begin() + (n - 16));
    std::sort(middle.begin(), middle.end(), std::greater<>());
    const double cut = middle[49];
    for (const int32_t p : rows[static_cast<size_t>(h)])
      EXPECT_GE(kv[static_cast<size_t>(p)], cut * (1 - 1e-5)) << "head " << h << " position " << p;
  }
}

// --- accumulated attention ------------------------------------------------------------------------------------

TEST(KvCrushImportance, SumsEqualTheProbabilitiesHandedIn) {
  const Model m(kQHeads, 0.25f, KVRET_IMPORTANCE_ACCUMULATED);
  const auto s = m.open();
  int64_t n = length_of(*s);
  std::vector<float> ref;  // [kQHeads, tokens]
  int64_t ref_n = 0;
  std::mt19937_64 rng(8);
  for (int step = 0; step < 6; ++step) {
    const int64_t cols = step == 2 ? n / 3 : n;  // a step over the first tokens only
    F32 p({kQHeads, cols});
    for (auto& x : p.data) x = static_cast<float>(rng() % 1000) / 997.0f;
    KVRET_ASSERT_OK(kvret_seq_observe_attention(s->s, 0, &p));
    if (cols > ref_n) {
      std::vector<float> grown(static_cast<size_t>(kQHeads * cols), 0.0f);
      for (int i = 0; i < kQHeads; ++i) std::copy_n(ref.begin() + i * ref_n, ref_n, grown.begin() + i * cols);
      ref.swap(grown);
      ref_n = cols;
    }
    for (int i = 0; i < kQHeads; ++i)
      for (int64_t t = 0; t < cols; ++t)
        ref[static_cast<size_t>(i * ref_n + t)] += p.data[static_cast<size_t>(i * cols + t)];
    const AttentionAccumulator& a = seq_of(*s).accumulated(0);
    ASSERT_EQ(a.tokens(), ref_n);
    ASSERT_EQ(a.importance(), ref) << "step " << step;
    EXPECT_EQ(seq_of(*s).accumulated_steps(0), step + 1);
    decode(s->s, 0, m.k, m.v, n, n + 1);
    ++n;
  }
}

TEST(KvCrushImportance, AttendAddsItsSoftmaxOverTheWorkingSet) {
  const Model m(kQHeads, 0.0f, KVRET_IMPORTANCE_ACCUMULATED);
  const auto s = m.open();
  const int64_t n = length_of(*s);
  const int32_t budget = 30;
  const F32 q = random_tensor({kQHeads, kDim}, 13, 2.0f);
  const auto sel = selected(*s, q, budget);
  F32 out({kQHeads, kDim});
  KVRET_ASSERT_OK(kvret_seq_attend(s->s, 0, &q, budget, 0.0f, &out, nullptr));
  const AttentionAccumulator& a = seq_of(*s).accumulated(0);
  ASSERT_EQ(a.tokens(), n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  for (int i = 0; i < kQHeads; ++i) {
    const int h = i / (kQHeads / kHeads);
    std::vector<int32_t> rows(sel[static_cast<size_t>(h)]);  // the working set: sink, selection, local
    for (int32_t p = 0; p < 4; ++p) rows.push_back(p);
    for (int64_t p = n - 16; p < n; ++p) rows.push_back(static_cast<int32_t>(p));
    std::vector<double> l;
    for (const int32_t p : rows) {
      double d = 0;
      for (int x = 0; x < kDim; ++x)
        d += static_cast<double>(q.data[static_cast<size_t>(i * kDim + x)]) *
             m.k.data[static_cast<size_t>((p * kHeads + h) * kDim + x)];
      l.push_back(d * scale);
    }
    const double mx = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (const double x : l) z += std::exp(x - mx);
    std::vector<double> want(static_cast<size_t>(n), 0.0);
    for (size_t r = 0; r < rows.size(); ++r) want[static_cast<size_t>(rows[r])] = std::exp(l[r] - mx) / z;
    for (int64_t t = 0; t < n; ++t)
      EXPECT_NEAR(a.importance()[static_cast<size_t>(i * n + t)], want[static_cast<size_t>(t)], 1e-5)
          << "query head " << i << " token " << t;
  }
}

/// Reference representatives of KV head h (docs/kvcrush.md): the middle tokens ordered by (Hamming distance of the
/// query-head bits to the alternating anchor, position), cut into `reps` buckets of near-equal size, each sending its
/// first token not in `important`; a bucket of important tokens only gives its place to the first such token in the
/// order not yet taken.
std::vector<int32_t> reference_reps(const std::vector<std::vector<bool>>& marks, int64_t mid_begin, int64_t mid_end,
                                    const std::vector<int32_t>& important, int64_t reps) {
  std::vector<std::pair<int, int32_t>> c;
  for (int64_t p = mid_begin; p < mid_end; ++p) {
    int d = 0;
    for (size_t i = 0; i < marks.size(); ++i) d += marks[i][static_cast<size_t>(p)] != (i % 2 == 1);
    c.emplace_back(d, static_cast<int32_t>(p));
  }
  std::sort(c.begin(), c.end());
  const auto cn = static_cast<int64_t>(c.size());
  std::set<int32_t> taken(important.begin(), important.end());
  std::vector<int32_t> out;
  int64_t missing = 0;
  for (int64_t b = 0; b < reps; ++b) {
    int64_t i = b * cn / reps;
    while (i < (b + 1) * cn / reps && taken.count(c[static_cast<size_t>(i)].second) != 0) ++i;
    if (i == (b + 1) * cn / reps) {
      ++missing;
      continue;
    }
    out.push_back(c[static_cast<size_t>(i)].second);
    taken.insert(out.back());
  }
  for (size_t i = 0; i < c.size() && missing > 0; ++i)
    if (taken.insert(c[i].second).second) {
      out.push_back(c[i].second);
      --missing;
    }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(KvCrushImportance, SignaturesAndRepresentativesComeFromTheSums) {
  const Model crushed(kQHeads, 0.25f, KVRET_IMPORTANCE_ACCUMULATED), plain(kQHeads, 0.0f, KVRET_IMPORTANCE_ACCUMULATED);
  const auto s = crushed.open(), base = plain.open();
  const int64_t n = length_of(*s);
  std::mt19937_64 rng(17);
  for (int step = 0; step < 4; ++step) {
    F32 p({kQHeads, n});
    for (auto& x : p.data) x = static_cast<float>(rng() % 4096) / 4096.0f;
    KVRET_ASSERT_OK(kvret_seq_observe_attention(s->s, 0, &p));
    KVRET_ASSERT_OK(kvret_seq_observe_attention(base->s, 0, &p));
  }
  const std::vector<float>& sums = seq_of(*s).accumulated(0).importance();
  std::vector<std::vector<bool>> marks;
  for (int i = 0; i < kQHeads; ++i)
    marks.push_back(top_half(std::vector<float>(sums.begin() + i * n, sums.begin() + (i + 1) * n)));
  const F32 q = random_tensor({kQHeads, kDim}, 23, 2.0f);
  const int32_t budget = 40;  // 10 representatives
  const auto rows = selected(*s, q, budget);
  const auto important = selected(*base, q, budget - 10);
  const KvCrushLayer& c = *seq_of(*s).crush(0);
  ASSERT_TRUE(c.from_sums());
  const std::vector<uint64_t> bits = bits_of(*s);
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < kQHeads; ++i)
      ASSERT_EQ(bit(bits, 1, t, i), marks[static_cast<size_t>(i)][static_cast<size_t>(t)]);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<float> weight(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      float w = sums[static_cast<size_t>(h * 4 * n + t)];
      for (int g = 1; g < 4; ++g) w += sums[static_cast<size_t>((h * 4 + g) * n + t)];
      weight[static_cast<size_t>(t)] = w;
    }
    const auto reps = reference_reps(marks, 4, n - 16, important[static_cast<size_t>(h)], 10);
    std::vector<int32_t> want = important[static_cast<size_t>(h)];
    want.insert(want.end(), reps.begin(), reps.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(rows[static_cast<size_t>(h)], want) << "head " << h;
    // the retained set's important part: the head's top middle tokens by the summed weight
    std::vector<float> middle(weight.begin() + 4, weight.begin() + (n - 16));
    std::vector<int32_t> top(middle.size());
    std::iota(top.begin(), top.end(), 4);
    std::stable_sort(top.begin(), top.end(), [&](int32_t a, int32_t b) {
      return weight[static_cast<size_t>(a)] > weight[static_cast<size_t>(b)];
    });
    top.resize(30);
    std::sort(top.begin(), top.end());
    EXPECT_EQ(retained(*base, 30)[static_cast<size_t>(h)], top);
    std::vector<int32_t> kept = top;
    const auto kept_reps = reference_reps(marks, 4, n - 16, top, 10);
    kept.insert(kept.end(), kept_reps.begin(), kept_reps.end());
    std::sort(kept.begin(), kept.end());
    EXPECT_EQ(retained(*s, 40)[static_cast<size_t>(h)], kept);
  }
}

TEST(KvCrushImportance, ShareZeroAndNoStepAreTheBaseMethod) {
  const Model window(kQHeads, 0.25f), acc(kQHeads, 0.25f, KVRET_IMPORTANCE_ACCUMULATED),
      plain(kQHeads, 0.0f, KVRET_IMPORTANCE_ACCUMULATED);
  const auto w = window.open(), a = acc.open(), p = plain.open(), p2 = plain.open();
  const F32 q = random_tensor({kQHeads, kDim}, 29, 2.0f);
  // before any step, the accumulated mode is the window's
  EXPECT_EQ(selected(*a, q, 60), selected(*w, q, 60));
  EXPECT_EQ(retained(*a, 60), retained(*w, 60));
  // share 0 selects as the index does, whatever the sums and the window say
  const int64_t n = length_of(*p);
  F32 probs = random_tensor({kQHeads, n}, 31);
  for (auto& x : probs.data) x = std::abs(x);
  const F32 qw = random_tensor({8, kQHeads, kDim}, 37);
  KVRET_ASSERT_OK(kvret_seq_observe_attention(p->s, 0, &probs));
  KVRET_ASSERT_OK(kvret_seq_observe(p->s, 0, &qw));
  for (const int32_t budget : {1, 20, 200}) EXPECT_EQ(selected(*p, q, budget), selected(*p2, q, budget));
}

TEST(KvCrushImportance, TruncateDropFrontAndForkCarryTheState) {
  const Model m(kQHeads, 0.25f, KVRET_IMPORTANCE_ACCUMULATED);
  const auto s = m.open();
  const int64_t n = length_of(*s);
  F32 probs = random_tensor({kQHeads, n}, 41);
  for (auto& x : probs.data) x = std::abs(x);
  KVRET_ASSERT_OK(kvret_seq_observe_attention(s->s, 0, &probs));
  KVRET_ASSERT_OK(kvret_seq_observe_attention(s->s, 0, &probs));
  const std::vector<float> sums = seq_of(*s).accumulated(0).importance();
  const F32 q = random_tensor({kQHeads, kDim}, 43, 2.0f);
  const auto before = selected(*s, q, 40);
  kvret_seq* child = nullptr;
  KVRET_ASSERT_OK(kvret_seq_fork(s->s, &child));
  const Seq forked(child);
  EXPECT_EQ(seq_of(forked).accumulated(0).importance(), sums);
  EXPECT_EQ(selected(forked, q, 40), before);
  // truncate: the sums of the tokens that stay
  KVRET_ASSERT_OK(kvret_seq_truncate(forked.s, n - 100));
  const AttentionAccumulator& t = seq_of(forked).accumulated(0);
  ASSERT_EQ(t.tokens(), n - 100);
  for (int i = 0; i < kQHeads; ++i)
    for (int64_t x = 0; x < n - 100; ++x)
      ASSERT_EQ(t.importance()[static_cast<size_t>(i * (n - 100) + x)], sums[static_cast<size_t>(i * n + x)]);
  EXPECT_EQ(seq_of(*s).accumulated(0).importance(), sums);  // the parent is unchanged
  // drop_front: the dropped tokens' sums go, the others move with their tokens
  KVRET_ASSERT_OK(kvret_seq_drop_front(s->s, 4, 50));
  const AttentionAccumulator& d = seq_of(*s).accumulated(0);
  ASSERT_EQ(d.tokens(), n - 50);
  for (int i = 0; i < kQHeads; ++i)
    for (int64_t x = 0; x < n - 50; ++x)
      ASSERT_EQ(d.importance()[static_cast<size_t>(i * (n - 50) + x)],
                sums[static_cast<size_t>(i * n + (x < 4 ? x : x + 50))]);
  // sessions do not save the inputs
  EXPECT_EQ(kvret_session_save(s->s, "acc"), KVRET_ERR_UNSUPPORTED);
}

TEST(KvCrushImportance, TruncationIntoTheObservedPromptDropsTheWindow) {
  const Model m(kQHeads, 0.0f);
  const auto s = m.open(), keys = m.open();
  const int64_t n = length_of(*s);
  const F32 qw = random_tensor({kW, kQHeads, kDim}, 47);
  KVRET_ASSERT_OK(kvret_seq_observe(s->s, 0, &qw));
  decode(s->s, 0, m.k, m.v, n, n + 10);
  decode(keys->s, 0, m.k, m.v, n, n + 10);
  KVRET_ASSERT_OK(kvret_seq_truncate(s->s, n + 2));  // not into the prompt: kept
  KVRET_ASSERT_OK(kvret_seq_truncate(keys->s, n + 2));
  EXPECT_NE(retained(*s, 50), retained(*keys, 50));
  kvret_seq* child = nullptr;
  KVRET_ASSERT_OK(kvret_seq_fork(s->s, &child));
  const Seq forked(child);
  EXPECT_EQ(retained(forked, 50), retained(*s, 50));
  EXPECT_EQ(kvret_session_save(s->s, "window"), KVRET_ERR_UNSUPPORTED);
  KVRET_ASSERT_OK(kvret_seq_truncate(s->s, n - 1));  // into it: the keys' rule again
  KVRET_ASSERT_OK(kvret_seq_truncate(keys->s, n - 1));
  EXPECT_EQ(retained(*s, 50), retained(*keys, 50));
  KVRET_ASSERT_OK(kvret_session_save(s->s, "window"));
}

// --- errors ---------------------------------------------------------------------------------------------------

TEST(KvCrushImportance, BadInputIsRefusedAndChangesNothing) {
  const Model m(kQHeads, 0.25f), acc(kQHeads, 0.25f, KVRET_IMPORTANCE_ACCUMULATED);
  const auto s = m.open(), a = acc.open();
  const int64_t n = length_of(*s);
  const F32 good = random_tensor({4, kQHeads, kDim}, 53);
  const auto before = retained(*s, 40);
  auto refused = [&](kvret_status want, kvret_status got, const char* word) {
    EXPECT_EQ(got, want) << kvret_last_error();
    EXPECT_NE(std::string(kvret_last_error()).find(word), std::string::npos) << kvret_last_error();
  };
  refused(KVRET_ERR_INVALID_ARGUMENT, kvret_seq_observe(s->s, 0, nullptr), "q_window");
  refused(KVRET_ERR_OUT_OF_RANGE, kvret_seq_observe(s->s, 2, &good), "layer 2");
  refused(KVRET_ERR_OUT_OF_RANGE, kvret_seq_observe(s->s, -1, &good), "layer -1");
  refused(KVRET_ERR_STATE, kvret_seq_observe(s->s, 1, &good), "holds no tokens");
  EXPECT_EQ(kvret_seq_observe(nullptr, 0, &good), KVRET_ERR_INVALID_HANDLE);
  const F32 rank2({kQHeads, kDim}), heads({4, kHeads, kDim}), dim({4, kQHeads, 32}), long_w({n + 1, kQHeads, kDim});
  refused(KVRET_ERR_SHAPE, kvret_seq_observe(s->s, 0, &rank2), "q_window");
  refused(KVRET_ERR_SHAPE, kvret_seq_observe(s->s, 0, &heads), "n_q_heads");
  refused(KVRET_ERR_SHAPE, kvret_seq_observe(s->s, 0, &dim), "head_dim");
  refused(KVRET_ERR_SHAPE, kvret_seq_observe(s->s, 0, &long_w), "q_window");
  F32 empty({0, kQHeads, kDim});
  refused(KVRET_ERR_SHAPE, kvret_seq_observe(s->s, 0, &empty), "q_window");
  I32 ints({4, kQHeads, kDim});
  refused(KVRET_ERR_DTYPE, kvret_seq_observe(s->s, 0, &ints), "q_window");
  F32 foreign({4, kQHeads, kDim});
  foreign.t.device = foreign_device();
  EXPECT_NE(kvret_seq_observe(s->s, 0, &foreign), KVRET_OK);
  EXPECT_EQ(retained(*s, 40), before);
  {  // NaN with check_finite
    kvret_config c = config(kQHeads, 0.25f);
    c.check_finite = 1;
    const ContextPtr ctx = make_context(c);
    Seq f(ctx.get());
    prefill(f.s, 0, m.k, m.v, 0, 100);
    F32 nan = random_tensor({4, kQHeads, kDim}, 59);
    nan.data[17] = NAN;
    refused(KVRET_ERR_NONFINITE, kvret_seq_observe(f.s, 0, &nan), "q_window");
  }
  // observe_attention
  F32 probs({kQHeads, n}, 0.01f);
  refused(KVRET_ERR_STATE, kvret_seq_observe_attention(s->s, 0, &probs), "hamming_importance");
  refused(KVRET_ERR_INVALID_ARGUMENT, kvret_seq_observe_attention(a->s, 0, nullptr), "probs");
  EXPECT_EQ(kvret_seq_observe_attention(nullptr, 0, &probs), KVRET_ERR_INVALID_HANDLE);
  refused(KVRET_ERR_OUT_OF_RANGE, kvret_seq_observe_attention(a->s, 2, &probs), "layer 2");
  refused(KVRET_ERR_STATE, kvret_seq_observe_attention(a->s, 1, &probs), "holds no tokens");
  const F32 too_long({kQHeads, n + 1}), wrong_heads({kHeads, n}), rank3({1, kQHeads, n});
  refused(KVRET_ERR_SHAPE, kvret_seq_observe_attention(a->s, 0, &too_long), "probs");
  refused(KVRET_ERR_SHAPE, kvret_seq_observe_attention(a->s, 0, &wrong_heads), "n_q_heads");
  refused(KVRET_ERR_SHAPE, kvret_seq_observe_attention(a->s, 0, &rank3), "probs");
  I32 iprobs({kQHeads, n});
  refused(KVRET_ERR_DTYPE, kvret_seq_observe_attention(a->s, 0, &iprobs), "probs");
  for (const float bad : {-0.5f, NAN, INFINITY}) {
    F32 p({kQHeads, n}, 0.01f);
    p.data[static_cast<size_t>(3 * n + 9)] = bad;
    refused(KVRET_ERR_INVALID_ARGUMENT, kvret_seq_observe_attention(a->s, 0, &p), "query head 3, position 9");
  }
  EXPECT_EQ(seq_of(*a).accumulated_steps(0), 0);
  EXPECT_EQ(seq_of(*a).accumulated(0).tokens(), 0);
  // the config field
  kvret_config c = config(kQHeads, 0.25f);
  for (const int32_t v : {-1, 2}) {
    c.hamming_importance = v;
    kvret_context* ctx = nullptr;
    refused(KVRET_ERR_INVALID_ARGUMENT, kvret_create(&c, &ctx), "hamming_importance");
    EXPECT_EQ(ctx, nullptr);
  }
}

}  // namespace
