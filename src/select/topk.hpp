#pragma once
#include <cstdint>

namespace kvret {

/// Writes base + i for the k largest scores[i] (ties: the lower i first), in ascending order, to out.
/// Requires 0 <= k <= n.
void topk_positions(const float* scores, int64_t n, int64_t k, int64_t base, int32_t* out);

}  // namespace kvret
