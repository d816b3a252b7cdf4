#pragma once
// Reference attention over a working set, on the CPU: the body of kvret_attend and of kvret_seq_attend.
#include <cstdint>

#include "core/tensor_view.hpp"
#include "kvret.h"

namespace kvret {

/// out[h] = softmax(s * q[h] . k[g(h)]^T) v[g(h)] over the first `rows` rows, g(h) = h / (n_q_heads / n_kv_heads),
/// s = scale, or 1/sqrt(head_dim) when scale <= 0. q: [n_q_heads, head_dim]; k, v: [n_kv_heads, >= rows,
/// head_dim] (f16, bf16 or f32); out: f32 [n_q_heads, head_dim]. Checks every shape against `config` first
/// (KVRET_ERR_SHAPE, KVRET_ERR_INVALID_ARGUMENT for rows < 1 or a non-finite scale); writes only out.
/// attend's argument checks alone (KVRET_ERR_SHAPE, KVRET_ERR_INVALID_ARGUMENT), for every backend's attention.
void check_attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                  int64_t rows, float scale, const TensorView& out);
/// The softmax scale attend uses: `scale`, or 1/sqrt(head_dim) when scale <= 0.
float attend_scale(const kvret_config& config, float scale) noexcept;

void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
            float scale, const TensorView& out, int n_threads);

}  // namespace kvret
