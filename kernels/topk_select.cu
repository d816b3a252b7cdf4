// Host launcher of the batched top-k (topk_select.cuh).
#include <atomic>

#include "topk_select.cuh"
#include "topk_select.h"

namespace kvret::cuda {

namespace {

/// Whether the code of topk_cluster_kernel loaded for the current device was compiled for sm_90 or newer (its
/// cudaFuncAttributes::ptxVersion, the virtual architecture of the SASS or PTX the device runs). A build that carries
/// code for an older architecture only runs it on a newer device too, and then only the one-block path is compiled
/// in. Remembered per device.
cudaError_t device_has_clusters(bool* out) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};  // 0: not asked yet, 1: no clusters, 2: clusters
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    cudaFuncAttributes attributes{};
    if ((err = cudaFuncGetAttributes(&attributes, topk_detail::topk_cluster_kernel)) != cudaSuccess) return err;
    state = attributes.ptxVersion >= topk_detail::kClusterMinArch ? 2 : 1;
    known[device].store(state, std::memory_order_relaxed);
  }
  *out = state == 2;
  return cudaSuccess;
}

}  // namespace

cudaError_t topk_uses_clusters(bool* uses) {
  if (uses == nullptr) return cudaErrorInvalidValue;
  return device_has_clusters(uses);
}

cudaError_t launch_topk_positions(const TopkParams& params, cudaStream_t stream, TopkPath path) {
  if (params.n_seqs < 0 || params.n_kv_heads <= 0 || params.k < 0 || params.positions_stride < params.k ||
      params.score_stride < 0 || (path != TopkPath::kAuto && path != TopkPath::kBlocks)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(params.n_seqs) * params.n_kv_heads;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff || params.scores == nullptr || params.n_tokens == nullptr ||
      (params.k > 0 && params.positions == nullptr)) {
    return cudaErrorInvalidValue;
  }
  bool clusters = false;
  if (path == TopkPath::kAuto) {
    const cudaError_t err = device_has_clusters(&clusters);
    if (err != cudaSuccess) return err;
  }
  if (!clusters) {
    topk_detail::topk_block_kernel<<<static_cast<unsigned>(rows), topk_detail::kThreads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  // One cluster of kClusterSize blocks per row.
  if (rows * topk_detail::kClusterSize > 0x7fffffff) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(rows * topk_detail::kClusterSize));
  config.blockDim = dim3(topk_detail::kThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = topk_detail::kClusterSize;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, topk_detail::topk_cluster_kernel, params);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kvret::cuda
