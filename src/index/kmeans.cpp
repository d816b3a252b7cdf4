#include "index/kmeans.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "core/parallel.hpp"
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

int nearest_one(const float* x, int d, const float* transposed, const float* bias, int k) {
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

#if defined(__x86_64__) || defined(__i386__)
#define KVRET_KMEANS_AVX2 1
constexpr int kBlockPoints = 4;  ///< points per register block: 4 points x 16 centroids = 8 accumulators

/// The nearest of k centroids (k % 16 == 0) for P points at once: a register-blocked panel product (each centroid
/// column loaded once serves P points) with a running per-lane argmax; ties go to the lowest index, as in
/// nearest_one. This is where k-means and PQ encoding spend their time.
template <int P>
__attribute__((target("avx2,fma"))) void nearest_block_avx2(const float* x, int64_t x_stride, int d,
                                                            const float* transposed, const float* bias, int k,
                                                            int* best) {
  __m256 best_score[P];
  __m256i best_index[P];
  for (int p = 0; p < P; ++p) {
    best_score[p] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    best_index[p] = _mm256_setzero_si256();
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int j0 = 0; j0 < k; j0 += 16) {
    __m256 acc[P][2];
    for (int p = 0; p < P; ++p) {
      acc[p][0] = _mm256_loadu_ps(bias + j0);
      acc[p][1] = _mm256_loadu_ps(bias + j0 + 8);
    }
    const float* column = transposed + j0;
    for (int t = 0; t < d; ++t, column += k) {
      const __m256 c0 = _mm256_loadu_ps(column);
      const __m256 c1 = _mm256_loadu_ps(column + 8);
      for (int p = 0; p < P; ++p) {
        const __m256 xt = _mm256_broadcast_ss(x + p * x_stride + t);
        acc[p][0] = _mm256_fmadd_ps(xt, c0, acc[p][0]);
        acc[p][1] = _mm256_fmadd_ps(xt, c1, acc[p][1]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i index = _mm256_add_epi32(lane, _mm256_set1_epi32(j0 + 8 * h));
      for (int p = 0; p < P; ++p) {
        const __m256 better = _mm256_cmp_ps(acc[p][h], best_score[p], _CMP_GT_OQ);
        best_score[p] = _mm256_blendv_ps(best_score[p], acc[p][h], better);
        best_index[p] = _mm256_blendv_epi8(best_index[p], index, _mm256_castps_si256(better));
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    alignas(32) float score[8];
    alignas(32) int index[8];
    _mm256_store_ps(score, best_score[p]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(index), best_index[p]);
    int b = 0;
    for (int l = 1; l < 8; ++l)
      if (score[l] > score[b] || (score[l] == score[b] && index[l] < index[b])) b = l;
    best[p] = index[b];
  }
}

bool has_avx2_fma() {
  static const bool ok = cpu_has_avx2() && __builtin_cpu_supports("fma");  // cpu_has_avx2: KVRET_MAX_CPU_ISA
  return ok;
}
#endif

/// Nearest centroids of points [begin, end).
void nearest_range(const float* x, int64_t begin, int64_t end, int d, int64_t x_stride, const CentroidPanel& panel,
                   int k, int* best) {
  int64_t i = begin;
#ifdef KVRET_KMEANS_AVX2
  if (k % 16 == 0 && has_avx2_fma()) {
    for (; i + kBlockPoints <= end; i += kBlockPoints)
      nearest_block_avx2<kBlockPoints>(x + i * x_stride, x_stride, d, panel.transposed.data(), panel.bias.data(), k,
                                       best + (i - begin));
    for (; i < end; ++i)
      nearest_block_avx2<1>(x + i * x_stride, x_stride, d, panel.transposed.data(), panel.bias.data(), k,
                            best + (i - begin));
    return;
  }
#endif
  for (; i < end; ++i)
    best[i - begin] = nearest_one(x + i * x_stride, d, panel.transposed.data(), panel.bias.data(), k);
}

constexpr int64_t kAssignChunk = 256;

}  // namespace

template <class Code>
void assign_nearest(const float* x, int64_t n, int d, int64_t x_stride, const float* centroids, int k, Code* codes,
                    float* distances, bool parallel) {
  const CentroidPanel panel(centroids, k, d);
  const int64_t chunks = (n + kAssignChunk - 1) / kAssignChunk;
  parallel_for(chunks, 0, parallel && n >= 1024, Schedule::kStatic, [&](int64_t c) {
    int best[kAssignChunk];
    const int64_t begin = c * kAssignChunk;
    const int64_t end = std::min(n, begin + kAssignChunk);
    nearest_range(x, begin, end, d, x_stride, panel, k, best);
    for (int64_t i = begin; i < end; ++i) {
      const int b = best[i - begin];
      codes[i] = static_cast<Code>(b);
      if (distances) distances[i] = squared_distance(x + i * x_stride, centroids + static_cast<size_t>(b) * d, d);
    }
  });
}

template void assign_nearest<uint8_t>(const float*, int64_t, int, int64_t, const float*, int, uint8_t*, float*, bool);
template void assign_nearest<int32_t>(const float*, int64_t, int, int64_t, const float*, int, int32_t*, float*, bool);

std::vector<int64_t> forgy_indices(int64_t n, int k, uint64_t seed) {
  // a partial Fisher-Yates shuffle of the point indices; with fewer points than centroids they repeat
  uint64_t state = seed;
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  const int64_t distinct = std::min<int64_t>(n, k);
  for (int64_t i = 0; i < distinct; ++i) {
    const int64_t j = i + static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(n - i));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  std::vector<int64_t> out(static_cast<size_t>(std::max(k, 0)));
  for (int j = 0; j < k; ++j) out[static_cast<size_t>(j)] = order[static_cast<size_t>(j % distinct)];
  return out;
}

void forgy_init(const float* x, int64_t n, int d, int64_t x_stride, int k, uint64_t seed, float* out) {
  const std::vector<int64_t> points = forgy_indices(n, k, seed);
  for (int j = 0; j < k; ++j)
    std::memcpy(out + static_cast<size_t>(j) * d, x + points[static_cast<size_t>(j)] * x_stride,
                sizeof(float) * static_cast<size_t>(d));
}

KmeansResult kmeans(const float* x, int64_t n, int d, int64_t x_stride, const KmeansOptions& o) {
  KmeansResult r;
  const int k = std::clamp(o.k, 1, kMaxK);
  r.centroids.assign(static_cast<size_t>(k) * d, 0.0f);
  if (n <= 0) return r;

  forgy_init(x, n, d, x_stride, k, o.seed, r.centroids.data());

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
