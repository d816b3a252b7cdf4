// kvret-kvcrush-cost: what KVCrush (config.hamming_fraction) adds to a select, through the C ABI. For each index
// kind: one layer of `tokens` clustered keys (32 query heads, 8 KV heads, head_dim 128, f32), then the median of
// `reps` selects of `budget` tokens without KVCrush and with hamming_fraction = 0.25, and the first select with it
// (which computes the layer's signatures). The kind "retained" times kvret_seq_retained_set instead (the
// eviction-only mode, on a STREAMING context): the median of `reps` calls with hamming_fraction 0 and 0.25.
//   kvret-kvcrush-cost [tokens=32768] [budget=1024] [reps=20] [kinds=exact,page,quant,pq,cluster] (kinds may add
//   retained)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvret.h"

namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

double now_ms() {
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

struct Timing {
  double first_ms = 0, median_ms = 0;
};

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

Timing run(int32_t kind, float share, int64_t tokens, int32_t budget, int reps, const std::vector<float>& k,
           const std::vector<float>& q) {
  Layer layer(kind, share, tokens, budget, k);
  kvret_seq* seq = layer.seq;
  const kvret_tensor& ot = layer.ot;
  std::vector<int64_t> q_shape{kQHeads, kDim};
  const kvret_tensor qt = f32_tensor(const_cast<float*>(q.data()), q_shape);
  int32_t count = 0;
  Timing t;
  double start = now_ms();
  check(kvret_select(seq, 0, &qt, budget, &ot, &count), "kvret_select");
  t.first_ms = now_ms() - start;
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    start = now_ms();
    check(kvret_select(seq, 0, &qt, budget, &ot, &count), "kvret_select");
    ms.push_back(now_ms() - start);
  }
  std::sort(ms.begin(), ms.end());
  t.median_ms = ms[ms.size() / 2];
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
  std::printf("tokens %lld, budget %d, %d query / %d KV heads, head_dim %d, median of %d selects\n",
              static_cast<long long>(tokens), budget, kQHeads, kKvHeads, kDim, reps);
  std::printf("%-8s %12s %12s %12s %18s\n", "kind", "plain ms", "kvcrush ms", "added", "first kvcrush ms");
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
    const Timing plain = run(kind.kind, 0.0f, tokens, budget, reps, k, q);
    const Timing crushed = run(kind.kind, 0.25f, tokens, budget, reps, k, q);
    std::printf("%-8s %12.3f %12.3f %11.1f%% %18.1f\n", kind.name, plain.median_ms, crushed.median_ms,
                100.0 * (crushed.median_ms - plain.median_ms) / plain.median_ms, crushed.first_ms);
  }
  if ((std::string(",") + kinds + ",").find(",retained,") != std::string::npos) {
    const double plain = retained_ms(0.0f, tokens, budget, reps, k);
    const double crushed = retained_ms(0.25f, tokens, budget, reps, k);
    std::printf("%-8s %12.3f %12.3f %11.1f%%   (kvret_seq_retained_set, eviction-only)\n", "retained", plain, crushed,
                100.0 * (crushed - plain) / plain);
  }
  return 0;
}
