// launch_pq_scores against a double-precision CPU evaluation of the same lookup-table scores and GQA folds.
#include <algorithm>
#include <cmath>
#include <vector>

#include "gpu_test_util.h"
#include "pq_scores.h"

namespace kvret::cuda::testing {
namespace {

struct PqScoreCase {
  int n_q_heads;
  int n_kv_heads;
  int head_dim;
  int pq_m;
  int pq_bits;
  std::vector<int> n_tokens;  // per sequence
  GqaFold fold;
};

/// scores[s][h][t] of the CPU reference.
std::vector<std::vector<std::vector<double>>> reference_scores(const PqScoreCase& c, const std::vector<float>& queries,
                                                               const std::vector<std::vector<float>>& centroids,
                                                               const std::vector<std::vector<uint8_t>>& codes,
                                                               double scale) {
  const int n_centroids = 1 << c.pq_bits;
  const int sub = c.head_dim / c.pq_m;
  const int group = c.n_q_heads / c.n_kv_heads;
  std::vector<std::vector<std::vector<double>>> out(c.n_tokens.size());
  for (size_t s = 0; s < c.n_tokens.size(); ++s) {
    const int n = c.n_tokens[s];
    out[s].assign(c.n_kv_heads, std::vector<double>(n, c.fold == GqaFold::kSumProb ? 0.0 : -INFINITY));
    for (int h = 0; h < c.n_kv_heads; ++h) {
      for (int g = 0; g < group; ++g) {
        const int qh = h * group + g;
        const float* q = &queries[(s * c.n_q_heads + qh) * c.head_dim];
        std::vector<double> lut(static_cast<size_t>(c.pq_m) * n_centroids);
        for (int j = 0; j < c.pq_m; ++j) {
          for (int k = 0; k < n_centroids; ++k) {
            const float* cent = &centroids[s][((static_cast<size_t>(h) * c.pq_m + j) * n_centroids + k) * sub];
            double dot = 0;
            for (int e = 0; e < sub; ++e) dot += static_cast<double>(q[j * sub + e]) * cent[e];
            lut[j * n_centroids + k] = scale * dot;
          }
        }
        std::vector<double> logits(n);
        for (int t = 0; t < n; ++t) {
          double logit = 0;
          for (int j = 0; j < c.pq_m; ++j) {
            logit += lut[j * n_centroids + codes[s][(static_cast<size_t>(h) * n + t) * c.pq_m + j]];
          }
          logits[t] = logit;
        }
        if (c.fold == GqaFold::kMaxLogit) {
          for (int t = 0; t < n; ++t) out[s][h][t] = std::max(out[s][h][t], logits[t]);
        } else if (n > 0) {
          const double max = *std::max_element(logits.begin(), logits.end());
          double sum = 0;
          for (int t = 0; t < n; ++t) sum += std::exp(logits[t] - max);
          for (int t = 0; t < n; ++t) out[s][h][t] += std::exp(logits[t] - max) / sum;
        }
      }
    }
  }
  return out;
}

/// `overstate`: the longest sequence's device-side count is raised by this much past max_tokens; the kernels must
/// clamp it to max_tokens (its real length) and write nothing past it.
void run_case(const PqScoreCase& c, uint64_t seed, int overstate = 0) {
  const int n_seqs = static_cast<int>(c.n_tokens.size());
  const int n_centroids = 1 << c.pq_bits;
  const int max_tokens = *std::max_element(c.n_tokens.begin(), c.n_tokens.end());
  const int64_t stride = max_tokens + 5;  // a stride wider than the rows

  const auto queries = random_normal<float>(static_cast<size_t>(n_seqs) * c.n_q_heads * c.head_dim, seed);
  std::vector<std::vector<float>> centroids;
  std::vector<std::vector<uint8_t>> codes;
  std::mt19937_64 rng(seed + 1);
  std::uniform_int_distribution<int> code_dist(0, n_centroids - 1);
  for (int s = 0; s < n_seqs; ++s) {
    centroids.push_back(random_normal<float>(static_cast<size_t>(c.n_kv_heads) * n_centroids * c.head_dim,
                                             seed + 10 + static_cast<uint64_t>(s)));
    std::vector<uint8_t> seq_codes(static_cast<size_t>(c.n_kv_heads) * c.n_tokens[s] * c.pq_m);
    for (auto& code : seq_codes) code = static_cast<uint8_t>(code_dist(rng));
    codes.push_back(std::move(seq_codes));
  }

  DeviceBuffer<float> d_queries(queries);
  std::vector<DeviceBuffer<float>> d_centroids;
  std::vector<DeviceBuffer<uint8_t>> d_codes;
  std::vector<const float*> centroid_ptrs;
  std::vector<const uint8_t*> code_ptrs;
  for (int s = 0; s < n_seqs; ++s) {
    d_centroids.emplace_back(centroids[s]);
    centroid_ptrs.push_back(d_centroids.back().get());
    d_codes.emplace_back(codes[s].empty() ? std::vector<uint8_t>(1) : codes[s]);
    for (int h = 0; h < c.n_kv_heads; ++h) {
      code_ptrs.push_back(d_codes.back().get() + static_cast<size_t>(h) * c.n_tokens[s] * c.pq_m);
    }
  }
  DeviceBuffer<const float*> d_centroid_ptrs(centroid_ptrs);
  DeviceBuffer<const uint8_t*> d_code_ptrs(code_ptrs);
  std::vector<int32_t> device_n_tokens(c.n_tokens.begin(), c.n_tokens.end());
  *std::max_element(device_n_tokens.begin(), device_n_tokens.end()) += overstate;
  DeviceBuffer<int32_t> d_n_tokens(device_n_tokens);
  DeviceBuffer<float> d_scores(static_cast<size_t>(n_seqs) * c.n_kv_heads * stride);
  d_scores.fill_bytes(0xff);  // NaN: any score left unwritten fails the comparison

  PqScoreParams p;
  p.n_seqs = n_seqs;
  p.n_q_heads = c.n_q_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.pq_m = c.pq_m;
  p.pq_bits = c.pq_bits;
  p.queries = d_queries.get();
  p.centroids = d_centroid_ptrs.get();
  p.codes = d_code_ptrs.get();
  p.n_tokens = d_n_tokens.get();
  p.max_tokens = max_tokens;
  p.scale = 0.0f;  // 1/sqrt(head_dim)
  p.fold = c.fold;
  p.scores = d_scores.get();
  p.score_stride = stride;
  DeviceBuffer<unsigned char> workspace(std::max<size_t>(pq_scores_workspace_bytes(p), 1));
  KVRET_LAUNCH_AND_SYNC(launch_pq_scores(p, workspace.get(), workspace.size(), nullptr));

  const auto scores = d_scores.download();
  const auto expected = reference_scores(c, queries, centroids, codes, 1.0 / std::sqrt(c.head_dim));
  const double atol = c.fold == GqaFold::kSumProb ? 1e-7 : 1e-4;
  int bad = 0;
  for (int s = 0; s < n_seqs; ++s) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      for (int t = 0; t < c.n_tokens[s]; ++t) {
        const float got = scores[(static_cast<size_t>(s) * c.n_kv_heads + h) * stride + t];
        const double want = expected[s][h][t];
        if (!close(got, want, atol, 1e-4) && ++bad <= 10) {
          ADD_FAILURE() << "seq " << s << " head " << h << " token " << t << ": got " << got << ", want " << want;
        }
      }
      for (int64_t t = c.n_tokens[s]; t < stride; ++t) {  // left untouched: still the NaN fill
        const float got = scores[(static_cast<size_t>(s) * c.n_kv_heads + h) * stride + t];
        if (!std::isnan(got) && ++bad <= 10) ADD_FAILURE() << "seq " << s << " head " << h << " wrote token " << t;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

class PqScoresTest : public GpuTest {};

TEST_F(PqScoresTest, SumProbMatchesCpuAcrossChunksAndEmptySequences) {
  run_case({8, 2, 128, 2, 6, {3000, 1, 0, 4097}, GqaFold::kSumProb}, 1);
}

TEST_F(PqScoresTest, DeviceCountsPastMaxTokensAreClamped) {
  run_case({8, 2, 128, 2, 6, {3000, 4097}, GqaFold::kSumProb}, 7, 5000);
  run_case({8, 2, 128, 2, 6, {3000, 4097}, GqaFold::kMaxLogit}, 8, 5000);
}

TEST_F(PqScoresTest, MaxLogitMatchesCpu) { run_case({8, 2, 128, 2, 6, {3000, 1, 0, 4097}, GqaFold::kMaxLogit}, 2); }

TEST_F(PqScoresTest, HeadDim64ManySubspacesNoGqa) {
  run_case({4, 4, 64, 8, 8, {2048, 100}, GqaFold::kSumProb}, 3);
  run_case({4, 4, 64, 8, 8, {2048, 100}, GqaFold::kMaxLogit}, 4);
}

TEST_F(PqScoresTest, HeadDim256FourBitCodes) { run_case({32, 8, 256, 4, 4, {5000}, GqaFold::kSumProb}, 5); }

TEST_F(PqScoresTest, LargeTableNeedsOptInSharedMemory) {
  // group 8 x 16 sub-spaces x 256 centroids: a 128 KiB table, above the default 48 KiB per block.
  run_case({64, 8, 128, 16, 8, {2500, 700}, GqaFold::kSumProb}, 6);
}

TEST_F(PqScoresTest, RejectsBadGeometry) {
  PqScoreParams p;
  p.n_seqs = 1;
  p.n_q_heads = 6;
  p.n_kv_heads = 4;  // 6 % 4 != 0
  p.head_dim = 128;
  p.pq_m = 2;
  p.pq_bits = 6;
  EXPECT_EQ(launch_pq_scores(p, nullptr, 0, nullptr), cudaErrorInvalidValue);
  p.n_q_heads = 8;
  p.pq_m = 3;  // 128 % 3 != 0
  EXPECT_EQ(launch_pq_scores(p, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvret::cuda::testing
