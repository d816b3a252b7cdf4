// traces.hpp — loads the real-model Q/K/V traces written by tools/traces/make_traces.py for kvret-eval.
//
// A trace directory holds meta.json and, per recorded layer LL, q.LL.npy [T, Hq, D], k.LL.npy [T, Hkv, D],
// v.LL.npy [T, Hkv, D] (after RoPE), optionally q_pre.LL.npy / k_pre.LL.npy (before RoPE), in f16 or f32.
//
// kvret takes head_dim 64, 128 or 256. A model with another head_dim is zero-padded to the next of them: dot products
// are unchanged, and queries are multiplied by sqrt(padded / original) so that kvret's logit scale 1/sqrt(padded)
// gives the model's own 1/sqrt(original).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvret::eval {

/// A C-order float16/float32 .npy array, converted to f32.
struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
NpyArray load_npy(const std::string& path);  ///< throws std::runtime_error with the path and the reason

struct TraceMeta {
  std::string model;
  int n_q_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t tokens = 0;
  std::vector<int> layers;
  bool pre_rope = false;
  double rope_theta = 10000.0;       ///< meta.json's rope_theta
  bool rope_adjacent_pairs = false;  ///< rope_layout "adjacent pairs" (GPT-J's layout), else NeoX's halves
};

/// One layer of a trace in kvret's layout, head_dim padded (see above).
struct TraceLayer {
  int padded_dim = 0;
  std::vector<float> q, k, v;       ///< [T, H, padded_dim]; q pre-scaled
  std::vector<float> q_pre, k_pre;  ///< the same before RoPE, when the trace has them
};

class Trace {
 public:
  explicit Trace(std::string dir);  ///< reads meta.json; throws std::runtime_error
  const TraceMeta& meta() const noexcept { return meta_; }
  int padded_dim() const noexcept;
  TraceLayer layer(int layer, bool with_pre_rope) const;

 private:
  std::string dir_;
  TraceMeta meta_;
};

}  // namespace kvret::eval
