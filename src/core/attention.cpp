#include "core/attention.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/vec_math.hpp"

namespace kvret {

void check_attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                  int64_t rows, float scale, const TensorView& out) {
  require(rows >= 1, KVRET_ERR_INVALID_ARGUMENT, "rows must be >= 1, got " + std::to_string(rows));
  q.expect_dim(0, config.n_q_heads, "n_q_heads");
  q.expect_dim(1, config.head_dim, "head_dim");
  for (const auto* t : {&k, &v}) {
    t->expect_dim(0, config.n_kv_heads, "n_kv_heads");
    t->expect_dim_at_least(1, rows, "rows");
    t->expect_dim(2, config.head_dim, "head_dim");
  }
  out.expect_dim(0, config.n_q_heads, "n_q_heads");
  out.expect_dim(1, config.head_dim, "head_dim");
  require(std::isfinite(scale), KVRET_ERR_INVALID_ARGUMENT, "scale is not finite");
}

float attend_scale(const kvret_config& config, float scale) noexcept {
  return scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(config.head_dim));
}

void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
            float scale, const TensorView& out, int n_threads) {
  check_attend(config, q, k, v, rows, scale, out);
  const int d = config.head_dim;
  const float s = attend_scale(config, scale);
  const int group = config.n_q_heads / config.n_kv_heads;
  // One KV head per task: its rows are converted to f32 once and shared by the group's query heads.
  parallel_for(config.n_kv_heads, n_threads, rows * config.n_q_heads >= 8192, Schedule::kStatic, [&](int64_t g_i) {
    const auto g = static_cast<int>(g_i);
    std::vector<float> keys(static_cast<size_t>(rows * d)), values(static_cast<size_t>(rows * d));
    for (int64_t r = 0; r < rows; ++r) {
      k.load_f32(k.at({g, r}), static_cast<size_t>(d), keys.data() + r * d);
      v.load_f32(v.at({g, r}), static_cast<size_t>(d), values.data() + r * d);
    }
    std::vector<float> qf(static_cast<size_t>(d)), acc(static_cast<size_t>(d)), p(static_cast<size_t>(rows));
    for (int h = g * group; h < (g + 1) * group; ++h) {
      q.load_f32(q.at({h}), static_cast<size_t>(d), qf.data());
      float mx = -INFINITY;
      for (int64_t r = 0; r < rows; ++r) {
        p[static_cast<size_t>(r)] = s * dot(qf.data(), keys.data() + r * d, d);
        mx = std::max(mx, p[static_cast<size_t>(r)]);
      }
      double z = 0;
      for (int64_t r = 0; r < rows; ++r)
        z += (p[static_cast<size_t>(r)] = exp_nonpositive(p[static_cast<size_t>(r)] - mx));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float w = p[static_cast<size_t>(r)];
        const float* vr = values.data() + r * d;
        for (int t = 0; t < d; ++t) acc[static_cast<size_t>(t)] += w * vr[t];
      }
      auto* o = reinterpret_cast<float*>(out.at({h}));
      const float inv = static_cast<float>(1.0 / z);
      for (int t = 0; t < d; ++t) o[t] = acc[static_cast<size_t>(t)] * inv;
    }
  });
}

}  // namespace kvret
