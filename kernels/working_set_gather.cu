// Host launcher of the working-set gather (working_set_gather.cuh): compile-time dispatch on the row size.
#include "working_set_gather.cuh"
#include "working_set_gather.h"

namespace kvret::cuda {

cudaError_t launch_working_set_gather(const WorkingSetGatherSeq* seqs, int32_t n_seqs, int32_t max_rows,
                                      const KvGeometry& geo, cudaStream_t stream) {
  using namespace gather_detail;
  if (n_seqs < 0 || max_rows < 0 || geo.n_kv_heads <= 0 || !supported_head_dim(geo.head_dim) || geo.block_tokens <= 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t pairs = static_cast<int64_t>(n_seqs) * geo.n_kv_heads;
  if (pairs == 0 || max_rows == 0) return cudaSuccess;
  if (seqs == nullptr || pairs > 65535) return cudaErrorInvalidValue;
  const int64_t vecs = kv_row_bytes(geo) / 16;
  const dim3 grid(static_cast<unsigned>(ceil_div(max_rows * vecs, kPiecesPerBlock)), static_cast<unsigned>(pairs));
  switch (vecs) {
    case 8:
      gather_kernel<8><<<grid, kThreads, 0, stream>>>(seqs, geo, max_rows);
      break;
    case 16:
      gather_kernel<16><<<grid, kThreads, 0, stream>>>(seqs, geo, max_rows);
      break;
    case 32:
      gather_kernel<32><<<grid, kThreads, 0, stream>>>(seqs, geo, max_rows);
      break;
    case 64:
      gather_kernel<64><<<grid, kThreads, 0, stream>>>(seqs, geo, max_rows);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvret::cuda
