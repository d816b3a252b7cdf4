#pragma once
// Per-element and decision math of CLUSTER's cosine k-means (src/index/cluster_retriever.cpp: cosine_kmeans and a
// segment's layout), shared by the CPU build and the CUDA backend's device build (src/backend/cluster_build_ops.hpp),
// so that both compute the same bits:
// - a key's unit row: its squared norm summed in double in element order, each element times 1 / sqrt of it (a zero
//   or non-finite norm gives the zero row);
// - the cosine of a unit row and a direction: dot8's order (scaled_dots with scale 1, which the CPU's blocked
//   assignment computes); the assignment: the direction of largest cosine, ties to the lower index;
// - the centroid update: per cluster and element the sum, in double, of its points' elements in point order; the
//   direction is that sum times 1 / sqrt of its squared norm (summed in double in element order), kept as it was
//   when the norm is 0;
// - an exact singleton's fit: its key's cosine to its cluster's direction in double, NaN as -2 (the lowest fits are
//   kept out of the clusters);
// - the scoring centroid: the double sum of a cluster's keys times 1 / its size, rounded to float.
// Every double operation that could be contracted goes through hd.h's d*_rn helpers.
#include <cmath>

#include "page_math.h"

namespace kvret::cuda::math {

/// The correctly rounded square root (IEEE on both sides).
KVRET_HD double kmeans_sqrt(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

/// x <= DBL_MAX, written so that it holds for no NaN and no infinity.
KVRET_HD bool kmeans_finite_positive(double s) { return s > 0 && s <= 1.7976931348623157e308; }

/// out [d] = row [d] / |row| (the squared norm summed in double in order), or zeros when it is 0 or not finite.
KVRET_HD void kmeans_unit_row(const float* row, int d, float* out) {
  double s = 0;
  for (int t = 0; t < d; ++t) s = dadd_rn(s, dmul_rn(static_cast<double>(row[t]), static_cast<double>(row[t])));
  if (kmeans_finite_positive(s)) {
    const double inv = 1.0 / kmeans_sqrt(s);
    for (int t = 0; t < d; ++t) out[t] = static_cast<float>(dmul_rn(static_cast<double>(row[t]), inv));
  } else {
    for (int t = 0; t < d; ++t) out[t] = 0.0f;
  }
}

/// The cosine of a unit row and a unit direction (the assignment's GEMM entry).
KVRET_HD float kmeans_cosine(const float* unit, const float* direction, int d) { return dot8(unit, direction, d); }

/// The index of the largest of k scores (ties: the lowest index; the assignment's argmax).
KVRET_HD int32_t kmeans_argmax(const float* score, int k) {
  int32_t best = 0;
  for (int32_t j = 1; j < k; ++j)
    if (score[j] > score[best]) best = j;
  return best;
}

/// One step of a cluster's element sum (start from 0.0, points in order).
KVRET_HD double kmeans_sum_step(double acc, float x) { return dadd_rn(acc, static_cast<double>(x)); }

/// A cluster's new direction from its element sums s [d]: s / |s| into c [d]; false (c unchanged) when |s| is 0.
KVRET_HD bool kmeans_direction(const double* s, int d, float* c) {
  double norm = 0;
  for (int t = 0; t < d; ++t) norm = dadd_rn(norm, dmul_rn(s[t], s[t]));
  if (!(norm > 0)) return false;
  const double inv = 1.0 / kmeans_sqrt(norm);
  for (int t = 0; t < d; ++t) c[t] = static_cast<float>(dmul_rn(s[t], inv));
  return true;
}

/// The fit of a key [d] to its cluster's direction [d]: (key . dir) / |key| in double, 0 for a zero or non-finite
/// key, -2 for NaN (the exact singletons are the lowest fits, ties to the earlier position).
KVRET_HD float kmeans_fit(const float* key, const float* dir, int d) {
  double dot = 0, norm = 0;
  for (int t = 0; t < d; ++t) {
    dot = dadd_rn(dot, dmul_rn(static_cast<double>(key[t]), static_cast<double>(dir[t])));
    norm = dadd_rn(norm, dmul_rn(static_cast<double>(key[t]), static_cast<double>(key[t])));
  }
  const float cos = norm > 0 && norm <= 1.7976931348623157e308 ? static_cast<float>(dot / kmeans_sqrt(norm)) : 0.0f;
  return cos != cos ? -2.0f : cos;
}

/// A scoring centroid's element: the cluster's double sum of that element times 1 / size (size > 0).
KVRET_HD float kmeans_mean(double sum, int32_t size) {
  const double inv = 1.0 / static_cast<double>(size);
  return static_cast<float>(dmul_rn(sum, inv));
}

}  // namespace kvret::cuda::math
