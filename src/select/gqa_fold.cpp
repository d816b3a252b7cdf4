#include "select/gqa_fold.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/vec_math.hpp"

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
  // Sum of softmax probabilities. One exp per entry and head; every loop below vectorizes.
  std::fill(folded, folded + n, 0.0f);
  std::vector<float> e(static_cast<size_t>(n));
  for (int g = 0; g < group; ++g) {
    const float* l = logits + g * n;
    float mx = lowest;
    if (weight) {
      for (int64_t u = 0; u < n; ++u) mx = std::max(mx, weight[u] > 0 ? l[u] : lowest);
    } else {
      for (int64_t u = 0; u < n; ++u) mx = std::max(mx, l[u]);
    }
    if (!(mx > lowest)) continue;
    for (int64_t u = 0; u < n; ++u) e[static_cast<size_t>(u)] = exp_nonpositive(l[u] - mx);
    double z = 0;
    if (weight) {
      float zf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t u = 0;
      for (; u + 8 <= n; u += 8)
        for (int i = 0; i < 8; ++i) zf[i] += static_cast<float>(weight[u + i]) * e[static_cast<size_t>(u + i)];
      for (float x : zf) z += x;
      for (; u < n; ++u) z += static_cast<double>(weight[u]) * e[static_cast<size_t>(u)];
    } else {
      for (int64_t u = 0; u < n; ++u) z += e[static_cast<size_t>(u)];
    }
    if (z <= 0) continue;
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t u = 0; u < n; ++u) folded[u] += e[static_cast<size_t>(u)] * inv;
  }
}

void fold_logits(const float* logits, int group, int64_t n, kvret_gqa_fold fold, float* folded) {
  fold_weighted_logits(logits, nullptr, group, n, fold, folded);
}

}  // namespace kvret
