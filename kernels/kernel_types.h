#pragma once
// Vocabulary shared by the CUDA launchers' declarations. No CUDA includes: the C++ core includes the launcher
// headers (*.h in kernels/) from plain .cpp files; the kernels themselves live in *.cuh, included only by *.cu.
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define KVRET_HOST_DEVICE __host__ __device__
#else
#define KVRET_HOST_DEVICE
#endif

namespace kvret::cuda {

/// Element type of keys and values; the values equal kvret_kv_dtype's.
enum class ElemType : int32_t { kF16 = 0, kBF16 = 1, kF32 = 2 };

/// How the query heads of one KV group fold into one score per token; the values equal kvret_gqa_fold's.
enum class GqaFold : int32_t { kSumProb = 0, kMaxLogit = 1 };

/// Replacement policy of the block cache; the values equal kvret_cache_policy's.
enum class CachePolicy : int32_t { kLru = 0, kLfu = 1 };

constexpr size_t elem_size(ElemType type) noexcept { return type == ElemType::kF32 ? 4 : 2; }

constexpr int64_t ceil_div(int64_t a, int64_t b) noexcept { return (a + b - 1) / b; }

/// True for the head dimensions the kernels are compiled for.
constexpr bool supported_head_dim(int32_t head_dim) noexcept {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

}  // namespace kvret::cuda
