// CPU decode attention through the C ABI (Google Benchmark): kvret_attend for one decode query of a Llama-3-8B-like
// layer (32 query heads, 8 KV heads, head_dim 128, f16 keys and values, f32 q and out) over 1,024 / 3,357 / 32,768 /
// 131,072 rows per KV head, on 1 and 2 threads (config.n_threads), beside a memcpy of the same K and V bytes on as
// many threads: the floor a pass that reads every row once can approach. bench/attention_torch.py times PyTorch's
// scaled_dot_product_attention on the CPU at the same sizes (BENCHMARKS.md, "CPU decode attention"). BM_SeqAttend
// times kvret_seq_attend at 32k tokens, budget a tenth: EXACT's working set, and QUANT's quantized attention.
// Run: build/bin/kvret-bench-attention [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "kvret.h"

namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

/// A row-major host tensor (f16 elements are uint16_t, f32 elements float), kept by its owner.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<uint16_t> half;
  std::vector<float> full;
  kvret_tensor t{};
  Tensor(std::vector<int64_t> s, bool f16) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    if (f16)
      half.assign(static_cast<size_t>(n), 0);
    else
      full.assign(static_cast<size_t>(n), 0.0f);
    t.data = f16 ? static_cast<void*>(half.data()) : static_cast<void*>(full.data());
    t.device = {KVRET_DEVICE_CPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = {KVRET_DTYPE_FLOAT, static_cast<uint8_t>(f16 ? 16 : 32), 1};
    t.shape = shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  size_t bytes() const { return half.size() * 2 + full.size() * 4; }
};

/// Random f16 bits of moderate magnitude (|x| < 1): sign, exponent 2^-1..2^-8, random mantissa.
uint16_t random_half(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  const auto r = static_cast<uint32_t>(s >> 33);
  return static_cast<uint16_t>(((r & 1u) << 15) | ((7u + (r >> 1) % 8u) << 10) | ((r >> 4) & 0x3ffu));
}

/// q, k and v of one size, made once and shared by the benchmarks.
struct Inputs {
  Tensor q{{kQHeads, kDim}, false}, k, v;
  explicit Inputs(int64_t rows) : k({kKvHeads, rows, kDim}, true), v({kKvHeads, rows, kDim}, true) {
    uint64_t s = static_cast<uint64_t>(rows);
    for (float& x : q.full) x = static_cast<float>(static_cast<int>(random_half(s) % 2001) - 1000) / 1000.0f;
    for (uint16_t& x : k.half) x = random_half(s);
    for (uint16_t& x : v.half) x = random_half(s);
  }
};

Inputs& inputs(int64_t rows) {
  static std::map<int64_t, std::unique_ptr<Inputs>> cache;
  auto& p = cache[rows];
  if (!p) p = std::make_unique<Inputs>(rows);  // every size kept: 688 MiB of K and V in all
  return *p;
}

/// One layer of the benchmark's shape (f16 keys and values) on `threads` threads.
kvret_config layer_config(int64_t threads) {
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = kQHeads;
  c.n_kv_heads = kKvHeads;
  c.head_dim = kDim;
  c.kv_dtype = KVRET_KV_F16;
  c.n_threads = static_cast<int32_t>(threads);
  return c;
}

/// kvret_attend: range(0) rows per KV head, range(1) threads.
void BM_Attend(benchmark::State& state) {
  const int64_t rows = state.range(0);
  Inputs& in = inputs(rows);
  kvret_config c = layer_config(state.range(1));
  kvret_context* ctx = nullptr;
  if (kvret_create(&c, &ctx) != KVRET_OK) {
    state.SkipWithError(kvret_last_error());
    return;
  }
  Tensor out({kQHeads, kDim}, false);
  for (auto _ : state) {
    if (kvret_attend(ctx, &in.q.t, &in.k.t, &in.v.t, rows, 0.0f, &out.t, nullptr) != KVRET_OK) {
      state.SkipWithError(kvret_last_error());
      break;
    }
    benchmark::DoNotOptimize(out.full.data());
    benchmark::ClobberMemory();
  }
  kvret_destroy(ctx);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(in.k.bytes() + in.v.bytes()));
}

/// memcpy of the same K and V bytes into buffers of their own, on range(1) threads (each copies its share).
void BM_MemcpyKv(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  Inputs& in = inputs(rows);
  const size_t bytes = in.k.bytes();
  std::vector<char> dk(bytes), dv(bytes);
  std::memset(dk.data(), 1, bytes);  // touched once, outside the timing
  std::memset(dv.data(), 1, bytes);
  const auto* sk = reinterpret_cast<const char*>(in.k.half.data());
  const auto* sv = reinterpret_cast<const char*>(in.v.half.data());
  for (auto _ : state) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int part = 0; part < threads; ++part) {
      const size_t begin = bytes * static_cast<size_t>(part) / static_cast<size_t>(threads);
      const size_t end = bytes * static_cast<size_t>(part + 1) / static_cast<size_t>(threads);
      std::memcpy(dk.data() + begin, sk + begin, end - begin);
      std::memcpy(dv.data() + begin, sv + begin, end - begin);
    }
    benchmark::DoNotOptimize(dk.data());
    benchmark::DoNotOptimize(dv.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(2 * bytes));
}

/// kvret_seq_attend over a prefilled sequence of range(0) tokens (the same random f16 rows), budget a tenth, on
/// range(1) threads: range(2) = 0 the EXACT index (select, fetch of the working set, attention over it), 1 the QUANT
/// index with quantized attention (the exact rows through the same attention, every other token from the 2-bit
/// copy). Context and prefill are made outside the timing.
void BM_SeqAttend(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const bool quant = state.range(2) == 1;
  kvret_config c = layer_config(state.range(1));
  c.background_build = 0;
  c.index_kind = quant ? KVRET_INDEX_QUANT : KVRET_INDEX_EXACT;
  c.quant_attention = quant ? 1 : 0;
  kvret_context* ctx = nullptr;
  kvret_seq* seq = nullptr;
  Tensor k({tokens, kKvHeads, kDim}, true), v({tokens, kKvHeads, kDim}, true), out({kQHeads, kDim}, false);
  uint64_t s = static_cast<uint64_t>(tokens) + 7;
  for (uint16_t& x : k.half) x = random_half(s);
  for (uint16_t& x : v.half) x = random_half(s);
  const Inputs& in = inputs(1024);  // its query
  if (kvret_create(&c, &ctx) != KVRET_OK || kvret_seq_open(ctx, &seq) != KVRET_OK ||
      kvret_append_prefill(seq, 0, &k.t, &v.t) != KVRET_OK) {
    state.SkipWithError(kvret_last_error());
    kvret_destroy(ctx);
    return;
  }
  for (auto _ : state) {
    if (kvret_seq_attend(seq, 0, &in.q.t, static_cast<int32_t>(tokens / 10), 0.0f, &out.t, nullptr) != KVRET_OK) {
      state.SkipWithError(kvret_last_error());
      break;
    }
    benchmark::DoNotOptimize(out.full.data());
    benchmark::ClobberMemory();
  }
  kvret_seq_close(seq);
  kvret_destroy(ctx);
}

void Sizes(benchmark::internal::Benchmark* b) {
  for (const int64_t rows : {1024, 3357, 32768, 131072})
    for (const int64_t threads : {1, 2}) b->Args({rows, threads});
  b->ArgNames({"rows", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_Attend)->Apply(Sizes);
BENCHMARK(BM_MemcpyKv)->Apply(Sizes);
BENCHMARK(BM_SeqAttend)
    ->ArgsProduct({{32768}, {1, 2}, {0, 1}})
    ->ArgNames({"tokens", "threads", "quant"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
