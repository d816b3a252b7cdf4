// kvret against FAISS (Debian's libfaiss, linked with OpenBLAS and OpenMP) on identical data and settings, in one
// run, timings interleaved and summarized by medians:
//  (a) PQ build = training + encoding of one layer's keys (one codebook per KV head): kvret's PqRetriever::extend
//      on a HostKvStore vs one faiss::ProductQuantizer per KV head (train + compute_codes);
//  (b) k-means alone on one sub-space: kvret::kmeans vs faiss::Clustering (same k, d, points, no redo, and the
//      same number of centroid updates: see kvret_iters);
//  (c) PQ search, inner-product top-B per query head over one KV head's codes: kvret's PqRetriever::select (LUT +
//      code cells, one query head per KV head) vs faiss::IndexPQ::search (METRIC_INNER_PRODUCT, k = B).
// Quality side by side: (a) reconstruction error of the codes, (b) the k-means objective of the final centroids,
// (c) recall of the exact top-B by q.k — for the timed seed, and as mean [min, max] over --quality-seeds training
// seeds (codebooks differ by seed more than the two libraries differ).
//
// Both libraries get their best: the time of each in a repetition is the faster of its schedules. FAISS: KV heads
// one after another with FAISS's own OpenMP/BLAS parallelism (T threads), or KV heads in parallel over T OpenMP
// threads with single-threaded FAISS/BLAS inside. kvret: n_threads = T inside each call, or (search) the calls in
// parallel over T OpenMP threads with n_threads = 1 inside.
//
// Run: build/bin/kvret-bench-faiss [--tokens 32768] [--threads T] [--reps 5] [--iters 25] [--sample 8192]
//                                  [--budgets 0.1,0.02] [--quality-seeds 5] [--json]
#include <faiss/Clustering.h>
#include <faiss/IndexFlat.h>
#include <faiss/IndexPQ.h>
#include <faiss/impl/ProductQuantizer.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "index/kmeans.hpp"
#include "index/pq_retriever.hpp"
#include "store/host_kv_store.hpp"
#include "workload.hpp"

extern "C" void openblas_set_num_threads(int num_threads);

namespace {

struct Options {
  int64_t tokens = 32768;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int m = 2;
  int bits = 6;
  int iters = 25;
  int64_t sample = 8192;
  int threads = 0;  ///< 0 = all cores
  int reps = 5;
  int steps = 4;  ///< decode steps whose queries are searched
  std::vector<double> budgets{0.1, 0.02};
  int quality_seeds = 5;  ///< training seeds the quality columns are averaged over
  uint64_t seed = 1;
  bool json = false;
};

void usage() {
  std::fprintf(stderr,
               "usage: kvret-bench-faiss [--tokens N] [--threads T] [--reps R] [--iters I] [--sample S]\n"
               "                         [--steps S] [--budgets f1,f2,...] [--quality-seeds K] [--seed X] [--json]\n");
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokens")
      o.tokens = std::atoll(value());
    else if (a == "--threads")
      o.threads = std::atoi(value());
    else if (a == "--reps")
      o.reps = std::atoi(value());
    else if (a == "--iters")
      o.iters = std::atoi(value());
    else if (a == "--sample")
      o.sample = std::atoll(value());
    else if (a == "--steps")
      o.steps = std::atoi(value());
    else if (a == "--quality-seeds")
      o.quality_seeds = std::atoi(value());
    else if (a == "--seed")
      o.seed = std::strtoull(value(), nullptr, 10);
    else if (a == "--json")
      o.json = true;
    else if (a == "--budgets") {
      o.budgets.clear();
      std::string s = value();
      for (size_t p = 0; p < s.size();) {
        const size_t q = s.find(',', p);
        o.budgets.push_back(std::atof(s.substr(p, q - p).c_str()));
        p = q == std::string::npos ? s.size() : q + 1;
      }
    } else {
      usage();
      return false;
    }
  }
  if (o.threads <= 0) o.threads = omp_get_num_procs();
  return o.tokens > 0 && o.reps > 0 && o.iters > 0 && o.sample >= (1 << o.bits) && o.head_dim % o.m == 0;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Sets both OpenMP's and OpenBLAS's thread counts.
void set_threads(int t) {
  omp_set_num_threads(t);
  openblas_set_num_threads(t);
}

struct Schedule {
  std::string name;
  std::function<void()> run;
};

/// Mean, min and max of a quality figure over training seeds.
struct Spread {
  std::vector<double> values;
  double mean() const {
    return values.empty() ? 0 : std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  }
  double min() const { return values.empty() ? 0 : *std::min_element(values.begin(), values.end()); }
  double max() const { return values.empty() ? 0 : *std::max_element(values.begin(), values.end()); }
};

struct Row {
  std::string name;
  std::vector<double> kvret_ms, faiss_ms, ratio;  // per repetition: each library's best schedule
  std::vector<std::string> kvret_names, faiss_names;
  std::vector<std::vector<double>> kvret_sched_ms, faiss_sched_ms;  // [schedule][repetition]
  std::string quality_name;
  bool higher_is_better = true;
  Spread kvret_quality, faiss_quality;  // first value: the timed seed
};

/// Runs every schedule of both libraries `reps` times, interleaved (the order reverses every repetition).
void measure(Row& row, int reps, const std::vector<Schedule>& kvret_runs, const std::vector<Schedule>& faiss_runs) {
  row.kvret_sched_ms.assign(kvret_runs.size(), {});
  row.faiss_sched_ms.assign(faiss_runs.size(), {});
  for (const auto& s : kvret_runs) row.kvret_names.push_back(s.name);
  for (const auto& s : faiss_runs) row.faiss_names.push_back(s.name);
  auto time = [](const std::function<void()>& f) {
    const double t0 = now_ms();
    f();
    return now_ms() - t0;
  };
  for (int r = 0; r < reps; ++r) {
    std::vector<std::pair<int, size_t>> order;  // (library, schedule)
    for (size_t i = 0; i < kvret_runs.size(); ++i) order.emplace_back(0, i);
    for (size_t i = 0; i < faiss_runs.size(); ++i) order.emplace_back(1, i);
    if (r % 2) std::reverse(order.begin(), order.end());
    for (const auto& [lib, i] : order) {
      if (lib == 0)
        row.kvret_sched_ms[i].push_back(time(kvret_runs[i].run));
      else
        row.faiss_sched_ms[i].push_back(time(faiss_runs[i].run));
    }
    double k = 1e300, f = 1e300;
    for (const auto& v : row.kvret_sched_ms) k = std::min(k, v.back());
    for (const auto& v : row.faiss_sched_ms) f = std::min(f, v.back());
    row.kvret_ms.push_back(k);
    row.faiss_ms.push_back(f);
    row.ratio.push_back(f / k);
  }
}

/// The data: one layer of the synthetic workload, keys per KV head [n, D] f32, and decode queries [steps, Hq, D].
struct Data {
  Options o;
  std::vector<float> keys;                  // [n, H, D] as generated
  std::vector<std::vector<float>> by_head;  // per head [n, D]
  std::vector<float> queries;               // [steps, Hq, D]
  explicit Data(const Options& opt) : o(opt) {
    kvret::workload::Config wc;
    wc.n_layers = 1;
    wc.n_q_heads = o.q_heads;
    wc.n_kv_heads = o.kv_heads;
    wc.head_dim = o.head_dim;
    wc.n_prefill = o.tokens;
    wc.n_decode = o.steps;
    wc.seed = o.seed;
    const kvret::workload::Workload w(wc);
    const size_t n = static_cast<size_t>(o.tokens), d = static_cast<size_t>(o.head_dim);
    keys.resize(n * o.kv_heads * d);
    w.keys_values(0, 0, o.tokens, keys.data(), nullptr);
    by_head.assign(static_cast<size_t>(o.kv_heads), std::vector<float>(n * d));
    for (size_t t = 0; t < n; ++t)
      for (int h = 0; h < o.kv_heads; ++h)
        std::memcpy(by_head[static_cast<size_t>(h)].data() + t * d, keys.data() + (t * o.kv_heads + h) * d,
                    d * sizeof(float));
    queries.resize(static_cast<size_t>(o.steps) * o.q_heads * d);
    w.queries(0, o.steps, queries.data());
  }
  const float* query(int step, int q_head) const {
    return queries.data() + (static_cast<size_t>(step) * o.q_heads + q_head) * o.head_dim;
  }
};

// ---- (a) PQ build ----------------------------------------------------------------------------------------------

struct FaissPq {
  std::vector<faiss::ProductQuantizer> pq;
  std::vector<std::vector<uint8_t>> codes;
};

faiss::ProductQuantizer make_faiss_pq(const Options& o, int head, uint64_t seed) {
  faiss::ProductQuantizer pq(static_cast<size_t>(o.head_dim), static_cast<size_t>(o.m), static_cast<size_t>(o.bits));
  pq.cp.niter = o.iters;
  pq.cp.nredo = 1;
  pq.cp.verbose = false;
  // FAISS samples k * max_points_per_centroid points when given more: the same sample size as kvret's.
  pq.cp.max_points_per_centroid = static_cast<int>(o.sample >> o.bits);
  pq.cp.seed = static_cast<int>(seed) + head;
  return pq;
}

void faiss_build_head(const Data& data, FaissPq& f, int h, uint64_t seed) {
  const size_t n = static_cast<size_t>(data.o.tokens);
  auto& pq = f.pq[static_cast<size_t>(h)];
  pq = make_faiss_pq(data.o, h, seed);
  pq.train(n, data.by_head[static_cast<size_t>(h)].data());
  f.codes[static_cast<size_t>(h)].resize(n * pq.code_size);
  pq.compute_codes(data.by_head[static_cast<size_t>(h)].data(), f.codes[static_cast<size_t>(h)].data(), n);
}

/// Mean squared reconstruction error ||k - decode(code(k))||^2 / ||k||^2 over every key of every head.
double faiss_reconstruction(const Data& data, const FaissPq& f) {
  double err = 0, norm = 0;
  std::vector<float> rec(static_cast<size_t>(data.o.head_dim));
  for (int h = 0; h < data.o.kv_heads; ++h)
    for (int64_t t = 0; t < data.o.tokens; ++t) {
      const auto& pq = f.pq[static_cast<size_t>(h)];
      pq.decode(f.codes[static_cast<size_t>(h)].data() + t * pq.code_size, rec.data());
      const float* k = data.by_head[static_cast<size_t>(h)].data() + t * data.o.head_dim;
      err += kvret::squared_distance(k, rec.data(), data.o.head_dim);
      norm += kvret::dot(k, k, data.o.head_dim);
    }
  return err / norm;
}

double kvret_reconstruction(const Data& data, const kvret::PqRetriever& pq) {
  double err = 0, norm = 0;
  const int ds = pq.sub_dim();
  for (int h = 0; h < data.o.kv_heads; ++h)
    for (int64_t t = 0; t < data.o.tokens; ++t) {
      const float* k = data.by_head[static_cast<size_t>(h)].data() + t * data.o.head_dim;
      for (int j = 0; j < pq.m(); ++j)
        err += kvret::squared_distance(k + j * ds, pq.centroids(h, j) + pq.codes(h)[t * pq.m() + j] * ds, ds);
      norm += kvret::dot(k, k, data.o.head_dim);
    }
  return err / norm;
}

/// FAISS's niter counts assignment + update rounds; kvret's iteration count counts assignments and keeps the
/// centroids the last assignment refers to (no update after it). Both do o.iters centroid updates when kvret runs
/// o.iters + 1 assignments (one assignment pass more than FAISS: counted against kvret).
int kvret_iters(const Options& o) { return o.iters + 1; }

kvret::PqRetriever::Params kvret_params(const Options& o, uint64_t seed) {
  kvret::PqRetriever::Params p;
  p.m = o.m;
  p.bits = o.bits;
  p.iters = kvret_iters(o);
  p.train_sample = o.sample;
  p.seed = seed;
  p.exact_fraction = 0.0f;  // plain PQ, like FAISS's IndexPQ (no exact outliers)
  return p;
}

// ---- (c) search --------------------------------------------------------------------------------------------------

/// Exact top-B positions by q . k for one query head over its KV head's keys.
std::vector<int64_t> exact_top(const Data& data, const float* q, int kv_head, int64_t budget) {
  const int64_t n = data.o.tokens;
  std::vector<double> s(static_cast<size_t>(n));
  const float* k = data.by_head[static_cast<size_t>(kv_head)].data();
  for (int64_t t = 0; t < n; ++t) {
    double acc = 0;
    for (int i = 0; i < data.o.head_dim; ++i) acc += static_cast<double>(q[i]) * k[t * data.o.head_dim + i];
    s[static_cast<size_t>(t)] = acc;
  }
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + budget, idx.end(),
                    [&](int64_t a, int64_t b) { return s[static_cast<size_t>(a)] > s[static_cast<size_t>(b)]; });
  idx.resize(static_cast<size_t>(budget));
  std::sort(idx.begin(), idx.end());
  return idx;
}

template <class T>
double recall(const std::vector<int64_t>& exact_sorted, const T* got, int64_t budget) {
  int64_t hit = 0;
  for (int64_t i = 0; i < budget; ++i)
    hit += std::binary_search(exact_sorted.begin(), exact_sorted.end(), static_cast<int64_t>(got[i])) ? 1 : 0;
  return static_cast<double>(hit) / static_cast<double>(budget);
}

// ---- output ------------------------------------------------------------------------------------------------------

void print_table(const Options& o, const std::vector<Row>& rows) {
  std::printf(
      "kvret vs FAISS: %lld tokens, %d KV heads x head_dim %d, m=%d, bits=%d (%d centroids), %d iterations, "
      "training sample %lld, %d threads, %d repetitions (medians)\n\n",
      static_cast<long long>(o.tokens), o.kv_heads, o.head_dim, o.m, o.bits, 1 << o.bits, o.iters,
      static_cast<long long>(o.sample), o.threads, o.reps);
  std::printf("| %-34s | %10s | %10s | %8s | %-24s | %8s | %8s |\n", "benchmark", "kvret ms", "FAISS ms", "speedup",
              "quality (timed seed)", "kvret", "FAISS");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str(), std::string(10, '-').c_str(), std::string(26, '-').c_str(),
              std::string(10, '-').c_str(), std::string(10, '-').c_str());
  for (const Row& r : rows)
    std::printf("| %-34s | %10.2f | %10.2f | %7.2fx | %-24s | %8.4f | %8.4f |\n", r.name.c_str(), median(r.kvret_ms),
                median(r.faiss_ms), median(r.ratio), r.quality_name.c_str(), r.kvret_quality.values.front(),
                r.faiss_quality.values.front());
  std::printf(
      "\nspeedup = median over repetitions of (FAISS time / kvret time), measured back to back; each library's time "
      "is its fastest schedule in that repetition.\nMedian ms per schedule:\n");
  for (const Row& r : rows) {
    std::printf("  %s:", r.name.c_str());
    for (size_t i = 0; i < r.kvret_names.size(); ++i)
      std::printf(" kvret %s %.2f;", r.kvret_names[i].c_str(), median(r.kvret_sched_ms[i]));
    for (size_t i = 0; i < r.faiss_names.size(); ++i)
      std::printf(" FAISS %s %.2f;", r.faiss_names[i].c_str(), median(r.faiss_sched_ms[i]));
    std::printf("\n");
  }
  const size_t seeds = rows.front().kvret_quality.values.size();
  std::printf("\nQuality over %zu training seeds, mean [min, max]:\n\n", seeds);
  std::printf("| %-34s | %-24s | %-26s | %-26s |\n", "benchmark", "quality", "kvret", "FAISS");
  std::printf("|%s|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(26, '-').c_str(),
              std::string(28, '-').c_str(), std::string(28, '-').c_str());
  for (const Row& r : rows) {
    const auto& k = r.kvret_quality;
    const auto& f = r.faiss_quality;
    std::printf("| %-34s | %-24s | %.4f [%.4f, %.4f]   | %.4f [%.4f, %.4f]   |\n", r.name.c_str(),
                (r.quality_name + (r.higher_is_better ? " (higher)" : " (lower)")).c_str(), k.mean(), k.min(), k.max(),
                f.mean(), f.min(), f.max());
  }
}

void print_json(const Options& o, const std::vector<Row>& rows) {
  std::printf(
      "{\"tokens\": %lld, \"kv_heads\": %d, \"head_dim\": %d, \"m\": %d, \"bits\": %d, \"iters\": %d, "
      "\"sample\": %lld, \"threads\": %d, \"reps\": %d, \"rows\": [",
      static_cast<long long>(o.tokens), o.kv_heads, o.head_dim, o.m, o.bits, o.iters, static_cast<long long>(o.sample),
      o.threads, o.reps);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf(
        "%s\n  {\"name\": \"%s\", \"kvret_ms\": %.4f, \"faiss_ms\": %.4f, \"speedup\": %.4f, \"schedules_ms\": {",
        i ? "," : "", r.name.c_str(), median(r.kvret_ms), median(r.faiss_ms), median(r.ratio));
    for (size_t j = 0; j < r.kvret_names.size(); ++j)
      std::printf("%s\"kvret %s\": %.4f", j ? ", " : "", r.kvret_names[j].c_str(), median(r.kvret_sched_ms[j]));
    for (size_t j = 0; j < r.faiss_names.size(); ++j)
      std::printf(", \"FAISS %s\": %.4f", r.faiss_names[j].c_str(), median(r.faiss_sched_ms[j]));
    std::printf(
        "}, \"quality\": \"%s\", \"higher_is_better\": %s, \"kvret_quality\": %.6f, \"faiss_quality\": %.6f, "
        "\"kvret_quality_mean\": %.6f, \"faiss_quality_mean\": %.6f, \"quality_seeds\": %zu}",
        r.quality_name.c_str(), r.higher_is_better ? "true" : "false", r.kvret_quality.values.front(),
        r.faiss_quality.values.front(), r.kvret_quality.mean(), r.faiss_quality.mean(), r.kvret_quality.values.size());
  }
  std::printf("\n]}\n");
}

/// Everything one training seed produces, and the searches over it.
struct Built {
  std::unique_ptr<kvret::PqRetriever> kvret_pq;
  FaissPq faiss_pq;
  std::vector<faiss::IndexPQ> indexes;  // one per KV head, over faiss_pq's codes
};

void build_kvret(const Options& o, const kvret::HostKvStore& store, uint64_t seed, Built& b) {
  set_threads(o.threads);
  b.kvret_pq = std::make_unique<kvret::PqRetriever>(o.kv_heads, o.head_dim, kvret_params(o, seed));
  b.kvret_pq->extend(store, 0, o.tokens, true, o.threads);
}

void build_faiss(const Data& data, uint64_t seed, bool heads_in_parallel, Built& b) {
  const int H = data.o.kv_heads, T = data.o.threads;
  b.faiss_pq.pq.assign(static_cast<size_t>(H), faiss::ProductQuantizer());
  b.faiss_pq.codes.assign(static_cast<size_t>(H), {});
  if (heads_in_parallel) {
    omp_set_num_threads(T);
    openblas_set_num_threads(1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(T)
    for (int h = 0; h < H; ++h) faiss_build_head(data, b.faiss_pq, h, seed);
  } else {
    set_threads(T);
    for (int h = 0; h < H; ++h) faiss_build_head(data, b.faiss_pq, h, seed);
  }
}

void make_indexes(const Options& o, Built& b) {
  b.indexes.clear();
  b.indexes.reserve(static_cast<size_t>(o.kv_heads));
  for (int h = 0; h < o.kv_heads; ++h) {
    b.indexes.emplace_back(o.head_dim, static_cast<size_t>(o.m), static_cast<size_t>(o.bits),
                           faiss::METRIC_INNER_PRODUCT);
    faiss::IndexPQ& ix = b.indexes.back();
    ix.pq = b.faiss_pq.pq[static_cast<size_t>(h)];
    ix.codes = b.faiss_pq.codes[static_cast<size_t>(h)];
    ix.ntotal = o.tokens;
    ix.is_trained = true;
  }
}

/// The searches of one budget: every query head of every step, top-B by inner product over its KV head's codes.
struct Search {
  const Data& data;
  const kvret::HostKvStore& store;
  int64_t budget;
  int group, H, D, steps;
  std::vector<std::vector<float>> faiss_queries;  // per KV head [steps * group, D], step-major
  std::vector<std::vector<float>> kvret_queries;  // per (step, g): [H, D], query head h * group + g of each KV head
  std::vector<int32_t> kvret_out;                 // [steps, group, H, budget]
  std::vector<float> faiss_dist;                  // [H, steps * group, budget]
  std::vector<faiss::Index::idx_t> faiss_labels;

  Search(const Data& d, const kvret::HostKvStore& s, int64_t b)
      : data(d),
        store(s),
        budget(b),
        group(d.o.q_heads / d.o.kv_heads),
        H(d.o.kv_heads),
        D(d.o.head_dim),
        steps(d.o.steps) {
    faiss_queries.resize(static_cast<size_t>(H));
    for (int h = 0; h < H; ++h)
      for (int st = 0; st < steps; ++st)
        for (int g = 0; g < group; ++g) {
          const float* q = data.query(st, h * group + g);
          faiss_queries[static_cast<size_t>(h)].insert(faiss_queries[static_cast<size_t>(h)].end(), q, q + D);
        }
    for (int st = 0; st < steps; ++st)
      for (int g = 0; g < group; ++g) {
        std::vector<float> q(static_cast<size_t>(H) * D);
        for (int h = 0; h < H; ++h) std::memcpy(q.data() + h * D, data.query(st, h * group + g), D * sizeof(float));
        kvret_queries.push_back(std::move(q));
      }
    kvret_out.resize(static_cast<size_t>(steps) * group * H * budget);
    faiss_dist.resize(static_cast<size_t>(H) * steps * group * budget);
    faiss_labels.resize(faiss_dist.size());
  }
  int64_t nq() const { return static_cast<int64_t>(steps) * group; }

  /// One select call: query column c = (step, g) against every KV head (one query head each: the top-B of its
  /// logits, so the fold is the identity).
  void kvret_call(const kvret::PqRetriever& pq, int64_t c, int n_threads) {
    kvret::SelectRequest r;
    r.q = kvret_queries[static_cast<size_t>(c)].data();
    r.n_q_heads = H;
    r.group = 1;
    r.scale = 1.0f;
    r.mid_begin = 0;
    r.mid_end = data.o.tokens;
    r.budget = budget;
    r.fold = KVRET_FOLD_MAX_LOGIT;
    r.n_threads = n_threads;
    std::vector<int32_t*> out(static_cast<size_t>(H));
    for (int h = 0; h < H; ++h) out[static_cast<size_t>(h)] = kvret_out.data() + (c * H + h) * budget;
    pq.select(store, r, out.data(), nullptr);
  }
  void kvret_run(const kvret::PqRetriever& pq, bool calls_in_parallel) {
    const int T = data.o.threads;
    set_threads(T);
    if (calls_in_parallel) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(T)
      for (int64_t c = 0; c < nq(); ++c) kvret_call(pq, c, 1);
    } else {
      for (int64_t c = 0; c < nq(); ++c) kvret_call(pq, c, T);
    }
  }
  void faiss_head(Built& b, int h) {
    b.indexes[static_cast<size_t>(h)].search(nq(), faiss_queries[static_cast<size_t>(h)].data(), budget,
                                             faiss_dist.data() + h * nq() * budget,
                                             faiss_labels.data() + h * nq() * budget);
  }
  void faiss_run(Built& b, bool heads_in_parallel) {
    const int T = data.o.threads;
    if (heads_in_parallel) {
      omp_set_num_threads(T);
      openblas_set_num_threads(1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(T)
      for (int h = 0; h < H; ++h) faiss_head(b, h);
    } else {
      set_threads(T);
      for (int h = 0; h < H; ++h) faiss_head(b, h);
    }
  }
  /// Mean recall of the exact top-B of both libraries' last results.
  std::pair<double, double> recalls() const {
    double rk = 0, rf = 0;
    for (int st = 0; st < steps; ++st)
      for (int h = 0; h < H; ++h)
        for (int g = 0; g < group; ++g) {
          const auto exact = exact_top(data, data.query(st, h * group + g), h, budget);
          const int64_t c = static_cast<int64_t>(st) * group + g;
          rk += recall(exact, kvret_out.data() + (c * H + h) * budget, budget);
          rf += recall(exact, faiss_labels.data() + (h * nq() + c) * budget, budget);
        }
    const double n = static_cast<double>(steps) * H * group;
    return {rk / n, rf / n};
  }
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;
  const Data data(o);
  const int H = o.kv_heads, D = o.head_dim, T = o.threads;
  const int k = 1 << o.bits;
  const size_t n = static_cast<size_t>(o.tokens);
  std::vector<Row> rows;

  // kvret trains and encodes from its host KV store (f32, the same floats FAISS gets); FAISS from per-head arrays.
  kvret::HostKvStore store(H, D, kvret::DType::F32);
  {
    std::vector<float> zeros(data.keys.size());
    const int64_t shape[3] = {o.tokens, H, D};
    kvret_tensor kt{
        const_cast<float*>(data.keys.data()), {KVRET_DEVICE_CPU, 0}, 3, {KVRET_DTYPE_FLOAT, 32, 1}, shape, nullptr, 0};
    kvret_tensor vt = kt;
    vt.data = zeros.data();
    store.append(kvret::TensorView::from(&kt, "k", kvret::kFloatTypes, {3}),
                 kvret::TensorView::from(&vt, "v", kvret::kFloatTypes, {3}), o.tokens, true);
  }

  // (a) PQ build, timed with the first seed
  Built timed;
  {
    Row row;
    row.name = "PQ build (train+encode, " + std::to_string(H) + " heads)";
    row.quality_name = "rel. reconstr. error";
    row.higher_is_better = false;
    measure(row, o.reps, {{"threads in call", [&] { build_kvret(o, store, o.seed, timed); }}},
            {{"heads in sequence", [&] { build_faiss(data, o.seed, false, timed); }},
             {"heads in parallel", [&] { build_faiss(data, o.seed, true, timed); }}});
    rows.push_back(std::move(row));
  }

  // (b) k-means alone: sub-space 0 of KV head 0, a fixed random sample of `sample` tokens, the same for both.
  const int ds = D / o.m;
  const int64_t np = std::min<int64_t>(o.sample, o.tokens);
  std::vector<float> x(static_cast<size_t>(np) * ds);
  {
    std::vector<int64_t> pick(n);
    std::iota(pick.begin(), pick.end(), 0);
    uint64_t state = o.seed * 7919;
    for (int64_t i = 0; i < np; ++i)
      std::swap(pick[static_cast<size_t>(i)],
                pick[static_cast<size_t>(
                    i + static_cast<int64_t>(kvret::splitmix64(state) % static_cast<uint64_t>(o.tokens - i)))]);
    for (int64_t i = 0; i < np; ++i)
      std::memcpy(x.data() + i * ds, data.by_head[0].data() + pick[static_cast<size_t>(i)] * D, ds * sizeof(float));
  }
  auto kvret_kmeans = [&](uint64_t seed) {
    set_threads(T);
    kvret::KmeansOptions ko;
    ko.k = k;
    ko.max_iters = kvret_iters(o);
    ko.adaptive = false;
    ko.seed = seed;
    ko.parallel = true;
    return kvret::kmeans(x.data(), np, ds, ds, ko).centroids;
  };
  auto faiss_kmeans = [&](uint64_t seed, int blas_threads) {
    omp_set_num_threads(T);
    openblas_set_num_threads(blas_threads);
    faiss::Clustering clus(ds, k);
    clus.niter = o.iters;
    clus.nredo = 1;
    clus.verbose = false;
    clus.max_points_per_centroid = static_cast<int>((np + k - 1) / k);  // no subsampling: all np points
    clus.seed = static_cast<int>(seed);
    faiss::IndexFlatL2 index(ds);
    clus.train(np, x.data(), index);
    return clus.centroids;
  };
  auto objective = [&](const std::vector<float>& c) {
    set_threads(T);
    std::vector<int32_t> a(static_cast<size_t>(np));
    std::vector<float> dist(static_cast<size_t>(np));
    kvret::assign_nearest(x.data(), np, ds, ds, c.data(), k, a.data(), dist.data(), true);
    double sum = 0;
    for (float v : dist) sum += v;
    return sum / static_cast<double>(np);
  };
  {
    Row row;
    row.name = "k-means (n=" + std::to_string(np) + ", d=" + std::to_string(ds) + ", k=" + std::to_string(k) + ")";
    row.quality_name = "mean sq. distance";
    row.higher_is_better = false;
    measure(row, o.reps, {{"threads in call", [&] { kvret_kmeans(o.seed); }}},
            {{"OpenMP + BLAS threads", [&] { faiss_kmeans(o.seed, T); }},
             {"OpenMP threads, 1 BLAS thread", [&] { faiss_kmeans(o.seed, 1); }}});
    rows.push_back(std::move(row));
  }

  // (c) search, per budget, over the codes of the timed build
  make_indexes(o, timed);
  std::vector<std::unique_ptr<Search>> searches;
  for (double frac : o.budgets) {
    const int64_t budget = std::max<int64_t>(1, std::llround(frac * static_cast<double>(o.tokens)));
    searches.push_back(std::make_unique<Search>(data, store, budget));
    Search& s = *searches.back();
    Row row;
    row.name = "PQ search top-" + std::to_string(budget) + " (" + std::to_string(o.q_heads * o.steps) + " q)";
    row.quality_name = "recall of exact top-B";
    measure(row, o.reps,
            {{"threads in call", [&] { s.kvret_run(*timed.kvret_pq, false); }},
             {"calls in parallel", [&] { s.kvret_run(*timed.kvret_pq, true); }}},
            {{"heads in sequence", [&] { s.faiss_run(timed, false); }},
             {"heads in parallel", [&] { s.faiss_run(timed, true); }}});
    rows.push_back(std::move(row));
  }

  // quality: the timed seed first, then further training seeds (untimed)
  for (int i = 0; i < std::max(1, o.quality_seeds); ++i) {
    const uint64_t seed = o.seed + static_cast<uint64_t>(i);
    Built b;
    Built& built = i == 0 ? timed : b;
    if (i > 0) {
      build_kvret(o, store, seed, built);
      build_faiss(data, seed, true, built);
      make_indexes(o, built);
    }
    set_threads(T);
    rows[0].kvret_quality.values.push_back(kvret_reconstruction(data, *built.kvret_pq));
    rows[0].faiss_quality.values.push_back(faiss_reconstruction(data, built.faiss_pq));
    rows[1].kvret_quality.values.push_back(objective(kvret_kmeans(seed)));
    rows[1].faiss_quality.values.push_back(objective(faiss_kmeans(seed, 1)));
    for (size_t j = 0; j < searches.size(); ++j) {
      Search& s = *searches[j];
      s.kvret_run(*built.kvret_pq, true);
      s.faiss_run(built, true);
      const auto [rk, rf] = s.recalls();
      rows[2 + j].kvret_quality.values.push_back(rk);
      rows[2 + j].faiss_quality.values.push_back(rf);
    }
  }

  if (o.json)
    print_json(o, rows);
  else
    print_table(o, rows);
  return 0;
}
