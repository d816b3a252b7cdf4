// Host launcher of the PQ code assignment (pq_encode.cuh).
#include "dispatch.cuh"
#include "pq_encode.cuh"
#include "pq_encode.h"

namespace kvret::cuda {

cudaError_t launch_pq_encode(const PqEncodeParams& params, cudaStream_t stream) {
  using namespace pq_encode_detail;
  const PqEncodeParams& p = params;
  if (p.n_tokens < 0 || p.n_kv_heads <= 0 || !supported_head_dim(p.head_dim) || p.pq_m <= 0 ||
      p.head_dim % p.pq_m != 0 || p.pq_bits < 1 || p.pq_bits > 8 || p.key_token_stride < 0 || p.key_head_stride < 0 ||
      p.code_head_stride < static_cast<int64_t>(p.n_tokens) * p.pq_m) {
    return cudaErrorInvalidValue;
  }
  if (p.n_tokens == 0) return cudaSuccess;
  if (p.keys == nullptr || p.centroids == nullptr || p.codes == nullptr) return cudaErrorInvalidValue;
  const int64_t head_stride = p.key_head_stride > 0 ? p.key_head_stride : p.head_dim;
  const int64_t token_stride =
      p.key_token_stride > 0 ? p.key_token_stride : static_cast<int64_t>(p.n_kv_heads) * p.head_dim;
  const int64_t problems = static_cast<int64_t>(p.n_kv_heads) * p.pq_m;
  if (problems > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n_tokens, kTokensPerBlock)), static_cast<unsigned>(problems));
  const size_t smem = smem_bytes(p.head_dim / p.pq_m);
  return dispatch_elem_type(p.key_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cudaError_t err = prepare_dynamic_smem<pq_encode_kernel<T>>(smem);
    if (err != cudaSuccess) return err;
    pq_encode_kernel<T><<<grid, kThreads, smem, stream>>>(p, token_stride, head_stride);
    return cudaGetLastError();
  });
}

}  // namespace kvret::cuda
