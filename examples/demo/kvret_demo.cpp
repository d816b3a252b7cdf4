// kvret-demo — a simulated long-context decode of a Llama-3-8B-like model over kvret's public C ABI.
//
// For every index kind asked for (exact, pq, streaming by default), one after another: create a context with that
// index, open a sequence, prefill every layer with keys and values from the synthetic workload (tools/workload;
// converted to the KV dtype here, so that the reference below sees exactly what kvret stores; the prefill of layer
// l+1 overlaps the background index build of layer l), wait for the indexes, then decode: for every step and layer,
// append the new token, select with the step's query, fetch the working set (sink + selected + local) and attend over
// it with kvret_attend. Select and fetch are timed per call. Then the context is destroyed and the next kind runs,
// so that only one copy of the KV cache (4 GiB of f16 at the defaults) is alive at a time.
//
// Quality is computed afterwards by the demo itself, one layer at a time, against exact attention over every stored
// token (the workload's K/V rounded to the KV dtype):
//   token recall@B   per KV head, |selected ∩ exact top-B| / B, where the exact top-B ranks the middle tokens by the
//                    same GQA fold kvret uses (the default: the sum over the KV group's query heads of each head's
//                    softmax probability over the middle tokens). EXACT therefore scores 1.0 by construction and the
//                    figure measures an index's approximation of it. Scores within a relative 1e-4 of the B-th best
//                    count as ties (f32 round-off in the library's scoring). STREAMING selects nothing: 0.
//   mass recall      per query head, the exact softmax mass (over all tokens) that falls in the working set;
//   output error     per query head, ||o_ws - o_full|| / ||o_full||, o_ws from kvret_attend over the working set,
//                    o_full exact attention over all tokens.
// Each is averaged over steps, layers and heads.
//
// Only kvret.h is used from kvret (KVRET_EXPERIMENTAL is not needed).
#define KVRET_EXPERIMENTAL 1  // kvret_prefetch_async (NAME+prefetch)
#include <kvret.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "half.hpp"
#include "quality.hpp"
#include "workload.hpp"

#if defined(KVRET_DEMO_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ------------------------------------------------------------------------------------------------------------------
// options
// ------------------------------------------------------------------------------------------------------------------
struct IndexChoice {
  const char* name;
  kvret_index_kind kind;
  int quant_bits;         // the quant index's bits; 0: the library's default
  bool prefetch = false;  // NAME+prefetch: speculative prefetch with the current query as the next step's guess
  std::string label() const { return std::string(name) + (prefetch ? "+prefetch" : ""); }
};
constexpr IndexChoice kIndexNames[] = {{"exact", KVRET_INDEX_EXACT, 0},         {"pq", KVRET_INDEX_PQ, 0},
                                       {"streaming", KVRET_INDEX_STREAMING, 0}, {"page", KVRET_INDEX_PAGE, 0},
                                       {"cluster", KVRET_INDEX_CLUSTER, 0},     {"quant", KVRET_INDEX_QUANT, 0},
                                       {"quant1", KVRET_INDEX_QUANT, 1},        {"quant2", KVRET_INDEX_QUANT, 2}};

struct Options {
  int layers = 32, q_heads = 32, kv_heads = 8, head_dim = 128;
  int64_t prefill = 32768;
  int decode = 16;
  double budget_ratio = 0.1;
  int budget = 0;  // 0: use budget_ratio
  uint64_t seed = 1;
  int threads = 0;
  int n_sink = -1, n_local = -1;                               // -1: the library's defaults
  int pq_m = -1, pq_bits = -1, pq_iters = -1, pq_sample = -1;  // -1: the library's defaults
  double pq_exact_fraction = -1;                               // -1: the library's default
  int quant_rerank = -1;                                       // -1: the library's default
  std::vector<IndexChoice> indexes{kIndexNames[0], kIndexNames[1], kIndexNames[2]};
  std::string kv_dtype = "f16";
  std::string device = "cpu";
  double hamming_fraction = 0;      // KVCrush's share of representatives; 0: off
  std::string importance = "keys";  // KVCrush's importance: keys, queries or accumulated
  bool json = false;
  bool progress = true;
};

void usage(FILE* f) {
  std::fprintf(
      f,
      "usage: kvret-demo [options]\n"
      "Simulates a long-context decode of a Llama-3-8B-like model on a synthetic workload and compares kvret's\n"
      "indexes: token recall@B, attention-mass recall, output error, build/select/fetch time, memory.\n\n"
      "  --layers N          layers (32)\n"
      "  --q-heads N         query heads (32)\n"
      "  --kv-heads N        KV heads (8)\n"
      "  --head-dim N        head dimension: 64, 128 or 256 (128)\n"
      "  --prefill N         prefill tokens (32768)\n"
      "  --decode N          decode steps (16)\n"
      "  --budget-ratio R    budget as a fraction of the context (0.1)\n"
      "  --budget N          budget in middle tokens per KV head (overrides --budget-ratio)\n"
      "  --n-sink N          sink tokens (library default: 16)\n"
      "  --n-local N         local window (library default: 64)\n"
      "  --pq-m N            PQ sub-spaces (library default: 4)\n"
      "  --pq-bits N         PQ bits per code (library default: 6)\n"
      "  --pq-iters N        k-means iterations, 0 = adaptive (library default: 0)\n"
      "  --pq-sample N       PQ training tokens per KV head, 0 = all (library default: 8192)\n"
      "  --pq-exact-fraction F  share of keys PQ keeps exact, 0 = none (library default)\n"
      "  --quant-rerank N    quant index: candidates per selected token re-ranked by exact keys, 1 = none\n"
      "                      (library default: 4)\n"
      "  --seed N            workload seed (1)\n"
      "  --threads N         CPU threads, library and demo (0 = all cores)\n"
      "  --indexes LIST      comma-separated: exact,pq,streaming (also page, cluster, quant1, quant2); NAME+prefetch:\n"
      "                      after each step, kvret_prefetch_async with that step's query as the next one's guess\n"
      "  --hamming-fraction F  KVCrush: share of each select's budget spent on representatives, [0, 1) (0)\n"
      "  --importance I      KVCrush's importance (with --hamming-fraction): keys (the layer's last 32 keys as "
      "stand-in\n"
      "                      queries, the library's default), queries (the prompt's last 32 queries, handed in with\n"
      "                      kvret_seq_observe after the prefill) or accumulated (each step's attention over its\n"
      "                      working set, handed in with kvret_seq_observe_attention; cpu only) (keys)\n"
      "  --kv-dtype T        f16, bf16 or f32 (f16)\n"
      "  --device D          cpu or cuda (cpu)\n"
      "  --json              print one JSON object on stdout instead of the table\n"
      "  --no-progress       no progress bar (it is shown only when stderr is a terminal)\n"
      "  --help              this text\n");
}

[[noreturn]] void bad_arg(const char* fmt, ...) {
  std::va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "kvret-demo: ");
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  usage(stderr);
  std::exit(2);
}

int64_t parse_int(const char* flag, const char* s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) {
    bad_arg("%s expects an integer in [%lld, %lld], got '%s'", flag, static_cast<long long>(lo),
            static_cast<long long>(hi), s);
  }
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) bad_arg("%s expects a value", a.c_str());
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--layers") {
      o.layers = static_cast<int>(parse_int("--layers", val(), 1, 4096));
    } else if (a == "--q-heads") {
      o.q_heads = static_cast<int>(parse_int("--q-heads", val(), 1, 4096));
    } else if (a == "--kv-heads") {
      o.kv_heads = static_cast<int>(parse_int("--kv-heads", val(), 1, 4096));
    } else if (a == "--head-dim") {
      o.head_dim = static_cast<int>(parse_int("--head-dim", val(), 8, 1024));
    } else if (a == "--prefill") {
      o.prefill = parse_int("--prefill", val(), 1, int64_t{1} << 30);
    } else if (a == "--decode") {
      o.decode = static_cast<int>(parse_int("--decode", val(), 1, 1 << 20));
    } else if (a == "--budget-ratio") {
      const char* s = val();
      char* end = nullptr;
      o.budget_ratio = std::strtod(s, &end);
      if (end == s || *end != '\0' || !(o.budget_ratio > 0.0) || o.budget_ratio > 1.0) {
        bad_arg("--budget-ratio expects a number in (0, 1], got '%s'", s);
      }
      o.budget = 0;
    } else if (a == "--budget") {
      o.budget = static_cast<int>(parse_int("--budget", val(), 1, INT32_MAX));
    } else if (a == "--n-sink") {
      o.n_sink = static_cast<int>(parse_int("--n-sink", val(), 0, INT32_MAX));
    } else if (a == "--n-local") {
      o.n_local = static_cast<int>(parse_int("--n-local", val(), 0, INT32_MAX));
    } else if (a == "--pq-m") {
      o.pq_m = static_cast<int>(parse_int("--pq-m", val(), 1, 256));
    } else if (a == "--pq-bits") {
      o.pq_bits = static_cast<int>(parse_int("--pq-bits", val(), 1, 8));
    } else if (a == "--pq-iters") {
      o.pq_iters = static_cast<int>(parse_int("--pq-iters", val(), 0, 1000));
    } else if (a == "--quant-rerank") {
      o.quant_rerank = static_cast<int>(parse_int("--quant-rerank", val(), 1, 64));
    } else if (a == "--pq-sample") {
      o.pq_sample = static_cast<int>(parse_int("--pq-sample", val(), 0, INT32_MAX));
    } else if (a == "--pq-exact-fraction") {
      const char* s = val();
      char* end = nullptr;
      o.pq_exact_fraction = std::strtod(s, &end);
      if (end == s || *end != '\0' || !(o.pq_exact_fraction >= 0.0) || o.pq_exact_fraction > 0.5) {
        bad_arg("--pq-exact-fraction expects a number in [0, 0.5], got '%s'", s);
      }
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(parse_int("--seed", val(), 0, INT64_MAX));
    } else if (a == "--threads") {
      o.threads = static_cast<int>(parse_int("--threads", val(), 0, 4096));
    } else if (a == "--indexes") {
      o.indexes.clear();
      std::string list = val();
      size_t pos = 0;
      while (pos <= list.size()) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        std::string name = list.substr(pos, comma - pos);
        const std::string suffix = "+prefetch";
        const bool prefetch = name.size() > suffix.size() && name.ends_with(suffix);
        if (prefetch) name.resize(name.size() - suffix.size());
        const IndexChoice* found = nullptr;
        for (const auto& c : kIndexNames) {
          if (name == c.name) found = &c;
        }
        if (!found) bad_arg("unknown index '%s' in --indexes", list.substr(pos, comma - pos).c_str());
        if (prefetch && found->kind == KVRET_INDEX_STREAMING) bad_arg("streaming selects nothing to prefetch");
        o.indexes.push_back(*found);
        o.indexes.back().prefetch = prefetch;
        pos = comma + 1;
      }
    } else if (a == "--kv-dtype") {
      o.kv_dtype = val();
      if (o.kv_dtype != "f16" && o.kv_dtype != "bf16" && o.kv_dtype != "f32") {
        bad_arg("--kv-dtype expects f16, bf16 or f32, got '%s'", o.kv_dtype.c_str());
      }
    } else if (a == "--device") {
      o.device = val();
      if (o.device != "cpu" && o.device != "cuda") bad_arg("--device expects cpu or cuda, got '%s'", o.device.c_str());
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--no-progress") {
      o.progress = false;
    } else if (a == "--hamming-fraction") {
      const char* v = val();
      char* end = nullptr;
      o.hamming_fraction = std::strtod(v, &end);
      if (end == v || *end != '\0' || !(o.hamming_fraction >= 0 && o.hamming_fraction < 1))
        bad_arg("--hamming-fraction expects a number in [0, 1), got '%s'", v);
    } else if (a == "--importance") {
      o.importance = val();
      if (o.importance != "keys" && o.importance != "queries" && o.importance != "accumulated")
        bad_arg("--importance expects keys, queries or accumulated, got '%s'", o.importance.c_str());
    } else {
      bad_arg("unknown argument '%s'", a.c_str());
    }
  }
  if (o.q_heads % o.kv_heads != 0)
    bad_arg("--q-heads (%d) must be a multiple of --kv-heads (%d)", o.q_heads, o.kv_heads);
  if (o.head_dim % 2 != 0) bad_arg("--head-dim must be even");
  if (o.importance == "accumulated" && o.device != "cpu") bad_arg("--importance accumulated needs --device cpu");
  if (o.importance == "queries" && o.prefill < o.decode + 96 + 1)
    bad_arg("--importance queries needs --prefill above --decode + 96 (the prompt queries' generator)");
  if (!isatty(STDERR_FILENO)) o.progress = false;
  return o;
}

// ------------------------------------------------------------------------------------------------------------------
// errors and progress
// ------------------------------------------------------------------------------------------------------------------
void check(kvret_status st, const char* what) {
  if (st == KVRET_OK) return;
  std::fprintf(stderr, "\nkvret-demo: %s failed: %s: %s\n", what, kvret_status_string(st), kvret_last_error());
  std::exit(1);
}
#define KVRET_CHECK(call) check((call), #call)

[[noreturn]] void fail(const char* fmt, ...) {
  std::va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "\nkvret-demo: ");
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::exit(1);
}

class Progress {
 public:
  Progress(bool on, std::string label, int64_t total) : on_(on), label_(std::move(label)), total_(total) { update(0); }
  ~Progress() {
    if (on_) std::fprintf(stderr, "\r\033[K");
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void update(int64_t done) {
    if (!on_) return;
    const int width = 30;
    const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r\033[K%-28s [%s] %lld/%lld", label_.c_str(), bar.c_str(), static_cast<long long>(done),
                 static_cast<long long>(total_));
    std::fflush(stderr);
  }

 private:
  bool on_;
  std::string label_;
  int64_t total_;
};

// ------------------------------------------------------------------------------------------------------------------
// tensors
// ------------------------------------------------------------------------------------------------------------------
enum class KvType { F16, BF16, F32 };

struct KvFormat {
  KvType type;
  int32_t kv_dtype;  // kvret_kv_dtype
  kvret_dtype dtype;
  size_t bytes;
};

KvFormat kv_format(const std::string& s) {
  if (s == "bf16") return {KvType::BF16, KVRET_KV_BF16, {KVRET_DTYPE_BFLOAT, 16, 1}, 2};
  if (s == "f32") return {KvType::F32, KVRET_KV_F32, {KVRET_DTYPE_FLOAT, 32, 1}, 4};
  return {KvType::F16, KVRET_KV_F16, {KVRET_DTYPE_FLOAT, 16, 1}, 2};
}

/// A borrowed kvret_tensor over `data` with up to 3 dims, compact row-major.
struct Tensor {
  int64_t shape[3] = {0, 0, 0};
  kvret_tensor t{};
  Tensor() = default;
  Tensor(void* data, kvret_dtype dtype, std::initializer_list<int64_t> dims, int32_t device_type = KVRET_DEVICE_CPU) {
    int i = 0;
    for (int64_t d : dims) shape[i++] = d;
    t.data = data;
    t.device = {device_type, 0};
    t.ndim = i;
    t.dtype = dtype;
    t.shape = shape;
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  Tensor(const Tensor& o) : Tensor() { *this = o; }
  Tensor& operator=(const Tensor& o) {
    std::memcpy(shape, o.shape, sizeof shape);
    t = o.t;
    t.shape = shape;
    return *this;
  }
  const kvret_tensor* get() const { return &t; }
};

constexpr kvret_dtype kF32{KVRET_DTYPE_FLOAT, 32, 1};
constexpr kvret_dtype kI32{KVRET_DTYPE_INT, 32, 1};

constexpr size_t kChunk = 4096;  // conversion chunk (per OpenMP iteration)

/// Converts n floats to the KV dtype into dst.
void convert_kv(const float* src, size_t n, KvType type, void* dst) {
  if (type == KvType::F32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  const auto chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static) if (n > kChunk)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t b = static_cast<size_t>(c) * kChunk, m = std::min(kChunk, n - b);
    if (type == KvType::F16) {
      kvret_demo::f32_to_f16_n(src + b, d + b, m);
    } else {
      for (size_t i = b; i < b + m; ++i) d[i] = kvret_demo::f32_to_bf16(src[i]);
    }
  }
}

/// Rounds n floats in place to what the KV dtype stores.
void round_kv(float* x, size_t n, KvType type) {
  if (type == KvType::F32) return;
  const auto chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static) if (n > kChunk)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t b = static_cast<size_t>(c) * kChunk, m = std::min(kChunk, n - b);
    if (type == KvType::F16) {
      uint16_t h[kChunk];
      kvret_demo::f32_to_f16_n(x + b, h, m);
      kvret_demo::f16_to_f32_n(h, x + b, m);
    } else {
      for (size_t i = b; i < b + m; ++i) x[i] = kvret_demo::bf16_to_f32(kvret_demo::f32_to_bf16(x[i]));
    }
  }
}

/// Host data as the backend under test takes it: the host pointer itself on the CPU backend, a copy in device memory
/// (cudaMalloc) on the CUDA backend, where an engine's tensors live.
class Staged {
 public:
  Staged(bool cuda, size_t bytes) : cuda_(cuda), bytes_(bytes) {
#if defined(KVRET_DEMO_CUDA)
    if (cuda_ && cudaMalloc(&device_, bytes == 0 ? 1 : bytes) != cudaSuccess)
      fail("cudaMalloc of %zu bytes failed", bytes);
#else
    if (cuda_) fail("this kvret-demo was built without the CUDA runtime: --device cuda is not available");
#endif
  }
  ~Staged() {
#if defined(KVRET_DEMO_CUDA)
    if (device_ != nullptr) cudaFree(device_);
#endif
  }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  /// Where the backend reads `host` (its first `bytes` bytes, at most the staged size).
  void* put(void* host, size_t bytes) {
#if defined(KVRET_DEMO_CUDA)
    if (cuda_) {
      if (bytes > bytes_ || cudaMemcpy(device_, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
        fail("cudaMemcpy (staging %zu bytes) failed", bytes);
      return device_;
    }
#endif
    (void)bytes;
    return host;
  }
  /// Where the backend writes what `get` then copies into `host`.
  void* target(void* host) const { return cuda_ ? device_ : host; }
  void get(void* host, size_t bytes) const {
#if defined(KVRET_DEMO_CUDA)
    if (cuda_ && (bytes > bytes_ || cudaMemcpy(host, device_, bytes, cudaMemcpyDeviceToHost) != cudaSuccess))
      fail("cudaMemcpy (reading %zu bytes back) failed", bytes);
#endif
    (void)host;
    (void)bytes;
  }
  int32_t device_type() const { return cuda_ ? KVRET_DEVICE_CUDA : KVRET_DEVICE_CPU; }

 private:
  bool cuda_;
  size_t bytes_;
  void* device_ = nullptr;
};

// Buffers the working set and the attention output live in: host memory for the CPU backend, device memory for CUDA.
struct DeviceBuffers {
  bool cuda = false;
  void* ws_k = nullptr;
  void* ws_v = nullptr;
  void* ws_pos = nullptr;
  void* out = nullptr;
  std::vector<unsigned char> host_k, host_v, host_pos, host_out;

  DeviceBuffers(bool use_cuda, size_t kv_bytes, size_t pos_bytes, size_t out_bytes) : cuda(use_cuda) {
    if (!cuda) {
      host_k.resize(kv_bytes);
      host_v.resize(kv_bytes);
      host_pos.resize(pos_bytes);
      host_out.resize(out_bytes);
      ws_k = host_k.data();
      ws_v = host_v.data();
      ws_pos = host_pos.data();
      out = host_out.data();
      return;
    }
#if defined(KVRET_DEMO_CUDA)
    auto alloc = [](void** p, size_t n) {
      if (cudaMalloc(p, n) != cudaSuccess) fail("cudaMalloc of %zu bytes failed", n);
    };
    alloc(&ws_k, kv_bytes);
    alloc(&ws_v, kv_bytes);
    alloc(&ws_pos, pos_bytes);
    alloc(&out, out_bytes);
    host_pos.resize(pos_bytes);
    host_out.resize(out_bytes);
#else
    fail("this kvret-demo was built without the CUDA runtime: --device cuda is not available");
#endif
  }
  ~DeviceBuffers() {
#if defined(KVRET_DEMO_CUDA)
    if (cuda) {
      for (void* p : {ws_k, ws_v, ws_pos, out}) cudaFree(p);
    }
#endif
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;

  int32_t device_type() const { return cuda ? KVRET_DEVICE_CUDA : KVRET_DEVICE_CPU; }
  /// Host copies of the working-set positions and the attention output.
  void read_back(size_t pos_bytes, size_t out_bytes) {
#if defined(KVRET_DEMO_CUDA)
    if (cuda) {
      if (cudaMemcpy(host_pos.data(), ws_pos, pos_bytes, cudaMemcpyDeviceToHost) != cudaSuccess ||
          cudaMemcpy(host_out.data(), out, out_bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        fail("cudaMemcpy (read back) failed");
      }
    }
#endif
    (void)pos_bytes;
    (void)out_bytes;
  }
};

// ------------------------------------------------------------------------------------------------------------------
// one index kind: prefill, decode, record
// ------------------------------------------------------------------------------------------------------------------
struct Record {  // what one index kind produced, for the quality pass
  std::string name;
  kvret_index_kind kind{};
  int n_sink = 0, n_local = 0;
  std::vector<int32_t> count;     // [step, layer]: selected per KV head
  std::vector<int32_t> selected;  // [step, layer, kv, max_count] (count valid entries each)
  std::vector<float> o_ws;        // [step, layer, q_head, head_dim]
  int32_t max_count = 0;
  int64_t budget = 0;
  double build_ms_per_layer = 0, select_us = 0, fetch_us = 0, attend_us = 0;
  double prefill_s = 0, decode_s = 0;
  int64_t host_bytes = 0, device_bytes = 0, index_bytes = 0;
  double prefetch_hit_rate = -1;  // NAME+prefetch: stats.prefetch_hits over the middle rows fetched after a prefetch
  // quality (filled by the quality pass)
  double token_recall = 0, mass_recall = 0, output_error = 0;
};

/// f32 of element i of a KV buffer in `type`.
float kv_element(const void* data, KvType type, size_t i) {
  switch (type) {
    case KvType::F32:
      return static_cast<const float*>(data)[i];
    case KvType::F16:
      return kvret_demo::f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case KvType::BF16:
      return kvret_demo::bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0f;
}

Record run_index(const Options& o, const kvret::workload::Workload& w, const std::vector<float>& queries,
                 const std::vector<float>& prompt_queries, const IndexChoice& ix) {
  const KvFormat fmt = kv_format(o.kv_dtype);
  const bool cuda = o.device == "cuda";
  const int L = o.layers, HQ = o.q_heads, HK = o.kv_heads, D = o.head_dim;
  Record rec;
  rec.name = ix.label();
  if (o.hamming_fraction > 0) rec.name += "/" + o.importance;
  rec.kind = ix.kind;

  kvret_config cfg;
  KVRET_CHECK(kvret_config_init(&cfg));
  cfg.n_layers = L;
  cfg.n_q_heads = HQ;
  cfg.n_kv_heads = HK;
  cfg.head_dim = D;
  cfg.kv_dtype = fmt.kv_dtype;
  cfg.device_type = cuda ? KVRET_DEVICE_CUDA : KVRET_DEVICE_CPU;
  cfg.index_kind = ix.kind;
  cfg.budget = o.budget;
  cfg.budget_ratio = static_cast<float>(o.budget_ratio);
  cfg.n_threads = o.threads;
  cfg.seed = o.seed;
  if (o.n_sink >= 0) cfg.n_sink = o.n_sink;
  if (o.n_local >= 0) cfg.n_local = o.n_local;
  if (o.pq_m >= 0) cfg.pq_m = o.pq_m;
  if (o.pq_bits >= 0) cfg.pq_bits = o.pq_bits;
  if (o.pq_iters >= 0) cfg.pq_iters = o.pq_iters;
  if (o.pq_sample >= 0) cfg.pq_train_sample = o.pq_sample;
  if (o.quant_rerank >= 0) cfg.quant_rerank = o.quant_rerank;
  if (o.pq_exact_fraction >= 0) cfg.pq_exact_fraction = static_cast<float>(o.pq_exact_fraction);
  if (ix.quant_bits > 0) cfg.quant_bits = ix.quant_bits;
  cfg.hamming_fraction = static_cast<float>(o.hamming_fraction);
  cfg.hamming_importance = o.importance == "accumulated" ? KVRET_IMPORTANCE_ACCUMULATED : KVRET_IMPORTANCE_WINDOW;
  kvret_context* ctx = nullptr;
  KVRET_CHECK(kvret_create(&cfg, &ctx));
  kvret_config eff;
  KVRET_CHECK(kvret_config_init(&eff));
  KVRET_CHECK(kvret_get_config(ctx, &eff));
  rec.n_sink = eff.n_sink;
  rec.n_local = eff.n_local;
  kvret_seq* seq = nullptr;
  KVRET_CHECK(kvret_seq_open(ctx, &seq));

  // ---- prefill, layer by layer (the index build of layer l runs while layer l+1 is generated and appended) ----
  const auto t_prefill = Clock::now();
  {
    const size_t n = static_cast<size_t>(o.prefill) * HK * D;
    std::vector<float> k(n), v(n);
    std::vector<unsigned char> kc(n * fmt.bytes), vc(n * fmt.bytes);
    Staged k_in(cuda, kc.size()), v_in(cuda, vc.size());
    Progress bar(o.progress, "[" + rec.name + "] prefill", L);
    for (int l = 0; l < L; ++l) {
      w.keys_values(l, 0, o.prefill, k.data(), v.data());
      convert_kv(k.data(), n, fmt.type, kc.data());
      convert_kv(v.data(), n, fmt.type, vc.data());
      const Tensor kt(k_in.put(kc.data(), kc.size()), fmt.dtype, {o.prefill, HK, D}, k_in.device_type()),
          vt(v_in.put(vc.data(), vc.size()), fmt.dtype, {o.prefill, HK, D}, v_in.device_type());
      KVRET_CHECK(kvret_append_prefill(seq, l, kt.get(), vt.get()));
      bar.update(l + 1);
    }
  }
  KVRET_CHECK(kvret_wait_index(seq, -1));
  if (!prompt_queries.empty()) {  // KVCrush's observation window: the prompt's last queries of every layer
    const size_t per_layer = prompt_queries.size() / static_cast<size_t>(L);
    Staged q_in(cuda, per_layer * sizeof(float));
    for (int l = 0; l < L; ++l) {
      float* host = const_cast<float*>(&prompt_queries[static_cast<size_t>(l) * per_layer]);
      const Tensor qt(q_in.put(host, per_layer * sizeof(float)), kF32,
                      {static_cast<int64_t>(per_layer / (static_cast<size_t>(HQ) * D)), HQ, D}, q_in.device_type());
      KVRET_CHECK(kvret_seq_observe(seq, l, qt.get()));
    }
  }
  rec.prefill_s = seconds_since(t_prefill);
  {
    kvret_stats st;
    KVRET_CHECK(kvret_stats_init(&st));
    KVRET_CHECK(kvret_seq_stats(seq, &st));
    rec.build_ms_per_layer = st.index_build_ms / L;
  }

  // ---- decode ----
  int64_t cap_rows = 0;
  {
    // the largest working set of the run: at the last step (the context only grows)
    const int64_t last_len = o.prefill + o.decode;
    const int64_t n_sink = std::min<int64_t>(rec.n_sink, last_len);
    const int64_t n_local = std::min<int64_t>(rec.n_local, last_len - n_sink);
    const int64_t middle = last_len - n_sink - n_local;
    // as kvret computes it (ratio as a float), plus one for rounding
    const int64_t b =
        o.budget > 0
            ? o.budget
            : std::llround(static_cast<double>(static_cast<float>(o.budget_ratio)) * static_cast<double>(last_len)) + 1;
    rec.max_count = static_cast<int32_t>(std::clamp<int64_t>(b, 1, std::max<int64_t>(middle, 1)));
    cap_rows = n_sink + n_local + rec.max_count;
  }
  rec.count.assign(static_cast<size_t>(o.decode) * L, 0);
  rec.selected.assign(static_cast<size_t>(o.decode) * L * HK * rec.max_count, 0);
  rec.o_ws.assign(static_cast<size_t>(o.decode) * L * HQ * D, 0.f);
  const size_t ws_kv_bytes = static_cast<size_t>(HK) * cap_rows * D * fmt.bytes;
  const size_t ws_pos_bytes = static_cast<size_t>(HK) * cap_rows * sizeof(int32_t);
  const size_t q_bytes = static_cast<size_t>(HQ) * D * sizeof(float);
  DeviceBuffers buf(cuda, ws_kv_bytes, ws_pos_bytes, q_bytes);
  std::vector<int32_t> positions(static_cast<size_t>(HK) * rec.max_count);
  std::vector<float> kd(static_cast<size_t>(HK) * D), vd(static_cast<size_t>(HK) * D);
  std::vector<unsigned char> kdc(kd.size() * fmt.bytes), vdc(vd.size() * fmt.bytes);
  const Tensor ws_k(buf.ws_k, fmt.dtype, {HK, cap_rows, D}, buf.device_type());
  const Tensor ws_v(buf.ws_v, fmt.dtype, {HK, cap_rows, D}, buf.device_type());
  const Tensor ws_p(buf.ws_pos, kI32, {HK, cap_rows}, buf.device_type());
  const kvret_working_set ws{ws_k.t, ws_v.t, ws_p.t};
  const Tensor out_t(buf.out, kF32, {HQ, D}, buf.device_type());
  Staged sel_buf(cuda, positions.size() * sizeof(int32_t)), k_step(cuda, kdc.size()), v_step(cuda, vdc.size()),
      q_step(cuda, q_bytes);
  const Tensor sel_t(sel_buf.target(positions.data()), kI32, {HK, rec.max_count}, sel_buf.device_type());
  double t_select = 0, t_fetch = 0, t_attend = 0;
  int64_t prefetched_rows = 0;  // middle rows fetched at steps that followed a prefetch
  const auto t_decode = Clock::now();
  {
    Progress bar(o.progress, "[" + rec.name + "] decode", static_cast<int64_t>(o.decode) * L);
    for (int s = 0; s < o.decode; ++s) {
      const int64_t pos = o.prefill + s;
      for (int l = 0; l < L; ++l) {
        const size_t sl = static_cast<size_t>(s) * L + l;
        // the new token's K/V (converted to the KV dtype as for the prefill)
        w.keys_values(l, pos, pos + 1, kd.data(), vd.data());
        convert_kv(kd.data(), kd.size(), fmt.type, kdc.data());
        convert_kv(vd.data(), vd.size(), fmt.type, vdc.data());
        const Tensor kt(k_step.put(kdc.data(), kdc.size()), fmt.dtype, {HK, D}, k_step.device_type()),
            vt(v_step.put(vdc.data(), vdc.size()), fmt.dtype, {HK, D}, v_step.device_type());
        KVRET_CHECK(kvret_append_decode(seq, l, kt.get(), vt.get()));

        const float* qh = &queries[((static_cast<size_t>(l) * o.decode + s) * HQ) * D];
        const Tensor q_t(q_step.put(const_cast<float*>(qh), q_bytes), kF32, {HQ, D}, q_step.device_type());
        int32_t count = 0;
        int32_t budget = 0;
        KVRET_CHECK(kvret_seq_budget(seq, l, &budget));
        if (budget > rec.max_count)
          fail("kvret_seq_budget: %d, above the %d the demo planned for", budget, rec.max_count);
        auto t0 = Clock::now();
        if (ix.kind != KVRET_INDEX_STREAMING) {
          KVRET_CHECK(kvret_select(seq, l, q_t.get(), KVRET_BUDGET_DEFAULT, sel_t.get(), &count));
        }
        auto t1 = Clock::now();
        int64_t rows = 0;
        KVRET_CHECK(kvret_fetch_async(seq, l, sel_t.get(), count, &ws, &rows, nullptr));
        KVRET_CHECK(kvret_synchronize(ctx, nullptr));
        auto t2 = Clock::now();
        // the query staged for select serves the attention too
        KVRET_CHECK(kvret_attend(ctx, q_t.get(), &ws.k, &ws.v, rows, 0.0f, out_t.get(), nullptr));
        KVRET_CHECK(kvret_synchronize(ctx, nullptr));
        auto t3 = Clock::now();
        if (s > 0 && ix.prefetch) prefetched_rows += static_cast<int64_t>(count) * HK;
        // the guess for the next step: this step's query (its own KV is never stored)
        if (ix.prefetch && s + 1 < o.decode)
          KVRET_CHECK(kvret_prefetch_async(seq, l, q_t.get(), KVRET_BUDGET_DEFAULT, nullptr));
        t_select += std::chrono::duration<double>(t1 - t0).count();
        t_fetch += std::chrono::duration<double>(t2 - t1).count();
        t_attend += std::chrono::duration<double>(t3 - t2).count();
        buf.read_back(ws_pos_bytes, q_bytes);
        sel_buf.get(positions.data(), positions.size() * sizeof(int32_t));

        // record; check that the working set is sink + selected + local, in position order
        if (count < 0 || count > rec.max_count) fail("select returned count %d (capacity %d)", count, rec.max_count);
        rec.count[sl] = count;
        if (s == 0 && l == 0) rec.budget = count;
        const int64_t len = pos + 1;
        const int64_t n_sink = std::min<int64_t>(rec.n_sink, len);
        const int64_t n_local = std::min<int64_t>(rec.n_local, len - n_sink);
        if (rows != n_sink + count + n_local) {
          fail("fetch returned %lld rows, expected %lld sink + %d selected + %lld local", static_cast<long long>(rows),
               static_cast<long long>(n_sink), count, static_cast<long long>(n_local));
        }
        const auto* wpos = reinterpret_cast<const int32_t*>(buf.cuda ? buf.host_pos.data() : buf.ws_pos);
        for (int h = 0; h < HK; ++h) {
          int32_t* dst = &rec.selected[(sl * HK + h) * rec.max_count];
          std::copy_n(&positions[static_cast<size_t>(h) * rec.max_count], count, dst);
          std::sort(dst, dst + count);
          const int32_t* row = wpos + static_cast<size_t>(h) * cap_rows;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t want = r < n_sink ? r : r < n_sink + count ? dst[r - n_sink] : len - (rows - r);
            if (row[r] != want) {
              fail("working set of layer %d head %d, row %lld: position %d, expected %lld", l, h,
                   static_cast<long long>(r), row[r], static_cast<long long>(want));
            }
          }
        }
        if (o.importance == "accumulated") {
          // an engine that attends itself hands kvret the step's probabilities: softmax over the working set
          std::vector<float> probs(static_cast<size_t>(HQ) * len, 0.0f), logit(static_cast<size_t>(rows));
          const int group = HQ / HK;
          const float scale = 1.0f / std::sqrt(static_cast<float>(D));
          for (int h = 0; h < HQ; ++h) {
            const int g = h / group;
            float mx = -INFINITY;
            for (int64_t r = 0; r < rows; ++r) {
              float dot = 0;
              for (int d = 0; d < D; ++d)
                dot += qh[static_cast<size_t>(h) * D + d] *
                       kv_element(buf.ws_k, fmt.type, (static_cast<size_t>(g) * cap_rows + r) * D + d);
              logit[static_cast<size_t>(r)] = scale * dot;
              mx = std::max(mx, logit[static_cast<size_t>(r)]);
            }
            double z = 0;
            for (int64_t r = 0; r < rows; ++r) z += std::exp(logit[static_cast<size_t>(r)] - mx);
            const int32_t* row = wpos + static_cast<size_t>(g) * cap_rows;
            for (int64_t r = 0; r < rows; ++r)
              probs[static_cast<size_t>(h) * len + row[r]] =
                  static_cast<float>(std::exp(logit[static_cast<size_t>(r)] - mx) / z);
          }
          const Tensor pt(probs.data(), kF32, {HQ, len}, KVRET_DEVICE_CPU);
          KVRET_CHECK(kvret_seq_observe_attention(seq, l, pt.get()));
        }
        const auto* o_ws = reinterpret_cast<const float*>(buf.cuda ? buf.host_out.data() : buf.out);
        std::copy_n(o_ws, static_cast<size_t>(HQ) * D, &rec.o_ws[sl * HQ * D]);
        bar.update(static_cast<int64_t>(s) * L + l + 1);
      }
    }
  }
  rec.decode_s = seconds_since(t_decode);
  const double calls = static_cast<double>(o.decode) * L;
  rec.select_us = t_select / calls * 1e6;
  rec.fetch_us = t_fetch / calls * 1e6;
  rec.attend_us = t_attend / calls * 1e6;
  {
    kvret_stats st;
    KVRET_CHECK(kvret_stats_init(&st));
    KVRET_CHECK(kvret_context_stats(ctx, &st));
    rec.host_bytes = st.host_bytes;
    rec.device_bytes = st.device_bytes;
    rec.index_bytes = st.index_bytes;
    if (ix.prefetch && prefetched_rows > 0)
      rec.prefetch_hit_rate = static_cast<double>(st.prefetch_hits) / static_cast<double>(prefetched_rows);
  }
  KVRET_CHECK(kvret_seq_close(seq));
  KVRET_CHECK(kvret_destroy(ctx));
  return rec;
}

// ------------------------------------------------------------------------------------------------------------------
// quality: exact attention over every token, one layer at a time, for all index kinds at once
// ------------------------------------------------------------------------------------------------------------------
// Per layer, all decode steps at once (kvret_quality's exact_attention_steps reads each key and value row once for
// every step and query head of a KV group), then every index kind's selections scored against them.
void quality(const Options& o, const kvret::workload::Workload& w, const std::vector<float>& queries,
             std::vector<Record>& recs) {
  if (recs.empty()) return;
  const KvFormat fmt = kv_format(o.kv_dtype);
  const int L = o.layers, HQ = o.q_heads, HK = o.kv_heads, D = o.head_dim, S = o.decode;
  const int64_t total = o.prefill + S;
  const size_t n = static_cast<size_t>(total) * HK * D;
  std::vector<float> K(n), V(n);
  std::vector<kvret::quality::Totals> totals(recs.size());
  kvret::quality::StepsInput in;
  in.k = K.data();
  in.v = V.data();
  in.n_q_heads = HQ;
  in.n_kv_heads = HK;
  in.head_dim = D;
  // the sink/local split is the same for every kind (one config); take it from the first record
  in.n_sink = recs.front().n_sink;
  in.n_local = recs.front().n_local;
  for (int s = 0; s < S; ++s) in.lengths.push_back(o.prefill + s + 1);
  Progress bar(o.progress, "quality (exact attention)", L);
  std::vector<const int32_t*> selected(static_cast<size_t>(HK));
  for (int l = 0; l < L; ++l) {
    w.keys_values(l, 0, total, K.data(), V.data());
    round_kv(K.data(), n, fmt.type);
    round_kv(V.data(), n, fmt.type);
    in.q = &queries[static_cast<size_t>(l) * S * HQ * D];
    const std::vector<kvret::quality::ExactAttention> exact = kvret::quality::exact_attention_steps(in);
    for (size_t x = 0; x < recs.size(); ++x) {
      const Record& rec = recs[x];
      for (int s = 0; s < S; ++s) {
        const size_t sl = static_cast<size_t>(s) * L + l;
        for (int g = 0; g < HK; ++g) selected[static_cast<size_t>(g)] = &rec.selected[(sl * HK + g) * rec.max_count];
        kvret::quality::score_selection(exact[static_cast<size_t>(s)], selected.data(), rec.count[sl], totals[x],
                                        &rec.o_ws[sl * HQ * D]);
      }
    }
    bar.update(l + 1);
  }
  for (size_t x = 0; x < recs.size(); ++x) {
    recs[x].token_recall = totals[x].token_recall();
    recs[x].mass_recall = totals[x].mass_recall();
    recs[x].output_error = totals[x].output_error();
  }
}

// ------------------------------------------------------------------------------------------------------------------
// output
// ------------------------------------------------------------------------------------------------------------------
std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = static_cast<double>(b);
  int u = 0;
  while (x >= 1024.0 && u < 4) x /= 1024.0, ++u;
  char s[32];
  std::snprintf(s, sizeof s, u == 0 ? "%.0f %s" : "%.2f %s", x, units[u]);
  return s;
}

void print_table(const Options& o, const std::vector<Record>& recs, double total_s) {
  std::printf("kvret %s — simulated decode: %d layers, %d q / %d kv heads, head_dim %d, %s KV, %s\n",
              kvret_version_string(), o.layers, o.q_heads, o.kv_heads, o.head_dim, o.kv_dtype.c_str(),
              o.device.c_str());
  std::printf("context %lld prefill + %d decode steps; budget %s; seed %llu\n", static_cast<long long>(o.prefill),
              o.decode,
              o.budget > 0 ? (std::to_string(o.budget) + " tokens per KV head").c_str()
                           : (std::to_string(o.budget_ratio).substr(0, 6) + " x context").c_str(),
              static_cast<unsigned long long>(o.seed));
  if (o.hamming_fraction > 0)
    std::printf("KVCrush: %.3g of each budget on representatives, importance from %s\n", o.hamming_fraction,
                o.importance.c_str());
  if (!recs.empty()) {
    std::printf("working set = %d sink + budget + %d local tokens per KV head\n\n", recs.front().n_sink,
                recs.front().n_local);
  }
  std::printf("%-15s %7s %8s %8s %8s %10s %10s %10s %11s %11s %11s %9s\n", "index", "budget", "token", "mass", "output",
              "build", "select", "fetch", "host", "device", "index", "prefetch");
  std::printf("%-15s %7s %8s %8s %8s %10s %10s %10s %11s %11s %11s %9s\n", "", "", "recall", "recall", "error",
              "ms/layer", "us/layer", "us/layer", "bytes", "bytes", "bytes", "hit rate");
  for (const auto& r : recs) {
    char hit[16] = "-";
    if (r.prefetch_hit_rate >= 0) std::snprintf(hit, sizeof hit, "%.4f", r.prefetch_hit_rate);
    std::printf("%-15s %7lld %8.4f %8.4f %8.4f %10.2f %10.1f %10.1f %11s %11s %11s %9s\n", r.name.c_str(),
                static_cast<long long>(r.budget), r.token_recall, r.mass_recall, r.output_error, r.build_ms_per_layer,
                r.select_us, r.fetch_us, human_bytes(r.host_bytes).c_str(), human_bytes(r.device_bytes).c_str(),
                human_bytes(r.index_bytes).c_str(), hit);
  }
  std::printf(
      "\ntoken recall: selected vs the exact top-B of the same GQA-folded score (EXACT = 1 by construction);\n"
      "mass recall: exact softmax mass (over all tokens) inside the working set; output error: ||o_ws - o||/||o||;\n"
      "prefetch hit rate: the share of the middle rows a step fetched that the previous step's prefetch had selected.\n"
      "total %.1f s\n",
      total_s);
}

void print_json(const Options& o, const std::vector<Record>& recs, double total_s) {
  std::printf(
      "{\"config\": {\"layers\": %d, \"q_heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"prefill\": %lld, "
      "\"decode\": %d, \"budget_ratio\": %.6g, \"budget\": %d, \"n_sink\": %d, \"n_local\": %d, "
      "\"seed\": %llu, \"threads\": %d, \"indexes\": [",
      o.layers, o.q_heads, o.kv_heads, o.head_dim, static_cast<long long>(o.prefill), o.decode, o.budget_ratio,
      o.budget, recs.empty() ? o.n_sink : recs.front().n_sink, recs.empty() ? o.n_local : recs.front().n_local,
      static_cast<unsigned long long>(o.seed), o.threads);
  for (size_t i = 0; i < o.indexes.size(); ++i) std::printf("%s\"%s\"", i ? ", " : "", o.indexes[i].label().c_str());
  std::printf(
      "], \"kv_dtype\": \"%s\", \"device\": \"%s\", \"hamming_fraction\": %.6g, \"importance\": \"%s\", "
      "\"kvret_version\": \"%s\"}, \"results\": [",
      o.kv_dtype.c_str(), o.device.c_str(), o.hamming_fraction, o.importance.c_str(), kvret_version_string());
  for (size_t i = 0; i < recs.size(); ++i) {
    const Record& r = recs[i];
    std::printf(
        "%s{\"index\": \"%s\", \"budget\": %lld, \"token_recall\": %.6f, \"mass_recall\": %.6f, "
        "\"output_error\": %.6f, \"build_ms_per_layer\": %.4f, \"select_us_per_layer\": %.3f, "
        "\"fetch_us_per_layer\": %.3f, \"attend_us_per_layer\": %.3f, \"host_bytes\": %lld, "
        "\"device_bytes\": %lld, \"index_bytes\": %lld, \"prefill_s\": %.3f, \"decode_s\": %.3f, "
        "\"prefetch_hit_rate\": %s}",
        i ? ", " : "", r.name.c_str(), static_cast<long long>(r.budget), r.token_recall, r.mass_recall, r.output_error,
        r.build_ms_per_layer, r.select_us, r.fetch_us, r.attend_us, static_cast<long long>(r.host_bytes),
        static_cast<long long>(r.device_bytes), static_cast<long long>(r.index_bytes), r.prefill_s, r.decode_s,
        r.prefetch_hit_rate >= 0 ? std::to_string(r.prefetch_hit_rate).c_str() : "null");
  }
  std::printf("], \"total_s\": %.3f}\n", total_s);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const auto t0 = Clock::now();
  if (o.threads > 0) omp_set_num_threads(o.threads);
  if (kvret_version_number() != KVRET_VERSION_NUMBER) {
    std::fprintf(stderr, "kvret-demo: warning: built against kvret %d.%d.%d, running with %s\n", KVRET_VERSION_MAJOR,
                 KVRET_VERSION_MINOR, KVRET_VERSION_PATCH, kvret_version_string());
  }

  kvret::workload::Config wc;
  wc.n_layers = o.layers;
  wc.n_q_heads = o.q_heads;
  wc.n_kv_heads = o.kv_heads;
  wc.head_dim = o.head_dim;
  wc.n_prefill = o.prefill;
  wc.n_decode = o.decode;
  wc.seed = o.seed;
  const kvret::workload::Workload w(wc);

  // every layer's decode queries, [layer, step, q_head, head_dim] (8 MiB at the defaults)
  std::vector<float> queries(static_cast<size_t>(o.layers) * o.decode * o.q_heads * o.head_dim);
  for (int l = 0; l < o.layers; ++l) {
    w.queries(l, o.decode, &queries[static_cast<size_t>(l) * o.decode * o.q_heads * o.head_dim]);
  }

  // --importance queries: the prompt's last 32 queries of every layer, [layer, 32, q_head, head_dim]. The workload
  // generates queries for decode steps only: a workload that ends its prefill `gap` + 32 tokens earlier places its
  // decode steps gap .. gap + 31 at the prompt's last 32 positions (the same keys and topics; the steps' random
  // innovations are those of steps the decode below never reaches, so the window does not see the measured queries).
  std::vector<float> prompt_queries;
  if (o.importance == "queries" && o.hamming_fraction > 0) {
    constexpr int kWindow = 32;
    const int gap = o.decode + 64;
    kvret::workload::Config pc = wc;
    pc.n_prefill = o.prefill - kWindow - gap;
    pc.n_decode = gap + kWindow;
    const kvret::workload::Workload pw(pc);
    const size_t row = static_cast<size_t>(o.q_heads) * o.head_dim;
    std::vector<float> steps(static_cast<size_t>(gap + kWindow) * row);
    prompt_queries.resize(static_cast<size_t>(o.layers) * kWindow * row);
    for (int l = 0; l < o.layers; ++l) {
      pw.queries(l, gap + kWindow, steps.data());
      std::copy(steps.begin() + static_cast<std::ptrdiff_t>(gap * row), steps.end(),
                prompt_queries.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(l) * kWindow * row));
    }
  }

  std::vector<Record> recs;
  for (const auto& ix : o.indexes) recs.push_back(run_index(o, w, queries, prompt_queries, ix));
  quality(o, w, queries, recs);
  const double total_s = seconds_since(t0);
  if (o.json) {
    print_json(o, recs, total_s);
  } else {
    print_table(o, recs, total_s);
  }
  return 0;
}
