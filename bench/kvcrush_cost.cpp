// kvret-kvcrush-cost: what KVCrush (config.hamming_fraction) adds to a select, through the C ABI. For each index
// kind: one layer of `tokens` clustered keys (32 query heads, 8 KV heads, head_dim 128, f32) in two contexts, one
// without KVCrush and one with hamming_fraction = 0.25; `reps` rounds in which they take turns: a select of `budget`
// tokens without KVCrush (plain), one with it (kvcrush), and one without it of the important part's budget
// B_imp = budget - floor(0.25 * budget) (the index's share of the kvcrush select). Printed: the medians, the
// kvcrush select's time over the plain one (added), the grouping's time (kvcrush - B_imp) and its share of the plain
// select, the same share from the fastest select of each kind (min share: on a busy machine, the least disturbed),
// the grouping alone (grouping us: the median time of the library's calls that add the representatives to the
// index's rows, timed directly, and its share of the plain select), and the first kvcrush select (which computes the
// layer's signatures). Links the library's internals (kvret_core) for the direct timing. The kind "retained"
// times kvret_seq_retained_set instead (the eviction-only mode, on a STREAMING context): the median of `reps` calls
// with hamming_fraction 0 and 0.25.
//   kvret-kvcrush-cost [tokens=32768] [budget=1024] [reps=20] [kinds=exact,page,quant,pq,cluster] [threads=0]
//   (kinds may add retained; threads: config.n_threads, 0 = all cores; 1 times the thread's CPU time, not the wall)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "c_api/handles.hpp"
#include "engine/kvcrush_layer.hpp"
#include "engine/sequence.hpp"
#include "kvret.h"

namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;
int32_t g_threads = 0;  // config.n_threads

/// Wall-clock time; with threads = 1 the calling thread's CPU time instead (every select runs on it), which time
/// taken by other processes on a busy machine does not disturb.
double now_ms() {
  if (g_threads == 1) {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

kvret_tensor f32_tensor(float* data, std::vector<int64_t>& shape) {
  kvret_tensor t{};
  t.data = data;
  t.device = {KVRET_DEVICE_CPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = {KVRET_DTYPE_FLOAT, 32, 1};
  t.shape = shape.data();
  return t;
}

void check(kvret_status s, const char* what) {
  if (s == KVRET_OK) return;
  std::fprintf(stderr, "%s: %s: %s\n", what, kvret_status_string(s), kvret_last_error());
  std::exit(1);
}

/// A one-layer context of `kind` with the keys k prefilled (values: the keys again) and its index built, and an
/// int32 [n_kv_heads, budget] output tensor.
struct Layer {
  kvret_context* ctx = nullptr;
  kvret_seq* seq = nullptr;
  std::vector<int32_t> out;
  std::vector<int64_t> out_shape;
  kvret_tensor ot{};

  Layer(int32_t kind, float share, int64_t tokens, int32_t budget, const std::vector<float>& k)
      : out(static_cast<size_t>(kKvHeads) * static_cast<size_t>(budget)), out_shape{kKvHeads, budget} {
    kvret_config c;
    kvret_config_init(&c);
    c.n_layers = 1;
    c.n_q_heads = kQHeads;
    c.n_kv_heads = kKvHeads;
    c.head_dim = kDim;
    c.kv_dtype = KVRET_KV_F32;
    c.index_kind = kind;
    c.hamming_fraction = share;
    c.n_threads = g_threads;
    check(kvret_create(&c, &ctx), "kvret_create");
    check(kvret_seq_open(ctx, &seq), "kvret_seq_open");
    std::vector<int64_t> kv_shape{tokens, kKvHeads, kDim};
    const kvret_tensor kt = f32_tensor(const_cast<float*>(k.data()), kv_shape);
    check(kvret_append_prefill(seq, 0, &kt, &kt), "kvret_append_prefill");
    check(kvret_wait_index(seq, 0), "kvret_wait_index");
    ot.data = out.data();
    ot.device = {KVRET_DEVICE_CPU, 0};
    ot.ndim = 2;
    ot.dtype = {KVRET_DTYPE_INT, 32, 1};
    ot.shape = out_shape.data();
  }
  ~Layer() {
    kvret_seq_close(seq);
    kvret_destroy(ctx);
  }
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
};

/// One select of `budget` on `layer`: its time in ms.
double select_ms(Layer& layer, const kvret_tensor& qt, int32_t budget) {
  int32_t count = 0;
  const double start = now_ms();
  check(kvret_select(layer.seq, 0, &qt, budget, &layer.ot, &count), "kvret_select");
  return now_ms() - start;
}

double median(std::vector<double>& ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Paired {
  double plain = 0, crushed = 0, index_part = 0, first = 0;
  double plain_min = 0, crushed_min = 0, index_part_min = 0;  // the fastest of each: the least disturbed by others
  double grouping = 0;  // the grouping alone (median), timed on the library's own state: see grouping_ms
};

/// The grouping alone, as a kvcrush select runs it after the index: the middle's place in the distance lists, then
/// each KV head's representatives added to its important row (here: the plain context's select of B_imp tokens,
/// the rows the index gives the kvcrush context). Times the calls on the kvcrush context's own state (internal
/// headers; the library's code, not a copy).
double grouping_ms(Layer& crushed, const Layer& index_rows, int32_t important, int32_t budget) {
  const kvret::Sequence* seq = kvret::sequence_from_handle(crushed.seq);
  const kvret::KvCrushLayer* crush = seq->crush(0);
  const kvret::TokenGroups g = seq->groups(0);
  std::vector<int32_t> rows(static_cast<size_t>(kKvHeads) * static_cast<size_t>(budget));
  for (int h = 0; h < kKvHeads; ++h)
    std::copy_n(index_rows.out.begin() + static_cast<int64_t>(h) * budget, important,
                rows.begin() + static_cast<int64_t>(h) * budget);
  const double start = now_ms();
  const kvret::KvCrushLayer::MiddleOrder order = crush->middle_order(g.mid_begin, g.mid_end, budget - important);
  int64_t count = 0;
  for (int h = 0; h < kKvHeads; ++h)
    count += crush->add_representatives(h, order, rows.data() + static_cast<int64_t>(h) * budget, nullptr, important,
                                        budget - important);
  const double ms = now_ms() - start;
  if (count != static_cast<int64_t>(kKvHeads) * budget) {
    std::fprintf(stderr, "grouping: %lld tokens, not %d per head\n", static_cast<long long>(count), budget);
    std::exit(1);
  }
  return ms;
}

/// Paired in one run: the selects of a context without KVCrush (budget B and the important part's budget B_imp)
/// and one with hamming_fraction = share (budget B) take turns, `reps` rounds; the medians of each. The grouping's
/// cost is crushed - index_part (the same index select of B_imp tokens, plus the representatives).
Paired run(int32_t kind, float share, int64_t tokens, int32_t budget, int reps, const std::vector<float>& k,
           const std::vector<float>& q) {
  Layer plain(kind, 0.0f, tokens, budget, k), crushed(kind, share, tokens, budget, k);
  std::vector<int64_t> q_shape{kQHeads, kDim};
  const kvret_tensor qt = f32_tensor(const_cast<float*>(q.data()), q_shape);
  const auto important =
      static_cast<int32_t>(budget - static_cast<int32_t>(std::floor(static_cast<double>(share) * budget)));
  Paired t;
  t.first = select_ms(crushed, qt, budget);
  select_ms(plain, qt, budget);  // warm
  std::vector<double> a, b, c, gr;
  for (int r = 0; r < reps; ++r) {
    a.push_back(select_ms(plain, qt, budget));
    b.push_back(select_ms(crushed, qt, budget));
    c.push_back(select_ms(plain, qt, important));  // leaves the important rows in plain.out
    gr.push_back(grouping_ms(crushed, plain, important, budget));
  }
  t.grouping = median(gr);
  t.plain = median(a);
  t.crushed = median(b);
  t.index_part = median(c);
  t.plain_min = a.front();  // sorted by median()
  t.crushed_min = b.front();
  t.index_part_min = c.front();
  return t;
}

/// The median time of kvret_seq_retained_set (each call computes the window importance of every token afresh).
double retained_ms(float share, int64_t tokens, int32_t budget, int reps, const std::vector<float>& k) {
  Layer layer(KVRET_INDEX_STREAMING, share, tokens, budget, k);
  kvret_seq* seq = layer.seq;
  const kvret_tensor& ot = layer.ot;
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    int32_t count = 0;
    const double start = now_ms();
    check(kvret_seq_retained_set(seq, 0, budget, &ot, &count), "kvret_seq_retained_set");
    ms.push_back(now_ms() - start);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 32768;
  const auto budget = static_cast<int32_t>(argc > 2 ? std::atoi(argv[2]) : 1024);
  const int reps = argc > 3 ? std::max(1, std::atoi(argv[3])) : 20;
  const std::string kinds = argc > 4 ? argv[4] : "exact,page,quant,pq,cluster";
  g_threads = argc > 5 ? std::max(0, std::atoi(argv[5])) : 0;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> centers(static_cast<size_t>(64 * kKvHeads * kDim)),
      k(static_cast<size_t>(tokens) * kKvHeads * kDim), q(static_cast<size_t>(kQHeads * kDim));
  for (auto& x : centers) x = 2.0f * n01(rng);
  for (int64_t t = 0; t < tokens; ++t) {
    const size_t which = rng() % 64;
    for (size_t i = 0; i < static_cast<size_t>(kKvHeads * kDim); ++i)
      k[static_cast<size_t>(t) * kKvHeads * kDim + i] = centers[which * kKvHeads * kDim + i] + 0.5f * n01(rng);
  }
  for (auto& x : q) x = n01(rng);
  std::printf("tokens %lld, budget %d, %d query / %d KV heads, head_dim %d, median of %d selects, threads %d%s\n",
              static_cast<long long>(tokens), budget, kQHeads, kKvHeads, kDim, reps, g_threads,
              g_threads == 1 ? " (thread CPU time)" : "");
  std::printf("%-8s %10s %12s %8s %10s %12s %8s %10s %12s %9s %10s\n", "kind", "plain ms", "kvcrush ms", "added",
              "B_imp ms", "kv-B_imp ms", "share", "min share", "grouping us", "share", "first ms");
  const struct {
    const char* name;
    int32_t kind;
  } all[] = {{"exact", KVRET_INDEX_EXACT},
             {"page", KVRET_INDEX_PAGE},
             {"quant", KVRET_INDEX_QUANT},
             {"pq", KVRET_INDEX_PQ},
             {"cluster", KVRET_INDEX_CLUSTER}};
  for (const auto& kind : all) {
    std::string padded(","), key(",");
    padded += kinds;
    padded += ',';
    key += kind.name;
    key += ',';
    if (padded.find(key) == std::string::npos) continue;
    const Paired t = run(kind.kind, 0.25f, tokens, budget, reps, k, q);
    std::printf("%-8s %10.4f %12.4f %7.1f%% %10.4f %12.4f %7.1f%% %9.1f%% %12.2f %8.2f%% %10.1f\n", kind.name, t.plain,
                t.crushed, 100.0 * (t.crushed - t.plain) / t.plain, t.index_part, t.crushed - t.index_part,
                100.0 * (t.crushed - t.index_part) / t.plain, 100.0 * (t.crushed_min - t.index_part_min) / t.plain_min,
                1e3 * t.grouping, 100.0 * t.grouping / t.plain, t.first);
  }
  if ((std::string(",") + kinds + ",").find(",retained,") != std::string::npos) {
    const double plain = retained_ms(0.0f, tokens, budget, reps, k);
    const double crushed = retained_ms(0.25f, tokens, budget, reps, k);
    std::printf("%-8s %12.3f %12.3f %11.1f%%   (kvret_seq_retained_set, eviction-only)\n", "retained", plain, crushed,
                100.0 * (crushed - plain) / plain);
  }
  return 0;
}
