#pragma once
// The CUDA backend's select for the CLUSTER index (docs/cuda_backend.md), as per-element functors for Thrust passes:
// compiled for the device by nvcc and for the host on Thrust's OpenMP system. The math is
// kernels/math/cluster_math.h, the functions the CPU retriever (src/index/cluster_retriever.cpp) is tested against,
// so both compute the same bits.
//
// A KV head's G groups are its C clusters, its E exact singletons and its P pending decode tokens, in that order.
// One select of one (sequence, layer) is these passes, around page_select_ops.hpp's shared ones:
//   PageLoadQuery      q into f32 [n_q_heads, d]
//   ClusterLogits      the scaled logit of every (query head, group): q . mu, or q . k for a singleton
//   ClusterSoftmaxes   KVRET_FOLD_SUM_PROB: per query head the maximum, the terms and the inverse normaliser
//   PageFold           per (KV head, group) the folded score, its order key and its index
//   (the two stable sorts: per head the groups best first)
//   ClusterSortedWeights  the tokens of each group in that order
//   (inclusive scan, PageTake, exclusive scan: the tokens taken from each group and where they go)
//   ClusterPick        per taken token the key (head, position) and its group's score
//   (sort by key: per head the positions ascending)
//   TopWrite           the positions and their scores into the caller's tensors
#include <cstddef>
#include <cstdint>

#include "backend/page_select_ops.hpp"
#include "math/cluster_math.h"

namespace kvret::device_math {

/// The device mirror of one (sequence, layer)'s clusters, all heads side by side (every head has the same counts),
/// each head's part of an array `*_stride` elements (rows) after the previous head's (room for decode intervals).
struct ClusterLayout {
  const float* centroids;     ///< [heads, cluster_stride, d]
  const int32_t* sizes;       ///< [heads, cluster_stride]
  const int32_t* offsets;     ///< [heads, cluster_stride + 1]
  const int32_t* ids;         ///< [heads, id_stride]: positions sorted by cluster, ascending within one
  const int32_t* exact_pos;   ///< [heads, exact_stride]
  const float* exact_keys;    ///< [heads, exact_stride, d]
  const float* pending_keys;  ///< [heads, P, d]: this select's pending tail
  int64_t clusters, ids_per_head, exacts, pending, first_pending;
  int64_t cluster_stride, id_stride, exact_stride;
  int32_t d;
  KVRET_BACKEND_HD int64_t groups() const { return clusters + exacts + pending; }
  /// The row [d] scored for group u of head h.
  KVRET_BACKEND_HD const float* row(int64_t h, int64_t u) const {
    if (u < clusters) return centroids + (h * cluster_stride + u) * d;
    u -= clusters;
    if (u < exacts) return exact_keys + (h * exact_stride + u) * d;
    return pending_keys + (h * pending + u - exacts) * d;
  }
  KVRET_BACKEND_HD int32_t weight(int64_t h, int64_t u) const {
    return pm::cluster_weight(sizes + h * cluster_stride, clusters, u);
  }
  /// Position t (< the group's weight) of group u of head h: a cluster's are ascending.
  KVRET_BACKEND_HD int32_t position(int64_t h, int64_t u, int64_t t) const {
    if (u < clusters) return ids[h * id_stride + offsets[h * (cluster_stride + 1) + u] + t];
    u -= clusters;
    if (u < exacts) return exact_pos[h * exact_stride + u];
    return static_cast<int32_t>(first_pending + u - exacts);
  }
};

// The passes below run over one select or a fused batch of them (job after job, one layout per job): each job's
// rows are `width` groups wide, the most groups of any job; a job's groups past its own are padding (logit -inf,
// no tokens).

struct ClusterLogits {
  const ClusterLayout* layouts;  ///< per job
  const float* q;                ///< [jobs * n_kv_heads * group, d]
  float* logits;                 ///< [jobs * n_kv_heads * group, width]
  int64_t width, q_heads;        ///< q_heads: per job
  int32_t group;
  float scale;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / width, u = i % width;
    const ClusterLayout& l = layouts[row / q_heads];
    logits[i] =
        u < l.groups() ? pm::cluster_logit(scale, q + row * l.d, l.row(row % q_heads / group, u), l.d) : pm::neg_inf();
  }
};

struct ClusterSoftmaxes {
  const ClusterLayout* layouts;
  float* logits;         ///< [jobs * n_q_heads, width]: replaced by the softmax's terms
  pm::PageSoftmax* out;  ///< [jobs * n_q_heads]
  int64_t width, q_heads;
  int32_t group;
  KVRET_BACKEND_HD void operator()(int64_t row) const {
    const ClusterLayout& l = layouts[row / q_heads];
    out[row] = pm::cluster_softmax_terms(logits + row * width, l.groups(),
                                         l.sizes + row % q_heads / group * l.cluster_stride, l.clusters);
  }
};

/// The tokens of each sorted group (0 for the padding).
struct ClusterSortedWeights {
  const ClusterLayout* layouts;
  const int64_t* index;
  int64_t* weight;
  int64_t width, heads;  ///< heads: KV heads per job
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t segment = index[i] / width, u = index[i] % width;
    const ClusterLayout& l = layouts[segment / heads];
    weight[i] = u < l.groups() ? l.weight(segment % heads, u) : 0;
  }
};

/// Per (job, KV head, group): its taken tokens as keys segment << 32 | position, with the group's score, at the
/// group's offset in its head's row of `budget` entries.
struct ClusterPick {
  const ClusterLayout* layouts;
  const int64_t* taken;   ///< [jobs * n_kv_heads, width]
  const int64_t* offset;  ///< exclusive scan of taken per head
  const float* folded;
  uint64_t* keys;  ///< [jobs * n_kv_heads, budget]
  float* score;    ///< [jobs * n_kv_heads, budget]
  int64_t width, heads, budget;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t segment = i / width, u = i % width;
    const ClusterLayout& l = layouts[segment / heads];
    for (int64_t t = 0; t < taken[i]; ++t) {
      const int64_t at = segment * budget + offset[i] + t;
      keys[at] = static_cast<uint64_t>(segment) << 32 | static_cast<uint32_t>(l.position(segment % heads, u, t));
      score[at] = folded[i];
    }
  }
};

}  // namespace kvret::device_math
