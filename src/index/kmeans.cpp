#include "index/kmeans.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/vec_math.hpp"

namespace kvret {

namespace {

constexpr int kMaxK = 256;

/// Centroids transposed ([d, k]) with -|c|^2 / 2, so that argmax_c (x.c - |c|^2/2) is the nearest centroid and the
/// inner loop runs over k contiguous floats (vectorizes without reassociation).
struct CentroidPanel {
  std::vector<float> transposed;
  std::vector<float> bias;
  CentroidPanel(const float* c, int k, int d) : transposed(static_cast<size_t>(k) * d), bias(k) {
    for (int j = 0; j < k; ++j) {
      float norm = 0;
      for (int t = 0; t < d; ++t) {
        transposed[static_cast<size_t>(t) * k + j] = c[static_cast<size_t>(j) * d + t];
        norm += c[static_cast<size_t>(j) * d + t] * c[static_cast<size_t>(j) * d + t];
      }
      bias[j] = -0.5f * norm;
    }
  }
};

__attribute__((target_clones("avx2", "default"))) int nearest_one(const float* x, int d, const float* transposed,
                                                                   const float* bias, int k) {
  alignas(64) float score[kMaxK];
  std::memcpy(score, bias, sizeof(float) * static_cast<size_t>(k));
  for (int t = 0; t < d; ++t) {
    const float xt = x[t];
    const float* row = transposed + static_cast<size_t>(t) * k;
    for (int j = 0; j < k; ++j) score[j] += xt * row[j];
  }
  int best = 0;
  for (int j = 1; j < k; ++j)
    if (score[j] > score[best]) best = j;
  return best;
}

}  // namespace

template <class Code>
void assign_nearest(const float* x, int64_t n, int d, int64_t x_stride, const float* centroids, int k, Code* codes,
                    float* distances, bool parallel) {
  const CentroidPanel panel(centroids, k, d);
#pragma omp parallel for schedule(static) if (parallel && n >= 1024)
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * x_stride;
    const int best = nearest_one(xi, d, panel.transposed.data(), panel.bias.data(), k);
    codes[i] = static_cast<Code>(best);
    if (distances) distances[i] = squared_distance(xi, centroids + static_cast<size_t>(best) * d, d);
  }
}

template void assign_nearest<uint8_t>(const float*, int64_t, int, int64_t, const float*, int, uint8_t*, float*, bool);
template void assign_nearest<int32_t>(const float*, int64_t, int, int64_t, const float*, int, int32_t*, float*,
                                      bool);

KmeansResult kmeans(const float* x, int64_t n, int d, int64_t x_stride, const KmeansOptions& o) {
  KmeansResult r;
  const int k = std::clamp(o.k, 1, kMaxK);
  r.centroids.assign(static_cast<size_t>(k) * d, 0.0f);
  if (n <= 0) return r;

  // Forgy init: a partial Fisher-Yates shuffle of the point indices.
  uint64_t state = o.seed;
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  const int64_t distinct = std::min<int64_t>(n, k);
  for (int64_t i = 0; i < distinct; ++i) {
    const int64_t j = i + static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(n - i));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  for (int j = 0; j < k; ++j)
    std::memcpy(&r.centroids[static_cast<size_t>(j) * d], x + order[static_cast<size_t>(j % distinct)] * x_stride,
                sizeof(float) * static_cast<size_t>(d));

  std::vector<int32_t> assign(static_cast<size_t>(n));
  std::vector<float> dist(static_cast<size_t>(n));
  std::vector<double> sums(static_cast<size_t>(k) * d);
  std::vector<int64_t> counts(static_cast<size_t>(k));
  const int iters = std::max(1, o.max_iters);
  for (int it = 0; it < iters; ++it) {
    assign_nearest(x, n, d, x_stride, r.centroids.data(), k, assign.data(), dist.data(), o.parallel);
    double objective = 0;
    for (int64_t i = 0; i < n; ++i) objective += dist[static_cast<size_t>(i)];
    r.objective.push_back(objective);
    r.iterations = it + 1;
    if (o.adaptive && it > 0) {
      const double previous = r.objective[r.objective.size() - 2];
      if (previous - objective <= static_cast<double>(o.tol) * previous) break;
    }
    if (it + 1 == iters) break;  // keep the centroids the last assignment (and objective) refer to

    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) {
      const size_t c = static_cast<size_t>(assign[static_cast<size_t>(i)]);
      ++counts[c];
      const float* xi = x + i * x_stride;
      double* s = &sums[c * static_cast<size_t>(d)];
      for (int t = 0; t < d; ++t) s[t] += xi[t];
    }
    std::vector<int64_t> farthest;  // points by decreasing distance, built only if a centroid emptied
    size_t next_far = 0;
    for (int j = 0; j < k; ++j) {
      float* c = &r.centroids[static_cast<size_t>(j) * d];
      if (counts[static_cast<size_t>(j)] > 0) {
        const double inv = 1.0 / static_cast<double>(counts[static_cast<size_t>(j)]);
        for (int t = 0; t < d; ++t) c[t] = static_cast<float>(sums[static_cast<size_t>(j) * d + t] * inv);
        continue;
      }
      if (farthest.empty()) {
        farthest.resize(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) farthest[static_cast<size_t>(i)] = i;
        std::sort(farthest.begin(), farthest.end(), [&](int64_t a, int64_t b) {
          return dist[static_cast<size_t>(a)] > dist[static_cast<size_t>(b)] ||
                 (dist[static_cast<size_t>(a)] == dist[static_cast<size_t>(b)] && a < b);
        });
      }
      const int64_t p = farthest[next_far++ % farthest.size()];
      std::memcpy(c, x + p * x_stride, sizeof(float) * static_cast<size_t>(d));
    }
  }
  return r;
}

}  // namespace kvret
