// launch_topk_positions against a CPU sort by the CPU selection's order (select/topk.hpp: NaN as -inf, -0 as +0,
// ties to the lower index): exact equality of the selected positions, ties included. Every case runs on both paths:
// the device's own (clusters on sm_90 and newer) and the one-block-per-row path of sm_80 / sm_89.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "backend/cuda_arch.hpp"
#include "gpu_test_util.h"
#include "select/topk.hpp"
#include "topk_select.h"

namespace kvret::cuda::testing {
namespace {

/// Ascending in the CPU selection's order of scores.
uint32_t order_key(float f) { return ~kvret::descending_rank(f); }

/// The documented rule: the min(k, n) largest scores, equal scores ranked by lower index, written ascending.
std::vector<int32_t> reference_topk(const float* scores, int n, int k, int32_t offset) {
  std::vector<int32_t> index(n);
  std::iota(index.begin(), index.end(), 0);
  std::sort(index.begin(), index.end(), [&](int32_t a, int32_t b) {
    const uint32_t ka = order_key(scores[a]);
    const uint32_t kb = order_key(scores[b]);
    return ka != kb ? ka > kb : a < b;
  });
  index.resize(std::min(k, n));
  std::sort(index.begin(), index.end());
  for (auto& i : index) i += offset;
  return index;
}

struct TopkCase {
  int n_kv_heads;
  std::vector<int> n_tokens;
  std::vector<int> offsets;  // empty: no offsets
  int k;
};

void run_case_on(const TopkCase& c, const std::vector<float>& scores, int64_t stride, TopkPath path) {
  SCOPED_TRACE(path == TopkPath::kAuto ? "TopkPath::kAuto" : "TopkPath::kBlocks");
  const int n_seqs = static_cast<int>(c.n_tokens.size());
  const int64_t out_stride = c.k + 3;
  DeviceBuffer<float> d_scores(scores);
  DeviceBuffer<int32_t> d_n_tokens(std::vector<int32_t>(c.n_tokens.begin(), c.n_tokens.end()));
  DeviceBuffer<int32_t> d_offsets(std::vector<int32_t>(c.offsets.begin(), c.offsets.end()));
  DeviceBuffer<int32_t> d_positions(static_cast<size_t>(n_seqs) * c.n_kv_heads * std::max<int64_t>(out_stride, 1));
  DeviceBuffer<int32_t> d_counts(n_seqs);
  d_positions.fill_bytes(0xff);
  d_counts.fill_bytes(0xff);

  TopkParams p;
  p.n_seqs = n_seqs;
  p.n_kv_heads = c.n_kv_heads;
  p.scores = d_scores.get();
  p.score_stride = stride;
  p.n_tokens = d_n_tokens.get();
  p.k = c.k;
  p.position_offset = c.offsets.empty() ? nullptr : d_offsets.get();
  p.positions = d_positions.get();
  p.positions_stride = out_stride;
  p.counts = d_counts.get();
  KVRET_LAUNCH_AND_SYNC(launch_topk_positions(p, nullptr, path));

  const auto positions = d_positions.download();
  const auto counts = d_counts.download();
  for (int s = 0; s < n_seqs; ++s) {
    const int n = static_cast<int>(std::clamp<int64_t>(c.n_tokens[s], 0, stride));  // the kernel's clamp
    EXPECT_EQ(counts[s], std::min(c.k, n)) << "seq " << s;
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const size_t row = static_cast<size_t>(s) * c.n_kv_heads + h;
      const auto want = reference_topk(&scores[row * stride], n, c.k, c.offsets.empty() ? 0 : c.offsets[s]);
      const std::vector<int32_t> got(positions.begin() + static_cast<std::ptrdiff_t>(row * out_stride),
                                     positions.begin() + static_cast<std::ptrdiff_t>(row * out_stride + want.size()));
      EXPECT_EQ(got, want) << "seq " << s << " head " << h;
      if (static_cast<int64_t>(want.size()) < out_stride) {
        EXPECT_EQ(positions[row * out_stride + want.size()], -1) << "wrote past the selection, seq " << s;
      }
    }
  }
}

void run_case(const TopkCase& c, const std::vector<float>& scores, int64_t stride) {
  run_case_on(c, scores, stride, TopkPath::kAuto);
  run_case_on(c, scores, stride, TopkPath::kBlocks);
}

std::vector<float> normal_scores(size_t n, uint64_t seed) { return random_normal<float>(n, seed); }

class TopkSelectTest : public GpuTest {};

TEST_F(TopkSelectTest, RandomScoresWithOffsetsAndEmptyRows) {
  const TopkCase c{8, {10000, 5, 0}, {16, 0, 7}, 1000};
  const int64_t stride = 10003;
  run_case(c, normal_scores(3 * 8 * stride, 11), stride);
}

TEST_F(TopkSelectTest, DeviceCountsPastTheRowAreClamped) {
  // n_tokens[0] exceeds the stride (the last row would read past the buffer), n_tokens[1] is negative
  const TopkCase c{2, {5000, -3}, {}, 300};
  const int64_t stride = 4096;
  run_case(c, normal_scores(2 * 2 * stride, 21), stride);
}

TEST_F(TopkSelectTest, HeavyTiesTakeLowerPositionsFirst) {
  const TopkCase c{4, {50000, 4097}, {}, 12345};
  const int64_t stride = 50000;
  std::vector<float> scores(2 * 4 * stride);
  std::mt19937_64 rng(12);
  std::uniform_int_distribution<int> level(0, 9);
  for (auto& x : scores) x = static_cast<float>(level(rng));
  run_case(c, scores, stride);
}

TEST_F(TopkSelectTest, BudgetAtOrAboveLengthTakesEverything) {
  const TopkCase c{2, {150, 200, 250}, {}, 200};
  run_case(c, normal_scores(3 * 2 * 256, 13), 256);
}

TEST_F(TopkSelectTest, SpecialValuesOrderAsOnTheCpu) {
  const TopkCase c{1, {4096}, {}, 100};
  auto scores = normal_scores(4096, 14);
  const float inf = std::numeric_limits<float>::infinity();
  for (int i = 0; i < 4096; i += 97) scores[i] = 0.0f;
  for (int i = 1; i < 4096; i += 89) scores[i] = -0.0f;
  for (int i = 2; i < 4096; i += 211) scores[i] = inf;
  for (int i = 3; i < 4096; i += 101) scores[i] = -inf;
  for (auto& x : scores) x = x > 0 && x < 1.0f ? -x : x;  // many negatives
  // NaNs of both signs and several payloads count as -inf: never above a number
  const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffffffffu};
  for (int i = 4; i < 4096; i += 53) std::memcpy(&scores[i], &nans[(i / 53) % 4], sizeof(float));
  run_case(c, scores, 4096);
  const TopkCase all{1, {4096}, {}, 4000};  // deep enough to reach the NaNs, -inf and the ties among them
  run_case(all, scores, 4096);
}

TEST_F(TopkSelectTest, SoftmaxLikeScoresAt128kTokens) {
  // Probabilities share a few exponents: the histogram's hottest bins, as in a real select.
  const TopkCase c{8, {131072, 131072}, {16, 16}, 13107};
  const int64_t stride = 131072;
  auto scores = normal_scores(2 * 8 * stride, 15);
  for (auto& x : scores) x = std::exp(2.0f * x) / 131072.0f;
  run_case(c, scores, stride);
}

TEST_F(TopkSelectTest, ZeroBudgetWritesNothing) {
  const TopkCase c{3, {100}, {}, 0};
  run_case(c, normal_scores(3 * 100, 16), 100);
}

TEST_F(TopkSelectTest, ClustersExactlyWhereTheDeviceCodeHasThem) {
  int device = 0;
  int major = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  bool clusters = true;
  ASSERT_EQ(topk_uses_clusters(&clusters), cudaSuccess);
  if (major < 9) {
    EXPECT_FALSE(clusters) << "a device without thread-block clusters";
  }
  std::vector<cuda_arch::ArchEntry> built;
  ASSERT_TRUE(cuda_arch::parse_arch_list(cuda_arch::built_arch_list(), built));
  const bool sm90_code =
      std::any_of(built.begin(), built.end(), [](const cuda_arch::ArchEntry& e) { return e.sass && e.arch == 90; });
  if (major == 9 && sm90_code) {
    EXPECT_TRUE(clusters) << "an sm_90 device running the build's sm_90 code";
  }
  EXPECT_EQ(topk_uses_clusters(nullptr), cudaErrorInvalidValue);
}

TEST_F(TopkSelectTest, UnknownPathIsRefused) {
  TopkParams p;
  p.n_seqs = 0;
  p.n_kv_heads = 1;
  EXPECT_EQ(launch_topk_positions(p, nullptr, static_cast<TopkPath>(7)), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvret::cuda::testing
