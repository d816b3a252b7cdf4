#pragma once
// Kernels of launch_topk_positions (see topk_select.h). One algorithm, two ways to spread a row over blocks:
//
// - topk_cluster_kernel (sm_90 and newer): one thread-block cluster of kClusterSize blocks per row (Hopper
//   distributed shared memory); each block owns one contiguous slice of the row, so even a batch of one sequence
//   keeps 8 x n_kv_heads multiprocessors busy.
// - topk_block_kernel (every architecture; the path of sm_80 and sm_89, which have no clusters): one block per row,
//   the same code with a "cluster" of one block whose shared memory is its own.
//
// Both run the same steps, so their selections are identical, ties included:
// 1. Radix select over the scores' order keys, 11 + 11 + 10 bits: in each pass every block builds a histogram of
//    its slice's keys that match the bits fixed so far (shared-memory atomics, warp-aggregated with
//    __match_any_sync); after a group barrier every block adds up the group's histograms (read through
//    distributed shared memory) and runs the same cub::BlockScan over them, so all blocks find the same digit in
//    which the kk-th largest key lies. Histograms are double-buffered: one group barrier per pass.
// 2. Each block counts its keys above the threshold and equal to it; the blocks exchange these counts, which gives
//    every block where its output starts and how many threshold-equal keys come before its slice.
// 3. Each block compacts its slice in index order (one cub::BlockScan per tile), so the selection comes out
//    ascending with no sort: keys above the threshold, and threshold-equal keys while fewer than `need` were taken.
#include <cooperative_groups.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "device_util.cuh"
#include "math/topk_math.h"
#include "topk_select.h"

namespace kvret::cuda::topk_detail {

inline constexpr int kClusterSize = 8;      // blocks per row of topk_cluster_kernel
inline constexpr int kClusterMinArch = 90;  // clusters: sm_90 and newer
inline constexpr int kThreads = 512;
inline constexpr int kLoadUnroll = 4;  // histogram: keys loaded per thread before their atomics
inline constexpr int kItemsPerThread = 8;
inline constexpr int kTile = kThreads * kItemsPerThread;  // compaction tile; < 2^16 (packed scan)
inline constexpr int kPasses = math::kTopkPasses;
inline constexpr int kBins = 1 << 11;
inline constexpr int kBinsPerThread = kBins / kThreads;
static_assert(kBinsPerThread * kThreads == kBins);

using Scan = cub::BlockScan<int, kThreads>;
using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
union TempStorage {
  typename Scan::TempStorage scan;
  typename Reduce::TempStorage reduce;
};
/// Static shared memory of the kernel: the scan/reduce storage, the double-buffered histograms, four scalars.
inline constexpr size_t kStaticSmemBytes =
    sizeof(TempStorage) + sizeof(int) * 2 * kBins + 3 * sizeof(int) + sizeof(unsigned long long);
static_assert(kStaticSmemBytes <= 24 * 1024, "top-k: static shared memory over its 24 KiB budget");

/// The blocks that share one row: a thread-block cluster (sm_90 and newer) ...
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
struct ClusterGroup {
  static constexpr int kSize = kClusterSize;
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  __device__ int rank() const { return static_cast<int>(cluster.block_rank()); }
  __device__ void sync() { cluster.sync(); }
  template <typename T>
  __device__ T* map(T* shared, int r) {
    return cluster.map_shared_rank(shared, r);
  }
};
#endif

/// ... or one block alone (every architecture), whose "group" shared memory is its own.
struct BlockGroup {
  static constexpr int kSize = 1;
  __device__ int rank() const { return 0; }
  __device__ void sync() { __syncthreads(); }
  template <typename T>
  __device__ T* map(T* shared, int) {
    return shared;
  }
};

/// The selection of one row by the Group::kSize blocks of `group`.
template <typename Group>
__device__ __forceinline__ void topk_row(const TopkParams& p, Group group, int row) {
  __shared__ TempStorage temp;
  __shared__ int hist[2][kBins];
  __shared__ int s_digit;
  __shared__ int s_digit_count;
  __shared__ int s_count_above;
  __shared__ unsigned long long s_slice_counts;  // this block's (above | equal << 32), read by the whole group

  const int rank = group.rank();
  const int s = row / p.n_kv_heads;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int n = math::topk_clamp_count(p.n_tokens[s], p.score_stride);  // never past the row
  const int kk = min(p.k, n);
  if (rank == 0 && row % p.n_kv_heads == 0 && tid == 0 && p.counts != nullptr) p.counts[s] = kk;
  if (kk <= 0) return;  // the whole group returns: no distributed shared memory was touched
  const float* scores = p.scores + static_cast<size_t>(row) * p.score_stride;
  const int slice = (n + Group::kSize - 1) / Group::kSize;
  const int begin = min(n, rank * slice);
  const int end = min(n, begin + slice);

  // ---- 1. radix select: (prefix, mask) of the threshold, and how many keys equal to it to take ----
  uint32_t prefix = 0;
  uint32_t mask = 0;
  int need = kk;
  for (int pass = 0; pass < kPasses && kk < n; ++pass) {
    const int shift = math::topk_pass_shift(pass);
    const uint32_t digit_mask = math::topk_digit_mask(pass);
    int* my_hist = hist[pass & 1];
    for (int b = tid; b < kBins; b += kThreads) my_hist[b] = 0;
    __syncthreads();
    for (int base = begin; base < end; base += kThreads * kLoadUnroll) {
      uint32_t keys[kLoadUnroll];
#pragma unroll
      for (int u = 0; u < kLoadUnroll; ++u) {
        const int idx = base + u * kThreads + tid;
        keys[u] = idx < end ? math::topk_order_key(scores[idx]) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kLoadUnroll; ++u) {
        const int idx = base + u * kThreads + tid;
        const int bin =
            idx < end && (keys[u] & mask) == prefix ? static_cast<int>(math::topk_digit(keys[u], pass)) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, bin);  // lanes with the same bin add once
        if (bin >= 0 && lane == __ffs(peers) - 1) atomicAdd(&my_hist[bin], __popc(peers));
      }
    }
    group.sync();  // every block's histogram of this pass is complete and visible

    // Thread t owns the bins kBins-1-4t .. kBins-4-4t (descending), summed over the group.
    int total[kBinsPerThread] = {};
    for (int r = 0; r < Group::kSize; ++r) {
      const int* remote = group.map(&hist[pass & 1][0], r);
#pragma unroll
      for (int i = 0; i < kBinsPerThread; ++i) total[i] += remote[kBins - 1 - (tid * kBinsPerThread + i)];
    }
    int at_or_above[kBinsPerThread];
    Scan(temp.scan).InclusiveSum(total, at_or_above);
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      if (math::radix_bin_holds(at_or_above[i], total[i], need)) {
        s_digit = kBins - 1 - (tid * kBinsPerThread + i);
        s_digit_count = total[i];
        s_count_above = at_or_above[i] - total[i];
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s_digit) << shift;
    mask |= digit_mask << shift;
    need -= s_count_above;
    const bool done = s_digit_count == need;  // every key with this digit is taken: lower bits do not matter
    __syncthreads();                          // s_* and temp are rewritten by the next pass
    if (done) break;
  }

  // ---- 2. this block's keys above / equal to the threshold, exchanged across the group ----
  unsigned long long mine = 0;
  for (int idx = begin + tid; idx < end; idx += kThreads) {
    const uint32_t key = math::topk_order_key(scores[idx]) & mask;
    mine += key > prefix ? 1ull : key == prefix ? (1ull << 32) : 0ull;
  }
  mine = Reduce(temp.reduce).Sum(mine);
  if (tid == 0) s_slice_counts = mine;
  group.sync();         // also ends every block's reads of the others' histograms
  int out_carry = 0;    // indices written by the blocks before this one (then: by this block's earlier tiles)
  int equal_carry = 0;  // threshold-equal keys before this block's slice (then: before the current tile)
  int my_quota = 0;     // indices this block writes
  for (int r = 0; r <= rank; ++r) {
    const unsigned long long counts = *group.map(&s_slice_counts, r);
    const int above = static_cast<int>(counts & 0xffffffffu);
    const int equal = static_cast<int>(counts >> 32);
    const int taken = above + min(equal_carry + equal, need) - min(equal_carry, need);
    if (r < rank) {
      out_carry += taken;
      equal_carry += equal;
    } else {
      my_quota = taken;
    }
  }
  group.sync();     // no block touches another's shared memory after this: blocks may finish independently
  __syncthreads();  // temp.reduce is reused as temp.scan below
  const int out_end = out_carry + my_quota;

  // ---- 3. order-preserving compaction of this block's slice ----
  int32_t* out = p.positions + static_cast<size_t>(row) * p.positions_stride;
  const int32_t offset = p.position_offset != nullptr ? p.position_offset[s] : 0;
  for (int base = begin; base < end && out_carry < out_end; base += kTile) {
    bool above[kItemsPerThread];
    bool equal[kItemsPerThread];
    int n_above = 0;
    int n_equal = 0;
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {  // blocked: thread tid owns indices base + tid*8 + i
      const int idx = base + tid * kItemsPerThread + i;
      const uint32_t key = idx < end ? math::topk_order_key(scores[idx]) & mask : 0u;
      above[i] = idx < end && key > prefix;
      equal[i] = idx < end && key == prefix;
      n_above += above[i] ? 1 : 0;
      n_equal += equal[i] ? 1 : 0;
    }
    int before = 0;  // (above | equal << 16) of the lower threads of the tile
    int tile = 0;
    Scan(temp.scan).ExclusiveSum(n_above | (n_equal << 16), before, tile);
    __syncthreads();
    int equal_rank = equal_carry + (before >> 16);
    int out_index = out_carry + (before & 0xffff) + min(equal_rank, need) - min(equal_carry, need);
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {
      const bool take = above[i] || (equal[i] && equal_rank < need);
      equal_rank += equal[i] ? 1 : 0;
      if (take) out[out_index++] = base + tid * kItemsPerThread + i + offset;
    }
    const int tile_equal = tile >> 16;
    out_carry += (tile & 0xffff) + min(equal_carry + tile_equal, need) - min(equal_carry, need);
    equal_carry += tile_equal;
  }
}

/// One cluster of kClusterSize blocks per row. Compiled for sm_90 and newer; for an older target its body is empty
/// and launch_topk_positions never launches it (it reads the architecture the loaded code was compiled for).
__global__ void __launch_bounds__(kThreads) topk_cluster_kernel(TopkParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ClusterGroup group;
  if (group.cluster.num_blocks() != kClusterSize) __trap();  // launched without its cluster: fail loudly
  topk_row(p, group, static_cast<int>(blockIdx.x) / kClusterSize);
#endif
}

/// One block per row: every architecture.
__global__ void __launch_bounds__(kThreads) topk_block_kernel(TopkParams p) {
  topk_row(p, BlockGroup{}, static_cast<int>(blockIdx.x));
}

}  // namespace kvret::cuda::topk_detail
