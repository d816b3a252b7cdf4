// k-means: the objective never rises, codes are the nearest centroids, results are reproducible from the seed.
#include <gtest/gtest.h>

#include "core/vec_math.hpp"
#include "index/kmeans.hpp"
#include "test_util.hpp"

namespace kvret {
namespace {

std::vector<float> blobs(int64_t n, int d, int centers, uint64_t seed) {
  auto c = test::random_vector(static_cast<size_t>(centers * d), seed, 3.0f);
  auto noise = test::random_vector(static_cast<size_t>(n * d), seed + 1);
  std::vector<float> x(static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n; ++i)
    for (int t = 0; t < d; ++t)
      x[static_cast<size_t>(i * d + t)] =
          c[static_cast<size_t>((i % centers) * d + t)] + noise[static_cast<size_t>(i * d + t)];
  return x;
}

class KmeansObjective : public ::testing::TestWithParam<std::tuple<int, int, uint64_t>> {};

TEST_P(KmeansObjective, NeverRises) {
  const auto [k, d, seed] = GetParam();
  const int64_t n = 3000;
  const auto x = blobs(n, d, 20, seed);
  KmeansOptions o;
  o.k = k;
  o.max_iters = 30;
  o.adaptive = false;
  o.seed = seed;
  const KmeansResult r = kmeans(x.data(), n, d, d, o);
  ASSERT_EQ(r.iterations, 30);
  ASSERT_EQ(r.objective.size(), 30u);
  for (size_t i = 1; i < r.objective.size(); ++i)
    EXPECT_LE(r.objective[i], r.objective[i - 1] * (1 + 1e-6)) << "iteration " << i;
  EXPECT_LT(r.objective.back(), r.objective.front());
}

INSTANTIATE_TEST_SUITE_P(Shapes, KmeansObjective,
                         ::testing::Values(std::make_tuple(64, 64, 1u), std::make_tuple(16, 32, 2u),
                                           std::make_tuple(256, 16, 3u), std::make_tuple(8, 128, 4u)));

TEST(Kmeans, EmptyClustersAreReseededWithoutRaisingTheObjective) {
  // 64 centroids for points that sit on only 5 distinct spots: most clusters empty out at once.
  const int d = 8;
  std::vector<float> x;
  for (int i = 0; i < 500; ++i)
    for (int t = 0; t < d; ++t) x.push_back(static_cast<float>((i % 5) * 10 + (t == 0 ? i % 7 : 0)));
  KmeansOptions o;
  o.k = 64;
  o.max_iters = 10;
  o.adaptive = false;
  const KmeansResult r = kmeans(x.data(), 500, d, d, o);
  for (size_t i = 1; i < r.objective.size(); ++i) EXPECT_LE(r.objective[i], r.objective[i - 1] * (1 + 1e-6));
  for (float c : r.centroids) EXPECT_TRUE(std::isfinite(c));
}

TEST(Kmeans, AdaptiveStopsEarlyAndIsReproducible) {
  const auto x = blobs(4000, 32, 10, 7);
  KmeansOptions o;
  o.k = 10;
  o.adaptive = true;
  o.tol = 1e-4f;
  o.max_iters = 25;
  const KmeansResult a = kmeans(x.data(), 4000, 32, 32, o);
  const KmeansResult b = kmeans(x.data(), 4000, 32, 32, o);
  EXPECT_LT(a.iterations, 25);  // 10 well separated blobs converge quickly
  EXPECT_EQ(a.centroids, b.centroids);
  o.seed = 99;
  const KmeansResult c = kmeans(x.data(), 4000, 32, 32, o);
  EXPECT_NE(a.centroids, c.centroids);
}

TEST(Kmeans, FewerPointsThanCentroids) {
  const auto x = blobs(10, 16, 10, 3);
  KmeansOptions o;
  o.k = 64;
  const KmeansResult r = kmeans(x.data(), 10, 16, 16, o);
  EXPECT_EQ(r.centroids.size(), 64u * 16u);
  EXPECT_NEAR(r.objective.back(), 0.0, 1e-6);  // every point is its own centroid
}

TEST(AssignNearest, CodesAreTheNearestCentroids) {
  for (int d : {16, 32, 64, 128}) {
    for (int k : {4, 64, 256}) {
      const auto x = test::random_vector(static_cast<size_t>(500 * d), static_cast<uint64_t>(d * k));
      const auto c = test::random_vector(static_cast<size_t>(k * d), static_cast<uint64_t>(d + k));
      std::vector<uint8_t> codes(500);
      std::vector<float> dist(500);
      assign_nearest(x.data(), 500, d, d, c.data(), k, codes.data(), dist.data(), true);
      for (int i = 0; i < 500; ++i) {
        double best = 1e300;
        for (int j = 0; j < k; ++j)
          best = std::min(best, static_cast<double>(squared_distance(x.data() + i * d, c.data() + j * d, d)));
        const double got = squared_distance(x.data() + i * d, c.data() + codes[static_cast<size_t>(i)] * d, d);
        EXPECT_LE(got, best * (1 + 1e-5) + 1e-5) << "d=" << d << " k=" << k << " point " << i;
        EXPECT_NEAR(dist[static_cast<size_t>(i)], got, 1e-3 * (1 + got));
      }
    }
  }
}

TEST(AssignNearest, StridedInputEqualsContiguous) {
  const int d = 32, stride = 128, n = 300, k = 16;
  const auto wide = test::random_vector(static_cast<size_t>(n * stride), 5);
  std::vector<float> narrow(static_cast<size_t>(n * d));
  for (int i = 0; i < n; ++i) std::copy_n(wide.data() + i * stride + 64, d, narrow.data() + i * d);
  const auto c = test::random_vector(static_cast<size_t>(k * d), 6);
  std::vector<int32_t> a(n), b(n);
  assign_nearest(wide.data() + 64, n, d, stride, c.data(), k, a.data(), nullptr, false);
  assign_nearest(narrow.data(), n, d, d, c.data(), k, b.data(), nullptr, false);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace kvret
