#pragma once
// The CUDA backend's build of CLUSTER's index (one KV head's segment: cosine k-means, the exact singletons, the
// layout; docs/cuda_backend.md), as per-element functors for Thrust passes: compiled for the device by nvcc and for
// the host on Thrust's OpenMP system. The math is kernels/math/kmeans_math.h, the functions the CPU build
// (src/index/cluster_retriever.cpp: cosine_kmeans, cluster_segment_index) calls, so both compute the same bits.
//
// One segment of n keys, k clusters, m training points (n, or the sample), these passes (CudaClusterBuilder):
//   KmUnitRows        the keys' unit rows
//   KmGatherRows      the training points (a sample), then the k seeds (forgy_indices, drawn on the host)
//   per iteration:
//     KmCosineGemm    the [m, k] cosines of every point and direction: the assignment as a GEMM (a Thrust reference
//                     pass: one dot8 per entry, in the CPU's order)
//     KmArgmax        per point the max-cosine direction (ties to the lower one), its cosine, whether it changed
//     KmObjective     the sum of the cosines in point order (one thread: the CPU's double sum, bit for bit)
//     (count of changes: settled when 0, or the iteration cap)
//     (stable sort of the points by label, lower bounds: each cluster's points in point order)
//     KmClusterSums   per (cluster, element) the double sum over its points, in point order
//     (points by increasing cosine, only when a cluster emptied: the CPU's re-seeding order)
//     KmDirections    per cluster its normalized sum, or the re-seed of an emptied one
//   KmCosineGemm, KmArgmax again over every key when a sample trained
//   KmFit             per key its fit to its direction; (stable sort by fit: the lowest are the exact singletons)
//   KmLayoutKey       per key its cluster, or k for a singleton; (stable sort, lower bounds: ids, sizes, offsets)
//   KmMeans           per (cluster, element) the raw mean of its keys, in point order
#include <cstddef>
#include <cstdint>

#include "backend/page_select_ops.hpp"
#include "math/kmeans_math.h"

namespace kvret::device_math {

struct KmUnitRows {
  const float* keys;  ///< [n, d]
  float* unit;        ///< [n, d]
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const { pm::kmeans_unit_row(keys + i * d, d, unit + i * d); }
};

/// dst row i = src row index[i].
struct KmGatherRows {
  const float* src;
  const int64_t* index;
  float* dst;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    for (int32_t t = 0; t < d; ++t) dst[i * d + t] = src[index[i] * d + t];
  }
};

/// score [m, k] = unit [m, d] . directions [k, d]^T.
struct KmCosineGemm {
  const float* unit;
  const float* directions;
  float* score;
  int32_t k, d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    score[i] = pm::kmeans_cosine(unit + (i / k) * d, directions + (i % k) * d, d);
  }
};

struct KmArgmax {
  const float* score;  ///< [m, k]
  int32_t* labels;     ///< [m]: the previous labels (-1: none), replaced
  float* cosine;       ///< [m]
  int32_t* changed;    ///< [m]: 1 where the label changed
  int32_t k;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int32_t best = pm::kmeans_argmax(score + i * k, k);
    changed[i] = labels[i] != best ? 1 : 0;
    labels[i] = best;
    cosine[i] = score[i * k + best];
  }
};

/// One thread: out[0] = the sum of the m cosines in order, in double.
struct KmObjective {
  const float* cosine;
  int64_t m;
  double* out;
  KVRET_BACKEND_HD void operator()(int64_t) const {
    double s = 0;
    for (int64_t i = 0; i < m; ++i) s = pm::dadd_rn(s, static_cast<double>(cosine[i]));
    out[0] = s;
  }
};

/// sums [k, d]: per cluster j and element t the sum over its points (order[offsets[j] .. offsets[j + 1]), ascending)
/// of x[point, t], from 0.0 in that order.
struct KmClusterSums {
  const float* x;
  const int64_t* order;
  const int64_t* offsets;  ///< [k + 1]
  double* sums;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t j = i / d, t = i % d;
    double s = 0;
    for (int64_t p = offsets[j]; p < offsets[j + 1]; ++p) s = pm::kmeans_sum_step(s, x[order[p] * d + t]);
    sums[i] = s;
  }
};

/// Per cluster j: its normalized sum (unchanged for a sum of 0); an emptied one takes the point lowest[rank % m],
/// rank its place among the emptied clusters.
struct KmDirections {
  const double* sums;
  const int64_t* offsets;
  const int64_t* empty_rank;  ///< [k]
  const int64_t* lowest;      ///< [m]: points by increasing cosine (ties: the earlier), when a cluster emptied
  const float* x;
  float* directions;
  int64_t m;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t j) const {
    float* c = directions + j * d;
    if (offsets[j + 1] > offsets[j]) {
      pm::kmeans_direction(sums + j * d, d, c);
      return;
    }
    const int64_t p = lowest[empty_rank[j] % m];
    for (int32_t t = 0; t < d; ++t) c[t] = x[p * d + t];
  }
};

struct KmFit {
  const float* keys;
  const float* directions;
  const int32_t* labels;
  float* fit;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    fit[i] = pm::kmeans_fit(keys + i * d, directions + static_cast<int64_t>(labels[i]) * d, d);
  }
};

/// exact[order[i]] = 1 for the first i < e of the points sorted by fit.
struct KmMarkExact {
  const int64_t* order;
  int32_t* key;  ///< [n]: the layout keys, k for a singleton
  int32_t k;
  KVRET_BACKEND_HD void operator()(int64_t i) const { key[order[i]] = k; }
};

/// The raw mean of each cluster's keys, in point order; 0 for an empty cluster.
struct KmMeans {
  const float* keys;
  const int64_t* order;
  const int64_t* offsets;
  float* centroids;
  int32_t d;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t j = i / d, t = i % d;
    const int64_t size = offsets[j + 1] - offsets[j];
    if (size == 0) {
      centroids[i] = 0.0f;
      return;
    }
    double s = 0;
    for (int64_t p = offsets[j]; p < offsets[j + 1]; ++p) s = pm::kmeans_sum_step(s, keys[order[p] * d + t]);
    centroids[i] = pm::kmeans_mean(s, static_cast<int32_t>(size));
  }
};

}  // namespace kvret::device_math
