#include "select/gqa_fold.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvret {

void fold_weighted_logits(const float* logits, const int32_t* weight, int group, int64_t n, kvret_gqa_fold fold,
                          float* folded) {
  const float lowest = -std::numeric_limits<float>::infinity();
  if (fold == KVRET_FOLD_MAX_LOGIT) {
    std::fill(folded, folded + n, lowest);
    for (int g = 0; g < group; ++g) {
      const float* l = logits + g * n;
      for (int64_t u = 0; u < n; ++u) folded[u] = std::max(folded[u], l[u]);
    }
    return;
  }
  std::fill(folded, folded + n, 0.0f);
  for (int g = 0; g < group; ++g) {
    const float* l = logits + g * n;
    float mx = lowest;
    for (int64_t u = 0; u < n; ++u)
      if (!weight || weight[u] > 0) mx = std::max(mx, l[u]);
    double z = 0;
    for (int64_t u = 0; u < n; ++u)
      if (!weight || weight[u] > 0) z += static_cast<double>(weight ? weight[u] : 1) * std::exp(l[u] - mx);
    if (z <= 0) continue;
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t u = 0; u < n; ++u) folded[u] += std::exp(l[u] - mx) * inv;
  }
}

void fold_logits(const float* logits, int group, int64_t n, kvret_gqa_fold fold, float* folded) {
  fold_weighted_logits(logits, nullptr, group, n, fold, folded);
}

}  // namespace kvret
