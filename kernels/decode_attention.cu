// Host launchers of the decode attention (decode_attention.cuh): compile-time dispatch on head_dim and the KV type.
#include <algorithm>
#include <cmath>

#include "decode_attention.cuh"
#include "decode_attention.h"
#include "dispatch.cuh"
#include "math/kv_math.h"

namespace kvret::cuda {

namespace {

constexpr int64_t kTargetChunks = 256;  // about two thread blocks per multiprocessor of an H100
constexpr int64_t kMinRowsPerSplit = 64;

bool valid(const DecodeAttentionParams& p) {
  return p.n_seqs >= 0 && p.n_seqs <= 65535 && p.n_kv_heads > 0 && p.n_kv_heads <= 65535 && p.n_q_heads > 0 &&
         p.n_q_heads % p.n_kv_heads == 0 && p.n_q_heads / p.n_kv_heads <= kDecodeAttentionMaxGroup &&
         supported_head_dim(p.head_dim) && p.max_rows >= 0 && p.rows_per_split >= 0 && p.rows_per_split % 32 == 0;
}

int64_t n_splits(const DecodeAttentionParams& p, int64_t rows_per_split) {
  return std::max<int64_t>(1, ceil_div(p.max_rows, rows_per_split));
}

/// Whether the current device gives the chunk kernel its static and dynamic shared memory in one block. Devices of
/// compute capability 8.6 and 8.9 allow 99 KiB, less than head_dim 256 with f32 keys and values takes (148 KiB);
/// 8.0 allows 163 KiB, 9.0 and 10.0 227 KiB. False when the device cannot be asked.
bool fits_device(const DecodeAttentionParams& p) noexcept {
  using namespace attention_detail;
  const size_t static_bytes = p.head_dim == 64    ? kChunkStaticSmemBytes<64>
                              : p.head_dim == 128 ? kChunkStaticSmemBytes<128>
                                                  : kChunkStaticSmemBytes<256>;
  const size_t bytes =
      static_bytes + math::attention_kv_smem_bytes(p.head_dim, static_cast<int32_t>(elem_size(p.kv_type)));
  if (bytes <= 48 * 1024) return true;  // every device
  int device = 0;
  int optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return bytes <= static_cast<size_t>(optin);
}

}  // namespace

int32_t decode_attention_rows_per_split(const DecodeAttentionParams& params) noexcept {
  if (params.rows_per_split > 0) return params.rows_per_split;
  const int64_t pairs = std::max<int64_t>(1, static_cast<int64_t>(params.n_seqs) * params.n_kv_heads);
  const int64_t splits = std::max<int64_t>(1, kTargetChunks / pairs);
  const int64_t rows = ceil_div(std::max<int64_t>(params.max_rows, 1), splits);
  return static_cast<int32_t>(std::max(kMinRowsPerSplit, ceil_div(rows, 32) * 32));
}

size_t decode_attention_workspace_bytes(const DecodeAttentionParams& params) noexcept {
  if (!valid(params) || params.n_seqs == 0 || !fits_device(params)) return 0;
  const auto slots = static_cast<size_t>(params.n_seqs) * static_cast<size_t>(params.n_q_heads) *
                     static_cast<size_t>(n_splits(params, decode_attention_rows_per_split(params)));
  const size_t out_bytes = (slots * static_cast<size_t>(params.head_dim) * sizeof(float) + 255) / 256 * 256;
  return out_bytes + slots * sizeof(float2);
}

cudaError_t launch_decode_attention(const DecodeAttentionParams& params, void* workspace, size_t workspace_bytes,
                                    cudaStream_t stream) {
  using namespace attention_detail;
  const DecodeAttentionParams& p = params;
  if (!valid(p)) return cudaErrorInvalidValue;
  if (p.n_seqs == 0) return cudaSuccess;
  if (p.seqs == nullptr || workspace == nullptr || !math::aligned16(workspace) ||
      workspace_bytes < decode_attention_workspace_bytes(p)) {
    return cudaErrorInvalidValue;
  }
  const int rows_per_split = decode_attention_rows_per_split(p);
  const int splits = static_cast<int>(n_splits(p, rows_per_split));
  const size_t slots = static_cast<size_t>(p.n_seqs) * static_cast<size_t>(p.n_q_heads) * static_cast<size_t>(splits);
  Partials partials{};
  partials.out = static_cast<float*>(workspace);
  partials.max_sum = reinterpret_cast<float2*>(
      static_cast<char*>(workspace) + (slots * static_cast<size_t>(p.head_dim) * sizeof(float) + 255) / 256 * 256);
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  const dim3 chunk_grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.n_kv_heads),
                        static_cast<unsigned>(p.n_seqs));
  const dim3 merge_grid(static_cast<unsigned>(p.n_q_heads), static_cast<unsigned>(p.n_seqs));
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    return dispatch_elem_type(p.kv_type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const size_t smem = math::attention_kv_smem_bytes(kHeadDim, static_cast<int32_t>(sizeof(T)));
      cudaError_t err = prepare_dynamic_smem<chunk_kernel<kHeadDim, T>>(smem);
      if (err != cudaSuccess) return err;
      chunk_kernel<kHeadDim, T><<<chunk_grid, kThreads, smem, stream>>>(p, scale, rows_per_split, splits, partials);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      merge_kernel<kHeadDim><<<merge_grid, kThreads, 0, stream>>>(p, rows_per_split, splits, partials);
      return cudaGetLastError();
    });
  });
}

}  // namespace kvret::cuda
