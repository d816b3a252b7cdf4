// kvret against FAISS (Debian's libfaiss, linked with OpenBLAS and OpenMP) on identical data and settings, in one
// run, timings interleaved and summarized by medians:
//  (a) PQ build = training + encoding of one layer's keys (one codebook per KV head): kvret's PqRetriever::extend
//      on a HostKvStore vs one faiss::ProductQuantizer per KV head (train + compute_codes);
//  (b) k-means alone on one sub-space: kvret::kmeans vs faiss::Clustering (same k, d, points, no redo, and the
//      same number of centroid updates: see kvret_iters);
//  (c) PQ search, inner-product top-B per query head over one KV head's codes: kvret's PqRetriever::select (LUT +
//      code cells, one query head per KV head) vs faiss::IndexPQ::search (METRIC_INNER_PRODUCT, k = B).
// Quality side by side: (a) reconstruction error of the codes, (b) the k-means objective of the final centroids,
// (c) recall of the exact top-B by q.k.
//
// FAISS gets its best: its time per repetition is the faster of two schedules — KV heads one after another with
// FAISS's own OpenMP/BLAS parallelism (T threads each), or KV heads in parallel over T OpenMP threads with
// single-threaded FAISS/BLAS inside. kvret runs with n_threads = T.
//
// Run: build/bin/kvret-bench-faiss [--tokens 32768] [--threads 2] [--reps 5] [--iters 25] [--sample 8192]
//                                  [--budgets 0.1,0.02] [--json]
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
  uint64_t seed = 1;
  bool json = false;
};

void usage() {
  std::fprintf(stderr,
               "usage: kvret-bench-faiss [--tokens N] [--threads T] [--reps R] [--iters I] [--sample S]\n"
               "                         [--steps S] [--budgets f1,f2,...] [--seed X] [--json]\n");
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

struct Row {
  std::string name;
  std::vector<double> kvret_ms, faiss_ms, ratio;  // per repetition; faiss = best schedule of that repetition
  std::vector<double> faiss_seq_ms, faiss_par_ms;
  std::string quality_name;  ///< what the quality columns mean
  double kvret_quality = 0, faiss_quality = 0;
  bool higher_is_better = true;
};

/// Runs kvret, FAISS sequential-heads and FAISS parallel-heads `reps` times, interleaved (the order alternates).
void measure(Row& row, int reps, const std::function<void()>& kvret_run, const std::function<void()>& faiss_seq,
             const std::function<void()>& faiss_par) {
  for (int r = 0; r < reps; ++r) {
    double k = 0, s = 0, p = 0;
    auto time = [](const std::function<void()>& f) {
      const double t0 = now_ms();
      f();
      return now_ms() - t0;
    };
    if (r % 2 == 0) {
      k = time(kvret_run);
      s = time(faiss_seq);
      p = time(faiss_par);
    } else {
      p = time(faiss_par);
      s = time(faiss_seq);
      k = time(kvret_run);
    }
    row.kvret_ms.push_back(k);
    row.faiss_seq_ms.push_back(s);
    row.faiss_par_ms.push_back(p);
    row.faiss_ms.push_back(std::min(s, p));
    row.ratio.push_back(std::min(s, p) / k);
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

faiss::ProductQuantizer make_faiss_pq(const Options& o, int head) {
  faiss::ProductQuantizer pq(static_cast<size_t>(o.head_dim), static_cast<size_t>(o.m), static_cast<size_t>(o.bits));
  pq.cp.niter = o.iters;
  pq.cp.nredo = 1;
  pq.cp.verbose = false;
  // FAISS samples k * max_points_per_centroid points when given more: the same sample size as kvret's.
  pq.cp.max_points_per_centroid = static_cast<int>(o.sample >> o.bits);
  pq.cp.seed = static_cast<int>(o.seed) + head;
  return pq;
}

void faiss_build_head(const Data& data, FaissPq& f, int h) {
  const size_t n = static_cast<size_t>(data.o.tokens);
  auto& pq = f.pq[static_cast<size_t>(h)];
  pq = make_faiss_pq(data.o, h);
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

kvret::PqRetriever::Params kvret_params(const Options& o) {
  kvret::PqRetriever::Params p;
  p.m = o.m;
  p.bits = o.bits;
  p.iters = kvret_iters(o);
  p.train_sample = o.sample;
  p.seed = o.seed;
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
  std::printf("| %-34s | %12s | %12s | %8s | %-22s | %10s | %10s |\n", "benchmark", "kvret ms", "FAISS ms", "speedup",
              "quality", "kvret", "FAISS");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(14, '-').c_str(),
              std::string(14, '-').c_str(), std::string(10, '-').c_str(), std::string(24, '-').c_str(),
              std::string(12, '-').c_str(), std::string(12, '-').c_str());
  for (const Row& r : rows)
    std::printf("| %-34s | %12.3f | %12.3f | %7.2fx | %-22s | %10.4f | %10.4f |\n", r.name.c_str(), median(r.kvret_ms),
                median(r.faiss_ms), median(r.ratio), r.quality_name.c_str(), r.kvret_quality, r.faiss_quality);
  std::string seq, par;
  for (const Row& r : rows) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%.3f", seq.empty() ? "" : ", ", median(r.faiss_seq_ms));
    seq += buf;
    std::snprintf(buf, sizeof buf, "%s%.3f", par.empty() ? "" : ", ", median(r.faiss_par_ms));
    par += buf;
  }
  std::printf(
      "\nspeedup = median over repetitions of (FAISS time / kvret time), measured back to back.\n"
      "FAISS time = the faster of its two schedules in each repetition; medians in ms, row by row:\n"
      "  KV heads in sequence, FAISS's own OpenMP + BLAS threads: %s\n"
      "  KV heads in parallel over OpenMP threads, single-threaded BLAS:  %s\n",
      seq.c_str(), par.c_str());
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
        "%s\n  {\"name\": \"%s\", \"kvret_ms\": %.4f, \"faiss_ms\": %.4f, \"faiss_seq_ms\": %.4f, "
        "\"faiss_par_ms\": %.4f, \"speedup\": %.4f, \"quality\": \"%s\", \"kvret_quality\": %.6f, "
        "\"faiss_quality\": %.6f, \"higher_is_better\": %s}",
        i ? "," : "", r.name.c_str(), median(r.kvret_ms), median(r.faiss_ms), median(r.faiss_seq_ms),
        median(r.faiss_par_ms), median(r.ratio), r.quality_name.c_str(), r.kvret_quality, r.faiss_quality,
        r.higher_is_better ? "true" : "false");
  }
  std::printf("\n]}\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;
  const Data data(o);
  const int H = o.kv_heads, D = o.head_dim, T = o.threads;
  const int k = 1 << o.bits;
  const size_t n = static_cast<size_t>(o.tokens);
  std::vector<Row> rows;

  // (a) PQ build: kvret trains and encodes from its host KV store; FAISS from per-head arrays.
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
  std::unique_ptr<kvret::PqRetriever> kv_pq;
  FaissPq fa;
  {
    Row row;
    row.name = "PQ build (train+encode, " + std::to_string(H) + " heads)";
    measure(
        row, o.reps,
        [&] {
          set_threads(T);
          kv_pq = std::make_unique<kvret::PqRetriever>(H, D, kvret_params(o));
          kv_pq->extend(store, 0, o.tokens, true, T);
        },
        [&] {
          set_threads(T);
          fa.pq.assign(static_cast<size_t>(H), faiss::ProductQuantizer());
          fa.codes.assign(static_cast<size_t>(H), {});
          for (int h = 0; h < H; ++h) faiss_build_head(data, fa, h);
        },
        [&] {
          omp_set_num_threads(T);
          openblas_set_num_threads(1);
          fa.pq.assign(static_cast<size_t>(H), faiss::ProductQuantizer());
          fa.codes.assign(static_cast<size_t>(H), {});
#pragma omp parallel for schedule(dynamic, 1) num_threads(T)
          for (int h = 0; h < H; ++h) faiss_build_head(data, fa, h);
        });
    set_threads(T);
    row.quality_name = "rel. reconstr. error";
    row.higher_is_better = false;
    row.kvret_quality = kvret_reconstruction(data, *kv_pq);
    row.faiss_quality = faiss_reconstruction(data, fa);
    rows.push_back(row);
  }

  // (b) k-means alone: sub-space 0 of KV head 0, a fixed random sample of `sample` tokens, the same for both.
  {
    const int ds = D / o.m;
    const int64_t np = std::min<int64_t>(o.sample, o.tokens);
    std::vector<int64_t> pick(n);
    std::iota(pick.begin(), pick.end(), 0);
    uint64_t state = o.seed * 7919;
    for (int64_t i = 0; i < np; ++i)
      std::swap(pick[static_cast<size_t>(i)],
                pick[static_cast<size_t>(
                    i + static_cast<int64_t>(kvret::splitmix64(state) % static_cast<uint64_t>(o.tokens - i)))]);
    std::vector<float> x(static_cast<size_t>(np) * ds);
    for (int64_t i = 0; i < np; ++i)
      std::memcpy(x.data() + i * ds, data.by_head[0].data() + pick[static_cast<size_t>(i)] * D, ds * sizeof(float));
    std::vector<float> kv_centroids, fa_centroids;
    Row row;
    row.name = "k-means (n=" + std::to_string(np) + ", d=" + std::to_string(ds) + ", k=" + std::to_string(k) + ")";
    auto faiss_kmeans = [&] {
      faiss::Clustering clus(ds, k);
      clus.niter = o.iters;
      clus.nredo = 1;
      clus.verbose = false;
      clus.max_points_per_centroid = static_cast<int>((np + k - 1) / k);  // no subsampling: all np points
      clus.seed = static_cast<int>(o.seed);
      faiss::IndexFlatL2 index(ds);
      clus.train(np, x.data(), index);
      fa_centroids = clus.centroids;
    };
    measure(
        row, o.reps,
        [&] {
          set_threads(T);
          kvret::KmeansOptions ko;
          ko.k = k;
          ko.max_iters = kvret_iters(o);
          ko.adaptive = false;
          ko.seed = o.seed;
          ko.parallel = true;
          kv_centroids = kvret::kmeans(x.data(), np, ds, ds, ko).centroids;
        },
        [&] {
          set_threads(T);
          faiss_kmeans();
        },
        [&] {  // one k-means has no heads to spread: FAISS with OpenMP threads and a single-threaded BLAS
          omp_set_num_threads(T);
          openblas_set_num_threads(1);
          faiss_kmeans();
        });
    set_threads(T);
    auto objective = [&](const std::vector<float>& c) {
      std::vector<int32_t> a(static_cast<size_t>(np));
      std::vector<float> dist(static_cast<size_t>(np));
      kvret::assign_nearest(x.data(), np, ds, ds, c.data(), k, a.data(), dist.data(), true);
      double s = 0;
      for (float v : dist) s += v;
      return s / static_cast<double>(np);
    };
    row.quality_name = "mean sq. distance";
    row.higher_is_better = false;
    row.kvret_quality = objective(kv_centroids);
    row.faiss_quality = objective(fa_centroids);
    rows.push_back(row);
  }

  // (c) search: every query head of every step, top-B by inner product over its KV head's codes.
  {
    const int group = o.q_heads / H;
    std::vector<faiss::IndexPQ> indexes;
    indexes.reserve(static_cast<size_t>(H));
    for (int h = 0; h < H; ++h) {
      indexes.emplace_back(D, static_cast<size_t>(o.m), static_cast<size_t>(o.bits), faiss::METRIC_INNER_PRODUCT);
      faiss::IndexPQ& ix = indexes.back();
      ix.pq = fa.pq[static_cast<size_t>(h)];
      ix.codes = fa.codes[static_cast<size_t>(h)];
      ix.ntotal = o.tokens;
      ix.is_trained = true;
    }
    // faiss queries per head: [steps * group, D] (step-major, the group's heads in order)
    std::vector<std::vector<float>> fq(static_cast<size_t>(H));
    for (int h = 0; h < H; ++h)
      for (int s = 0; s < o.steps; ++s)
        for (int g = 0; g < group; ++g) {
          const float* q = data.query(s, h * group + g);
          fq[static_cast<size_t>(h)].insert(fq[static_cast<size_t>(h)].end(), q, q + D);
        }
    const int64_t nq = static_cast<int64_t>(o.steps) * group;
    for (double frac : o.budgets) {
      const int64_t budget = std::max<int64_t>(1, std::llround(frac * static_cast<double>(o.tokens)));
      // kvret: one select per (step, head of the group) scores one query head against every KV head at once.
      std::vector<int32_t> kv_out(static_cast<size_t>(o.steps * group * H * budget));
      std::vector<float> fa_dist(static_cast<size_t>(H * nq * budget));
      std::vector<faiss::Index::idx_t> fa_lab(static_cast<size_t>(H * nq * budget));
      std::vector<float> q_sel(static_cast<size_t>(H) * D);
      auto kvret_search = [&] {
        set_threads(T);
        for (int s = 0; s < o.steps; ++s)
          for (int g = 0; g < group; ++g) {
            for (int h = 0; h < H; ++h) std::memcpy(q_sel.data() + h * D, data.query(s, h * group + g), D * 4);
            kvret::SelectRequest r;
            r.q = q_sel.data();
            r.n_q_heads = H;
            r.group = 1;
            r.scale = 1.0f;
            r.mid_begin = 0;
            r.mid_end = o.tokens;
            r.budget = budget;
            r.fold = KVRET_FOLD_MAX_LOGIT;  // one query head: the top-B of its logits
            r.n_threads = T;
            std::vector<int32_t*> out(static_cast<size_t>(H));
            for (int h = 0; h < H; ++h)
              out[static_cast<size_t>(h)] = kv_out.data() + ((static_cast<int64_t>(s) * group + g) * H + h) * budget;
            kv_pq->select(store, r, out.data());
          }
      };
      auto faiss_head = [&](int h) {
        indexes[static_cast<size_t>(h)].search(nq, fq[static_cast<size_t>(h)].data(), budget,
                                               fa_dist.data() + h * nq * budget, fa_lab.data() + h * nq * budget);
      };
      Row row;
      row.name = "PQ search top-" + std::to_string(budget) + " (" + std::to_string(o.q_heads * o.steps) + " q)";
      measure(
          row, o.reps, kvret_search,
          [&] {
            set_threads(T);
            for (int h = 0; h < H; ++h) faiss_head(h);
          },
          [&] {
            omp_set_num_threads(T);
            openblas_set_num_threads(1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(T)
            for (int h = 0; h < H; ++h) faiss_head(h);
          });
      set_threads(T);
      double rk = 0, rf = 0;
      for (int s = 0; s < o.steps; ++s)
        for (int h = 0; h < H; ++h)
          for (int g = 0; g < group; ++g) {
            const auto exact = exact_top(data, data.query(s, h * group + g), h, budget);
            rk += recall(exact, kv_out.data() + ((static_cast<int64_t>(s) * group + g) * H + h) * budget, budget);
            rf += recall(exact, fa_lab.data() + (h * nq + static_cast<int64_t>(s) * group + g) * budget, budget);
          }
      row.quality_name = "recall of exact top-B";
      row.kvret_quality = rk / (o.steps * H * group);
      row.faiss_quality = rf / (o.steps * H * group);
      rows.push_back(row);
    }
  }

  if (o.json)
    print_json(o, rows);
  else
    print_table(o, rows);
  return 0;
}
