#pragma once
// GPU k-means for the PQ sub-spaces: many independent problems (one per KV head and sub-space) in one batch of
// Lloyd iterations, with cuBLAS SGEMM for the distance cross terms and for the centroid sums.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernel_types.h"

namespace kvret::cuda {

/// Inputs and outputs of launch_kmeans. Every pointer is device memory.
///
/// Iteration t (t = 0 .. iters-1, global number it = iter_offset + t) of problem p:
///  1. assignment: every point goes to its nearest centroid by ||x||^2 - 2 x.c + ||c||^2 (exact ties: the lower
///     index); objective[p * iters + t] = the sum over points of that distance (clamped at 0), accumulated in f64;
///  2. update: a centroid becomes the mean of its points; a centroid with no point is reseeded to the point
///     kmeans_reseed_index(c, it, n_points).
/// `assignments` holds the last iteration's step 1, `centroids` the last step 2.
struct KmeansParams {
  int32_t n_problems = 0;
  int32_t n_points = 0;
  int32_t dim = 0;
  int32_t k = 0;  ///< clusters, 1 .. n_points
  int32_t iters = 0;
  int32_t iter_offset = 0;  ///< global number of the first iteration (only the reseeding rule uses it)

  const float* points = nullptr;          ///< [n_problems, n_points, dim]
  const int32_t* init_indices = nullptr;  ///< [n_problems, k] Forgy init: centroid c = points[p, init[p, c]];
                                          ///< nullptr: continue from the centroids already in `centroids`
  float* centroids = nullptr;             ///< [n_problems, k, dim]
  int32_t* assignments = nullptr;         ///< [n_problems, n_points]
  float* objective = nullptr;             ///< optional [n_problems, iters]
};

/// The point an empty cluster is reseeded to at global iteration `iteration`; a fixed hash, so that a CPU k-means
/// can follow the GPU's trajectory exactly.
KVRET_HOST_DEVICE constexpr int64_t kmeans_reseed_index(int32_t cluster, int32_t iteration, int64_t n_points) {
  uint64_t h = (static_cast<uint64_t>(cluster) + 1u) * 0x9E3779B97F4A7C15ull;
  h ^= (static_cast<uint64_t>(iteration) + 1u) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return static_cast<int64_t>(h % static_cast<uint64_t>(n_points));
}

/// Points per GEMM chunk launch_kmeans uses: the distance block [n_problems, chunk, k] stays under 64 MiB.
int32_t kmeans_chunk_points(const KmeansParams& params) noexcept;

/// Device workspace launch_kmeans needs.
size_t kmeans_workspace_bytes(const KmeansParams& params) noexcept;

/// Enqueues `iters` Lloyd iterations on `stream`. `cublas` is a handle of the current device; the launcher binds it
/// to `stream` with the host pointer mode for its GEMMs and gives it back with the caller's stream and pointer mode
/// on every return (math::ScopedHandleBinding); it uses the handle's math mode as set (the default is
/// full-precision f32). The assignment distance and its tie rule are math::kmeans_distance and
/// math::nearer_centroid. Errors of
/// cuBLAS come back as cudaErrorUnknown (cudaErrorMemoryAllocation for its allocation failures). For an adaptive
/// stop, call it with iters = 1 and init_indices = nullptr after the first call, reading the objective in between.
cudaError_t launch_kmeans(cublasHandle_t cublas, const KmeansParams& params, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

/// Inputs and outputs of launch_pq_training_points: the training matrices of every (KV head, sub-space).
/// points[(h * pq_m + j) * n_points + i, 0 .. sub) = keys[token_i, h, j * sub .. (j+1) * sub) in f32, with token_i =
/// sample[i] (or i when sample is nullptr). Problem p = h * pq_m + j matches the centroid layout
/// [n_kv_heads, pq_m, 2^bits, sub] of the PQ kernels.
struct PqTrainingPointsParams {
  int32_t n_points = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t pq_m = 0;
  ElemType key_type = ElemType::kF16;
  const void* keys = nullptr;       ///< [tokens, n_kv_heads, head_dim] by default strides
  int64_t key_token_stride = 0;     ///< elements; 0 means n_kv_heads * head_dim
  int64_t key_head_stride = 0;      ///< elements; 0 means head_dim
  const int32_t* sample = nullptr;  ///< optional [n_points] token indices
  float* points = nullptr;          ///< [n_kv_heads * pq_m, n_points, head_dim / pq_m]
};

cudaError_t launch_pq_training_points(const PqTrainingPointsParams& params, cudaStream_t stream);

}  // namespace kvret::cuda
