// PQ's select math in one place (kernels/math/pq_math.h, with page_math.h's weighted fold and take), the functions
// the CUDA backend's device select (src/backend/pq_select_ops.hpp) is made of, against the CPU code:
// - the lookup-table entry and an exact token's logit against scaled_dots (f32 and f16 keys), the cell logit against
//   the CPU select's cell table, with NaN, -0 and infinities among the inputs;
// - PqRetriever::select of the cell path (pq_bits * pq_m <= 16) against a model built from the header's functions
//   alone, positions and scores bit for bit: shapes m = 2, 3, 4, with and without exact tokens, f32 and f16 stores,
//   after decode appends and a cut, both folds, budgets from 1 to the whole middle, queries with ties (zero), NaN and
//   -0;
// - the index's items (a token's cell or exact item) and versions, which the device's copy of the index follows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "cpu_select.hpp"
#include "index/pq_retriever.hpp"
#include "math/page_math.h"
#include "math/pq_math.h"
#include "select/gqa_fold.hpp"
#include "store/host_kv_store.hpp"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
namespace pm = kvret::cuda::math;

namespace {

bool same_bits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  return (a != a && b != b) || x == y;
}

std::vector<float> awkward_floats(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            1e-40f,
                            -1e30f};
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = rng() % 12 == 0 ? specials[rng() % std::size(specials)] : u(rng);
  return out;
}

TEST(PqMath, LutEntryAndExactLogitAreScaledDots) {
  std::mt19937_64 rng(1);
  for (const int len : {1, 4, 7, 8, 9, 16, 21, 32, 64, 128}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int nq = 1 + static_cast<int>(rng() % 5), rows = 1 + static_cast<int>(rng() % 40);
      const std::vector<float> q = awkward_floats(static_cast<size_t>(nq * len), rng(), 3.0f);
      const std::vector<float> keys = awkward_floats(static_cast<size_t>(rows * len), rng(), 2.0f);
      const float scale = trial % 3 == 0 ? 1.0f : 1.0f / std::sqrt(static_cast<float>(len));
      std::vector<float> cpu(static_cast<size_t>(nq * rows));
      scaled_dots(q.data(), len, nq, keys.data(), len, rows, len, scale, cpu.data(), rows);
      // the same rows stored as f16, read back as f32
      std::vector<uint16_t> half(keys.size());
      convert_row(reinterpret_cast<const std::byte*>(keys.data()), DType::F32,
                  reinterpret_cast<std::byte*>(half.data()), DType::F16, keys.size());
      std::vector<float> widened(keys.size());
      convert_row(reinterpret_cast<const std::byte*>(half.data()), DType::F16,
                  reinterpret_cast<std::byte*>(widened.data()), DType::F32, keys.size());
      std::vector<float> cpu16(cpu.size());
      scaled_dots(q.data(), len, nq, half.data(), DType::F16, len, rows, len, scale, cpu16.data(), rows);
      for (int g = 0; g < nq; ++g)
        for (int r = 0; r < rows; ++r) {
          const float* qg = q.data() + g * len;
          const float want = cpu[static_cast<size_t>(g * rows + r)];
          ASSERT_TRUE(same_bits(pm::pq_lut_entry(qg, keys.data() + r * len, len, scale), want)) << len << " " << r;
          ASSERT_TRUE(same_bits(pm::pq_exact_logit(scale, qg, keys.data() + r * len, len), want));
          ASSERT_TRUE(same_bits(pm::pq_exact_logit(scale, qg, widened.data() + r * len, len),
                                cpu16[static_cast<size_t>(g * rows + r)]));
        }
    }
  }
}

/// The CPU select's cell table of one head (lut [m, k]): cell u = sum_j c_j k^j holds l_0[c_0] + l_1[c_1] + ...
TEST(PqMath, CellLogitIsTheCpuCellTable) {
  std::mt19937_64 rng(2);
  for (const auto& [m, bits] : std::vector<std::pair<int, int>>{{1, 8}, {2, 6}, {2, 8}, {3, 4}, {4, 3}, {4, 4}}) {
    const int k = 1 << bits;
    ASSERT_EQ(pm::pq_cells(m, bits), int64_t{1} << (m * bits));
    const std::vector<float> lut = awkward_floats(static_cast<size_t>(m * k), rng(), 5.0f);
    const int64_t cells = pm::pq_cells(m, bits);
    for (int64_t u = 0; u < cells; u += 1 + static_cast<int64_t>(rng() % 7)) {
      int64_t rest = u;
      float s = lut[static_cast<size_t>(rest % k)];
      for (int j = 1; j < m; ++j) {
        rest /= k;
        s = s + lut[static_cast<size_t>(j * k + rest % k)];
      }
      ASSERT_TRUE(same_bits(pm::pq_cell_logit(lut.data(), u, m, k), s)) << m << " " << bits << " cell " << u;
    }
  }
  EXPECT_EQ(pm::pq_cells(4, 6), 0) << "24 bits: scored per token";
  EXPECT_EQ(pm::pq_cells(2, 9), 0);
}

struct Shape {
  int m, bits;
  float exact;
  DType dtype;
};

constexpr int kH = 2, kD = 64, kQ = 8, kGroup = kQ / kH;

/// A store of n clustered keys and an index of `s` over [4, n - 100), then decode appends to n - 16, and a cut.
struct Built {
  HostKvStore store;
  PqRetriever index;
  Built(const Shape& s, int64_t n, uint64_t seed)
      : store(kH, kD, s.dtype), index(kH, kD, [&] {
          PqRetriever::Params p;
          p.m = s.m;
          p.bits = s.bits;
          p.exact_fraction = s.exact;
          p.seed = seed;
          return p;
        }()) {
    F32 k({n, kH, kD}), v({n, kH, kD});
    test::clustered_kv(n, kH, kD, seed, k, v);
    store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), n, true);
    index.extend(store, 4, n - 100, true, 2);
    for (int64_t t = n - 100; t < n - 16; t += 7) index.extend(store, t, std::min(t + 7, n - 16), false, 2);
  }
};

/// The header's model of a cell-path select of head h: positions ascending and their scores.
void header_select(const PqRetriever& index, const std::vector<float>& q, float scale, int64_t budget,
                   kvret_gqa_fold fold, int h, std::vector<int32_t>& rows, std::vector<float>& scores) {
  const int m = index.m(), k = index.k(), dsub = index.sub_dim();
  const int64_t cells = index.n_cells(), n = index.size(), base = index.base();
  const auto& exact_pos = index.exact_positions(h);
  const auto n_exact = static_cast<int64_t>(exact_pos.size());
  const std::vector<float> exact_keys = index.exact_keys_f32(h);
  const int32_t* counts = index.cell_counts(h).data();
  const int64_t items = cells + n_exact;
  std::vector<float> folded(static_cast<size_t>(items), fold == KVRET_FOLD_MAX_LOGIT ? pm::neg_inf() : 0.0f);
  for (int g = 0; g < kGroup; ++g) {
    const float* qg = q.data() + (h * kGroup + g) * kD;
    std::vector<float> lut(static_cast<size_t>(m * k));
    for (int j = 0; j < m; ++j)
      for (int c = 0; c < k; ++c)
        lut[static_cast<size_t>(j * k + c)] =
            pm::pq_lut_entry(qg + j * dsub, index.centroids(h, j) + c * dsub, dsub, scale);
    std::vector<float> l(static_cast<size_t>(items));
    for (int64_t u = 0; u < items; ++u)
      l[static_cast<size_t>(u)] = u < cells ? pm::pq_cell_logit(lut.data(), u, m, k)
                                            : pm::pq_exact_logit(scale, qg, exact_keys.data() + (u - cells) * kD, kD);
    if (fold == KVRET_FOLD_MAX_LOGIT) {
      for (int64_t u = 0; u < items; ++u)
        folded[static_cast<size_t>(u)] = pm::page_max_step(folded[static_cast<size_t>(u)], l[static_cast<size_t>(u)]);
      continue;
    }
    const pm::PageSoftmax sm = pm::weighted_softmax_terms(
        l.data(), items, [&](int64_t u) { return pm::pq_item_weight(counts, cells, n_exact, u); });
    for (int64_t u = 0; u < items; ++u)
      folded[static_cast<size_t>(u)] =
          pm::page_sum_prob_step(folded[static_cast<size_t>(u)], l[static_cast<size_t>(u)], sm);
  }
  // the take: items best first (page_order_key), whole while they fit, the crossing one trimmed
  std::vector<int64_t> order(static_cast<size_t>(items));
  for (int64_t u = 0; u < items; ++u) order[static_cast<size_t>(u)] = u;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return pm::page_order_key(folded[static_cast<size_t>(a)], static_cast<uint32_t>(a)) <
           pm::page_order_key(folded[static_cast<size_t>(b)], static_cast<uint32_t>(b));
  });
  std::vector<int64_t> taken(static_cast<size_t>(items));
  int64_t before = 0;
  for (const int64_t u : order) {
    const int64_t w = pm::pq_item_weight(counts, cells, n_exact, u);
    taken[static_cast<size_t>(u)] = pm::page_take(before, w, budget);
    before += w;
  }
  // tokens in position order: the item of each from its codes (or its exact entry), its rank within the item
  std::vector<int64_t> seen(static_cast<size_t>(items));
  rows.clear();
  scores.clear();
  const uint8_t* codes = index.codes(h);
  for (int64_t t = 0, e = 0; t < n; ++t) {
    int64_t u = 0;
    for (int j = m - 1; j >= 0; --j) u = u * k + codes[t * m + j];
    if (e < n_exact && exact_pos[static_cast<size_t>(e)] == base + t) u = cells + e++;
    const int64_t rank = seen[static_cast<size_t>(u)]++;
    if (pm::pq_token_taken(taken[static_cast<size_t>(u)], pm::pq_item_weight(counts, cells, n_exact, u), rank)) {
      rows.push_back(static_cast<int32_t>(base + t));
      scores.push_back(folded[static_cast<size_t>(u)]);
    }
  }
}

using HeaderModel = void (*)(const PqRetriever& index, const std::vector<float>& q, float scale, int64_t budget,
                             kvret_gqa_fold fold, int h, std::vector<int32_t>& rows, std::vector<float>& scores);

/// 16 selects of b.index, both folds, budgets of the whole middle, 1 and random, with random, zero, -0 and awkward
/// (NaN, -0, infinities; at trial 4 of 8, and 6 too when `awkward_six`) queries: every head's positions and scores
/// are `model`'s, bit for bit.
void expect_selects_are_the_model(const Built& b, HeaderModel model, bool awkward_six, std::mt19937_64& rng,
                                  const std::string& where) {
  const PqRetriever& index = b.index;
  const int64_t middle = index.size();
  for (int trial = 0; trial < 16; ++trial) {
    const auto fold = trial % 2 == 0 ? KVRET_FOLD_SUM_PROB : KVRET_FOLD_MAX_LOGIT;
    const int64_t budget = trial % 8 == 1   ? middle
                           : trial % 8 == 3 ? 1
                                            : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(middle));
    std::vector<float> q = test::random_vector(static_cast<size_t>(kQ * kD), rng(), 2.0f);
    if (trial % 8 == 2) std::fill(q.begin(), q.end(), 0.0f);  // every logit 0: ties everywhere
    if (trial % 8 == 4 || (awkward_six && trial % 8 == 6)) q = awkward_floats(q.size(), rng(), 2.0f);
    if (trial % 8 == 5) std::fill(q.begin(), q.end(), -0.0f);
    const test::HeadsSelected s =
        test::select_heads(index, b.store, q, kH, kD, kGroup, index.indexed_begin(), index.indexed_end(), budget, fold);
    ASSERT_EQ(s.count, budget);
    const SelectRequest& req = s.req;
    const auto& rows = s.rows;
    const auto& scores = s.scores;
    for (int h = 0; h < kH; ++h) {
      std::vector<int32_t> want_rows;
      std::vector<float> want_scores;
      model(index, q, req.scale, budget, fold, h, want_rows, want_scores);
      const std::string at = where + " trial " + std::to_string(trial) + " head " + std::to_string(h);
      ASSERT_EQ(rows[static_cast<size_t>(h)], want_rows) << at;
      for (size_t i = 0; i < want_scores.size(); ++i)
        ASSERT_TRUE(same_bits(scores[static_cast<size_t>(h)][i], want_scores[i]))
            << at << " token " << i << ": " << scores[static_cast<size_t>(h)][i] << " vs " << want_scores[i];
    }
  }
}

TEST(PqMath, CpuSelectIsTheHeaderModel) {
  const Shape shapes[] = {{2, 6, 0.0f, DType::F32}, {2, 6, 0.1f, DType::F32},  {2, 6, 0.05f, DType::F16},
                          {3, 4, 0.1f, DType::F32}, {4, 3, 0.05f, DType::F16}, {2, 4, 0.0f, DType::F16}};
  std::mt19937_64 rng(5);
  for (const Shape& s : shapes) {
    for (const bool cut : {false, true}) {
      Built b(s, 1300, 11 + static_cast<uint64_t>(s.m * 7 + s.bits));
      if (cut) {
        const int64_t to = b.index.indexed_end() - 37;
        ASSERT_TRUE(b.index.can_cut(to));
        b.index.cut(b.store, to);
      }
      const PqRetriever& index = b.index;
      ASSERT_TRUE(index.scores_cells());
      if (s.exact > 0) {
        ASSERT_GT(index.exact_positions(0).size(), 0u);
      }
      const std::string where = "m " + std::to_string(s.m) + " bits " + std::to_string(s.bits) + " exact " +
                                std::to_string(s.exact) + " cut " + std::to_string(cut);
      expect_selects_are_the_model(b, header_select, false, rng, where);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

/// pq_token_logit is pq_token_logits' bits (m = 4 from two pairs, the others from +0 in order), every m and vector
/// width, with NaN, -0 and infinities in the table.
TEST(PqMath, TokenLogitIsTheCpuTokenLogits) {
  std::mt19937_64 rng(6);
  for (const auto& [m, bits] :
       std::vector<std::pair<int, int>>{{4, 6}, {4, 8}, {8, 4}, {8, 8}, {3, 8}, {16, 2}, {12, 3}}) {
    const int k = 1 << bits, nq = 3;
    const int64_t n = 1 + static_cast<int64_t>(rng() % 300);
    const std::vector<float> lut = awkward_floats(static_cast<size_t>(nq * m * k), rng(), 4.0f);
    std::vector<uint8_t> codes(static_cast<size_t>(n * m));
    for (auto& c : codes) c = static_cast<uint8_t>(rng() % static_cast<uint64_t>(k));
    std::vector<float> cpu(static_cast<size_t>(nq * n));
    pq_token_logits(lut.data(), nq, m, k, codes.data(), n, cpu.data());
    for (int g = 0; g < nq; ++g)
      for (int64_t t = 0; t < n; ++t)
        ASSERT_TRUE(same_bits(pm::pq_token_logit(lut.data() + g * m * k, codes.data() + t * m, m, k),
                              cpu[static_cast<size_t>(g * n + t)]))
            << "m " << m << " bits " << bits << " token " << t;
  }
}

/// The header's model of a per-token select of head h (no cells): positions ascending and their scores.
void header_token_select(const PqRetriever& index, const std::vector<float>& q, float scale, int64_t budget,
                         kvret_gqa_fold fold, int h, std::vector<int32_t>& rows, std::vector<float>& scores) {
  const int m = index.m(), k = index.k(), dsub = index.sub_dim();
  const int64_t n = index.size(), base = index.base();
  const auto& exact_pos = index.exact_positions(h);
  const std::vector<float> exact_keys = index.exact_keys_f32(h);
  std::vector<int64_t> exact_of(static_cast<size_t>(n), -1);
  for (size_t e = 0; e < exact_pos.size(); ++e)
    exact_of[static_cast<size_t>(exact_pos[e] - base)] = static_cast<int64_t>(e);
  std::vector<std::vector<float>> luts(kGroup), logits(kGroup);
  std::vector<pm::Pq4Reference> refs(kGroup);
  bool tables = m == 4 && k <= 64 && fold == KVRET_FOLD_SUM_PROB;
  for (int g = 0; g < kGroup; ++g) {
    const float* qg = q.data() + (h * kGroup + g) * kD;
    auto& lut = luts[static_cast<size_t>(g)];
    lut.resize(static_cast<size_t>(m * k));
    for (int j = 0; j < m; ++j)
      for (int c = 0; c < k; ++c)
        lut[static_cast<size_t>(j * k + c)] =
            pm::pq_lut_entry(qg + j * dsub, index.centroids(h, j) + c * dsub, dsub, scale);
    auto& l = logits[static_cast<size_t>(g)];
    l.resize(static_cast<size_t>(n));
    float exact_max = pm::neg_inf();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t e = exact_of[static_cast<size_t>(t)];
      l[static_cast<size_t>(t)] = e >= 0 ? pm::pq_exact_logit(scale, qg, exact_keys.data() + e * kD, kD)
                                         : pm::pq_token_logit(lut.data(), index.codes(h) + t * m, m, k);
      if (e >= 0) exact_max = pm::page_max_step(exact_max, l[static_cast<size_t>(t)]);
    }
    if (m == 4 && k <= 64) {
      refs[static_cast<size_t>(g)] = pm::pq4_finish_reference(pm::pq4_table_reference(lut.data(), k), exact_max);
      tables = tables && refs[static_cast<size_t>(g)].ok;
    }
  }
  std::vector<float> folded(static_cast<size_t>(n), fold == KVRET_FOLD_MAX_LOGIT ? pm::neg_inf() : 0.0f);
  for (int g = 0; g < kGroup; ++g) {
    std::vector<float> l = logits[static_cast<size_t>(g)];
    if (fold == KVRET_FOLD_MAX_LOGIT) {
      for (int64_t t = 0; t < n; ++t)
        folded[static_cast<size_t>(t)] = pm::page_max_step(folded[static_cast<size_t>(t)], l[static_cast<size_t>(t)]);
      continue;
    }
    if (tables) {
      for (int64_t t = 0; t < n; ++t)
        l[static_cast<size_t>(t)] = exact_of[static_cast<size_t>(t)] >= 0
                                        ? pm::pq4_exact_term(l[static_cast<size_t>(t)], refs[static_cast<size_t>(g)])
                                        : pm::pq4_token_term(luts[static_cast<size_t>(g)].data(),
                                                             index.codes(h) + t * 4, k, refs[static_cast<size_t>(g)]);
    } else {
      const float mx = pm::pq_max_ignoring_nan(l.data(), n);
      if (!(mx > pm::neg_inf())) continue;
      for (auto& x : l) x = pm::pq_softmax_term(x, mx);
    }
    const pm::PageSoftmax sm = pm::pq_unweighted_normaliser(l.data(), n);
    for (int64_t t = 0; t < n; ++t)
      folded[static_cast<size_t>(t)] =
          pm::page_sum_prob_step(folded[static_cast<size_t>(t)], l[static_cast<size_t>(t)], sm);
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) order[static_cast<size_t>(t)] = t;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return pm::page_order_key(folded[static_cast<size_t>(a)], static_cast<uint32_t>(a)) <
           pm::page_order_key(folded[static_cast<size_t>(b)], static_cast<uint32_t>(b));
  });
  order.resize(static_cast<size_t>(budget));
  std::sort(order.begin(), order.end());
  rows.clear();
  scores.clear();
  for (const int64_t t : order) {
    rows.push_back(static_cast<int32_t>(base + t));
    scores.push_back(folded[static_cast<size_t>(t)]);
  }
}

/// The per-token path (pq_bits * pq_m > 16): m = 4 at 6 bits (the default; SUM_PROB folds from tables of
/// exponentials), m = 4 at 7 bits (k > 64: the logits' fold), m = 8 at 4 bits; with and without exact tokens, f32
/// and f16 stores, both folds, zero, -0, NaN and infinite queries (a non-finite reference: the logits' fold).
TEST(PqMath, CpuTokenSelectIsTheHeaderModel) {
  const Shape shapes[] = {
      {4, 6, 0.05f, DType::F32}, {4, 6, 0.0f, DType::F16}, {4, 7, 0.05f, DType::F32}, {8, 4, 0.1f, DType::F16}};
  std::mt19937_64 rng(7);
  for (const Shape& s : shapes) {
    Built b(s, 1300, 21 + static_cast<uint64_t>(s.m * 7 + s.bits));
    const PqRetriever& index = b.index;
    ASSERT_FALSE(index.scores_cells());
    expect_selects_are_the_model(b, header_token_select, true, rng,
                                 "m " + std::to_string(s.m) + " bits " + std::to_string(s.bits));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

/// items() is each token's cell (from its codes) or n_cells() + e for the e-th exact token, over any range; an
/// append keeps layout_version() and changes version(); a training, a cut and a restore change both.
TEST(PqMath, ItemsAndVersionsFollowTheIndex) {
  const Shape s{2, 6, 0.1f, DType::F32};
  Built b(s, 1300, 3);
  PqRetriever& index = b.index;
  const auto check_items = [&] {
    for (int h = 0; h < kH; ++h) {
      const int64_t n = index.size();
      std::vector<int32_t> all(static_cast<size_t>(n)), part(static_cast<size_t>(n));
      index.items(h, 0, n, all.data());
      const int64_t from = n / 3;
      index.items(h, from, n, part.data());
      const auto& pos = index.exact_positions(h);
      for (int64_t t = 0, e = 0; t < n; ++t) {
        int64_t u = 0;
        for (int j = index.m() - 1; j >= 0; --j) u = u * index.k() + index.codes(h)[t * index.m() + j];
        if (e < static_cast<int64_t>(pos.size()) && pos[static_cast<size_t>(e)] == index.base() + t)
          u = index.n_cells() + e++;
        ASSERT_EQ(all[static_cast<size_t>(t)], u) << "token " << t;
        if (t >= from) {
          ASSERT_EQ(part[static_cast<size_t>(t - from)], u);
        }
      }
    }
  };
  check_items();
  const uint64_t v0 = index.version(), l0 = index.layout_version();
  index.extend(b.store, index.indexed_end(), index.indexed_end() + 5, false, 2);
  EXPECT_NE(index.version(), v0);
  EXPECT_EQ(index.layout_version(), l0) << "an append keeps the layout";
  check_items();
  for (int h = 0; h < kH; ++h) {  // exact keys from an offset are the tail of all of them
    const auto all = index.exact_keys_f32(h);
    const auto tail = index.exact_keys_f32(h, 2);
    ASSERT_EQ(std::vector<float>(all.begin() + 2 * kD, all.end()), tail);
  }
  const uint64_t v1 = index.version();
  index.cut(b.store, index.indexed_end() - 3);
  EXPECT_NE(index.version(), v1);
  EXPECT_NE(index.layout_version(), l0) << "a cut changes the layout";
  check_items();
  const uint64_t l2 = index.layout_version();
  const std::vector<std::byte> saved = index.save();
  PqRetriever copy(kH, kD, [] {
    PqRetriever::Params p;
    p.exact_fraction = 0.1f;
    return p;
  }());
  copy.restore(b.store, saved.data(), saved.size());
  EXPECT_NE(copy.layout_version(), l2);
  EXPECT_NE(copy.version(), index.version());
}

}  // namespace
