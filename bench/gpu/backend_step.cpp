// kvret-bench-backend: one decode step through the C ABI on the CPU backend and on the CUDA backend, in one run.
//
// For each backend, index kind and context length: a one-layer context (32 query heads, 8 KV heads, head_dim 128,
// f16 KV), a prefill of clustered random keys, then per step kvret_select alone and kvret_seq_attend (select +
// fetch + attention) followed by kvret_synchronize. On the CUDA backend q, the prefill and out are device memory
// (cudaMalloc), as an engine holds them. Prints the median microseconds of each, and the prefill + index build.
// Then, per backend and index kind, a batch of n sequences (8k tokens down to 6k, so that they share one set of
// passes on the CUDA backend): kvret_select_batch against n kvret_select calls on the same sequences and queries,
// each followed by kvret_synchronize (section=backend_batch).
//
// With --step, only an engine's decode step for a batch of sequences (section=step; run_step below), at 32k and
// 128k tokens x batch 1, 8 and 32, PQ and EXACT: the device check's benchmark.
//
//   kvret-bench-backend [--quick] [--step] [--steps=N] [--pcie-gbps=G] [--hbm-gbps=G]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvret.h"

namespace {

constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;

#define BENCH_CHECK(call)                                                                             \
  do {                                                                                                \
    const kvret_status status_ = (call);                                                              \
    if (status_ != KVRET_OK) {                                                                        \
      std::fprintf(stderr, "kvret-bench-backend: %s: %s (%s)\n", #call, kvret_status_string(status_), \
                   kvret_last_error());                                                               \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)
#define CUDA_CHECK(call)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "kvret-bench-backend: %s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

/// A float tensor on `device`: host memory for the CPU backend, cudaMalloc'd memory for the CUDA backend.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> host;
  void* device_data = nullptr;
  kvret_tensor t{};

  Tensor(std::vector<int64_t> s, int32_t device_type, const std::vector<float>* init) : shape(std::move(s)) {
    size_t n = 1;
    for (int64_t e : shape) n *= static_cast<size_t>(e);
    host.assign(n, 0.0f);
    if (init != nullptr) host = *init;
    t.data = host.data();
    if (device_type == KVRET_DEVICE_CUDA) {
      CUDA_CHECK(cudaMalloc(&device_data, n * sizeof(float)));
      CUDA_CHECK(cudaMemcpy(device_data, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
      t.data = device_data;
    }
    t.device = {device_type, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = {KVRET_DTYPE_FLOAT, 32, 1};
    t.shape = shape.data();
  }
  ~Tensor() {
    if (device_data != nullptr) (void)cudaFree(device_data);
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

const char* index_name(int kind) {
  switch (kind) {
    case KVRET_INDEX_EXACT:
      return "exact";
    case KVRET_INDEX_PQ:
      return "pq";
    case KVRET_INDEX_PAGE:
      return "page";
    case KVRET_INDEX_QUANT:
      return "quant";
    default:
      return "?";
  }
}

/// A one-layer context of `index_kind` on `device_type`.
kvret_context* make_context(int32_t device_type, int index_kind, int threads) {
  kvret_config c;
  BENCH_CHECK(kvret_config_init(&c));
  c.n_layers = 1;
  c.n_q_heads = kQHeads;
  c.n_kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  c.index_kind = index_kind;
  c.n_threads = threads;
  c.device_type = device_type;
  kvret_context* ctx = nullptr;
  BENCH_CHECK(kvret_create(&c, &ctx));
  return ctx;
}

/// A sequence of ctx holding a prefill of `tokens` clustered random keys (64 centres) and random values, its index
/// built; the milliseconds of the prefill and build in *build_ms.
kvret_seq* prefilled(kvret_context* ctx, int32_t device_type, int tokens, uint64_t seed, double* build_ms) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const size_t kv_n = static_cast<size_t>(tokens) * kKvHeads * kHeadDim;
  std::vector<float> keys(kv_n), values(kv_n), centers(64 * kKvHeads * kHeadDim);
  for (auto& c : centers) c = 2.0f * n01(rng);
  for (int t = 0; t < tokens; ++t) {
    const size_t c = rng() % 64;
    for (size_t i = 0; i < static_cast<size_t>(kKvHeads * kHeadDim); ++i) {
      keys[static_cast<size_t>(t) * kKvHeads * kHeadDim + i] = centers[c * kKvHeads * kHeadDim + i] + 0.5f * n01(rng);
      values[static_cast<size_t>(t) * kKvHeads * kHeadDim + i] = n01(rng);
    }
  }
  kvret_seq* seq = nullptr;
  BENCH_CHECK(kvret_seq_open(ctx, &seq));
  Tensor k({tokens, kKvHeads, kHeadDim}, device_type, &keys), v({tokens, kKvHeads, kHeadDim}, device_type, &values);
  const auto t0 = std::chrono::steady_clock::now();
  BENCH_CHECK(kvret_append_prefill(seq, 0, &k.t, &v.t));
  BENCH_CHECK(kvret_wait_index(seq, -1));
  *build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return seq;
}

void run(int32_t device_type, int index_kind, int tokens, int steps, int threads) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  kvret_context* ctx = make_context(device_type, index_kind, threads);
  double build_ms = 0;
  kvret_seq* seq = prefilled(ctx, device_type, tokens, 7, &build_ms);
  int32_t budget = 0;
  BENCH_CHECK(kvret_seq_budget(seq, 0, &budget));
  std::vector<float> q_init(static_cast<size_t>(kQHeads * kHeadDim));
  Tensor out({kQHeads, kHeadDim}, device_type, nullptr);
  Tensor selected_f({kKvHeads, budget}, device_type, nullptr);  // storage for the selection (int32 view below)
  kvret_tensor sel = selected_f.t;
  sel.dtype = {KVRET_DTYPE_INT, 32, 1};
  std::vector<double> select_us, attend_us;
  for (int s = 0; s < steps + 3; ++s) {
    for (auto& x : q_init) x = n01(rng);
    Tensor q({kQHeads, kHeadDim}, device_type, &q_init);
    int32_t count = 0;
    auto t0 = std::chrono::steady_clock::now();
    BENCH_CHECK(kvret_select(seq, 0, &q.t, KVRET_BUDGET_DEFAULT, &sel, &count));
    BENCH_CHECK(kvret_synchronize(ctx, nullptr));
    auto t1 = std::chrono::steady_clock::now();
    BENCH_CHECK(kvret_seq_attend(seq, 0, &q.t, KVRET_BUDGET_DEFAULT, 0.0f, &out.t, nullptr));
    BENCH_CHECK(kvret_synchronize(ctx, nullptr));
    auto t2 = std::chrono::steady_clock::now();
    if (s < 3) continue;  // warm-up: the sequence's buffers grow on the first steps
    select_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    attend_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  std::printf(
      "section=backend backend=%s index=%s tokens=%d kv_heads=%d q_heads=%d head_dim=%d budget=%d threads=%d "
      "prefill_build_ms=%.1f select_us=%.1f seq_attend_us=%.1f\n",
      device_type == KVRET_DEVICE_CUDA ? "cuda" : "cpu", index_name(index_kind), tokens, kKvHeads, kQHeads, kHeadDim,
      budget, threads, build_ms, median(select_us), median(attend_us));
  std::fflush(stdout);
  BENCH_CHECK(kvret_seq_close(seq));
  BENCH_CHECK(kvret_destroy(ctx));
}

/// kvret_select_batch over n sequences (8192 tokens down to 6144) against n kvret_select calls, each then
/// kvret_synchronize; the budget of the shortest sequence for all.
void run_batch(int32_t device_type, int index_kind, int n, int steps, int threads) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  kvret_context* ctx = make_context(device_type, index_kind, threads);
  std::vector<kvret_seq*> seqs;
  double build_ms = 0;
  for (int i = 0; i < n; ++i)
    seqs.push_back(
        prefilled(ctx, device_type, 8192 - 2048 * i / std::max(1, n - 1), 100 + static_cast<uint64_t>(i), &build_ms));
  int32_t budget = 0;
  BENCH_CHECK(kvret_seq_budget(seqs.back(), 0, &budget));
  std::vector<float> q_init(static_cast<size_t>(n) * kQHeads * kHeadDim);
  Tensor positions_f({n, kKvHeads, budget}, device_type, nullptr);  // storage for the selections (int32 view)
  kvret_tensor positions = positions_f.t;
  positions.dtype = {KVRET_DTYPE_INT, 32, 1};
  std::vector<int32_t> counts(static_cast<size_t>(n));
  std::vector<double> batch_us, singles_us;
  for (int s = 0; s < steps + 3; ++s) {
    for (auto& x : q_init) x = n01(rng);
    Tensor q({n, kQHeads, kHeadDim}, device_type, &q_init);
    auto t0 = std::chrono::steady_clock::now();
    BENCH_CHECK(kvret_select_batch(ctx, n, seqs.data(), 0, &q.t, budget, &positions, counts.data()));
    BENCH_CHECK(kvret_synchronize(ctx, nullptr));
    auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      const int64_t q_shape[2] = {kQHeads, kHeadDim}, out_shape[2] = {kKvHeads, budget};
      kvret_tensor qi = q.t, oi = positions;
      qi.ndim = oi.ndim = 2;
      qi.shape = q_shape;
      oi.shape = out_shape;
      qi.data = static_cast<float*>(q.t.data) + static_cast<size_t>(i) * kQHeads * kHeadDim;
      oi.data = static_cast<int32_t*>(positions.data) + static_cast<size_t>(i) * kKvHeads * budget;
      BENCH_CHECK(kvret_select(seqs[static_cast<size_t>(i)], 0, &qi, budget, &oi, &counts[static_cast<size_t>(i)]));
    }
    BENCH_CHECK(kvret_synchronize(ctx, nullptr));
    auto t2 = std::chrono::steady_clock::now();
    if (s < 3) continue;  // warm-up: the device copies of the indexes are made at the first selects
    batch_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    singles_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  std::printf(
      "section=backend_batch backend=%s index=%s n=%d tokens=8192..6144 budget=%d threads=%d batch_us=%.1f "
      "singles_us=%.1f singles_over_batch=%.2f\n",
      device_type == KVRET_DEVICE_CUDA ? "cuda" : "cpu", index_name(index_kind), n, budget, threads, median(batch_us),
      median(singles_us), median(singles_us) / median(batch_us));
  std::fflush(stdout);
  for (kvret_seq* seq : seqs) BENCH_CHECK(kvret_seq_close(seq));
  BENCH_CHECK(kvret_destroy(ctx));
}

/// An engine's decode step of one layer for a batch of n sequences on the CUDA backend (section=step): per sequence
/// kvret_append_decode (k and v in device memory) and kvret_seq_attend on the engine's stream, then one
/// kvret_synchronize; the n sequences are forks of one prefilled sequence (their pages shared until a decode append
/// copies the last one), f16 KV, the default budget. Prints the median step, the select alone at batch 1, the block
/// cache's hit rate over the measured steps, and the step's physical floor: the bytes the step moved host to device
/// (stats.bytes_h2d) at `pcie_gbps`, plus the working sets' keys and values read once at `hbm_gbps`.
void run_step(int index_kind, int tokens, int n, int steps, int threads, double pcie_gbps, double hbm_gbps) {
  std::mt19937_64 rng(13);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  kvret_context* ctx = make_context(KVRET_DEVICE_CUDA, index_kind, threads);
  double build_ms = 0;
  std::vector<kvret_seq*> seqs{prefilled(ctx, KVRET_DEVICE_CUDA, tokens, 13, &build_ms)};
  for (int i = 1; i < n; ++i) {
    kvret_seq* fork = nullptr;
    BENCH_CHECK(kvret_seq_fork(seqs[0], &fork));
    seqs.push_back(fork);
  }
  int32_t budget = 0;
  BENCH_CHECK(kvret_seq_budget(seqs[0], 0, &budget));
  int64_t rows = 0;
  BENCH_CHECK(kvret_working_set_capacity(seqs[0], 0, budget, &rows));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto engine_stream = reinterpret_cast<kvret_stream>(stream);
  std::vector<float> q_init(static_cast<size_t>(kQHeads * kHeadDim)), kv_init(static_cast<size_t>(kKvHeads * kHeadDim));
  Tensor out({kQHeads, kHeadDim}, KVRET_DEVICE_CUDA, nullptr);
  for (auto& x : q_init) x = n01(rng);
  Tensor q({kQHeads, kHeadDim}, KVRET_DEVICE_CUDA, &q_init);
  for (auto& x : kv_init) x = n01(rng);
  Tensor k({1, kKvHeads, kHeadDim}, KVRET_DEVICE_CUDA, &kv_init),
      v({1, kKvHeads, kHeadDim}, KVRET_DEVICE_CUDA, &kv_init);
  Tensor selected_f({kKvHeads, budget}, KVRET_DEVICE_CUDA, nullptr);
  kvret_tensor sel = selected_f.t;
  sel.dtype = {KVRET_DTYPE_INT, 32, 1};
  const auto totals = [&] {
    kvret_stats sum;
    BENCH_CHECK(kvret_stats_init(&sum));
    for (kvret_seq* seq : seqs) {
      kvret_stats st;
      BENCH_CHECK(kvret_stats_init(&st));
      BENCH_CHECK(kvret_seq_stats(seq, &st));  // waits for the device's counts
      sum.cache_hits += st.cache_hits;
      sum.cache_misses += st.cache_misses;
      sum.bytes_h2d += st.bytes_h2d;
    }
    return sum;
  };
  const int warm = 3;
  std::vector<double> step_us, select_us;
  kvret_stats before{};
  for (int s = 0; s < steps + warm; ++s) {
    if (s == warm) before = totals();
    const auto t0 = std::chrono::steady_clock::now();
    for (kvret_seq* seq : seqs) {
      BENCH_CHECK(kvret_append_decode(seq, 0, &k.t, &v.t));
      BENCH_CHECK(kvret_seq_attend(seq, 0, &q.t, budget, 0.0f, &out.t, engine_stream));
    }
    BENCH_CHECK(kvret_synchronize(ctx, engine_stream));
    const auto t1 = std::chrono::steady_clock::now();
    int32_t count = 0;
    if (n == 1) {  // the select alone, as an engine with its own sparse attention calls it
      BENCH_CHECK(kvret_select(seqs[0], 0, &q.t, budget, &sel, &count));
      BENCH_CHECK(kvret_synchronize(ctx, nullptr));
    }
    const auto t2 = std::chrono::steady_clock::now();
    if (s < warm) continue;
    step_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    select_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  const kvret_stats after = totals();
  const double hits = static_cast<double>(after.cache_hits - before.cache_hits);
  const double misses = static_cast<double>(after.cache_misses - before.cache_misses);
  const double h2d_per_step = static_cast<double>(after.bytes_h2d - before.bytes_h2d) / steps;
  const double ws_bytes = 2.0 * n * kKvHeads * static_cast<double>(rows) * kHeadDim * 2;  // f16 keys and values
  const double floor_us = h2d_per_step / (pcie_gbps * 1e3) + ws_bytes / (hbm_gbps * 1e3);
  const double step = median(step_us);
  std::printf(
      "section=step backend=cuda index=%s tokens=%d batch=%d kv_heads=%d q_heads=%d head_dim=%d kv=f16 budget=%d "
      "rows=%lld prefill_build_ms=%.1f step_us=%.1f select_us=%s hit_rate=%.3f h2d_bytes_per_step=%.0f "
      "floor_us=%.1f step_over_floor=%.2f\n",
      index_name(index_kind), tokens, n, kKvHeads, kQHeads, kHeadDim, budget, static_cast<long long>(rows), build_ms,
      step, n == 1 ? std::to_string(median(select_us)).c_str() : "-", hits + misses > 0 ? hits / (hits + misses) : 0.0,
      h2d_per_step, floor_us, step / floor_us);
  std::fflush(stdout);
  for (kvret_seq* seq : seqs) BENCH_CHECK(kvret_seq_close(seq));
  CUDA_CHECK(cudaStreamDestroy(stream));
  BENCH_CHECK(kvret_destroy(ctx));
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, step_only = false;
  int steps = 30;
  double pcie_gbps = 50.0, hbm_gbps = 3350.0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
      steps = 10;
    } else if (std::strcmp(argv[i], "--step") == 0) {
      step_only = true;
    } else if (std::strncmp(argv[i], "--steps=", 8) == 0) {
      steps = std::max(1, std::atoi(argv[i] + 8));
    } else if (std::strncmp(argv[i], "--pcie-gbps=", 12) == 0) {
      pcie_gbps = std::max(1.0, std::atof(argv[i] + 12));
    } else if (std::strncmp(argv[i], "--hbm-gbps=", 11) == 0) {
      hbm_gbps = std::max(1.0, std::atof(argv[i] + 11));
    } else {
      std::fprintf(stderr,
                   "usage: kvret-bench-backend [--quick] [--step] [--steps=N] [--pcie-gbps=G] [--hbm-gbps=G]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kvret-bench-backend: no CUDA device; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device=\"%s\"\n", prop.name);
  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (step_only) {  // the device check's step benchmark (docs/cuda_backend.md)
    const std::vector<int> lengths = quick ? std::vector<int>{32768} : std::vector<int>{32768, 131072};
    const std::vector<int> batches = quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
    for (const int tokens : lengths)
      for (const int kind : {KVRET_INDEX_PQ, KVRET_INDEX_EXACT})
        for (const int n : batches) run_step(kind, tokens, n, steps, threads, pcie_gbps, hbm_gbps);
    return 0;
  }
  const std::vector<int> lengths = quick ? std::vector<int>{8192} : std::vector<int>{8192, 32768};
  for (const int tokens : lengths)
    for (const int kind : {KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_EXACT})
      for (const int32_t device : {KVRET_DEVICE_CPU, KVRET_DEVICE_CUDA}) run(device, kind, tokens, steps, threads);
  const std::vector<int> batches = quick ? std::vector<int>{4} : std::vector<int>{1, 4, 16};
  for (const int n : batches)
    for (const int kind : {KVRET_INDEX_PQ, KVRET_INDEX_QUANT, KVRET_INDEX_EXACT, KVRET_INDEX_PAGE})
      for (const int32_t device : {KVRET_DEVICE_CPU, KVRET_DEVICE_CUDA}) run_batch(device, kind, n, steps, threads);
  return 0;
}
