// kvret-bench-gpu: timings of the CUDA kernels with CUDA events, for the figures the spec asks of an H100.
//
//   select  PQ scores (sum-prob GQA fold) + top-k for 8k..128k tokens x 8 KV heads at batch 1 and 16
//   fetch   working-set gather of scattered 256-byte rows from mapped pinned host memory, against one contiguous
//           cudaMemcpyAsync of the same bytes, one cudaMemcpyAsync per row, and a gather that hits the block cache
//   build   PQ index build of one layer: training points + k-means (cuBLAS) + encoding every token
//   attend  decode attention over the working set
//   cache   block-cache update after a fetch
//
// Every line is "section=... key=value ...", so that bench/gpu/torch_peer.py's lines can be joined with these.
// Usage: kvret-bench-gpu [--quick] [--sections=select,fetch,build,attend,cache] [--reps=N]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_cache.h"
#include "decode_attention.h"
#include "device_probe.cuh"
#include "pq_encode.h"
#include "pq_kmeans.h"
#include "pq_scores.h"
#include "topk_select.h"
#include "working_set_gather.h"

namespace kvret::cuda::bench {
namespace {

// ---- the model the figures are for: an 8-KV-head, 32-query-head, head_dim 128, f16 layer ----
constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kPqM = 2;
constexpr int kPqBits = 6;
constexpr int kSink = 16;
constexpr int kLocal = 64;
constexpr int kBlockTokens = 128;
constexpr double kBudgetRatio = 0.1;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
#define CHECK(expr) check((expr), #expr)

template <typename T>
struct Device {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Device(size_t count) : n(count) {
    if (count > 0) CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), count * sizeof(T)));
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device() { (void)cudaFree(ptr); }
  void upload(const std::vector<T>& host) {
    CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
};

struct Pinned {
  void* host = nullptr;
  void* device = nullptr;
  explicit Pinned(size_t bytes) {
    CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer(&device, host, 0));
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() { (void)cudaFreeHost(host); }
};

struct Options {
  bool quick = false;
  int reps = 50;
  std::set<std::string> sections = {"select", "fetch", "build", "attend", "cache"};
};

struct Timing {
  double median_us;
  double min_us;
};

/// Times enqueue(rep) on `stream` between two events, `reps` times after `warmup` untimed runs.
Timing time_it(cudaStream_t stream, int warmup, int reps, const std::function<void(int)>& enqueue) {
  for (int i = 0; i < warmup; ++i) enqueue(i);
  CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start;
  cudaEvent_t stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(start, stream));
    enqueue(r);
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(1000.0 * ms);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us.front()};
}

std::vector<int> context_sizes(const Options& o) {
  if (o.quick) return {8192, 32768};
  return {8192, 16384, 32768, 65536, 131072};
}

std::vector<float> normal_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

int budget_of(int tokens) { return std::max(1, static_cast<int>(kBudgetRatio * tokens)); }

// ---------------------------------------------------------------------------------------------------------------
void bench_select(const Options& o, cudaStream_t stream) {
  const int n_centroids = 1 << kPqBits;
  for (const int batch : {1, 16}) {
    for (const int tokens : context_sizes(o)) {
      const int budget = budget_of(tokens);
      // Three rotating input sets, so that repeated runs do not just re-read the L2 cache.
      constexpr int kSets = 3;
      const size_t codes_per_set = static_cast<size_t>(batch) * kKvHeads * tokens * kPqM;
      Device<uint8_t> codes(codes_per_set * kSets);
      {
        std::vector<uint8_t> host(codes.n);
        std::mt19937_64 rng(1);
        for (auto& c : host) c = static_cast<uint8_t>(rng() % n_centroids);
        codes.upload(host);
      }
      Device<float> queries(static_cast<size_t>(batch) * kQHeads * kHeadDim);
      queries.upload(normal_floats(queries.n, 2));
      Device<float> centroids(static_cast<size_t>(batch) * kKvHeads * n_centroids * kHeadDim);
      centroids.upload(normal_floats(centroids.n, 3));
      std::vector<const float*> centroid_ptrs;
      for (int s = 0; s < batch; ++s) {
        centroid_ptrs.push_back(centroids.ptr + static_cast<size_t>(s) * kKvHeads * n_centroids * kHeadDim);
      }
      Device<const float*> d_centroid_ptrs(centroid_ptrs.size());
      d_centroid_ptrs.upload(centroid_ptrs);
      Device<const uint8_t*> d_code_ptrs(static_cast<size_t>(kSets) * batch * kKvHeads);
      {
        std::vector<const uint8_t*> ptrs;
        for (int set = 0; set < kSets; ++set) {
          for (int row = 0; row < batch * kKvHeads; ++row) {
            ptrs.push_back(codes.ptr + set * codes_per_set + static_cast<size_t>(row) * tokens * kPqM);
          }
        }
        d_code_ptrs.upload(ptrs);
      }
      Device<int32_t> n_tokens(batch);
      n_tokens.upload(std::vector<int32_t>(batch, tokens));
      Device<float> scores(static_cast<size_t>(batch) * kKvHeads * tokens);
      Device<int32_t> positions(static_cast<size_t>(batch) * kKvHeads * budget);

      PqScoreParams sp;
      sp.n_seqs = batch;
      sp.n_q_heads = kQHeads;
      sp.n_kv_heads = kKvHeads;
      sp.head_dim = kHeadDim;
      sp.pq_m = kPqM;
      sp.pq_bits = kPqBits;
      sp.queries = queries.ptr;
      sp.centroids = d_centroid_ptrs.ptr;
      sp.n_tokens = n_tokens.ptr;
      sp.max_tokens = tokens;
      sp.fold = GqaFold::kSumProb;
      sp.scores = scores.ptr;
      sp.score_stride = tokens;
      Device<unsigned char> workspace(pq_scores_workspace_bytes(sp));
      TopkParams tp;
      tp.n_seqs = batch;
      tp.n_kv_heads = kKvHeads;
      tp.scores = scores.ptr;
      tp.score_stride = tokens;
      tp.n_tokens = n_tokens.ptr;
      tp.k = budget;
      tp.positions = positions.ptr;
      tp.positions_stride = budget;

      auto scores_only = [&](int rep) {
        sp.codes = d_code_ptrs.ptr + static_cast<size_t>(rep % kSets) * batch * kKvHeads;
        CHECK(launch_pq_scores(sp, workspace.ptr, workspace.n, stream));
      };
      auto topk_only = [&](int) { CHECK(launch_topk_positions(tp, stream)); };
      auto both = [&](int rep) {
        scores_only(rep);
        topk_only(rep);
      };
      const Timing t_scores = time_it(stream, 5, o.reps, scores_only);
      const Timing t_topk = time_it(stream, 5, o.reps, topk_only);
      const Timing t_select = time_it(stream, 5, o.reps, both);

      // The same work replayed from a CUDA graph: the launch gaps removed.
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      both(0);
      CHECK(cudaStreamEndCapture(stream, &graph));
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const Timing t_graph = time_it(stream, 5, o.reps, [&](int) { CHECK(cudaGraphLaunch(exec, stream)); });
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));

      std::printf(
          "section=select impl=kvret tokens=%d kv_heads=%d q_heads=%d batch=%d budget=%d pq_m=%d pq_bits=%d "
          "us_per_call=%.2f us_min=%.2f scores_us=%.2f topk_us=%.2f graph_us=%.2f\n",
          tokens, kKvHeads, kQHeads, batch, budget, kPqM, kPqBits, t_select.median_us, t_select.min_us,
          t_scores.median_us, t_topk.median_us, t_graph.median_us);
      std::fflush(stdout);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
/// sink + budget sorted random middle positions + local, per head.
std::vector<int32_t> working_set(int tokens, int budget, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> rows;
  for (int i = 0; i < kSink; ++i) rows.push_back(i);
  std::set<int32_t> chosen;
  std::uniform_int_distribution<int32_t> middle(kSink, tokens - kLocal - 1);
  while (static_cast<int>(chosen.size()) < budget) chosen.insert(middle(rng));
  rows.insert(rows.end(), chosen.begin(), chosen.end());
  for (int p = tokens - kLocal; p < tokens; ++p) rows.push_back(p);
  return rows;
}

void bench_fetch(const Options& o, cudaStream_t stream) {
  const KvGeometry geo{kKvHeads, kHeadDim, ElemType::kF16, kBlockTokens};
  const int64_t row_bytes = kv_row_bytes(geo);  // 256
  for (const int tokens : context_sizes(o)) {
    const int budget = budget_of(tokens);
    const int rows = kSink + budget + kLocal;
    const size_t store_bytes = static_cast<size_t>(tokens) * kKvHeads * row_bytes;
    Pinned host_k(store_bytes);
    Pinned host_v(store_bytes);
    std::memset(host_k.host, 1, store_bytes);
    std::memset(host_v.host, 2, store_bytes);
    Device<const void*> k_pages(1);
    Device<const void*> v_pages(1);
    k_pages.upload({host_k.device});
    v_pages.upload({host_v.device});
    std::vector<int32_t> flat;
    for (int h = 0; h < kKvHeads; ++h) {
      const auto r = working_set(tokens, budget, 10 + static_cast<uint64_t>(h));
      flat.insert(flat.end(), r.begin(), r.end());
    }
    Device<int32_t> positions(flat.size());
    positions.upload(flat);
    const size_t out_bytes = static_cast<size_t>(kKvHeads) * rows * row_bytes;
    Device<unsigned char> out_k(out_bytes);
    Device<unsigned char> out_v(out_bytes);
    Device<int32_t> out_positions(static_cast<size_t>(kKvHeads) * rows);

    WorkingSetGatherSeq seq;
    seq.host.k_pages = k_pages.ptr;
    seq.host.v_pages = v_pages.ptr;
    seq.host.page_tokens = tokens;
    seq.host.token_stride = kKvHeads * row_bytes;
    seq.host.head_stride = row_bytes;
    seq.host.n_tokens = tokens;
    seq.positions = positions.ptr;
    seq.positions_stride = rows;
    seq.n_rows = rows;
    seq.out_k = out_k.ptr;
    seq.out_v = out_v.ptr;
    seq.out_positions = out_positions.ptr;
    seq.out_capacity = rows;
    Device<WorkingSetGatherSeq> d_seq(1);
    d_seq.upload({seq});
    const double bytes = 2.0 * static_cast<double>(out_bytes);  // keys and values
    const Timing gather =
        time_it(stream, 3, o.reps, [&](int) { CHECK(launch_working_set_gather(d_seq.ptr, 1, rows, geo, stream)); });

    // The same bytes as two contiguous host-to-device copies.
    const Timing contiguous = time_it(stream, 3, o.reps, [&](int) {
      CHECK(cudaMemcpyAsync(out_k.ptr, host_k.host, out_bytes, cudaMemcpyHostToDevice, stream));
      CHECK(cudaMemcpyAsync(out_v.ptr, host_v.host, out_bytes, cudaMemcpyHostToDevice, stream));
    });

    // One cudaMemcpyAsync per row (keys and values), the approach the gather replaces: 1024 rows are enough.
    const int per_row_rows = std::min(rows, 1024);
    const Timing per_row = time_it(stream, 1, std::min(o.reps, 10), [&](int) {
      for (int r = 0; r < per_row_rows; ++r) {
        const size_t src = static_cast<size_t>(flat[r]) * kKvHeads * row_bytes;
        CHECK(cudaMemcpyAsync(out_k.ptr + r * row_bytes, static_cast<char*>(host_k.host) + src, row_bytes,
                              cudaMemcpyHostToDevice, stream));
        CHECK(cudaMemcpyAsync(out_v.ptr + r * row_bytes, static_cast<char*>(host_v.host) + src, row_bytes,
                              cudaMemcpyHostToDevice, stream));
      }
    });

    // Every row from the block cache (device memory): the hit path.
    const int32_t n_blocks = static_cast<int32_t>((tokens + kBlockTokens - 1) / kBlockTokens);
    Device<int32_t> table(static_cast<size_t>(kKvHeads) * n_blocks);
    Device<unsigned char> cache_k(store_bytes);
    Device<unsigned char> cache_v(store_bytes);
    {
      std::vector<int32_t> t(table.n);
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i % n_blocks);  // block b in slot b
      table.upload(t);
    }
    WorkingSetGatherSeq hit = seq;
    hit.cache.block_table = table.ptr;
    hit.cache.k = cache_k.ptr;
    hit.cache.v = cache_v.ptr;
    hit.cache.max_blocks = n_blocks;
    hit.cache.n_slots = n_blocks;
    Device<WorkingSetGatherSeq> d_hit(1);
    d_hit.upload({hit});
    const Timing cached =
        time_it(stream, 3, o.reps, [&](int) { CHECK(launch_working_set_gather(d_hit.ptr, 1, rows, geo, stream)); });

    const double gbps_gather = bytes / (gather.median_us * 1e3);
    const double gbps_contig = bytes / (contiguous.median_us * 1e3);
    const double per_row_us = per_row.median_us / (2.0 * per_row_rows);
    std::printf(
        "section=fetch impl=kvret tokens=%d kv_heads=%d rows_per_head=%d row_bytes=%lld bytes=%.0f "
        "gather_us=%.2f gather_GBps=%.2f contiguous_memcpy_us=%.2f contiguous_GBps=%.2f ratio=%.3f "
        "per_row_memcpy_us_per_row=%.3f cache_hit_gather_us=%.2f cache_hit_GBps=%.2f\n",
        tokens, kKvHeads, rows, static_cast<long long>(row_bytes), bytes, gather.median_us, gbps_gather,
        contiguous.median_us, gbps_contig, gbps_gather / gbps_contig, per_row_us, cached.median_us,
        bytes / (cached.median_us * 1e3));
    std::fflush(stdout);
  }
}

// ---------------------------------------------------------------------------------------------------------------
void bench_build(const Options& o, cudaStream_t stream) {
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  const int n_centroids = 1 << kPqBits;
  const int sub = kHeadDim / kPqM;
  const int problems = kKvHeads * kPqM;
  const int iters = 25;
  for (const int tokens : context_sizes(o)) {
    Device<uint16_t> keys(static_cast<size_t>(tokens) * kKvHeads * kHeadDim);  // f16 bits
    {
      std::vector<uint16_t> host(keys.n);
      std::mt19937_64 rng(5);
      for (auto& x : host) x = static_cast<uint16_t>(0x3000 + rng() % 0x1000);  // f16 values in [0.125, 1)
      keys.upload(host);
    }
    for (const int sample : {8192, 0}) {  // 0: train on every token
      const int n_points = sample == 0 ? tokens : std::min(sample, tokens);
      Device<int32_t> sample_idx(n_points);
      {
        std::vector<int32_t> idx(n_points);
        for (int i = 0; i < n_points; ++i) idx[i] = static_cast<int32_t>((static_cast<int64_t>(i) * tokens) / n_points);
        sample_idx.upload(idx);
      }
      Device<float> points(static_cast<size_t>(problems) * n_points * sub);
      Device<int32_t> init(static_cast<size_t>(problems) * n_centroids);
      {
        std::vector<int32_t> idx(init.n);
        for (size_t i = 0; i < idx.size(); ++i)
          idx[i] = static_cast<int32_t>((i % n_centroids) * (n_points / n_centroids));
        init.upload(idx);
      }
      Device<float> centroids(static_cast<size_t>(problems) * n_centroids * sub);
      Device<int32_t> assignments(static_cast<size_t>(problems) * n_points);
      Device<uint8_t> codes(static_cast<size_t>(kKvHeads) * tokens * kPqM);

      PqTrainingPointsParams tp;
      tp.n_points = n_points;
      tp.n_kv_heads = kKvHeads;
      tp.head_dim = kHeadDim;
      tp.pq_m = kPqM;
      tp.key_type = ElemType::kF16;
      tp.keys = keys.ptr;
      tp.sample = sample_idx.ptr;
      tp.points = points.ptr;
      KmeansParams kp;
      kp.n_problems = problems;
      kp.n_points = n_points;
      kp.dim = sub;
      kp.k = n_centroids;
      kp.iters = iters;
      kp.points = points.ptr;
      kp.init_indices = init.ptr;
      kp.centroids = centroids.ptr;
      kp.assignments = assignments.ptr;
      Device<unsigned char> workspace(kmeans_workspace_bytes(kp));
      PqEncodeParams ep;
      ep.n_tokens = tokens;
      ep.n_kv_heads = kKvHeads;
      ep.head_dim = kHeadDim;
      ep.pq_m = kPqM;
      ep.pq_bits = kPqBits;
      ep.key_type = ElemType::kF16;
      ep.keys = keys.ptr;
      ep.centroids = centroids.ptr;
      ep.codes = codes.ptr;
      ep.code_head_stride = static_cast<int64_t>(tokens) * kPqM;

      const int reps = o.quick ? 3 : 5;
      const Timing kmeans = time_it(stream, 1, reps, [&](int) {
        CHECK(launch_pq_training_points(tp, stream));
        CHECK(launch_kmeans(cublas, kp, workspace.ptr, workspace.n, stream));
      });
      const Timing encode = time_it(stream, 1, reps, [&](int) { CHECK(launch_pq_encode(ep, stream)); });
      std::printf(
          "section=build impl=kvret tokens=%d kv_heads=%d pq_m=%d pq_bits=%d train_points=%d iters=%d "
          "kmeans_ms=%.3f encode_ms=%.3f build_ms=%.3f\n",
          tokens, kKvHeads, kPqM, kPqBits, n_points, iters, kmeans.median_us / 1e3, encode.median_us / 1e3,
          (kmeans.median_us + encode.median_us) / 1e3);
      std::fflush(stdout);
      if (sample == 0 && o.quick) break;
    }
  }
  (void)cublasDestroy(cublas);
}

// ---------------------------------------------------------------------------------------------------------------
void bench_attend(const Options& o, cudaStream_t stream) {
  for (const int batch : {1, 16}) {
    for (const int tokens : context_sizes(o)) {
      const int rows = kSink + budget_of(tokens) + kLocal;
      const size_t kv_elems = static_cast<size_t>(batch) * kKvHeads * rows * kHeadDim;
      Device<uint16_t> k(kv_elems);
      Device<uint16_t> v(kv_elems);
      {
        std::vector<uint16_t> host(kv_elems);
        std::mt19937_64 rng(7);
        for (auto& x : host) x = static_cast<uint16_t>(0x3000 + rng() % 0x1000);
        k.upload(host);
        v.upload(host);
      }
      Device<float> q(static_cast<size_t>(batch) * kQHeads * kHeadDim);
      q.upload(normal_floats(q.n, 8));
      Device<float> out(q.n);
      std::vector<DecodeAttentionSeq> seqs(batch);
      for (int s = 0; s < batch; ++s) {
        seqs[s].q = q.ptr + static_cast<size_t>(s) * kQHeads * kHeadDim;
        seqs[s].k = k.ptr + static_cast<size_t>(s) * kKvHeads * rows * kHeadDim;
        seqs[s].v = v.ptr + static_cast<size_t>(s) * kKvHeads * rows * kHeadDim;
        seqs[s].kv_capacity = rows;
        seqs[s].n_rows = rows;
        seqs[s].out = out.ptr + static_cast<size_t>(s) * kQHeads * kHeadDim;
      }
      Device<DecodeAttentionSeq> d_seqs(batch);
      d_seqs.upload(seqs);
      DecodeAttentionParams p;
      p.seqs = d_seqs.ptr;
      p.n_seqs = batch;
      p.n_q_heads = kQHeads;
      p.n_kv_heads = kKvHeads;
      p.head_dim = kHeadDim;
      p.kv_type = ElemType::kF16;
      p.max_rows = rows;
      Device<unsigned char> workspace(decode_attention_workspace_bytes(p));
      const Timing t = time_it(stream, 5, o.reps,
                               [&](int) { CHECK(launch_decode_attention(p, workspace.ptr, workspace.n, stream)); });
      const double bytes = 2.0 * static_cast<double>(kv_elems) * 2.0;
      std::printf("section=attend impl=kvret tokens=%d rows=%d kv_heads=%d q_heads=%d batch=%d us=%.2f GBps=%.1f\n",
                  tokens, rows, kKvHeads, kQHeads, batch, t.median_us, bytes / (t.median_us * 1e3));
      std::fflush(stdout);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
void bench_cache(const Options& o, cudaStream_t stream) {
  const KvGeometry geo{kKvHeads, kHeadDim, ElemType::kF16, kBlockTokens};
  const int n_slots = 32;  // the default 4096-token cache per (sequence, layer, head)
  for (const int batch : {1, 16}) {
    for (const int tokens : context_sizes(o)) {
      const int budget = budget_of(tokens);
      const int32_t n_blocks = static_cast<int32_t>(tokens / kBlockTokens);
      const size_t store_bytes = static_cast<size_t>(tokens) * kKvHeads * static_cast<size_t>(kv_row_bytes(geo));
      Pinned host_k(store_bytes);
      Pinned host_v(store_bytes);
      Device<const void*> k_pages(1);
      Device<const void*> v_pages(1);
      k_pages.upload({host_k.device});
      v_pages.upload({host_v.device});
      const size_t slot_entries = static_cast<size_t>(batch) * kKvHeads * n_slots;
      Device<int32_t> table(static_cast<size_t>(batch) * kKvHeads * n_blocks);
      Device<int32_t> slot_block(slot_entries);
      Device<uint32_t> stamp(slot_entries);
      Device<unsigned char> cache_k(slot_entries * kBlockTokens * static_cast<size_t>(kv_row_bytes(geo)));
      Device<unsigned char> cache_v(cache_k.n);
      Device<int32_t> items(static_cast<size_t>(kKvHeads) * budget);
      {
        std::vector<int32_t> flat;
        for (int h = 0; h < kKvHeads; ++h) {
          const auto r = working_set(tokens, budget, 20 + static_cast<uint64_t>(h));
          flat.insert(flat.end(), r.begin() + kSink, r.begin() + kSink + budget);
        }
        items.upload(flat);
      }
      std::vector<BlockCacheUpdateSeq> seqs(batch);
      for (int s = 0; s < batch; ++s) {
        BlockCacheUpdateSeq& q = seqs[s];
        q.cache.block_table = table.ptr + static_cast<size_t>(s) * kKvHeads * n_blocks;
        q.cache.slot_block = slot_block.ptr + static_cast<size_t>(s) * kKvHeads * n_slots;
        q.cache.slot_stamp = stamp.ptr + static_cast<size_t>(s) * kKvHeads * n_slots;
        q.cache.k = cache_k.ptr + static_cast<size_t>(s) * kKvHeads * n_slots * kBlockTokens * kv_row_bytes(geo);
        q.cache.v = cache_v.ptr + static_cast<size_t>(s) * kKvHeads * n_slots * kBlockTokens * kv_row_bytes(geo);
        q.cache.max_blocks = n_blocks;
        q.cache.n_slots = n_slots;
        q.host.k_pages = k_pages.ptr;
        q.host.v_pages = v_pages.ptr;
        q.host.page_tokens = tokens;
        q.host.token_stride = kKvHeads * kv_row_bytes(geo);
        q.host.head_stride = kv_row_bytes(geo);
        q.host.n_tokens = tokens;
        q.items = items.ptr;
        q.items_stride = budget;
        q.n_items = budget;
      }
      // One descriptor array per call, each with the next step, uploaded before timing.
      const int warmup = 3;
      const int calls = warmup + o.reps;
      Device<BlockCacheUpdateSeq> d_seqs(static_cast<size_t>(calls) * batch);
      {
        std::vector<BlockCacheUpdateSeq> all;
        for (int c = 0; c < calls; ++c) {
          for (auto q : seqs) {
            q.step = static_cast<uint32_t>(c + 1);
            all.push_back(q);
          }
        }
        d_seqs.upload(all);
      }
      BlockCacheUpdateParams p;
      p.n_seqs = batch;
      p.geo = geo;
      p.policy = CachePolicy::kLru;
      p.max_admit = 8;
      p.max_blocks = n_blocks;
      Device<unsigned char> workspace(block_cache_workspace_bytes(p));
      CHECK(cudaMemsetAsync(table.ptr, 0xff, table.n * sizeof(int32_t), stream));
      CHECK(cudaMemsetAsync(slot_block.ptr, 0xff, slot_block.n * sizeof(int32_t), stream));
      CHECK(cudaMemsetAsync(stamp.ptr, 0, stamp.n * sizeof(uint32_t), stream));
      // The same selection at every step: after the first calls the cache is full and stable, so the figure is
      // the steady-state bookkeeping (the first calls also copy admitted blocks).
      int call = 0;
      const Timing t = time_it(stream, warmup, o.reps, [&](int) {
        p.seqs = d_seqs.ptr + static_cast<size_t>(call++) * batch;
        CHECK(launch_block_cache_update(p, workspace.ptr, workspace.n, stream));
      });
      std::printf(
          "section=cache impl=kvret tokens=%d kv_heads=%d batch=%d selected=%d slots=%d max_admit=%d "
          "update_us=%.2f\n",
          tokens, kKvHeads, batch, budget, n_slots, p.max_admit, t.median_us);
      std::fflush(stdout);
    }
  }
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      o.quick = true;
      o.reps = 10;
    } else if (arg.rfind("--reps=", 0) == 0) {
      o.reps = std::max(1, std::atoi(arg.c_str() + 7));
    } else if (arg.rfind("--sections=", 0) == 0) {
      o.sections.clear();
      std::string list = arg.substr(11);
      size_t at = 0;
      while (at <= list.size()) {
        const size_t comma = list.find(',', at);
        o.sections.insert(list.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: kvret-bench-gpu [--quick] [--reps=N] [--sections=select,fetch,build,attend,cache]\n");
      std::exit(2);
    }
  }
  return o;
}

}  // namespace
}  // namespace kvret::cuda::bench

int main(int argc, char** argv) {
  using namespace kvret::cuda::bench;
  const Options o = parse(argc, argv);
  if (kvret::cuda::device_count() == 0) {
    std::printf("kvret-bench-gpu: no CUDA device; nothing to measure\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device=\"%s\" sms=%d l2_MB=%.0f\n", prop.name, prop.multiProcessorCount,
                static_cast<double>(prop.l2CacheSize) / (1 << 20));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    if (o.sections.count("select")) bench_select(o, stream);
    if (o.sections.count("fetch")) bench_fetch(o, stream);
    if (o.sections.count("build")) bench_build(o, stream);
    if (o.sections.count("attend")) bench_attend(o, stream);
    if (o.sections.count("cache")) bench_cache(o, stream);
    CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvret-bench-gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
