// launch_pq_encode against a CPU nearest-centroid loop over the CPU core's squared_distance. The kernel computes
// the same f32 operations in the same order without fused multiply-adds (math::pq_squared_distance), so the codes
// must be equal; the comparison still exempts near-ties, where the brief only asks for a consistent choice.
#include <cmath>
#include <limits>
#include <vector>

#include "core/vec_math.hpp"
#include "gpu_test_util.h"
#include "pq_encode.h"

namespace kvret::cuda::testing {
namespace {

/// The CPU library's squared distance, the kernel's reference bit for bit (out of line: inlined into the loops
/// below, GCC's loop analysis warns about the library's tail loop).
[[gnu::noinline]] float cpu_squared_distance(const float* a, const float* b, int64_t n) {
  return kvret::squared_distance(a, b, n);
}

struct EncodeCase {
  int n_tokens;
  int n_kv_heads;
  int head_dim;
  int pq_m;
  int pq_bits;
  bool head_major;  // keys stored [n_kv_heads, n_tokens, head_dim] and passed with strides
};

template <typename T>
void run_case(const EncodeCase& c, uint64_t seed) {
  const int n_centroids = 1 << c.pq_bits;
  const int sub = c.head_dim / c.pq_m;
  const size_t n_keys = static_cast<size_t>(c.n_tokens) * c.n_kv_heads * c.head_dim;
  const auto keys = random_normal<T>(n_keys, seed);
  const auto centroids = random_normal<float>(static_cast<size_t>(c.n_kv_heads) * n_centroids * c.head_dim, seed + 1);
  const int64_t token_stride = c.head_major ? c.head_dim : static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  const int64_t head_stride = c.head_major ? static_cast<int64_t>(c.n_tokens) * c.head_dim : c.head_dim;
  const int64_t code_head_stride = static_cast<int64_t>(c.n_tokens) * c.pq_m + 7;

  DeviceBuffer<T> d_keys(keys);
  DeviceBuffer<float> d_centroids(centroids);
  DeviceBuffer<uint8_t> d_codes(static_cast<size_t>(c.n_kv_heads) * code_head_stride);
  d_codes.fill_bytes(0xee);

  PqEncodeParams p;
  p.n_tokens = c.n_tokens;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.pq_m = c.pq_m;
  p.pq_bits = c.pq_bits;
  p.key_type = elem_type_of<T>();
  p.keys = d_keys.get();
  p.key_token_stride = token_stride;
  p.key_head_stride = head_stride;
  p.centroids = d_centroids.get();
  p.codes = d_codes.get();
  p.code_head_stride = code_head_stride;
  KVRET_LAUNCH_AND_SYNC(launch_pq_encode(p, nullptr));
  const auto codes = d_codes.download();

  int near_ties = 0;
  int bad = 0;
  for (int h = 0; h < c.n_kv_heads; ++h) {
    for (int t = 0; t < c.n_tokens; ++t) {
      for (int j = 0; j < c.pq_m; ++j) {
        std::vector<float> x(sub);
        for (int e = 0; e < sub; ++e) x[e] = to_float(keys[t * token_stride + h * head_stride + j * sub + e]);
        std::vector<float> dist(n_centroids);
        float best = std::numeric_limits<float>::infinity();
        float second = best;
        int code = 0;
        for (int k = 0; k < n_centroids; ++k) {
          const float* cent = &centroids[((static_cast<size_t>(h) * c.pq_m + j) * n_centroids + k) * sub];
          const float d = cpu_squared_distance(x.data(), cent, sub);
          dist[k] = d;
          if (d < best) {
            second = best;
            best = d;
            code = k;
          } else if (d < second) {
            second = d;
          }
        }
        const int got = codes[h * code_head_stride + static_cast<int64_t>(t) * c.pq_m + j];
        if (second - best <= 1e-5f * best) {  // a near-tie: either nearly-best centroid is right
          ++near_ties;
          EXPECT_LE(dist[got], second) << "token " << t << " head " << h << " sub-space " << j;
          continue;
        }
        if (got != code && ++bad <= 10) {
          ADD_FAILURE() << "token " << t << " head " << h << " sub-space " << j << ": got " << got << ", want " << code;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LT(near_ties, c.n_tokens * c.n_kv_heads * c.pq_m / 100 + 1);
  // Padding between heads is untouched.
  for (int h = 0; h < c.n_kv_heads; ++h) {
    EXPECT_EQ(codes[h * code_head_stride + static_cast<int64_t>(c.n_tokens) * c.pq_m], 0xee);
  }
}

class PqEncodeTest : public GpuTest {};

TEST_F(PqEncodeTest, F16HeadDim128) { run_case<__half>({1000, 8, 128, 2, 6, false}, 21); }
TEST_F(PqEncodeTest, Bf16HeadDim64EightBits) { run_case<__nv_bfloat16>({517, 4, 64, 4, 8, false}, 22); }
TEST_F(PqEncodeTest, F32HeadDim256FewCentroids) { run_case<float>({300, 2, 256, 8, 3, false}, 23); }
TEST_F(PqEncodeTest, HeadMajorStridesAndOneSubspace) { run_case<__half>({257, 3, 256, 1, 8, true}, 24); }
TEST_F(PqEncodeTest, SingleDecodeToken) { run_case<__half>({1, 8, 128, 2, 6, false}, 25); }

TEST_F(PqEncodeTest, ExactTiesGoToTheLowerCentroid) {
  // Every centroid of sub-space 0 duplicated: codes 2i and 2i+1 are equal, so the code must be even.
  const int n_tokens = 64;
  const int head_dim = 64;
  const int n_centroids = 16;
  auto centroids = random_normal<float>(static_cast<size_t>(n_centroids) * head_dim, 26);
  for (int k = 1; k < n_centroids; k += 2) {
    for (int e = 0; e < head_dim; ++e) centroids[k * head_dim + e] = centroids[(k - 1) * head_dim + e];
  }
  const auto keys = random_normal<float>(static_cast<size_t>(n_tokens) * head_dim, 27);
  DeviceBuffer<float> d_keys(keys);
  DeviceBuffer<float> d_centroids(centroids);
  DeviceBuffer<uint8_t> d_codes(n_tokens);
  PqEncodeParams p;
  p.n_tokens = n_tokens;
  p.n_kv_heads = 1;
  p.head_dim = head_dim;
  p.pq_m = 1;
  p.pq_bits = 4;
  p.key_type = ElemType::kF32;
  p.keys = d_keys.get();
  p.centroids = d_centroids.get();
  p.codes = d_codes.get();
  p.code_head_stride = n_tokens;
  KVRET_LAUNCH_AND_SYNC(launch_pq_encode(p, nullptr));
  for (const uint8_t code : d_codes.download()) EXPECT_EQ(code % 2, 0);
}

}  // namespace
}  // namespace kvret::cuda::testing
