// SpeCache's output rule (config.quant_attention): kvret_seq_attend on the quant index attends over every token,
// the selected ones exact and the rest as the low-bit copy has them. With every middle token selected it is exact
// attention (kvret_attend's, bit for bit: the exact rows go through the blocked decode attention); with 64 exact rows
// its error on the synthetic workload is at most half that of pure 1-bit attention; a config that asks for it on
// another index is refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/tensor_view.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"
#include "index/quant_retriever.hpp"
#include "kvret.h"
#include "test_util.hpp"
#ifdef KVRET_HAVE_WORKLOAD
#include "workload.hpp"
#endif

using namespace kvret;
using test::F32;
using test::I32;
#ifdef KVRET_HAVE_WORKLOAD
namespace workload = kvret::workload;
#endif

namespace {

constexpr int kHeads = 2, kQHeads = 8, kDim = 64;

/// Exact attention of q over all `tokens` rows of k and v ([T, H, D]), in double precision.
std::vector<double> exact_attention(const std::vector<float>& k, const std::vector<float>& v, int64_t tokens,
                                    const std::vector<float>& q) {
  const int group = kQHeads / kHeads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  std::vector<double> out(static_cast<size_t>(kQHeads * kDim), 0.0);
  for (int hq = 0; hq < kQHeads; ++hq) {
    const int h = hq / group;
    std::vector<double> logit(static_cast<size_t>(tokens));
    double mx = -INFINITY;
    for (int64_t t = 0; t < tokens; ++t) {
      double s = 0;
      for (int i = 0; i < kDim; ++i)
        s += static_cast<double>(q[static_cast<size_t>(hq * kDim + i)]) *
             k[static_cast<size_t>((t * kHeads + h) * kDim + i)];
      logit[static_cast<size_t>(t)] = s * scale;
      mx = std::max(mx, s * scale);
    }
    double z = 0;
    for (int64_t t = 0; t < tokens; ++t) z += std::exp(logit[static_cast<size_t>(t)] - mx);
    for (int64_t t = 0; t < tokens; ++t) {
      const double w = std::exp(logit[static_cast<size_t>(t)] - mx) / z;
      for (int i = 0; i < kDim; ++i)
        out[static_cast<size_t>(hq * kDim + i)] += w * v[static_cast<size_t>((t * kHeads + h) * kDim + i)];
    }
  }
  return out;
}

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

kvret_config quant_config(int bits) {
  kvret_config c = test::small_config(KVRET_INDEX_QUANT);
  c.quant_bits = bits;
  c.quant_attention = 1;
  c.background_build = 0;
  return c;
}

TEST(QuantAttention, EveryMiddleTokenSelectedIsExactAttention) {
  auto ctx = test::make_context(quant_config(1));
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  const int64_t tokens = 700;
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  test::clustered_kv(tokens, kHeads, kDim, 4, k, v);
  test::expect_ok(kvret_append_prefill(seq, 0, &k.t, &v.t));
  F32 q({kQHeads, kDim}), out({kQHeads, kDim});
  q.data = test::random_vector(static_cast<size_t>(kQHeads * kDim), 9, 0.5f);
  q.refresh();
  const int64_t middle = tokens - 4 - 16;
  test::expect_ok(kvret_seq_attend(seq, 0, &q.t, static_cast<int32_t>(middle), 0.0f, &out.t, nullptr));
  const std::vector<double> want = exact_attention(k.data, v.data, tokens, q.data);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(out.data[i], want[i], 1e-5) << i;
  // and it is the CPU backend's kvret_attend (the blocked decode attention) over the rows in position order, bit for
  // bit (on the CUDA backend too: its quantized attention runs the same arithmetic)
  kvret_config cpu = quant_config(1);
  cpu.device_type = KVRET_DEVICE_CPU;
  auto cpu_ctx = test::make_context(cpu);
  F32 qh = q, kh({kHeads, tokens, kDim}), vh({kHeads, tokens, kDim}), direct({kQHeads, kDim});
  for (int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < kHeads; ++h)
      for (int i = 0; i < kDim; ++i) {
        const auto from = static_cast<size_t>((t * kHeads + h) * kDim + i),
                   to = static_cast<size_t>((h * tokens + t) * kDim + i);
        kh.data[to] = k.data[from];
        vh.data[to] = v.data[from];
      }
  for (F32* b : {std::addressof(qh), std::addressof(kh), std::addressof(vh), std::addressof(direct)}) {
    b->refresh();
    b->t.device = {KVRET_DEVICE_CPU, 0};
  }
  test::expect_ok(kvret_attend(cpu_ctx.get(), &qh.t, &kh.t, &vh.t, tokens, 0.0f, &direct.t, nullptr));
  for (size_t i = 0; i < direct.data.size(); ++i) ASSERT_EQ(out.data[i], direct.data[i]) << i;
  test::expect_ok(kvret_seq_close(seq));
}

/// Relative output error of seq_attend with `budget` exact rows per head and of pure low-bit attention, averaged
/// over the queries (q: [steps, n_q_heads, head_dim]), against exact attention over every token.
struct Errors {
  double mixed = 0, pure = 0;
};
Errors quant_errors(int bits, int32_t budget, const F32& k, const F32& v, int64_t tokens, const std::vector<float>& qs,
                    int steps) {
  kvret_config c = quant_config(bits);
  std::string disk;
  Context ctx(read_config(&c, &disk), disk);
  Sequence* seq = ctx.open_sequence();
  seq->append_prefill(0, &k.t, &v.t);
  Errors e;
  for (int s = 0; s < steps; ++s) {
    F32 q({kQHeads, kDim}), out({kQHeads, kDim});
    q.data.assign(qs.begin() + s * kQHeads * kDim, qs.begin() + (s + 1) * kQHeads * kDim);
    q.refresh();
    seq->attend(0, &q.t, budget, 0.0f, &out.t);
    const std::vector<double> want = exact_attention(k.data, v.data, tokens, q.data);
    e.mixed += relative_error(out.data, want) / steps;
    const auto& quant = dynamic_cast<const QuantRetriever&>(seq->index(0));
    std::vector<float> pure(static_cast<size_t>(kQHeads * kDim));
    quant.attend_dense(seq->store(0), nullptr, 0, q.data.data(), kQHeads / kHeads, 1.0f / 8.0f, pure.data(), 1);
    e.pure += relative_error(pure, want) / steps;
  }
  ctx.close_sequence(seq);
  return e;
}

/// On clustered keys with random values (no structure for the selection to find in the values), the exact rows
/// still lower the error.
TEST(QuantAttention, ExactRowsLowerTheErrorOfPureLowBitAttention) {
  const int64_t tokens = 3000;
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  test::clustered_kv(tokens, kHeads, kDim, 21, k, v);
  const std::vector<float> qs = test::random_vector(static_cast<size_t>(4 * kQHeads * kDim), 40, 0.5f);
  for (const int bits : {1, 2}) {
    const Errors e = quant_errors(bits, 64, k, v, tokens, qs, 4);
    std::printf("[ quant attention ] clustered keys, %d-bit: relative output error %.4f pure, %.4f with 64 exact\n",
                bits, e.pure, e.mixed);
    EXPECT_LT(e.mixed, e.pure) << bits;
  }
}

#ifdef KVRET_HAVE_WORKLOAD
/// SpeCache's claim, on the demo's synthetic workload (RoPE keys, sinks, topics, needles, outlier channels): 64
/// exact rows per head at least halve the output error of pure 1-bit attention.
TEST(QuantAttention, SixtyFourExactRowsHalveTheErrorOfPureOneBitAttentionOnTheWorkload) {
  workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = kQHeads;
  wc.n_kv_heads = kHeads;
  wc.head_dim = kDim;
  wc.n_prefill = 4096;
  wc.n_decode = 4;
  const workload::Workload w(wc);
  F32 k({wc.n_prefill, kHeads, kDim}), v({wc.n_prefill, kHeads, kDim});
  w.keys_values(0, 0, wc.n_prefill, k.data.data(), v.data.data());
  std::vector<float> qs(static_cast<size_t>(wc.n_decode * kQHeads * kDim));
  w.queries(0, wc.n_decode, qs.data());
  for (const int bits : {1, 2}) {
    const Errors e = quant_errors(bits, 64, k, v, wc.n_prefill, qs, wc.n_decode);
    std::printf("[ quant attention ] workload 4k, %d-bit: relative output error %.4f pure, %.4f with 64 exact\n", bits,
                e.pure, e.mixed);
    if (bits == 1) {
      EXPECT_LE(e.mixed, 0.5 * e.pure);
    }
    EXPECT_LT(e.mixed, e.pure) << bits;
  }
}
#endif

/// The rule computed apart, in double precision: every token of layer 0 with the key exact for the sink, the
/// local window and the positions in exact_keys[h] or exact_rows[h], the low-bit copy's key otherwise, and the
/// value exact for the sink, the local window and exact_rows[h], the low-bit copy's value otherwise.
std::vector<double> mixed_attention(Sequence& seq, const std::vector<std::set<int32_t>>& exact_rows,
                                    const std::vector<std::set<int32_t>>& exact_keys, const std::vector<float>& q,
                                    double scale) {
  const auto& quant = dynamic_cast<const QuantRetriever&>(seq.index(0));
  const HostKvStore& store = seq.store(0);
  const int64_t n = store.size(), begin = quant.indexed_begin(), end = quant.indexed_end();
  const int group = kQHeads / kHeads;
  std::vector<double> out(static_cast<size_t>(kQHeads * kDim), 0.0);
  std::vector<float> key(kDim), value(kDim), low_key(kDim), low_value(kDim);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<double> logit(static_cast<size_t>(group * n));
    std::vector<std::vector<float>> values(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      const bool edge = t < begin || t >= end;
      const auto pos = static_cast<int32_t>(t);
      const bool row = edge || exact_rows[static_cast<size_t>(h)].count(pos) > 0;
      const bool exact_key = row || exact_keys[static_cast<size_t>(h)].count(pos) > 0;
      load_row_f32(store.key_row(h, t), store.dtype(), key.data(), kDim);
      load_row_f32(store.value_row(h, t), store.dtype(), value.data(), kDim);
      if (!edge) quant.head(h).reconstruct(t - begin, low_key.data(), low_value.data());
      values[static_cast<size_t>(t)] = row ? value : low_value;
      for (int g = 0; g < group; ++g) {
        double dot = 0;
        for (int i = 0; i < kDim; ++i)
          dot += static_cast<double>(q[static_cast<size_t>((h * group + g) * kDim + i)]) *
                 (exact_key ? key : low_key)[static_cast<size_t>(i)];
        logit[static_cast<size_t>(g * n + t)] = dot * scale;
      }
    }
    for (int g = 0; g < group; ++g) {
      const double* l = logit.data() + static_cast<size_t>(g * n);
      const double mx = *std::max_element(l, l + n);
      double z = 0;
      for (int64_t t = 0; t < n; ++t) z += std::exp(l[t] - mx);
      double* o = out.data() + static_cast<size_t>((h * group + g) * kDim);
      for (int64_t t = 0; t < n; ++t)
        for (int i = 0; i < kDim; ++i)
          o[i] += std::exp(l[t] - mx) / z * values[static_cast<size_t>(t)][static_cast<size_t>(i)];
    }
  }
  return out;
}

/// Each KV head's selected positions of layer 0 (seq.select with `budget`).
std::vector<std::set<int32_t>> selected_sets(Sequence& seq, const F32& q, int32_t budget) {
  I32 rows({kHeads, budget});
  const int64_t count = seq.select(0, &q.t, budget, &rows.t, nullptr);
  std::vector<std::set<int32_t>> sets(kHeads);
  for (int h = 0; h < kHeads; ++h)
    sets[static_cast<size_t>(h)].insert(rows.data.begin() + h * budget, rows.data.begin() + h * budget + count);
  return sets;
}

double max_abs_difference(const std::vector<float>& got, const std::vector<double>& want) {
  double d = 0;
  for (size_t i = 0; i < want.size(); ++i) d = std::max(d, std::abs(got[i] - want[i]));
  return d;
}

/// With re-ranking (quant_rerank = r), the r x budget candidates the low-bit keys rank highest (a plain select of
/// r x budget with quant_rerank = 1 and the maximum over each group, whatever the configured fold) enter the softmax
/// with their exact keys; the budget of them selected by their
/// exact scores (select's answer) with their exact values too; every other middle token as the copy has it. The
/// fetched rows count the sink, selected and local rows and the candidates read key only.
TEST(QuantAttention, CandidatesEnterWithExactLogitsAndTheSelectedWithExactValues) {
  const int64_t tokens = 1500;
  const int32_t budget = 30;
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  test::clustered_kv(tokens, kHeads, kDim, 61, k, v);
  F32 q({kQHeads, kDim}), out({kQHeads, kDim});
  q.data = test::random_vector(static_cast<size_t>(kQHeads * kDim), 62, 0.5f);
  q.refresh();
  for (const int bits : {1, 2}) {
    for (const int rerank : {4, 64}) {  // 64 x 30 candidates cover the 1480 middle tokens: every key exact
      kvret_config c = quant_config(bits);
      c.quant_rerank = rerank;
      kvret_config plain = c;
      plain.quant_rerank = 1;
      plain.quant_attention = 0;
      plain.gqa_fold = KVRET_FOLD_MAX_LOGIT;
      std::string disk, plain_disk;
      Context ctx(read_config(&c, &disk), disk), plain_ctx(read_config(&plain, &plain_disk), plain_disk);
      Sequence* seq = ctx.open_sequence();
      Sequence* plain_seq = plain_ctx.open_sequence();
      seq->append_prefill(0, &k.t, &v.t);
      plain_seq->append_prefill(0, &k.t, &v.t);
      const int64_t middle = tokens - c.n_sink - c.n_local;
      const auto candidates = static_cast<int32_t>(std::min<int64_t>(middle, int64_t{budget} * rerank));
      const auto selected = selected_sets(*seq, q, budget);
      const auto low_bit_top = selected_sets(*plain_seq, q, candidates);
      int64_t key_only = 0;
      for (int h = 0; h < kHeads; ++h) {
        const auto& cand = low_bit_top[static_cast<size_t>(h)];
        ASSERT_EQ(static_cast<int64_t>(cand.size()), candidates);
        for (const int32_t t : selected[static_cast<size_t>(h)]) EXPECT_EQ(cand.count(t), 1u) << t;
        key_only += candidates - budget;
      }
      const int64_t rows_before = seq->stats().fetched_rows.load();
      seq->attend(0, &q.t, budget, 0.0f, &out.t);
      const int64_t rows = seq->stats().fetched_rows.load() - rows_before;
      EXPECT_EQ(rows, (c.n_sink + budget + c.n_local) * kHeads + key_only) << bits << " " << rerank;
      const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
      const std::vector<double> want = mixed_attention(*seq, selected, low_bit_top, q.data, scale);
      double norm = 0;
      for (const double w : want) norm = std::max(norm, std::abs(w));
      const double error = max_abs_difference(out.data, want);
      EXPECT_LE(error, 1e-5 * norm) << bits << " " << rerank;
      // the former rule (only the selected keys exact) is another output on these keys: the test can tell them apart
      const std::vector<double> former =
          mixed_attention(*seq, selected, std::vector<std::set<int32_t>>(kHeads), q.data, scale);
      EXPECT_GT(max_abs_difference(out.data, former), 100 * error + 1e-4 * norm) << bits << " " << rerank;
      if (rerank == 64) {  // every key exact: exact attention's weights, over exact and low-bit values
        std::vector<std::set<int32_t>> all(kHeads);
        for (int h = 0; h < kHeads; ++h)
          for (int64_t t = c.n_sink; t < tokens - c.n_local; ++t)
            all[static_cast<size_t>(h)].insert(static_cast<int32_t>(t));
        const std::vector<double> exact_weights = mixed_attention(*seq, selected, all, q.data, scale);
        EXPECT_LE(max_abs_difference(out.data, exact_weights), 1e-5 * norm);
      }
      ctx.close_sequence(seq);
      plain_ctx.close_sequence(plain_seq);
    }
  }
}

/// quant_rerank = 1: no candidates; the selected rows are the only exact middle rows and the only rows fetched.
TEST(QuantAttention, WithoutRerankingOnlyTheSelectedRowsAreExact) {
  const int64_t tokens = 1500;
  const int32_t budget = 30;
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  test::clustered_kv(tokens, kHeads, kDim, 61, k, v);
  F32 q({kQHeads, kDim}), out({kQHeads, kDim});
  q.data = test::random_vector(static_cast<size_t>(kQHeads * kDim), 63, 0.5f);
  q.refresh();
  kvret_config c = quant_config(1);
  c.quant_rerank = 1;
  std::string disk;
  Context ctx(read_config(&c, &disk), disk);
  Sequence* seq = ctx.open_sequence();
  seq->append_prefill(0, &k.t, &v.t);
  const auto selected = selected_sets(*seq, q, budget);
  const int64_t rows_before = seq->stats().fetched_rows.load();
  seq->attend(0, &q.t, budget, 0.0f, &out.t);
  EXPECT_EQ(seq->stats().fetched_rows.load() - rows_before, (c.n_sink + budget + c.n_local) * kHeads);
  const std::vector<double> want =
      mixed_attention(*seq, selected, std::vector<std::set<int32_t>>(kHeads), q.data, 1.0 / 8.0);
  double norm = 0;
  for (const double w : want) norm = std::max(norm, std::abs(w));
  EXPECT_LE(max_abs_difference(out.data, want), 1e-5 * norm);
  ctx.close_sequence(seq);
}

TEST(QuantAttention, OnlyTheQuantIndexTakesIt) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.quant_attention = 1;
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("quant_attention"), std::string::npos) << kvret_last_error();
  c.index_kind = KVRET_INDEX_QUANT;
  c.quant_attention = 2;
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ctx, nullptr);
}

}  // namespace
