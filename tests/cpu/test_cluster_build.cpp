// CLUSTER's build on the CUDA backend's device (src/backend/cluster_build_ops.hpp, CudaClusterBuilder) against the
// CPU build (src/index/cluster_retriever.cpp):
// - kernels/math/kmeans_math.h: a model of the segment build made of the header's functions alone equals
//   cosine_kmeans and cluster_segment_index bit for bit (always runs);
// - the backend's builder equals the CPU build bit for bit (labels, directions, objective, centroids, sizes, ids,
//   singletons), and its result has the k-means properties (in a build with the CUDA backend);
// - under KVRET_TEST_DEVICE=cuda, a CUDA-backend context's index (built on the device) equals a CPU-backend
//   context's over prefill, many decode intervals, truncates, drop_fronts, forks, saved and opened sessions, f32 and
//   f16, and their selects are equal;
// - the device copy of the clusters is updated with what a decode interval added, not copied whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "core/error.hpp"
#include "device_twin.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"
#include "index/cluster_retriever.hpp"
#include "index/kmeans.hpp"
#include "kvret.h"
#include "math/kmeans_math.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
namespace pm = kvret::cuda::math;

namespace {

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

uint64_t bits(double f) {
  uint64_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

template <class T>
void expect_same_floats(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(bits(a[i]), bits(b[i])) << what << " element " << i;
}

/// A segment's keys: random rows, some repeated (so that equal seeds empty clusters), some zero, some scaled far.
std::vector<float> segment_keys(int64_t n, int d, std::mt19937_64& rng, bool awkward) {
  std::vector<float> keys = test::random_vector(static_cast<size_t>(n) * d, rng(), 1.5f);
  if (!awkward) return keys;
  for (int64_t i = 1; i < n; ++i) {
    const uint64_t r = rng() % 12;
    float* row = keys.data() + i * d;
    if (r == 0) std::copy(row - d, row, row);  // a repeat of the previous key
    if (r == 1) std::fill(row, row + d, 0.0f);
    if (r == 2)
      for (int t = 0; t < d; ++t) row[t] *= 1e18f;
    if (r == 3 && rng() % 8 == 0) row[rng() % static_cast<uint64_t>(d)] = std::numeric_limits<float>::infinity();
    if (r == 4 && i + 1 < n) {
      // two keys whose first elements, 1e38 and -1e38, cancel: in one cluster, its sum keeps only what is added
      // after them, so that the sums depend on their order
      row[0] = 1e38f;
      row[d] = -1e38f;
      ++i;
    }
  }
  return keys;
}

/// A random segment to cluster; one cluster and no singletons when `whole` (every key in one sum).
ClusterSegmentJob random_job(const std::vector<float>& keys, int64_t n, int d, std::mt19937_64& rng, bool whole) {
  ClusterSegmentJob job;
  job.keys = keys.data();
  job.n = n;
  job.d = d;
  job.k = 1 + static_cast<int>(rng() % static_cast<uint64_t>(std::min<int64_t>(n, 24)));
  job.exacts = rng() % 3 == 0 ? static_cast<int64_t>(rng() % static_cast<uint64_t>(n - job.k + 1)) : 0;
  job.begin = static_cast<int64_t>(rng() % 1000);
  job.seed = rng();
  job.max_iters = 1 + static_cast<int>(rng() % 8);
  job.sample = rng() % 3 == 0 ? static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1)) : 0;
  if (whole) {
    job.k = 1;
    job.exacts = 0;
  }
  return job;
}

/// The segment build made of kmeans_math.h's functions alone, in the simplest loops (what the device passes do).
ClusterSegmentIndex header_model(const ClusterSegmentJob& job, int* emptied) {
  const int64_t n = job.n;
  const int d = job.d;
  const int k = job.k;
  const auto row = [d](auto* base, int64_t i) { return base + i * d; };
  std::vector<float> unit(static_cast<size_t>(n) * d);
  for (int64_t i = 0; i < n; ++i) pm::kmeans_unit_row(row(job.keys, i), d, row(unit.data(), i));
  const std::vector<int64_t> sample = cosine_kmeans_sample(n, k, job.seed, job.sample);
  const int64_t m = sample.empty() ? n : static_cast<int64_t>(sample.size());
  std::vector<float> train(static_cast<size_t>(m) * d);
  for (int64_t i = 0; i < m; ++i)
    std::copy_n(row(unit.data(), sample.empty() ? i : sample[static_cast<size_t>(i)]), d, row(train.data(), i));
  ClusterSegmentIndex out;
  CosineKmeansResult& r = out.kmeans;
  r.trained = m;
  r.directions.resize(static_cast<size_t>(k) * d);
  const std::vector<int64_t> seeds = forgy_indices(m, k, job.seed);
  for (int j = 0; j < k; ++j)
    std::copy_n(row(train.data(), seeds[static_cast<size_t>(j)]), d, row(r.directions.data(), j));
  std::vector<float> score(static_cast<size_t>(k)), cosine(static_cast<size_t>(n));
  std::vector<int32_t> labels(static_cast<size_t>(n), -1);
  const auto assign = [&](const float* x, int64_t count) {
    int64_t changed = 0;
    for (int64_t i = 0; i < count; ++i) {
      for (int j = 0; j < k; ++j)
        score[static_cast<size_t>(j)] = pm::kmeans_cosine(row(x, i), row(r.directions.data(), j), d);
      const int32_t best = pm::kmeans_argmax(score.data(), k);
      changed += labels[static_cast<size_t>(i)] != best;
      labels[static_cast<size_t>(i)] = best;
      cosine[static_cast<size_t>(i)] = score[static_cast<size_t>(best)];
    }
    return changed;
  };
  for (int it = 0; it < std::max(1, job.max_iters); ++it) {
    const int64_t changed = assign(train.data(), m);
    double objective = 0;
    for (int64_t i = 0; i < m; ++i) objective = pm::dadd_rn(objective, cosine[static_cast<size_t>(i)]);
    r.objective.push_back(objective);
    r.iterations = it + 1;
    if (changed == 0 || it + 1 == std::max(1, job.max_iters)) break;
    std::vector<int64_t> lowest(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) lowest[static_cast<size_t>(i)] = i;
    std::stable_sort(lowest.begin(), lowest.end(), [&](int64_t a, int64_t b) {
      return cosine[static_cast<size_t>(a)] < cosine[static_cast<size_t>(b)];
    });
    int64_t empty_rank = 0;
    std::vector<float> next(r.directions);
    for (int j = 0; j < k; ++j) {
      std::vector<double> s(static_cast<size_t>(d), 0.0);
      int64_t count = 0;
      for (int64_t i = 0; i < m; ++i)
        if (labels[static_cast<size_t>(i)] == j) {
          ++count;
          for (int t = 0; t < d; ++t)
            s[static_cast<size_t>(t)] = pm::kmeans_sum_step(s[static_cast<size_t>(t)], row(train.data(), i)[t]);
        }
      if (count > 0) {
        pm::kmeans_direction(s.data(), d, row(next.data(), j));
      } else {
        ++*emptied;
        std::copy_n(row(train.data(), lowest[static_cast<size_t>(empty_rank++ % m)]), d, row(next.data(), j));
      }
    }
    r.directions = next;
  }
  if (m < n) {
    std::fill(labels.begin(), labels.end(), -1);
    assign(unit.data(), n);
  }
  labels.resize(static_cast<size_t>(n));
  r.labels = labels;
  // singletons: the lowest fits, ties to the earlier; then the layout and the raw means
  std::vector<int64_t> by_fit(static_cast<size_t>(n));
  std::vector<float> fit(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    by_fit[static_cast<size_t>(i)] = i;
    fit[static_cast<size_t>(i)] =
        pm::kmeans_fit(row(job.keys, i), row(r.directions.data(), labels[static_cast<size_t>(i)]), d);
  }
  std::stable_sort(by_fit.begin(), by_fit.end(),
                   [&](int64_t a, int64_t b) { return fit[static_cast<size_t>(a)] < fit[static_cast<size_t>(b)]; });
  std::vector<uint8_t> exact(static_cast<size_t>(n), 0);
  for (int64_t x = 0; x < job.exacts; ++x) exact[static_cast<size_t>(by_fit[static_cast<size_t>(x)])] = 1;
  out.centroids.assign(static_cast<size_t>(k) * d, 0.0f);
  for (int j = 0; j < k; ++j) {
    std::vector<double> s(static_cast<size_t>(d), 0.0);
    int32_t size = 0;
    for (int64_t i = 0; i < n; ++i)
      if (!exact[static_cast<size_t>(i)] && labels[static_cast<size_t>(i)] == j) {
        ++size;
        out.ids.push_back(static_cast<int32_t>(job.begin + i));
        for (int t = 0; t < d; ++t)
          s[static_cast<size_t>(t)] = pm::kmeans_sum_step(s[static_cast<size_t>(t)], row(job.keys, i)[t]);
      }
    out.sizes.push_back(size);
    if (size > 0)
      for (int t = 0; t < d; ++t)
        out.centroids[static_cast<size_t>(j) * d + t] = pm::kmeans_mean(s[static_cast<size_t>(t)], size);
  }
  for (int64_t i = 0; i < n; ++i)
    if (exact[static_cast<size_t>(i)]) {
      out.exact_pos.push_back(static_cast<int32_t>(job.begin + i));
      out.exact_keys.insert(out.exact_keys.end(), row(job.keys, i), row(job.keys, i + 1));
    }
  return out;
}

void expect_same_segment(const ClusterSegmentIndex& a, const ClusterSegmentIndex& b, const std::string& where) {
  EXPECT_EQ(a.kmeans.labels, b.kmeans.labels) << where;
  expect_same_floats(a.kmeans.directions, b.kmeans.directions, where + " directions");
  expect_same_floats(a.kmeans.objective, b.kmeans.objective, where + " objective");
  EXPECT_EQ(a.kmeans.iterations, b.kmeans.iterations) << where;
  EXPECT_EQ(a.kmeans.trained, b.kmeans.trained) << where;
  expect_same_floats(a.centroids, b.centroids, where + " centroids");
  EXPECT_EQ(a.sizes, b.sizes) << where;
  EXPECT_EQ(a.ids, b.ids) << where;
  EXPECT_EQ(a.exact_pos, b.exact_pos) << where;
  expect_same_floats(a.exact_keys, b.exact_keys, where + " exact keys");
}

TEST(KmeansMath, HeaderModelIsTheCpuSegmentBuild) {
  std::mt19937_64 rng(11);
  int emptied = 0, sampled = 0, settled = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int d = std::vector<int>{1, 3, 8, 13, 64}[rng() % 5];
    const int64_t n = 1 + static_cast<int64_t>(rng() % 300);
    const std::vector<float> keys = segment_keys(n, d, rng, trial % 2 == 1);
    const ClusterSegmentJob job = random_job(keys, n, d, rng, trial % 4 == 0);
    const ClusterSegmentIndex cpu = cluster_segment_index(job);
    const ClusterSegmentIndex model = header_model(job, &emptied);
    expect_same_segment(model, cpu, "trial " + std::to_string(trial));
    if (::testing::Test::HasFailure()) return;
    sampled += cpu.kmeans.trained < n;
    settled += cpu.kmeans.iterations < job.max_iters;
  }
  // the cases the model covers were met
  EXPECT_GT(emptied, 0);
  EXPECT_GT(sampled, 0);
  EXPECT_GT(settled, 0);
}

/// The CUDA backend's builder, or null in a build without one (or without a GPU to run it).
std::shared_ptr<const ClusterSegmentBuilder> device_builder(std::unique_ptr<Backend>& keep) {
  if (cuda_backend_system() == nullptr) return nullptr;
  kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
  c.device_type = KVRET_DEVICE_CUDA;
  try {
    keep = make_backend(c);
  } catch (const Error& e) {  // a build for a GPU on a machine without one
    if (e.status() != KVRET_ERR_CUDA) throw;
    return nullptr;
  }
  return keep->cluster_builder();
}

/// The k-means properties of a segment's result: every label is the max-cosine direction of its key (ties to the
/// lower), the objective does not fall, the layout lists every key once, sorted stably by cluster.
void expect_kmeans_properties(const ClusterSegmentJob& job, const ClusterSegmentIndex& r, const std::string& where) {
  const int d = job.d;
  const int k = job.k;
  std::vector<float> unit(static_cast<size_t>(d)), score(static_cast<size_t>(k));
  for (int64_t i = 0; i < job.n; ++i) {
    pm::kmeans_unit_row(job.keys + i * d, d, unit.data());
    for (int j = 0; j < k; ++j)
      score[static_cast<size_t>(j)] = pm::kmeans_cosine(unit.data(), r.kmeans.directions.data() + j * d, d);
    const int32_t label = r.kmeans.labels[static_cast<size_t>(i)];
    for (int j = 0; j < k; ++j) {
      ASSERT_LE(score[static_cast<size_t>(j)], score[static_cast<size_t>(label)]) << where << " key " << i;
      if (j < label) {
        ASSERT_LT(score[static_cast<size_t>(j)], score[static_cast<size_t>(label)]) << where << " key " << i;
      }
    }
  }
  const std::vector<double>& o = r.kmeans.objective;
  for (size_t it = 1; it < o.size(); ++it)
    EXPECT_GE(o[it], o[it - 1] - 1e-5 * static_cast<double>(r.kmeans.trained)) << where << " iteration " << it;
  int64_t total = 0;
  size_t at = 0;
  for (int j = 0; j < k; ++j) {
    for (int32_t t = 0; t < r.sizes[static_cast<size_t>(j)]; ++t, ++at) {
      const int32_t pos = r.ids[at];
      ASSERT_EQ(r.kmeans.labels[static_cast<size_t>(pos - job.begin)], j) << where;
      if (t > 0) {
        ASSERT_GT(pos, r.ids[at - 1]) << where;
      }
    }
    total += r.sizes[static_cast<size_t>(j)];
  }
  EXPECT_EQ(total + static_cast<int64_t>(r.exact_pos.size()), job.n) << where;
  EXPECT_EQ(static_cast<int64_t>(r.exact_pos.size()), job.exacts) << where;
}

TEST(ClusterDeviceBuild, BuilderEqualsTheCpuBuildAndIsAKmeans) {
  std::unique_ptr<Backend> backend;
  const auto builder = device_builder(backend);
  if (builder == nullptr) GTEST_SKIP() << "no CUDA backend to build on";
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 150; ++trial) {
    const int d = std::vector<int>{1, 5, 8, 64, 128}[rng() % 5];
    const int64_t n = 1 + static_cast<int64_t>(rng() % (trial % 10 == 0 ? 3000 : 400));
    const std::vector<float> keys = segment_keys(n, d, rng, trial % 2 == 1);
    const ClusterSegmentJob job = random_job(keys, n, d, rng, trial % 4 == 1);
    const std::string where = "trial " + std::to_string(trial);
    const ClusterSegmentIndex cpu = cluster_segment_index(job);
    const ClusterSegmentIndex dev = builder->build(job);
    expect_same_segment(dev, cpu, where);
    expect_kmeans_properties(job, dev, where);
    if (::testing::Test::HasFailure()) return;
  }
}

// --- through the C ABI: a CUDA-backend context against a CPU-backend one ---

using test::twin::kDim;
using test::twin::kHeads;
using test::twin::label;
using test::twin::length_of;

kvret_config build_config(int32_t device_type, int kv, float exact_fraction) {
  kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
  c.device_type = device_type;
  c.kv_dtype = kv;
  c.cluster_tokens = 12;
  c.cluster_decode_interval = 24;
  c.cluster_decode_k = 3;
  c.cluster_segment_tokens = 96;
  c.cluster_exact_fraction = exact_fraction;
  c.background_build = 1;
  return c;
}

void append_both(kvret_seq* dev, kvret_seq* cpu, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  k.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed);
  v.data = test::random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed + 1);
  k.refresh();
  v.refresh();
  const bool prefill = tokens > 1;
  for (int32_t l = 0; l < 2; ++l)
    test::expect_ok(prefill ? kvret_append_prefill(dev, l, &k.t, &v.t) : kvret_append_decode(dev, l, &k.t, &v.t));
  label(k, KVRET_DEVICE_CPU);
  label(v, KVRET_DEVICE_CPU);
  for (int32_t l = 0; l < 2; ++l)
    test::expect_ok(prefill ? kvret_append_prefill(cpu, l, &k.t, &v.t) : kvret_append_decode(cpu, l, &k.t, &v.t));
}

const ClusterRetriever& cluster_of(kvret_seq* seq, int32_t layer) {
  return dynamic_cast<const ClusterRetriever&>(sequence_from_handle(seq)->index(layer));
}

void expect_same_index(kvret_seq* dev, kvret_seq* cpu, const std::string& where) {
  for (int32_t l = 0; l < 2; ++l) {
    const ClusterRetriever& a = cluster_of(dev, l);
    const ClusterRetriever& b = cluster_of(cpu, l);
    ASSERT_NE(a.builder(), nullptr) << where << ": the CUDA backend's context builds on its device";
    ASSERT_EQ(b.builder(), nullptr) << where;
    ASSERT_EQ(a.indexed_begin(), b.indexed_begin()) << where;
    ASSERT_EQ(a.indexed_end(), b.indexed_end()) << where;
    ASSERT_EQ(a.segments(), b.segments()) << where;
    for (int h = 0; h < kHeads; ++h) {
      const std::string at = where + " layer " + std::to_string(l) + " head " + std::to_string(h);
      expect_same_floats(a.centroids(h), b.centroids(h), at + " centroids");
      ASSERT_EQ(a.sizes(h), b.sizes(h)) << at;
      ASSERT_EQ(a.offsets(h), b.offsets(h)) << at;
      ASSERT_EQ(a.sorted_ids(h), b.sorted_ids(h)) << at;
      ASSERT_EQ(a.exact_positions(h), b.exact_positions(h)) << at;
      expect_same_floats(a.exact_keys(h), b.exact_keys(h), at + " exact keys");
    }
  }
}

class ClusterDeviceIndex : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

/// The device-built index equals the CPU backend's (segments, centroids, sizes, offsets, ids, singletons) after
/// every step of a random run of prefills, decodes (many decode intervals), truncates, drop_fronts, forks and
/// sessions saved and opened, and the selects over it are equal, bit for bit.
TEST_F(ClusterDeviceIndex, EqualsTheCpuBackendsOverPrefillDecodesAndEdits) {
  for (const int kv : {KVRET_KV_F32, KVRET_KV_F16}) {
    for (const float exact : {0.0f, 0.1f}) {
      const std::string where = "kv " + std::to_string(kv) + " exact " + std::to_string(exact);
      SCOPED_TRACE(where);
      auto dev_ctx = test::make_context(build_config(KVRET_DEVICE_CUDA, kv, exact));
      auto cpu_ctx = test::make_context(build_config(KVRET_DEVICE_CPU, kv, exact));
      kvret_seq *a = nullptr, *b = nullptr;
      test::twin::open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
      append_both(a, b, 260, 31);
      std::mt19937_64 rng(40 + static_cast<uint64_t>(kv) + static_cast<uint64_t>(exact * 10));
      int decode_segments = 0;
      for (int step = 0; step < 160; ++step) {
        const int64_t length = length_of(a);
        const uint64_t op = rng() % 40;
        const std::string at = where + " step " + std::to_string(step);
        const size_t before = cluster_of(a, 0).segments().size();
        if (op == 0 && length > 120) {
          test::twin::truncate_both(a, b, length, 60, rng);
        } else if (op == 1 && length > 150) {
          test::twin::drop_front_both(a, b, 50, rng);
        } else if (op == 2) {
          kvret_seq *fa = nullptr, *fb = nullptr;
          test::twin::fork_both(a, b, fa, fb);
          append_both(fa, fb, 30, 700 + static_cast<uint64_t>(step));
          expect_same_index(fa, fb, at + " fork");
          std::swap(a, fa);
          std::swap(b, fb);
          test::expect_ok(kvret_seq_close(fa));
          test::expect_ok(kvret_seq_close(fb));
        } else if (op == 3) {
          test::twin::reopen_both(dev_ctx.get(), cpu_ctx.get(), a, b,
                                  "kmdev-" + std::to_string(kv) + "-" + std::to_string(step));
        } else if (op == 4) {
          append_both(a, b, 40 + static_cast<int64_t>(rng() % 120), 900 + static_cast<uint64_t>(step));  // a chunk
        } else if (op < 30) {
          for (int t = 0; t < 6; ++t) append_both(a, b, 1, 2000 + static_cast<uint64_t>(step * 8 + t));  // decodes
          decode_segments += cluster_of(a, 0).segments().size() > before;
        } else {
          const int32_t layer = static_cast<int32_t>(rng() % 2);
          const int64_t middle = length - 4 - 16;
          const int32_t budget = 1 + static_cast<int32_t>(rng() % static_cast<uint64_t>(middle));
          const std::vector<float> q = test::random_vector(8 * kDim, 5000 + static_cast<uint64_t>(step), 2.0f);
          const test::twin::Selected x = test::twin::select(a, KVRET_DEVICE_CUDA, layer, q, budget, budget, true);
          const test::twin::Selected y = test::twin::select(b, KVRET_DEVICE_CPU, layer, q, budget, budget, true);
          ASSERT_EQ(x.count, y.count) << at;
          ASSERT_EQ(x.positions, y.positions) << at;
          expect_same_floats(x.scores, y.scores, at + " scores");
        }
        expect_same_index(a, b, at);
        if (::testing::Test::HasFatalFailure()) return;
      }
      EXPECT_GT(decode_segments, 10) << "decode intervals were clustered";
      test::expect_ok(kvret_seq_close(a));
      test::expect_ok(kvret_seq_close(b));
    }
  }
}

}  // namespace

namespace {

/// The bytes of segments [from, end) of a CLUSTER index, every head: centroids, sizes, offsets, ids, singletons.
int64_t segment_bytes(const ClusterRetriever& c, size_t from) {
  int64_t clusters = 0, tokens = 0, exacts = 0;
  for (size_t s = from; s < c.segments().size(); ++s) {
    const ClusterRetriever::Segment& g = c.segments()[s];
    clusters += g.clusters;
    tokens += g.end - g.begin;
    exacts += g.exacts;
  }
  return c.n_kv_heads() * 4 *
         (clusters * c.head_dim() + 2 * clusters + (from == 0 ? 1 : 0) + tokens + exacts * c.head_dim());
}

/// After a long prefill's copy, a decode interval sends its own clusters only: exactly the bytes of its segment,
/// a small part of a full copy; a truncate back into the prefill's segments sends nothing; selects stay equal.
TEST_F(ClusterDeviceIndex, MirrorSendsOnlyWhatADecodeIntervalAdded) {
  for (const float exact : {0.0f, 0.1f}) {
    SCOPED_TRACE(exact);
    kvret_config dc = build_config(KVRET_DEVICE_CUDA, KVRET_KV_F32, exact),
                 cc = build_config(KVRET_DEVICE_CPU, KVRET_KV_F32, exact);
    dc.cluster_segment_tokens = cc.cluster_segment_tokens = 0;
    auto dev_ctx = test::make_context(dc), cpu_ctx = test::make_context(cc);
    const Backend& backend = context_from_handle(dev_ctx.get())->backend();
    kvret_seq *a = nullptr, *b = nullptr;
    test::twin::open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
    append_both(a, b, 3000, 77);
    const std::vector<float> q = test::random_vector(8 * kDim, 78, 2.0f);
    const auto select_both = [&](const std::string& at) {
      const test::twin::Selected x = test::twin::select(a, KVRET_DEVICE_CUDA, 0, q, 200, 200, true);
      const test::twin::Selected y = test::twin::select(b, KVRET_DEVICE_CPU, 0, q, 200, 200, true);
      ASSERT_EQ(x.positions, y.positions) << at;
      expect_same_floats(x.scores, y.scores, at);
    };
    int64_t sent = backend.cluster_upload_bytes();
    select_both("prefill");
    const int64_t full = backend.cluster_upload_bytes() - sent;
    const ClusterRetriever& c = cluster_of(a, 0);
    EXPECT_EQ(full, segment_bytes(c, 0)) << "the first copy is the whole index";
    for (int interval = 0; interval < 8; ++interval) {
      const size_t before = c.segments().size();
      for (int t = 0; t < 24; ++t) append_both(a, b, 1, 5000 + static_cast<uint64_t>(interval * 24 + t));
      ASSERT_EQ(c.segments().size(), before + 1) << "one decode interval clustered";
      sent = backend.cluster_upload_bytes();
      select_both("interval " + std::to_string(interval));
      const int64_t step = backend.cluster_upload_bytes() - sent;
      EXPECT_EQ(step, segment_bytes(c, before)) << "interval " << interval;
      EXPECT_LT(step * 50, full) << "interval " << interval;
    }
    // a truncate to a segment boundary drops the decode segments: nothing to send
    const int64_t to = c.segments()[1].begin + dc.n_local;  // the middle then ends where segment 1 begins
    test::expect_ok(kvret_seq_truncate(a, to));
    test::expect_ok(kvret_seq_truncate(b, to));
    sent = backend.cluster_upload_bytes();
    select_both("truncated");
    EXPECT_EQ(cluster_of(a, 0).segments().size(), 1u);
    EXPECT_EQ(backend.cluster_upload_bytes(), sent);
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

}  // namespace
