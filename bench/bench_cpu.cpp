// CPU benchmarks of the library's hot paths on the synthetic workload (Google Benchmark):
//  - PQ select (score + GQA fold + top-k) for a Llama-3-8B-like layer: 32 query heads, 8 KV heads, head_dim 128,
//    with the default pq_exact_fraction (BM_SelectPq), with exact outliers off (BM_SelectPqExactOff) and with 5%
//    of the tokens exact (BM_SelectPqExact5), so that one run compares them; and with pq_m = 4 (BM_SelectPqM4:
//    64^4 code tuples, too many for cells, so every token is scored from its own codes);
//  - EXACT select at the same size (the cost PQ saves);
//  - PQ index build (k-means + encode) of one layer;
//  - working-set fetch against plain memcpy of the same bytes;
//  - the batched fetch of 8 sequences (kvret_fetch_batch_async) against 8 kvret_fetch_async calls
//    (BM_FetchBatch, BM_FetchBatchSingles: the same selections, working sets and bytes);
//  - the append of a decode token after 1k, 10k and 100k decoded tokens (BM_DecodeAppend);
//  - CLUSTER, PQ and PAGE index build and select from 8k to 128k tokens in one run (BM_BuildKind, BM_SelectKind);
//  - the in-call flag of a sequence beside the cheapest C call that takes one (BM_InCallFlag, BM_SeqLengthCall);
//  - config.check_finite's cost: a PQ select, a decode append and an 8k-token prefill with it on and off
//    (BM_SelectPqCheckFinite beside BM_SelectPq, BM_DecodeAppend/1000/1 beside /1000/0, BM_PrefillAppend).
// Run: build/bin/kvret-bench-cpu [--benchmark_filter=...]   (contexts 8k..128k via the benchmark arguments)
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "core/half.hpp"
#include "host_tensor.hpp"
#include "kvret.h"
#include "workload.hpp"

namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

using Tensor = kvret::tools::HostTensor;
using kvret::tools::kF16;
using kvret::tools::kF32;
using kvret::tools::kI32;

/// One prefilled single-layer sequence per (index kind, context length), built once and shared by benchmarks.
struct Fixture {
  kvret_context* ctx = nullptr;
  kvret_seq* seq = nullptr;
  std::vector<float> queries;  // [steps, Hq, D]
  int64_t tokens = 0;
  double build_ms = 0;

  /// exact_fraction < 0: the library's default pq_exact_fraction; pq_m 0: the library's default pq_m.
  Fixture(int index_kind, int64_t n, int train_sample = 8192, float exact_fraction = -1.0f, int pq_m = 0,
          int threads = 0, int check_finite = 0)
      : tokens(n) {
    kvret::workload::Config wc;
    wc.n_layers = 1;
    wc.n_prefill = n;
    wc.n_decode = 8;
    kvret::workload::Workload w(wc);
    std::vector<float> k(static_cast<size_t>(n * kKvHeads * kDim)), v(k.size());
    w.keys_values(0, 0, n, k.data(), v.data());
    std::vector<uint16_t> kh(k.size()), vh(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      kh[i] = kvret::f32_to_f16(k[i]);
      vh[i] = kvret::f32_to_f16(v[i]);
    }
    queries.resize(static_cast<size_t>(8 * kQHeads * kDim));
    w.queries(0, 8, queries.data());
    kvret_config c;
    kvret_config_init(&c);
    c.n_layers = 1;
    c.index_kind = index_kind;
    c.pq_train_sample = train_sample;
    if (exact_fraction >= 0.0f) c.pq_exact_fraction = exact_fraction;
    if (pq_m > 0) c.pq_m = pq_m;
    c.n_threads = threads;
    c.check_finite = check_finite;
    kvret_create(&c, &ctx);
    kvret_seq_open(ctx, &seq);
    Tensor kt(kh.data(), {n, kKvHeads, kDim}, kF16), vt(vh.data(), {n, kKvHeads, kDim}, kF16);
    kvret_append_prefill(seq, 0, &kt.t, &vt.t);
    kvret_wait_index(seq, -1);
    kvret_stats s;
    kvret_stats_init(&s);
    kvret_seq_stats(seq, &s);
    build_ms = s.index_build_ms;
  }
  ~Fixture() { kvret_destroy(ctx); }

  static Fixture& get(int index_kind, int64_t n, float exact_fraction = -1.0f, int pq_m = 0, int threads = 0,
                      int check_finite = 0) {
    static std::map<std::tuple<int, int64_t, float, int, int, int>, std::unique_ptr<Fixture>> cache;
    auto& f = cache[{index_kind, n, exact_fraction, pq_m, threads, check_finite}];
    if (!f) f = std::make_unique<Fixture>(index_kind, n, 8192, exact_fraction, pq_m, threads, check_finite);
    return *f;
  }
};

void select_bench(benchmark::State& state, int index_kind, float exact_fraction = -1.0f, int pq_m = 0, int threads = 0,
                  int check_finite = 0) {
  const int64_t n = state.range(0);
  Fixture& f = Fixture::get(index_kind, n, exact_fraction, pq_m, threads, check_finite);
  int32_t budget = 0;
  kvret_seq_budget(f.seq, 0, &budget);
  std::vector<int32_t> out(static_cast<size_t>(kKvHeads) * budget);
  Tensor ot(out.data(), {kKvHeads, budget}, kI32);
  int step = 0;
  for (auto _ : state) {
    Tensor qt(f.queries.data() + (step++ % 8) * kQHeads * kDim, {kQHeads, kDim}, kF32);
    int32_t count = 0;
    if (kvret_select(f.seq, 0, &qt.t, budget, &ot.t, &count) != KVRET_OK) state.SkipWithError(kvret_last_error());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["budget"] = budget;
  state.counters["tokens"] = static_cast<double>(n);
  if (index_kind == KVRET_INDEX_PQ) {
    kvret_config c;
    kvret_config_init(&c);
    kvret_get_config(f.ctx, &c);
    state.counters["exact_fraction"] = c.pq_exact_fraction;
    state.counters["pq_m"] = c.pq_m;
    kvret_stats s;
    kvret_stats_init(&s);
    kvret_seq_stats(f.seq, &s);
    state.counters["index_MiB"] = static_cast<double>(s.index_bytes) / (1 << 20);
  }
}

/// The append of one decode token (store + the index entry of the token leaving the local window) after a 1024-token
/// prefill and `state.range(0)` decoded tokens, PQ at its defaults: flat in the sequence's length (the index arrays
/// grow geometrically, nothing is copied per step).
void BM_DecodeAppend(benchmark::State& state) {
  const int64_t decoded = state.range(0);
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = 1;
  c.check_finite = static_cast<int32_t>(state.range(1));
  kvret_context* ctx = nullptr;
  kvret_seq* seq = nullptr;
  if (kvret_create(&c, &ctx) != KVRET_OK || kvret_seq_open(ctx, &seq) != KVRET_OK) {
    state.SkipWithError(kvret_last_error());
    return;
  }
  constexpr int64_t kPrefill = 1024;
  kvret::workload::Config wc;
  wc.n_layers = 1;
  wc.n_prefill = kPrefill;
  kvret::workload::Workload w(wc);
  std::vector<float> k(static_cast<size_t>(kPrefill * kKvHeads * kDim)), v(k.size());
  w.keys_values(0, 0, kPrefill, k.data(), v.data());
  Tensor kt(k.data(), {kPrefill, kKvHeads, kDim}, kF32), vt(v.data(), {kPrefill, kKvHeads, kDim}, kF32);
  kvret_append_prefill(seq, 0, &kt.t, &vt.t);
  kvret_wait_index(seq, -1);
  // decode tokens: the prefill's keys again, one at a time
  auto step = [&](int64_t i) {
    const int64_t t = i % kPrefill;
    Tensor k1(k.data() + t * kKvHeads * kDim, {kKvHeads, kDim}, kF32);
    Tensor v1(v.data() + t * kKvHeads * kDim, {kKvHeads, kDim}, kF32);
    return kvret_append_decode(seq, 0, &k1.t, &v1.t);
  };
  for (int64_t i = 0; i < decoded; ++i) step(i);
  int64_t i = decoded;
  for (auto _ : state)
    if (step(i++) != KVRET_OK) state.SkipWithError(kvret_last_error());
  state.counters["decoded"] = static_cast<double>(decoded);
  state.counters["check_finite"] = static_cast<double>(c.check_finite);
  kvret_destroy(ctx);
}

/// The prefill of `state.range(0)` f16 tokens into a fresh sequence (EXACT: the store's copy and little else, so that
/// the finiteness pass is not hidden behind an index build), config.check_finite = state.range(1).
void BM_PrefillAppend(benchmark::State& state) {
  const int64_t n = state.range(0);
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = 1;
  c.index_kind = KVRET_INDEX_EXACT;
  c.check_finite = static_cast<int32_t>(state.range(1));
  kvret_context* ctx = nullptr;
  if (kvret_create(&c, &ctx) != KVRET_OK) {
    state.SkipWithError(kvret_last_error());
    return;
  }
  std::vector<uint16_t> k(static_cast<size_t>(n * kKvHeads * kDim)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = kvret::f32_to_f16(static_cast<float>(i % 97) * 0.01f);
    v[i] = kvret::f32_to_f16(static_cast<float>(i % 89) * 0.01f);
  }
  Tensor kt(k.data(), {n, kKvHeads, kDim}, kF16), vt(v.data(), {n, kKvHeads, kDim}, kF16);
  for (auto _ : state) {
    kvret_seq* seq = nullptr;
    if (kvret_seq_open(ctx, &seq) != KVRET_OK || kvret_append_prefill(seq, 0, &kt.t, &vt.t) != KVRET_OK)
      state.SkipWithError(kvret_last_error());
    kvret_seq_close(seq);
  }
  state.counters["check_finite"] = static_cast<double>(c.check_finite);
  kvret_destroy(ctx);
}

// PQ at the library's defaults (m = 4, 2% exact outliers), without the exact outliers, with 5%; and m = 2 (the cell
// path), with the default exact outliers and without (PQCache's setting).
void BM_SelectPq(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ); }
void BM_SelectPqExactOff(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ, 0.0f); }
// PQ at its defaults with config.check_finite = 1: the query's finiteness pass beside BM_SelectPq
void BM_SelectPqCheckFinite(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ, -1.0f, 0, 0, 1); }
void BM_SelectPqExact5(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ, 0.05f); }
void BM_SelectPqM2(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ, -1.0f, 2); }
void BM_SelectPqM2ExactOff(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ, 0.0f, 2); }
void BM_SelectExact(benchmark::State& state) { select_bench(state, KVRET_INDEX_EXACT); }
// A short context: the default thread count (all cores) against n_threads = 1 (a small select must not pay for
// waking a thread team).
void BM_SelectPqOneThread(benchmark::State& state) { select_bench(state, KVRET_INDEX_PQ, -1.0f, 0, 1); }

void BM_BuildPq(benchmark::State& state) {
  const int64_t n = state.range(0);
  for (auto _ : state) {
    Fixture f(KVRET_INDEX_PQ, n);
    state.SetIterationTime(f.build_ms * 1e-3);  // only the index build, not the data generation
  }
  state.counters["tokens"] = static_cast<double>(n);
}

// Build and select of the CLUSTER, PQ and PAGE kinds over context lengths, in one run (BM_BuildKind/<kind>/<n>,
// BM_SelectKind/<kind>/<n>): one layer of 8 KV heads, head_dim 128, the library's defaults (budget 1/10).

/// The fixture of the last (kind, length) asked for: one prefilled sequence alive at a time (a 128k one holds 512 MiB
/// of f16 KV), rebuilt only when the benchmark moves on to another kind or length.
Fixture& latest_fixture(int index_kind, int64_t n) {
  static std::unique_ptr<Fixture> f;
  static std::pair<int, int64_t> key{-1, 0};
  if (!f || key != std::pair<int, int64_t>{index_kind, n}) {
    f.reset();
    f = std::make_unique<Fixture>(index_kind, n);
    key = {index_kind, n};
  }
  return *f;
}

/// CPU seconds of every thread of the process so far.
double process_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

/// The time is the index build's wall time (kvret_stats.index_build_ms); the counter cpu_ms is the CPU time of all
/// threads over the prefill append and the build (the figure that a machine shared with other work disturbs least).
void BM_BuildKind(benchmark::State& state, int index_kind) {
  const int64_t n = state.range(0);
  kvret::workload::Config wc;
  wc.n_layers = 1;
  wc.n_prefill = n;
  kvret::workload::Workload w(wc);
  std::vector<float> k(static_cast<size_t>(n * kKvHeads * kDim)), v(k.size());
  w.keys_values(0, 0, n, k.data(), v.data());
  std::vector<uint16_t> kh(k.size()), vh(v.size());
  for (size_t i = 0; i < k.size(); ++i) {
    kh[i] = kvret::f32_to_f16(k[i]);
    vh[i] = kvret::f32_to_f16(v[i]);
  }
  Tensor kt(kh.data(), {n, kKvHeads, kDim}, kF16), vt(vh.data(), {n, kKvHeads, kDim}, kF16);
  double cpu_s = 0;
  for (auto _ : state) {
    kvret_config c;
    kvret_config_init(&c);
    c.n_layers = 1;
    c.index_kind = index_kind;
    kvret_context* ctx = nullptr;
    kvret_seq* seq = nullptr;
    if (kvret_create(&c, &ctx) != KVRET_OK || kvret_seq_open(ctx, &seq) != KVRET_OK) {
      state.SkipWithError(kvret_last_error());
      break;
    }
    const double cpu0 = process_cpu_s();
    if (kvret_append_prefill(seq, 0, &kt.t, &vt.t) != KVRET_OK || kvret_wait_index(seq, -1) != KVRET_OK)
      state.SkipWithError(kvret_last_error());
    cpu_s += process_cpu_s() - cpu0;
    kvret_stats s;
    kvret_stats_init(&s);
    kvret_seq_stats(seq, &s);
    state.SetIterationTime(s.index_build_ms * 1e-3);
    kvret_destroy(ctx);
  }
  state.counters["tokens"] = static_cast<double>(n);
  state.counters["cpu_ms"] = 1e3 * cpu_s / static_cast<double>(state.iterations());
}

void BM_SelectKind(benchmark::State& state, int index_kind) {
  const int64_t n = state.range(0);
  Fixture& f = latest_fixture(index_kind, n);
  int32_t budget = 0;
  kvret_seq_budget(f.seq, 0, &budget);
  std::vector<int32_t> out(static_cast<size_t>(kKvHeads) * budget);
  Tensor ot(out.data(), {kKvHeads, budget}, kI32);
  int step = 0;
  for (auto _ : state) {
    Tensor qt(f.queries.data() + (step++ % 8) * kQHeads * kDim, {kQHeads, kDim}, kF32);
    int32_t count = 0;
    if (kvret_select(f.seq, 0, &qt.t, budget, &ot.t, &count) != KVRET_OK) state.SkipWithError(kvret_last_error());
    benchmark::DoNotOptimize(out.data());
  }
  kvret_stats s;
  kvret_stats_init(&s);
  kvret_seq_stats(f.seq, &s);
  state.counters["budget"] = budget;
  state.counters["tokens"] = static_cast<double>(n);
  state.counters["index_MiB"] = static_cast<double>(s.index_bytes) / (1 << 20);
}

void BM_FetchGather(benchmark::State& state) {
  const int64_t n = state.range(0);
  Fixture& f = Fixture::get(KVRET_INDEX_PQ, n);
  int32_t budget = 0;
  kvret_seq_budget(f.seq, 0, &budget);
  std::vector<int32_t> sel(static_cast<size_t>(kKvHeads) * budget);
  Tensor st(sel.data(), {kKvHeads, budget}, kI32);
  Tensor qt(f.queries.data(), {kQHeads, kDim}, kF32);
  int32_t count = 0;
  kvret_select(f.seq, 0, &qt.t, budget, &st.t, &count);
  int64_t cap = 0;
  kvret_working_set_capacity(f.seq, 0, budget, &cap);
  std::vector<uint16_t> wk(static_cast<size_t>(kKvHeads * cap * kDim)), wv(wk.size());
  std::vector<int32_t> wp(static_cast<size_t>(kKvHeads * cap));
  Tensor kt(wk.data(), {kKvHeads, cap, kDim}, kF16), vt(wv.data(), {kKvHeads, cap, kDim}, kF16),
      pt(wp.data(), {kKvHeads, cap}, kI32);
  kvret_working_set ws{kt.t, vt.t, pt.t};
  for (auto _ : state) {
    int64_t rows = 0;
    kvret_fetch_async(f.seq, 0, &st.t, count, &ws, &rows, nullptr);
    benchmark::DoNotOptimize(wk.data());
  }
  state.SetBytesProcessed(state.iterations() * 2 * kKvHeads * cap * kDim * 2);
}

/// The peer of BM_FetchGather: one contiguous memcpy of the same bytes.
void BM_FetchMemcpyPeer(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int64_t cap = 16 + (n + 5) / 10 + 64;
  const size_t bytes = static_cast<size_t>(kKvHeads * cap * kDim * 2);
  std::vector<uint8_t> src(2 * bytes * 8, 1), dst(2 * bytes);  // source larger than the cache, like the store
  size_t offset = 0;
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data() + offset, 2 * bytes);
    offset = (offset + 2 * bytes) % (src.size() - 2 * bytes + 1);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(2 * bytes));
}

/// `n_seqs` sequences of one single-layer EXACT context, each prefilled with the same `tokens` workload tokens
/// (their own KV pages), selected once by kvret_select_batch with the queries of the workload, and f16 working
/// sets sized for the selection.
struct BatchFixture {
  kvret_context* ctx = nullptr;
  std::vector<kvret_seq*> seqs;
  std::vector<int32_t> positions, counts;
  int32_t budget = 0;
  int64_t capacity = 0;
  std::vector<std::vector<uint16_t>> wk, wv;
  std::vector<std::vector<int32_t>> wp;
  std::vector<std::unique_ptr<Tensor>> views;
  std::vector<kvret_working_set> outs;
  std::vector<int64_t> rows;

  BatchFixture(int n_seqs, int64_t tokens) {
    kvret::workload::Config wc;
    wc.n_layers = 1;
    wc.n_prefill = tokens;
    wc.n_decode = 8;
    kvret::workload::Workload w(wc);
    std::vector<float> k(static_cast<size_t>(tokens * kKvHeads * kDim)), v(k.size());
    w.keys_values(0, 0, tokens, k.data(), v.data());
    std::vector<uint16_t> kh(k.size()), vh(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      kh[i] = kvret::f32_to_f16(k[i]);
      vh[i] = kvret::f32_to_f16(v[i]);
    }
    std::vector<float> queries(static_cast<size_t>(8 * kQHeads * kDim));
    w.queries(0, 8, queries.data());
    kvret_config c;
    kvret_config_init(&c);
    c.n_layers = 1;
    c.index_kind = KVRET_INDEX_EXACT;
    kvret_create(&c, &ctx);
    Tensor kt(kh.data(), {tokens, kKvHeads, kDim}, kF16), vt(vh.data(), {tokens, kKvHeads, kDim}, kF16);
    seqs.resize(static_cast<size_t>(n_seqs));
    for (auto& s : seqs) {
      kvret_seq_open(ctx, &s);
      kvret_append_prefill(s, 0, &kt.t, &vt.t);
    }
    kvret_seq_budget(seqs[0], 0, &budget);
    std::vector<float> q(static_cast<size_t>(n_seqs * kQHeads * kDim));
    for (int i = 0; i < n_seqs; ++i)
      std::memcpy(q.data() + i * kQHeads * kDim, queries.data() + (i % 8) * kQHeads * kDim,
                  sizeof(float) * kQHeads * kDim);
    Tensor qt(q.data(), {n_seqs, kQHeads, kDim}, kF32);
    positions.resize(static_cast<size_t>(n_seqs) * kKvHeads * budget);
    counts.resize(static_cast<size_t>(n_seqs));
    Tensor pt(positions.data(), {n_seqs, kKvHeads, budget}, kI32);
    kvret_select_batch(ctx, n_seqs, seqs.data(), 0, &qt.t, budget, &pt.t, counts.data());
    kvret_working_set_capacity(seqs[0], 0, budget, &capacity);
    for (int i = 0; i < n_seqs; ++i) {
      wk.emplace_back(static_cast<size_t>(kKvHeads * capacity * kDim));
      wv.emplace_back(static_cast<size_t>(kKvHeads * capacity * kDim));
      wp.emplace_back(static_cast<size_t>(kKvHeads * capacity));
    }
    for (int i = 0; i < n_seqs; ++i) {
      const auto at = static_cast<size_t>(i);
      views.push_back(std::make_unique<Tensor>(wk[at].data(), std::vector<int64_t>{kKvHeads, capacity, kDim}, kF16));
      views.push_back(std::make_unique<Tensor>(wv[at].data(), std::vector<int64_t>{kKvHeads, capacity, kDim}, kF16));
      views.push_back(std::make_unique<Tensor>(wp[at].data(), std::vector<int64_t>{kKvHeads, capacity}, kI32));
      outs.push_back({views[3 * at]->t, views[3 * at + 1]->t, views[3 * at + 2]->t});
    }
    rows.resize(static_cast<size_t>(n_seqs));
  }
  ~BatchFixture() { kvret_destroy(ctx); }
  BatchFixture(const BatchFixture&) = delete;
  BatchFixture& operator=(const BatchFixture&) = delete;

  static BatchFixture& get(int n_seqs, int64_t tokens) {
    static std::map<std::pair<int, int64_t>, std::unique_ptr<BatchFixture>> cache;
    auto& f = cache[{n_seqs, tokens}];
    if (!f) f = std::make_unique<BatchFixture>(n_seqs, tokens);
    return *f;
  }
  void count_bytes(benchmark::State& state) const {
    state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(seqs.size()) * 2 * kKvHeads * capacity * kDim *
                            2);
    state.counters["sequences"] = static_cast<double>(seqs.size());
    state.counters["tokens"] = static_cast<double>(state.range(1));
    state.counters["budget"] = budget;
  }
};

/// One kvret_fetch_batch_async for the batch (args: sequences, tokens).
void BM_FetchBatch(benchmark::State& state) {
  BatchFixture& f = BatchFixture::get(static_cast<int>(state.range(0)), state.range(1));
  const int n = static_cast<int>(f.seqs.size());
  Tensor pt(f.positions.data(), {n, kKvHeads, f.budget}, kI32);
  for (auto _ : state) {
    if (kvret_fetch_batch_async(f.ctx, n, f.seqs.data(), 0, &pt.t, f.counts.data(), f.outs.data(), f.rows.data(),
                                nullptr) != KVRET_OK)
      state.SkipWithError(kvret_last_error());
    benchmark::DoNotOptimize(f.wk.data());
  }
  f.count_bytes(state);
}

/// The same fetches as BM_FetchBatch, one kvret_fetch_async per sequence.
void BM_FetchBatchSingles(benchmark::State& state) {
  BatchFixture& f = BatchFixture::get(static_cast<int>(state.range(0)), state.range(1));
  const int n = static_cast<int>(f.seqs.size());
  std::vector<std::unique_ptr<Tensor>> rows_of;
  for (int i = 0; i < n; ++i)
    rows_of.push_back(std::make_unique<Tensor>(f.positions.data() + static_cast<size_t>(i) * kKvHeads * f.budget,
                                               std::vector<int64_t>{kKvHeads, f.budget}, kI32));
  for (auto _ : state) {
    for (int i = 0; i < n; ++i) {
      const auto at = static_cast<size_t>(i);
      if (kvret_fetch_async(f.seqs[at], 0, &rows_of[at]->t, f.counts[at], &f.outs[at], &f.rows[at], nullptr) !=
          KVRET_OK)
        state.SkipWithError(kvret_last_error());
    }
    benchmark::DoNotOptimize(f.wk.data());
  }
  f.count_bytes(state);
}

}  // namespace

// The cost of the in-call flag every call that takes a kvret_seq* sets and clears (one sequence, one call at a
// time; KVRET_ERR_BUSY otherwise): the flag alone (one compare-and-swap and one store), beside the cheapest whole C
// call that takes a sequence (handle lookup, flag, the length read), in one run.
void BM_InCallFlag(benchmark::State& state) {
  std::atomic<bool> in_call{false};
  for (auto _ : state) {
    bool idle = false;
    const bool entered =
        in_call.compare_exchange_strong(idle, true, std::memory_order_acquire, std::memory_order_relaxed);
    benchmark::DoNotOptimize(entered);
    in_call.store(false, std::memory_order_release);
  }
}

void BM_SeqLengthCall(benchmark::State& state) {
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = 1;
  kvret_context* ctx = nullptr;
  kvret_seq* seq = nullptr;
  if (kvret_create(&c, &ctx) != KVRET_OK || kvret_seq_open(ctx, &seq) != KVRET_OK) {
    state.SkipWithError(kvret_last_error());
    return;
  }
  int64_t tokens = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(kvret_seq_length(seq, 0, &tokens));
    benchmark::DoNotOptimize(tokens);
  }
  kvret_seq_close(seq);
  kvret_destroy(ctx);
}

BENCHMARK(BM_InCallFlag)->Unit(benchmark::kNanosecond);
BENCHMARK(BM_SeqLengthCall)->Unit(benchmark::kNanosecond);
BENCHMARK(BM_SelectPq)->Arg(200)->Arg(8192)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectPqOneThread)->Arg(200)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectPqCheckFinite)->Arg(200)->Arg(32768)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectPqExactOff)->Arg(8192)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectPqExact5)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectPqM2)->Arg(8192)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectPqM2ExactOff)->Arg(8192)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SelectExact)->Arg(8192)->Arg(32768)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_BuildPq)
    ->Arg(8192)
    ->Arg(32768)
    ->Arg(131072)
    ->UseManualTime()
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_BuildKind, cluster, KVRET_INDEX_CLUSTER)
    ->RangeMultiplier(2)
    ->Range(8192, 131072)
    ->UseManualTime()
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_BuildKind, pq, KVRET_INDEX_PQ)
    ->RangeMultiplier(2)
    ->Range(8192, 131072)
    ->UseManualTime()
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_BuildKind, page, KVRET_INDEX_PAGE)
    ->RangeMultiplier(2)
    ->Range(8192, 131072)
    ->UseManualTime()
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_SelectKind, cluster, KVRET_INDEX_CLUSTER)
    ->RangeMultiplier(2)
    ->Range(8192, 131072)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SelectKind, pq, KVRET_INDEX_PQ)
    ->RangeMultiplier(2)
    ->Range(8192, 131072)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_SelectKind, page, KVRET_INDEX_PAGE)
    ->RangeMultiplier(2)
    ->Range(8192, 131072)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeAppend)
    ->Args({1000, 0})
    ->Args({1000, 1})
    ->Args({10000, 0})
    ->Args({100000, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PrefillAppend)->Args({8192, 0})->Args({8192, 1})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FetchGather)->Arg(8192)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FetchMemcpyPeer)->Arg(8192)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FetchBatch)->Args({8, 32768})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FetchBatchSingles)->Args({8, 32768})->UseRealTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
