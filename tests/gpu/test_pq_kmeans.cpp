// launch_kmeans against a CPU Lloyd loop from the same Forgy init, and launch_pq_training_points against a CPU
// split of the keys.
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "gpu_test_util.h"
#include "pq_kmeans.h"

namespace kvret::cuda::testing {
namespace {

class CublasHandle {
 public:
  CublasHandle() {
    if (cublasCreate(&handle_) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() { (void)cublasDestroy(handle_); }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

struct KmeansRun {
  std::vector<float> centroids;      // [P, k, dim]
  std::vector<int32_t> assignments;  // [P, n]
  std::vector<float> objective;      // [P, iters]
};

/// The documented algorithm with exact distances in double.
KmeansRun cpu_kmeans(const std::vector<float>& points, const std::vector<int32_t>& init, int n_problems, int n, int dim,
                     int k, int iters) {
  KmeansRun run;
  run.centroids.resize(static_cast<size_t>(n_problems) * k * dim);
  run.assignments.resize(static_cast<size_t>(n_problems) * n);
  run.objective.resize(static_cast<size_t>(n_problems) * iters);
  for (int p = 0; p < n_problems; ++p) {
    const float* x = &points[static_cast<size_t>(p) * n * dim];
    float* c = &run.centroids[static_cast<size_t>(p) * k * dim];
    for (int j = 0; j < k; ++j) std::copy_n(x + static_cast<size_t>(init[p * k + j]) * dim, dim, c + j * dim);
    for (int t = 0; t < iters; ++t) {
      std::vector<double> sums(static_cast<size_t>(k) * dim, 0.0);
      std::vector<int> counts(k, 0);
      double objective = 0;
      for (int i = 0; i < n; ++i) {
        double best = std::numeric_limits<double>::infinity();
        int best_j = 0;
        for (int j = 0; j < k; ++j) {
          double d = 0;
          for (int e = 0; e < dim; ++e) {
            const double diff = static_cast<double>(x[i * dim + e]) - c[j * dim + e];
            d += diff * diff;
          }
          if (d < best) {
            best = d;
            best_j = j;
          }
        }
        run.assignments[static_cast<size_t>(p) * n + i] = best_j;
        objective += best;
        ++counts[best_j];
        for (int e = 0; e < dim; ++e) sums[best_j * dim + e] += x[i * dim + e];
      }
      run.objective[static_cast<size_t>(p) * iters + t] = static_cast<float>(objective);
      for (int j = 0; j < k; ++j) {
        for (int e = 0; e < dim; ++e) {
          c[j * dim + e] = counts[j] > 0 ? static_cast<float>(sums[j * dim + e] / counts[j])
                                         : x[kmeans_reseed_index(j, t, n) * dim + e];
        }
      }
    }
  }
  return run;
}

KmeansRun gpu_kmeans(const std::vector<float>& points, const std::vector<int32_t>& init, int n_problems, int n, int dim,
                     int k, int iters) {
  CublasHandle cublas;
  DeviceBuffer<float> d_points(points);
  DeviceBuffer<int32_t> d_init(init);
  DeviceBuffer<float> d_centroids(static_cast<size_t>(n_problems) * k * dim);
  DeviceBuffer<int32_t> d_assignments(static_cast<size_t>(n_problems) * n);
  DeviceBuffer<float> d_objective(static_cast<size_t>(n_problems) * iters);
  d_centroids.fill_bytes(0xff);
  d_assignments.fill_bytes(0xff);
  d_objective.fill_bytes(0xff);
  KmeansParams p;
  p.n_problems = n_problems;
  p.n_points = n;
  p.dim = dim;
  p.k = k;
  p.iters = iters;
  p.points = d_points.get();
  p.init_indices = d_init.get();
  p.centroids = d_centroids.get();
  p.assignments = d_assignments.get();
  p.objective = d_objective.get();
  DeviceBuffer<unsigned char> workspace(kmeans_workspace_bytes(p));
  cudaStream_t stream = nullptr;
  KVRET_CUDA_CHECK(cudaStreamCreate(&stream));
  const cudaError_t launched = launch_kmeans(cublas.get(), p, workspace.get(), workspace.size(), stream);
  const cudaError_t synced = cudaStreamSynchronize(stream);
  KVRET_CUDA_CHECK(cudaStreamDestroy(stream));
  KVRET_CUDA_CHECK(launched);
  KVRET_CUDA_CHECK(synced);
  return {d_centroids.download(), d_assignments.download(), d_objective.download()};
}

/// Well-separated Gaussian blobs: point i of a problem belongs to blob i % k; init takes blob c's first point.
void make_blobs(int n_problems, int n, int dim, int k, uint64_t seed, std::vector<float>& points,
                std::vector<int32_t>& init) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  points.resize(static_cast<size_t>(n_problems) * n * dim);
  init.resize(static_cast<size_t>(n_problems) * k);
  for (int p = 0; p < n_problems; ++p) {
    std::vector<float> centers(static_cast<size_t>(k) * dim);
    for (auto& x : centers) x = 10.0f * normal(rng);
    for (int i = 0; i < n; ++i) {
      for (int e = 0; e < dim; ++e) {
        points[(static_cast<size_t>(p) * n + i) * dim + e] = centers[(i % k) * dim + e] + 0.1f * normal(rng);
      }
    }
    for (int c = 0; c < k; ++c) init[p * k + c] = c;
  }
}

class PqKmeansTest : public GpuTest {};

TEST_F(PqKmeansTest, BlobsMatchCpuLloydFromTheSameInit) {
  const int n_problems = 3, n = 3000, dim = 16, k = 8, iters = 6;
  std::vector<float> points;
  std::vector<int32_t> init;
  make_blobs(n_problems, n, dim, k, 31, points, init);
  // One init point per blob: no point is near a tie, so the expanded GPU distances and the exact CPU ones agree
  // on every assignment, while the centroids still move from a point to their blob's mean.
  const auto cpu = cpu_kmeans(points, init, n_problems, n, dim, k, iters);
  const auto gpu = gpu_kmeans(points, init, n_problems, n, dim, k, iters);
  EXPECT_EQ(gpu.assignments, cpu.assignments);
  for (size_t i = 0; i < cpu.centroids.size(); ++i) {
    ASSERT_TRUE(close(gpu.centroids[i], cpu.centroids[i], 1e-3, 1e-4)) << "centroid element " << i;
  }
  for (size_t i = 0; i < cpu.objective.size(); ++i) {
    EXPECT_TRUE(close(gpu.objective[i], cpu.objective[i], 1e-2, 5e-3))
        << "objective " << i << ": " << gpu.objective[i] << " vs " << cpu.objective[i];
  }
}

TEST_F(PqKmeansTest, ChunkedGemmsObjectiveFallsAndCentroidsAreMeans) {
  // PQ-sized: 16 problems (8 heads x 2 sub-spaces), 256 centroids, 8192 points: two GEMM chunks.
  const int n_problems = 16, n = 8192, dim = 64, k = 256, iters = 5;
  KmeansParams shape;
  shape.n_problems = n_problems;
  shape.n_points = n;
  shape.k = k;
  ASSERT_LT(kmeans_chunk_points(shape), n);
  const auto points = random_normal<float>(static_cast<size_t>(n_problems) * n * dim, 32);
  std::vector<int32_t> init(static_cast<size_t>(n_problems) * k);
  std::mt19937_64 rng(33);
  for (int p = 0; p < n_problems; ++p) {
    std::vector<int32_t> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy_n(perm.begin(), k, init.begin() + static_cast<std::ptrdiff_t>(p) * k);
  }
  const auto gpu = gpu_kmeans(points, init, n_problems, n, dim, k, iters);
  for (int p = 0; p < n_problems; ++p) {
    for (int t = 1; t < iters; ++t) {
      EXPECT_LE(gpu.objective[p * iters + t], gpu.objective[p * iters + t - 1] * (1.0f + 1e-4f)) << "problem " << p;
    }
  }
  for (int p = 0; p < n_problems; p += 5) {
    std::vector<double> sums(static_cast<size_t>(k) * dim, 0.0);
    std::vector<int> counts(k, 0);
    for (int i = 0; i < n; ++i) {
      const int j = gpu.assignments[static_cast<size_t>(p) * n + i];
      ASSERT_GE(j, 0);
      ASSERT_LT(j, k);
      ++counts[j];
      for (int e = 0; e < dim; ++e) sums[j * dim + e] += points[(static_cast<size_t>(p) * n + i) * dim + e];
    }
    for (int j = 0; j < k; ++j) {
      if (counts[j] == 0) continue;
      for (int e = 0; e < dim; ++e) {
        EXPECT_TRUE(
            close(gpu.centroids[(static_cast<size_t>(p) * k + j) * dim + e], sums[j * dim + e] / counts[j], 1e-4, 1e-3))
            << "problem " << p << " cluster " << j;
      }
    }
  }
}

TEST_F(PqKmeansTest, EmptyClustersAreReseededByTheDocumentedRule) {
  const int n_problems = 2, n = 1000, dim = 8, k = 4, iters = 1;
  std::vector<float> points;
  std::vector<int32_t> init;
  make_blobs(n_problems, n, dim, k, 34, points, init);
  for (int p = 0; p < n_problems; ++p) init[p * k + 1] = init[p * k + 0];  // two identical centroids
  const auto gpu = gpu_kmeans(points, init, n_problems, n, dim, k, iters);
  for (int p = 0; p < n_problems; ++p) {
    std::vector<int> counts(k, 0);
    for (int i = 0; i < n; ++i) ++counts[gpu.assignments[static_cast<size_t>(p) * n + i]];
    int empty = 0;
    for (int c = 0; c < k; ++c) {
      if (counts[c] > 0) continue;
      ++empty;
      const int64_t src = kmeans_reseed_index(c, 0, n);
      for (int e = 0; e < dim; ++e) {
        EXPECT_EQ(gpu.centroids[(static_cast<size_t>(p) * k + c) * dim + e],
                  points[(static_cast<size_t>(p) * n + src) * dim + e]);
      }
    }
    EXPECT_GE(empty, 1) << "problem " << p;
  }
  for (const float x : gpu.centroids) EXPECT_TRUE(std::isfinite(x));
}

TEST_F(PqKmeansTest, TrainingPointsSplitKeysBySubspace) {
  const int n_tokens = 300, n_kv_heads = 2, head_dim = 128, pq_m = 4, n_points = 100;
  const int sub = head_dim / pq_m;
  const auto keys = random_normal<__half>(static_cast<size_t>(n_tokens) * n_kv_heads * head_dim, 35);
  std::vector<int32_t> sample(n_points);
  for (int i = 0; i < n_points; ++i) sample[i] = (i * 37) % n_tokens;
  DeviceBuffer<__half> d_keys(keys);
  DeviceBuffer<int32_t> d_sample(sample);
  DeviceBuffer<float> d_points(static_cast<size_t>(n_kv_heads) * pq_m * n_points * sub);
  PqTrainingPointsParams p;
  p.n_points = n_points;
  p.n_kv_heads = n_kv_heads;
  p.head_dim = head_dim;
  p.pq_m = pq_m;
  p.key_type = ElemType::kF16;
  p.keys = d_keys.get();
  p.sample = d_sample.get();
  p.points = d_points.get();
  KVRET_LAUNCH_AND_SYNC(launch_pq_training_points(p, nullptr));
  const auto points = d_points.download();
  for (int h = 0; h < n_kv_heads; ++h) {
    for (int j = 0; j < pq_m; ++j) {
      for (int i = 0; i < n_points; ++i) {
        for (int e = 0; e < sub; ++e) {
          const float want = to_float(keys[(static_cast<size_t>(sample[i]) * n_kv_heads + h) * head_dim + j * sub + e]);
          ASSERT_EQ(points[((static_cast<size_t>(h) * pq_m + j) * n_points + i) * sub + e], want);
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvret::cuda::testing
