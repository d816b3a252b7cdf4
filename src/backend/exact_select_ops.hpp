#pragma once
// The CUDA backend's select for the EXACT index (the quality oracle; docs/cuda_backend.md), as per-element functors
// for Thrust passes: compiled for the device by nvcc and for the host on Thrust's OpenMP system. The math is
// kernels/math/exact_math.h, the dot product in the order of the CPU retriever's (src/index/exact_retriever.cpp), so
// both compute the same bits.
//
// EXACT keeps no device copy: the keys are read in place from the layer's KV store, whose pages are pinned,
// device-mapped host memory on this backend (HostKvStore's layout: a page of kPageTokens tokens holds the keys of
// every head, head after head, then the values). One select of one (sequence, layer), over the n middle tokens, is
// these passes, around the token top-k that QUANT's select shares (cuda_backend.cu's select_top and top_and_write):
//   PageLoadQuery   q into f32 [n_q_heads, d]
//   ExactLogits     per (KV head, middle token) its key read from its page (converted to f32), and the logit
//                   scale * q . k of each query head of the group
//   QuantSoftmaxes, TokenFold, the top-k (the tuned kernel, or its reference passes), TopkWrite: the fold, the
//   top-k, the positions ascending per head with their folded scores
#include <cstddef>
#include <cstdint>

#include "backend/device_math.hpp"
#include "math/exact_math.h"

namespace kvret::device_math {

/// The key rows of one layer's store as the device addresses them.
struct ExactKeyPages {
  const std::byte* const* pages;  ///< [pages]: each page's first byte, device-readable
  int64_t page_tokens;            ///< tokens per page
  int64_t row_bytes;              ///< bytes of one (token, head) row
  int32_t type;                   ///< the store's element type (ElemType)
  /// The key row of (KV head h, position p).
  KVRET_BACKEND_HD const std::byte* key_row(int64_t h, int64_t p) const {
    return pages[p / page_tokens] + (h * page_tokens + p % page_tokens) * row_bytes;
  }
};

/// Per (job, KV head, entry t < width): for a middle token of the job (t < n_of[job]), logits [job][h * group +
/// g][t] = scale * q[job][h * group + g] . k for each of the group's query heads, k the key at base_of[job] + t as
/// f32 (read once for the group); -inf for the padding past the job's middle (a fused batch's shorter rows).
struct ExactLogits {
  const ExactKeyPages* keys;  ///< per job
  const float* q;             ///< [jobs, n_q_heads, d]
  float* logits;              ///< [jobs, n_q_heads, width]
  const int64_t* n_of;        ///< per job its middle tokens
  const int64_t* base_of;     ///< per job its first middle position
  int64_t width, heads;
  int32_t d, group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t t = i % width, segment = i / width, job = segment / heads, h = segment % heads;
    float* out = logits + segment * group * width + t;
    if (t >= n_of[job]) {
      for (int32_t g = 0; g < group; ++g) out[g * width] = kvret::cuda::math::neg_inf();
      return;
    }
    const ExactKeyPages& k = keys[job];
    const std::byte* row = k.key_row(h, base_of[job] + t);
    float converted[256];  // head_dim <= 256
    const float* key = reinterpret_cast<const float*>(row);
    if (k.type != kF32) {
      for (int32_t c = 0; c < d; ++c) converted[c] = load_f32(row, k.type, c);
      key = converted;
    }
    const float* qs = q + segment * group * d;
    for (int32_t g = 0; g < group; ++g) out[g * width] = kvret::cuda::math::exact_logit(scale, qs + g * d, key, d);
  }
};

}  // namespace kvret::device_math
