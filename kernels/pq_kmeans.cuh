#pragma once
// Kernels of launch_kmeans and launch_pq_training_points (see pq_kmeans.h). The GEMMs are cuBLAS calls in the
// launcher; these kernels do the parts around them: norms, the argmin that also rewrites the distance block as a
// one-hot matrix (the input of the centroid-sum GEMM), the centroid update with reseeding, and the point gather.
#include "device_util.cuh"
#include "math/pq_math.h"
#include "pq_kmeans.h"

namespace kvret::cuda::kmeans_detail {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;

/// centroids[p, c, :] = points[p, init[p, c], :]. Grid (k, n_problems).
__global__ void init_centroids_kernel(KmeansParams p) {
  const int c = static_cast<int>(blockIdx.x);
  const int prob = static_cast<int>(blockIdx.y);
  const int64_t src = p.init_indices[static_cast<int64_t>(prob) * p.k + c];
  const float* from = p.points + (static_cast<int64_t>(prob) * p.n_points + src) * p.dim;
  float* to = p.centroids + (static_cast<int64_t>(prob) * p.k + c) * p.dim;
  for (int d = static_cast<int>(threadIdx.x); d < p.dim; d += blockDim.x) to[d] = from[d];
}

/// norms[r] = ||rows[r, :]||^2, one warp per row.
__global__ void __launch_bounds__(kThreads) row_norms_kernel(const float* rows, int64_t n_rows, int dim, float* norms) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (r >= n_rows) return;  // whole warps leave together
  const float* row = rows + r * dim;
  float sum = 0.0f;
  for (int d = lane; d < dim; d += 32) sum = fmaf(row[d], row[d], sum);
  sum = warp_sum(sum);
  if (lane == 0) norms[r] = sum;
}

/// Assignment of the points [begin, begin + len) of every problem; one warp per point. `cross` is the GEMM block
/// [n_problems, chunk, k] of x.c; it is overwritten with the one-hot matrix of the assignment.
/// Grid (ceil(len / kWarps), n_problems).
__global__ void __launch_bounds__(kThreads)
    assign_kernel(KmeansParams p, int begin, int len, int chunk, float* cross, const float* point_norms,
                  const float* centroid_norms, int32_t* counts, double* objective_sum) {
  __shared__ double block_sum;
  const int prob = static_cast<int>(blockIdx.y);
  const int i = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (threadIdx.x == 0) block_sum = 0.0;
  __syncthreads();
  if (i < len) {
    float* row = cross + (static_cast<int64_t>(prob) * chunk + i) * p.k;
    const float* cnorm = centroid_norms + static_cast<int64_t>(prob) * p.k;
    const float xnorm = point_norms[static_cast<int64_t>(prob) * p.n_points + begin + i];
    float best = __int_as_float(0x7f800000);
    int best_c = p.k;
    for (int c = lane; c < p.k; c += 32) {
      const float dist = math::kmeans_distance(xnorm, row[c], cnorm[c]);
      if (math::nearer_centroid(dist, c, best, best_c)) {
        best = dist;
        best_c = c;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_c = __shfl_xor_sync(0xffffffffu, best_c, offset);
      if (math::nearer_centroid(other, other_c, best, best_c)) {
        best = other;
        best_c = other_c;
      }
    }
    if (best_c >= p.k) best_c = 0;  // only NaN distances get here
    for (int c = lane; c < p.k; c += 32) row[c] = c == best_c ? 1.0f : 0.0f;
    if (lane == 0) {
      p.assignments[static_cast<int64_t>(prob) * p.n_points + begin + i] = best_c;
      atomicAdd(&counts[static_cast<int64_t>(prob) * p.k + best_c], 1);
      atomicAdd(&block_sum, static_cast<double>(fmaxf(best, 0.0f)));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(&objective_sum[prob], block_sum);
}

/// centroid = sums / count, or the reseed point when the cluster is empty; also stores the objective of the
/// iteration. Grid (k, n_problems).
__global__ void update_kernel(KmeansParams p, int t, const float* sums, const int32_t* counts,
                              const double* objective_sum) {
  const int c = static_cast<int>(blockIdx.x);
  const int prob = static_cast<int>(blockIdx.y);
  const int64_t cluster = static_cast<int64_t>(prob) * p.k + c;
  const int count = counts[cluster];
  float* centroid = p.centroids + cluster * p.dim;
  if (count > 0) {
    const float inv = 1.0f / static_cast<float>(count);
    const float* sum = sums + cluster * p.dim;
    for (int d = static_cast<int>(threadIdx.x); d < p.dim; d += blockDim.x) centroid[d] = sum[d] * inv;
  } else {
    const int64_t src = kmeans_reseed_index(c, p.iter_offset + t, p.n_points);
    const float* point = p.points + (static_cast<int64_t>(prob) * p.n_points + src) * p.dim;
    for (int d = static_cast<int>(threadIdx.x); d < p.dim; d += blockDim.x) centroid[d] = point[d];
  }
  if (c == 0 && threadIdx.x == 0 && p.objective != nullptr) {
    p.objective[static_cast<int64_t>(prob) * p.iters + t] = static_cast<float>(objective_sum[prob]);
  }
}

/// See PqTrainingPointsParams. Grid (ceil(n_points * sub / kThreads), n_kv_heads * pq_m).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    training_points_kernel(PqTrainingPointsParams p, int64_t token_stride, int64_t head_stride) {
  const int sub = p.head_dim / p.pq_m;
  const int prob = static_cast<int>(blockIdx.y);
  const int h = prob / p.pq_m;
  const int j = prob % p.pq_m;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= static_cast<int64_t>(p.n_points) * sub) return;
  const int i = static_cast<int>(e / sub);
  const int d = static_cast<int>(e % sub);
  const int64_t token = p.sample != nullptr ? p.sample[i] : i;
  const T* keys = static_cast<const T*>(p.keys);
  p.points[(static_cast<int64_t>(prob) * p.n_points + i) * sub + d] =
      to_float(keys[token * token_stride + h * head_stride + j * sub + d]);
}

}  // namespace kvret::cuda::kmeans_detail
