// libFuzzer target over the C API. The input is a program: a small context configuration (most of them valid), then
// up to 64 calls -- open, close, prefill, decode, select (and select_scored), select_batch (and fetch_batch), fetch,
// attend, seq_attend, truncate, fork, wait, stats -- on up to four sequences, with shapes, dtypes, budgets and values
// drawn from the input, biased so that the deep calls usually succeed. Every call must return a status (no crash, no
// abort: the sanitizers watch); and these oracles hold:
//   - a selection that succeeds is well formed: per head, count ascending, distinct middle positions; the same select
//     with scores returns the same positions, each with a score that is not NaN when the stored keys are finite;
//   - a fetch that succeeds returns, for every row, the stored key and value of the position it names (the input
//     rounded to the KV dtype), and the sink and local rows in order;
//   - a batched fetch that is refused (always when a count is broken) writes no working set and no row count;
//   - a truncate leaves every layer at the length asked for, a fork holds its source's lengths, and an attention
//     over values of 1 (or over a sequence's stored values) is a convex combination of them.
// A violated oracle calls __builtin_trap, which libFuzzer reports with the input.
// Build: cmake -DKVRET_BUILD_FUZZ=ON with clang (scripts/fuzz.sh). Corpus: tests/fuzz/corpus.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/half.hpp"
#include "host_tensor.hpp"
#include "kvret.h"

namespace {

#define FUZZ_CHECK(cond)           \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ >= end_; }
  uint8_t u8() { return p_ < end_ ? *p_++ : 0; }
  uint32_t u32() {
    uint32_t x = 0;
    for (int i = 0; i < 4; ++i) x = x << 8 | u8();
    return x;
  }
  /// A value in [0, n), n > 0.
  uint32_t below(uint32_t n) { return u8() % n; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

using Tensor = kvret::tools::HostTensor;
using kvret::tools::kF32;
using kvret::tools::kI32;

/// The stored value of x in the context's KV dtype, as f32.
float stored(float x, int kv_dtype) {
  if (kv_dtype == KVRET_KV_F16) return kvret::f16_to_f32(kvret::f32_to_f16(x));
  if (kv_dtype == KVRET_KV_BF16) return kvret::bf16_to_f32(kvret::f32_to_bf16(x));
  return x;
}

bool same_bits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

struct Seq {
  kvret_seq* handle = nullptr;
  std::vector<std::vector<float>> k, v;         // per layer, [tokens, n_kv, d], as stored (rounded)
  std::vector<std::vector<int32_t>> selection;  // per layer: the last successful select [n_kv, count]
  std::vector<int32_t> count;
};

/// Calls made and calls that returned KVRET_OK, per kind; printed at exit when KVRET_FUZZ_STATS is set.
enum Call {
  kCreate,
  kPrefill,
  kDecode,
  kSelect,
  kFetch,
  kBatch,
  kAttend,
  kTruncate,
  kFork,
  kSeqAttend,
  kSelectScored,
  kFetchBatch,
  kCalls
};
const char* const kCallNames[kCalls] = {"create", "prefill",  "decode", "select",     "fetch",         "select_batch",
                                        "attend", "truncate", "fork",   "seq_attend", "select_scored", "fetch_batch"};
uint64_t g_made[kCalls], g_ok[kCalls];

kvret_status tally(Call call, kvret_status status) {
  ++g_made[call];
  g_ok[call] += status == KVRET_OK;
  return status;
}

void print_stats() {
  for (int i = 0; i < kCalls; ++i)
    std::fprintf(stderr, "kvret-fuzz %-12s %10llu calls %10llu OK %5.1f%%\n", kCallNames[i],
                 static_cast<unsigned long long>(g_made[i]), static_cast<unsigned long long>(g_ok[i]),
                 g_made[i] ? 100.0 * static_cast<double>(g_ok[i]) / static_cast<double>(g_made[i]) : 0.0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (std::getenv("KVRET_FUZZ_STATS")) std::atexit(print_stats);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r(data, size);
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = 1 + static_cast<int32_t>(r.below(2));
  c.n_kv_heads = 1 + static_cast<int32_t>(r.below(2));
  c.n_q_heads = c.n_kv_heads * (1 + static_cast<int32_t>(r.below(3)));
  const int dims[] = {8, 16, 32, 64, 12};
  c.head_dim = dims[r.below(5)];
  c.kv_dtype = static_cast<int32_t>(r.below(3));
  const int kinds[] = {KVRET_INDEX_EXACT, KVRET_INDEX_PQ,      KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                       KVRET_INDEX_PQ,    KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT};
  c.index_kind = kinds[r.below(7)];
  c.n_sink = static_cast<int32_t>(r.below(6));
  c.n_local = static_cast<int32_t>(r.below(12));
  c.pq_m = 1 << r.below(3);  // 1, 2, 4: divides every head_dim above
  c.pq_bits = 1 + static_cast<int32_t>(r.below(6));
  c.pq_train_sample = 0;
  c.pq_iters = 1 + static_cast<int32_t>(r.below(3));  // a few k-means iterations keep an input fast
  c.pq_exact_fraction = static_cast<float>(r.below(4)) * 0.05f;
  c.page_size = 1 + static_cast<int32_t>(r.below(20));
  c.budget_ratio = 0.05f + static_cast<float>(r.below(20)) * 0.05f;
  c.gqa_fold = static_cast<int32_t>(r.below(2));
  c.n_threads = 1 + static_cast<int32_t>(r.below(2));
  c.background_build = static_cast<int32_t>(r.below(2));
  c.check_finite = static_cast<int32_t>(r.below(2));
  if (c.index_kind == KVRET_INDEX_CLUSTER) {  // small clusters and intervals: a short program makes several
    c.cluster_tokens = 1 + static_cast<int32_t>(r.below(32));
    c.cluster_decode_interval = 1 + static_cast<int32_t>(r.below(16));
    c.cluster_decode_k = 1 + static_cast<int32_t>(r.below(4));
  }
  if (r.below(16) == 0) c.head_dim = static_cast<int32_t>(r.u8()) - 8;  // now and then an invalid config
  kvret_context* ctx = nullptr;
  if (tally(kCreate, kvret_create(&c, &ctx)) != KVRET_OK) {
    FUZZ_CHECK(ctx == nullptr);
    return 0;
  }
  const int H = c.n_kv_heads, D = c.head_dim, L = c.n_layers;
  Seq seqs[4];
  uint64_t rng = r.u32();

  for (int step = 0; step < 64 && !r.empty(); ++step) {
    Seq& s = seqs[r.below(4)];
    int32_t layer = static_cast<int32_t>(r.below(static_cast<uint32_t>(L)));
    uint32_t op = r.below(10);
    // calls past the append go, 7 times in 8, to a layer that holds tokens, if there is one (the exception is a
    // byte of 7 mod 8, not 0: a mutated input is full of zeros, and an exhausted one reads them)
    if (op >= 5 && s.handle && s.k[static_cast<size_t>(layer)].empty() && r.below(8) != 7)
      for (int32_t other = 0; other < L; ++other)
        if (!s.k[static_cast<size_t>(other)].empty()) layer = other;
    // and a select or fetch on a sequence with no tokens there becomes, 7 times in 8, its prefill
    if ((op == 5 || op == 6) && s.handle && s.k[static_cast<size_t>(layer)].empty() && r.below(8) != 7) op = 3;
    switch (op) {
      case 0:
      case 1: {  // open (or reopen)
        if (s.handle) kvret_seq_close(s.handle);
        s = Seq{};
        FUZZ_CHECK(kvret_seq_open(ctx, &s.handle) == KVRET_OK);
        s.k.assign(static_cast<size_t>(L), {});
        s.v.assign(static_cast<size_t>(L), {});
        s.selection.assign(static_cast<size_t>(L), {});
        s.count.assign(static_cast<size_t>(L), 0);
        break;
      }
      case 2: {  // close
        if (s.handle) FUZZ_CHECK(kvret_seq_close(s.handle) == KVRET_OK);
        s = Seq{};
        break;
      }
      case 3:
      case 4: {  // prefill or decode: values from the generator, now and then a special one
        if (!s.handle) break;
        const bool decode = !s.k[static_cast<size_t>(layer)].empty() && r.below(2) == 1;  // decode needs a prefill
        const int64_t tokens = decode ? 1 : static_cast<int64_t>(r.below(200)) + (r.below(4) != 0 ? 40 : 0);
        const uint32_t special = r.u8();
        std::vector<float> k(static_cast<size_t>(tokens * H * D)), v(k.size());
        for (size_t i = 0; i < k.size(); ++i) {
          k[i] = static_cast<float>(static_cast<int64_t>(splitmix(rng) % 2001) - 1000) / 250.0f;
          v[i] = static_cast<float>(static_cast<int64_t>(splitmix(rng) % 2001) - 1000) / 250.0f;
        }
        if (special < 8 && !k.empty()) k[special % k.size()] = special % 2 ? 1e30f : -0.0f;
        Tensor kt(k.data(), decode ? std::vector<int64_t>{H, D} : std::vector<int64_t>{tokens, H, D}, kF32);
        Tensor vt(v.data(), kt.shape, kF32);
        const kvret_status st = decode ? tally(kDecode, kvret_append_decode(s.handle, layer, &kt.t, &vt.t))
                                       : tally(kPrefill, kvret_append_prefill(s.handle, layer, &kt.t, &vt.t));
        if (st == KVRET_OK) {
          for (float x : k) s.k[static_cast<size_t>(layer)].push_back(stored(x, c.kv_dtype));
          for (float x : v) s.v[static_cast<size_t>(layer)].push_back(stored(x, c.kv_dtype));
        }
        break;
      }
      case 5: {  // select
        if (!s.handle) break;
        const int64_t length = static_cast<int64_t>(s.k[static_cast<size_t>(layer)].size()) / (H * D);
        // mostly a budget the layer can give: the default, or 1..64 cut to the layer's length (once in eight not
        // cut); now and then any int32 from the input
        const int choice = static_cast<int>(r.below(8));
        int32_t budget = choice == 0   ? KVRET_BUDGET_DEFAULT
                         : choice == 7 ? static_cast<int32_t>(r.u32())
                                       : 1 + static_cast<int32_t>(r.below(64));
        if (choice >= 1 && choice <= 5 && length > 0) budget = static_cast<int32_t>(std::min<int64_t>(budget, length));
        std::vector<float> q(static_cast<size_t>(c.n_q_heads * D));
        for (float& x : q) x = static_cast<float>(static_cast<int64_t>(splitmix(rng) % 201) - 100) / 50.0f;
        int32_t cap = 0;
        if (kvret_seq_budget(s.handle, layer, &cap) != KVRET_OK) cap = 0;
        const int32_t width = std::max<int32_t>({1, budget, cap});
        if (width > (1 << 20)) break;
        std::vector<int32_t> out(static_cast<size_t>(H) * width, -1);
        Tensor qt(q.data(), {c.n_q_heads, D}, kF32), ot(out.data(), {H, width}, kI32);
        int32_t n_out = -1;
        if (tally(kSelect, kvret_select(s.handle, layer, &qt.t, budget, &ot.t, &n_out)) != KVRET_OK) break;
        const int64_t mid_begin = std::min<int64_t>(c.n_sink, length);
        const int64_t mid_end = std::max<int64_t>(mid_begin, length - c.n_local);
        FUZZ_CHECK(n_out >= 0 && n_out <= mid_end - mid_begin && (budget < 0 || n_out <= budget));
        for (int h = 0; h < H; ++h)
          for (int32_t i = 0; i < n_out; ++i) {
            const int32_t p = out[static_cast<size_t>(h) * width + i];
            FUZZ_CHECK(p >= mid_begin && p < mid_end);
            FUZZ_CHECK(i == 0 || p > out[static_cast<size_t>(h) * width + i - 1]);
          }
        auto& sel = s.selection[static_cast<size_t>(layer)];
        sel.assign(static_cast<size_t>(H) * n_out, 0);
        for (int h = 0; h < H; ++h)
          std::copy_n(out.begin() + static_cast<int64_t>(h) * width, n_out,
                      sel.begin() + static_cast<int64_t>(h) * n_out);
        s.count[static_cast<size_t>(layer)] = n_out;
        // at every fourth step the same select with scores (decided without reading the input, so that the inputs
        // of the corpus keep their meaning): the same positions, and a number for each when the stored keys are
        // finite (a key past the f16 range is stored as infinity, and 0 * infinity is NaN)
        if (step % 4 == 3) {
          const auto& keys = s.k[static_cast<size_t>(layer)];
          const bool finite = std::all_of(keys.begin(), keys.end(), [](float x) { return std::isfinite(x); });
          std::vector<int32_t> again(out.size(), -1);
          std::vector<float> scores(out.size(), 0.0f);
          Tensor at(again.data(), {H, width}, kI32), st(scores.data(), {H, width}, kF32);
          int32_t n_again = -1;
          if (tally(kSelectScored, kvret_select_scored(s.handle, layer, &qt.t, budget, &at.t, &st.t, &n_again)) ==
              KVRET_OK) {
            FUZZ_CHECK(n_again == n_out);
            for (int h = 0; h < H; ++h)
              for (int32_t i = 0; i < n_out; ++i) {
                const size_t at_i = static_cast<size_t>(h) * width + i;
                FUZZ_CHECK(again[at_i] == out[at_i] && !(finite && std::isnan(scores[at_i])));
              }
          }
        }
        break;
      }
      case 6: {  // fetch the last selection (possibly stale)
        if (!s.handle) break;
        const int32_t count = s.count[static_cast<size_t>(layer)];
        int64_t capacity = 0;
        if (kvret_working_set_capacity(s.handle, layer, count, &capacity) != KVRET_OK) break;
        std::vector<float> wk(static_cast<size_t>(H * capacity * D)), wv(wk.size());
        std::vector<int32_t> wp(static_cast<size_t>(H * capacity));
        std::vector<int32_t> sel = s.selection[static_cast<size_t>(layer)];
        if (sel.empty()) sel.assign(1, 0);
        Tensor kt(wk.data(), {H, capacity, D}, kF32), vt(wv.data(), {H, capacity, D}, kF32),
            pt(wp.data(), {H, capacity}, kI32), st(sel.data(), {H, std::max(count, 1)}, kI32);
        kvret_working_set ws{kt.t, vt.t, pt.t};
        int64_t rows = -1;
        if (tally(kFetch, kvret_fetch_async(s.handle, layer, &st.t, count, &ws, &rows, nullptr)) != KVRET_OK) break;
        const auto& sk = s.k[static_cast<size_t>(layer)];
        const auto& sv = s.v[static_cast<size_t>(layer)];
        const int64_t length = static_cast<int64_t>(sk.size()) / (H * D);
        FUZZ_CHECK(rows >= 0 && rows <= capacity && rows <= length);
        for (int h = 0; h < H; ++h)
          for (int64_t i = 0; i < rows; ++i) {
            const int32_t p = wp[static_cast<size_t>(h * capacity + i)];
            FUZZ_CHECK(p >= 0 && p < length);
            FUZZ_CHECK(i == 0 || p > wp[static_cast<size_t>(h * capacity + i - 1)]);
            for (int d = 0; d < D; ++d) {
              const size_t src = (static_cast<size_t>(p) * H + static_cast<size_t>(h)) * D + d;
              const size_t dst = (static_cast<size_t>(h) * capacity + static_cast<size_t>(i)) * D + d;
              FUZZ_CHECK(same_bits(wk[dst], sk[src]) && same_bits(wv[dst], sv[src]));
            }
          }
        break;
      }
      case 7: {  // select_batch over the open sequences
        // the open sequences with tokens in this layer (now and then every open one)
        const bool all = r.below(8) == 0;
        std::vector<kvret_seq*> open;
        for (Seq& x : seqs)
          if (x.handle &&
              (all || x.k[static_cast<size_t>(layer)].size() > static_cast<size_t>(H * D * (c.n_sink + c.n_local + 8))))
            open.push_back(x.handle);
        if (open.empty()) break;
        const int32_t n = static_cast<int32_t>(open.size());
        const int32_t budget = 1 + static_cast<int32_t>(r.below(8));
        std::vector<float> q(static_cast<size_t>(n * c.n_q_heads * D), 0.25f);
        std::vector<int32_t> out(static_cast<size_t>(n * H * budget)), counts(static_cast<size_t>(n));
        Tensor qt(q.data(), {n, c.n_q_heads, D}, kF32), ot(out.data(), {n, H, budget}, kI32);
        if (tally(kBatch, kvret_select_batch(ctx, n, open.data(), layer, &qt.t, budget, &ot.t, counts.data())) !=
                KVRET_OK ||
            r.below(4) == 3)
          break;
        // the batched fetch of that selection, now and then with one count broken: a refused batch writes nothing
        const int32_t broken = r.below(4) == 3 ? static_cast<int32_t>(r.below(static_cast<uint32_t>(n))) : -1;
        if (broken >= 0) counts[static_cast<size_t>(broken)] = r.below(2) ? -1 : 1 << 20;
        std::vector<std::vector<float>> wk(open.size()), wv(open.size());
        std::vector<std::vector<int32_t>> wp(open.size());
        std::vector<Tensor> views;
        views.reserve(3 * open.size());
        std::vector<kvret_working_set> outs;
        for (size_t i = 0; i < open.size(); ++i) {
          int64_t capacity = 0;
          if (kvret_working_set_capacity(open[i], layer, budget, &capacity) != KVRET_OK) capacity = 1;
          wk[i].assign(static_cast<size_t>(H * capacity * D), -3.0f);
          wv[i].assign(wk[i].size(), -3.0f);
          wp[i].assign(static_cast<size_t>(H * capacity), -3);
          views.emplace_back(wk[i].data(), std::vector<int64_t>{H, capacity, D}, kF32);
          views.emplace_back(wv[i].data(), std::vector<int64_t>{H, capacity, D}, kF32);
          views.emplace_back(wp[i].data(), std::vector<int64_t>{H, capacity}, kI32);
          outs.push_back({views[3 * i].t, views[3 * i + 1].t, views[3 * i + 2].t});
        }
        std::vector<int64_t> rows(open.size(), -3);
        const kvret_status st =
            tally(kFetchBatch, kvret_fetch_batch_async(ctx, n, open.data(), layer, &ot.t, counts.data(), outs.data(),
                                                       rows.data(), nullptr));
        if (broken >= 0) FUZZ_CHECK(st != KVRET_OK);
        if (st != KVRET_OK) {
          for (size_t i = 0; i < open.size(); ++i) {
            FUZZ_CHECK(rows[i] == -3);
            for (int32_t p : wp[i]) FUZZ_CHECK(p == -3);
            for (float x : wk[i]) FUZZ_CHECK(x == -3.0f);
          }
        } else {
          for (size_t i = 0; i < open.size(); ++i)
            FUZZ_CHECK(rows[i] >= counts[i] && (rows[i] == 0 || wp[i][0] != -3));  // no rows: maybe no buffer
        }
        break;
      }
      case 8: {  // attend over random rows
        const int64_t rows = static_cast<int64_t>(r.below(40));
        std::vector<float> q(static_cast<size_t>(c.n_q_heads * D), 0.5f),
            k(static_cast<size_t>(H * std::max<int64_t>(rows, 1) * D), 0.1f), v(k.size(), 1.0f),
            o(static_cast<size_t>(c.n_q_heads * D));
        Tensor qt(q.data(), {c.n_q_heads, D}, kF32), kt(k.data(), {H, std::max<int64_t>(rows, 1), D}, kF32),
            vt(v.data(), kt.shape, kF32), ot(o.data(), {c.n_q_heads, D}, kF32);
        // values all 1: every output is a convex combination of ones
        if (tally(kAttend, kvret_attend(ctx, &qt.t, &kt.t, &vt.t, rows, 0.0f, &ot.t, nullptr)) == KVRET_OK && rows > 0)
          for (float x : o) FUZZ_CHECK(x > 0.9999f && x < 1.0001f);
        // and over a sequence's working set: every output is a convex combination of stored values (|v| <= 4)
        if (s.handle && !s.k[static_cast<size_t>(layer)].empty()) {
          const int32_t budget = r.below(2) ? KVRET_BUDGET_DEFAULT : static_cast<int32_t>(r.below(64));
          if (tally(kSeqAttend, kvret_seq_attend(s.handle, layer, &qt.t, budget, 0.0f, &ot.t, nullptr)) == KVRET_OK)
            for (float x : o) FUZZ_CHECK(!(x > 4.001f) && !(x < -4.001f));
        }
        break;
      }
      default: {  // wait and stats, truncate, or fork
        if (!s.handle) break;
        Seq& free_slot = seqs[r.below(4)];
        if (r.below(3) == 0 && !free_slot.handle) {  // fork into a free slot: the fork holds what its source holds
          kvret_seq* forked = nullptr;
          const kvret_status st = tally(kFork, kvret_seq_fork(s.handle, &forked));
          FUZZ_CHECK(st == KVRET_OK ? forked != nullptr : forked == nullptr);
          if (st != KVRET_OK) break;
          free_slot = s;
          free_slot.handle = forked;
          for (int32_t l = 0; l < L; ++l) {
            int64_t a = -1, b = -2;
            FUZZ_CHECK(kvret_seq_length(s.handle, l, &a) == KVRET_OK && kvret_seq_length(forked, l, &b) == KVRET_OK);
            FUZZ_CHECK(a == b);
          }
          break;
        }
        if (r.below(2) == 0) {  // truncate: mostly within the longest layer, now and then negative or far beyond
          int64_t longest = 0;
          for (const auto& k : s.k) longest = std::max(longest, static_cast<int64_t>(k.size()) / (H * D));
          const uint32_t pick = r.below(16);
          const int64_t length = pick == 0   ? -static_cast<int64_t>(r.u8()) - 1
                                 : pick == 1 ? longest + static_cast<int64_t>(r.u8())
                                             : static_cast<int64_t>(r.below(static_cast<uint32_t>(longest) + 1));
          const kvret_status st = tally(kTruncate, kvret_seq_truncate(s.handle, length));
          FUZZ_CHECK(length >= 0 ? st == KVRET_OK || st == KVRET_ERR_OUT_OF_MEMORY : st == KVRET_ERR_INVALID_ARGUMENT);
          if (st != KVRET_OK) break;
          for (int32_t l = 0; l < L; ++l) {
            auto& k = s.k[static_cast<size_t>(l)];
            auto& v = s.v[static_cast<size_t>(l)];
            const size_t keep =
                static_cast<size_t>(std::min<int64_t>(length, static_cast<int64_t>(k.size()) / (H * D)));
            k.resize(keep * static_cast<size_t>(H * D));
            v.resize(keep * static_cast<size_t>(H * D));
            int64_t tokens = -1;
            FUZZ_CHECK(kvret_seq_length(s.handle, l, &tokens) == KVRET_OK && tokens == static_cast<int64_t>(keep));
          }
          break;
        }
        kvret_wait_index(s.handle, layer);
        kvret_stats st;
        kvret_stats_init(&st);
        FUZZ_CHECK(kvret_seq_stats(s.handle, &st) == KVRET_OK);
        break;
      }
    }
  }
  FUZZ_CHECK(kvret_destroy(ctx) == KVRET_OK);
  return 0;
}
