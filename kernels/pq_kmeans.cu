// Host launchers of the GPU k-means (pq_kmeans.cuh): the Lloyd loop, with cuBLAS for the two GEMMs.
#include <algorithm>

#include "dispatch.cuh"
#include "math/handle_binding.h"
#include "pq_kmeans.cuh"
#include "pq_kmeans.h"

namespace kvret::cuda {

namespace {

constexpr int64_t kCrossBlockFloats = int64_t{1} << 24;  // 64 MiB of x.c per chunk
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

/// The workspace, carved in a fixed order.
struct KmeansWorkspace {
  float* point_norms;     // [P, n]
  float* centroid_norms;  // [P, k]
  int32_t* counts;        // [P, k]
  float* sums;            // [P, k, dim]
  float* cross;           // [P, chunk, k]
  double* objective_sum;  // [P]
  size_t bytes;
};

KmeansWorkspace carve(const KmeansParams& p, void* base) {
  const auto P = static_cast<size_t>(p.n_problems);
  const auto n = static_cast<size_t>(p.n_points);
  const auto k = static_cast<size_t>(p.k);
  const auto dim = static_cast<size_t>(p.dim);
  const auto chunk = static_cast<size_t>(kmeans_chunk_points(p));
  auto* bytes = static_cast<char*>(base);
  size_t at = 0;
  auto take = [&](size_t size) {
    char* ptr = bytes == nullptr ? nullptr : bytes + at;
    at += align_up(size);
    return ptr;
  };
  KmeansWorkspace ws{};
  ws.point_norms = reinterpret_cast<float*>(take(P * n * sizeof(float)));
  ws.centroid_norms = reinterpret_cast<float*>(take(P * k * sizeof(float)));
  ws.counts = reinterpret_cast<int32_t*>(take(P * k * sizeof(int32_t)));
  ws.sums = reinterpret_cast<float*>(take(P * k * dim * sizeof(float)));
  ws.cross = reinterpret_cast<float*>(take(P * chunk * k * sizeof(float)));
  ws.objective_sum = reinterpret_cast<double*>(take(P * sizeof(double)));
  ws.bytes = at;
  return ws;
}

bool valid(const KmeansParams& p) {
  return p.n_problems >= 0 && p.n_problems <= 65535 && p.n_points > 0 && p.dim > 0 && p.k > 0 && p.k <= p.n_points &&
         p.k <= 65535 && p.iters >= 0 && p.iter_offset >= 0;
}

/// cuBLAS for math::ScopedHandleBinding: the caller's handle gets its stream and pointer mode back on every exit.
struct CublasApi {
  using Handle = cublasHandle_t;
  using Stream = cudaStream_t;
  using Mode = cublasPointerMode_t;
  using Status = cublasStatus_t;
  static constexpr Status kSuccess = CUBLAS_STATUS_SUCCESS;
  static Status get_stream(Handle h, Stream* s) { return cublasGetStream(h, s); }
  static Status set_stream(Handle h, Stream s) { return cublasSetStream(h, s); }
  static Status get_mode(Handle h, Mode* m) { return cublasGetPointerMode(h, m); }
  static Status set_mode(Handle h, Mode m) { return cublasSetPointerMode(h, m); }
};

cudaError_t from_cublas(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return cudaSuccess;
    case CUBLAS_STATUS_ALLOC_FAILED:
      return cudaErrorMemoryAllocation;
    case CUBLAS_STATUS_INVALID_VALUE:
      return cudaErrorInvalidValue;
    default:
      return cudaErrorUnknown;
  }
}

}  // namespace

int32_t kmeans_chunk_points(const KmeansParams& params) noexcept {
  if (params.n_problems <= 0 || params.k <= 0 || params.n_points <= 0) return 0;
  const int64_t fit = kCrossBlockFloats / (static_cast<int64_t>(params.n_problems) * params.k);
  return static_cast<int32_t>(std::clamp<int64_t>(fit, 1, params.n_points));
}

size_t kmeans_workspace_bytes(const KmeansParams& params) noexcept {
  if (!valid(params) || params.n_problems == 0) return 0;
  return carve(params, nullptr).bytes;
}

cudaError_t launch_kmeans(cublasHandle_t cublas, const KmeansParams& params, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  using namespace kmeans_detail;
  const KmeansParams& p = params;
  if (!valid(p)) return cudaErrorInvalidValue;
  if (p.n_problems == 0 || (p.iters == 0 && p.init_indices == nullptr)) return cudaSuccess;
  if (p.points == nullptr || p.centroids == nullptr) return cudaErrorInvalidValue;
  if (p.iters > 0 && (cublas == nullptr || p.assignments == nullptr || workspace == nullptr ||
                      workspace_bytes < kmeans_workspace_bytes(p))) {
    return cudaErrorInvalidValue;
  }
  const KmeansWorkspace ws = carve(p, workspace);
  const auto problems = static_cast<unsigned>(p.n_problems);
  const int64_t chunk = kmeans_chunk_points(p);
  cudaError_t err = cudaSuccess;

  if (p.init_indices != nullptr) {
    init_centroids_kernel<<<dim3(static_cast<unsigned>(p.k), problems), 128, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.iters == 0) return cudaSuccess;

  // The caller's stream and pointer mode are saved here and restored by `binding` on every return below.
  math::ScopedHandleBinding<CublasApi> binding(cublas);
  err = from_cublas(binding.bind(stream, CUBLAS_POINTER_MODE_HOST));
  if (err != cudaSuccess) return err;

  const int64_t n_point_rows = static_cast<int64_t>(p.n_problems) * p.n_points;
  row_norms_kernel<<<static_cast<unsigned>(ceil_div(n_point_rows, kWarps)), kThreads, 0, stream>>>(
      p.points, n_point_rows, p.dim, ws.point_norms);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  const int64_t n_centroid_rows = static_cast<int64_t>(p.n_problems) * p.k;
  const float one = 1.0f;
  const float zero = 0.0f;
  for (int t = 0; t < p.iters; ++t) {
    row_norms_kernel<<<static_cast<unsigned>(ceil_div(n_centroid_rows, kWarps)), kThreads, 0, stream>>>(
        p.centroids, n_centroid_rows, p.dim, ws.centroid_norms);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    if ((err = cudaMemsetAsync(ws.counts, 0, static_cast<size_t>(n_centroid_rows) * sizeof(int32_t), stream)) !=
        cudaSuccess) {
      return err;
    }
    if ((err = cudaMemsetAsync(ws.objective_sum, 0, static_cast<size_t>(p.n_problems) * sizeof(double), stream)) !=
        cudaSuccess) {
      return err;
    }
    for (int64_t begin = 0; begin < p.n_points; begin += chunk) {
      const auto len = static_cast<int>(std::min<int64_t>(chunk, p.n_points - begin));
      const float* x = p.points + begin * p.dim;
      // cross[prob, i, c] = x_i . c_c: in column-major terms (k x len) = C^T(k x dim) * X(dim x len).
      err = from_cublas(cublasSgemmStridedBatched(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.k, len, p.dim, &one, p.centroids,
                                                  p.dim, static_cast<long long>(p.k) * p.dim, x, p.dim,
                                                  static_cast<long long>(p.n_points) * p.dim, &zero, ws.cross, p.k,
                                                  chunk * p.k, p.n_problems));
      if (err != cudaSuccess) return err;
      assign_kernel<<<dim3(static_cast<unsigned>(ceil_div(len, kWarps)), problems), kThreads, 0, stream>>>(
          p, static_cast<int>(begin), len, static_cast<int>(chunk), ws.cross, ws.point_norms, ws.centroid_norms,
          ws.counts, ws.objective_sum);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
      // sums[prob, c, :] (+)= sum_i onehot[i, c] x_i: column-major (dim x k) = X(dim x len) * O^T(len x k).
      const float beta = begin == 0 ? 0.0f : 1.0f;
      err = from_cublas(cublasSgemmStridedBatched(
          cublas, CUBLAS_OP_N, CUBLAS_OP_T, p.dim, p.k, len, &one, x, p.dim, static_cast<long long>(p.n_points) * p.dim,
          ws.cross, p.k, chunk * p.k, &beta, ws.sums, p.dim, static_cast<long long>(p.k) * p.dim, p.n_problems));
      if (err != cudaSuccess) return err;
    }
    update_kernel<<<dim3(static_cast<unsigned>(p.k), problems), 128, 0, stream>>>(p, t, ws.sums, ws.counts,
                                                                                  ws.objective_sum);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return from_cublas(binding.restore());
}

cudaError_t launch_pq_training_points(const PqTrainingPointsParams& params, cudaStream_t stream) {
  using namespace kmeans_detail;
  const PqTrainingPointsParams& p = params;
  if (p.n_points < 0 || p.n_kv_heads <= 0 || !supported_head_dim(p.head_dim) || p.pq_m <= 0 ||
      p.head_dim % p.pq_m != 0 || p.key_token_stride < 0 || p.key_head_stride < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.n_points == 0) return cudaSuccess;
  if (p.keys == nullptr || p.points == nullptr) return cudaErrorInvalidValue;
  const int64_t problems = static_cast<int64_t>(p.n_kv_heads) * p.pq_m;
  if (problems > 65535) return cudaErrorInvalidValue;
  const int64_t head_stride = p.key_head_stride > 0 ? p.key_head_stride : p.head_dim;
  const int64_t token_stride =
      p.key_token_stride > 0 ? p.key_token_stride : static_cast<int64_t>(p.n_kv_heads) * p.head_dim;
  const int64_t elems = static_cast<int64_t>(p.n_points) * (p.head_dim / p.pq_m);
  const dim3 grid(static_cast<unsigned>(ceil_div(elems, kThreads)), static_cast<unsigned>(problems));
  return dispatch_elem_type(p.key_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    training_points_kernel<T><<<grid, kThreads, 0, stream>>>(p, token_stride, head_stride);
    return cudaGetLastError();
  });
}

}  // namespace kvret::cuda
