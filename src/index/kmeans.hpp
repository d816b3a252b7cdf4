#pragma once
// Lloyd's k-means in squared L2, the trainer of PQ codebooks.
//
// Init: Forgy — k distinct points drawn uniformly with the seed (as FAISS does); with fewer than k points every
// point is a centroid and the rest repeat them. Each iteration assigns every point to its nearest centroid, records
// the objective (sum of squared distances), then moves each centroid to the mean of its points. An emptied centroid
// is re-seeded at the point farthest from its own centroid; no other centroid moves, so the objective never rises.
// Iterations: a fixed count, or adaptive — stop once an iteration improves the objective by less than `tol`
// (relative), after at most max_iters.
#include <cstdint>
#include <vector>

namespace kvret {

struct KmeansOptions {
  int k = 64;
  int max_iters = 25;
  bool adaptive = true;
  float tol = 1e-3f;
  uint64_t seed = 42;
  bool parallel = true;  ///< parallelize the assignment with OpenMP (no effect inside a parallel region)
};

struct KmeansResult {
  std::vector<float> centroids;   ///< [k, d]
  std::vector<double> objective;  ///< after each iteration's assignment step
  int iterations = 0;
};

/// Clusters n points of dimension d (row i at x + i * x_stride).
KmeansResult kmeans(const float* x, int64_t n, int d, int64_t x_stride, const KmeansOptions& options);

/// Forgy initialization: out [k, d] = k of the n points (rows of x, x_stride apart) drawn without repeats by a
/// partial Fisher-Yates shuffle seeded with `seed` (points repeat, in the same order, when n < k).
void forgy_init(const float* x, int64_t n, int d, int64_t x_stride, int k, uint64_t seed, float* out);

/// The points forgy_init copies, in order: out[j] (j < k) is the index of centroid j's point (n > 0).
std::vector<int64_t> forgy_indices(int64_t n, int k, uint64_t seed);

/// For each of n points (row i at x + i * x_stride) the index of the nearest of k centroids ([k, d] row-major),
/// written to codes[i]; the squared distance to it to distances[i] when distances is not NULL.
template <class Code>
void assign_nearest(const float* x, int64_t n, int d, int64_t x_stride, const float* centroids, int k, Code* codes,
                    float* distances, bool parallel);

}  // namespace kvret
