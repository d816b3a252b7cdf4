// launch_decode_attention against double-precision softmax attention on the CPU, over the same rounded inputs.
#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_attention.h"
#include "gpu_test_util.h"

namespace kvret::cuda::testing {
namespace {

struct AttentionCase {
  int n_q_heads;
  int n_kv_heads;
  int head_dim;
  std::vector<int> n_rows;  // per sequence
  int rows_per_split;       // 0: the launcher's choice
};

/// `overstate`: the longest sequence's device-side n_rows is raised by this much (the kernels clamp it to max_rows,
/// its real length). `misalign_last`: the last sequence's k starts one element (2 or 4 bytes) into its buffer, so
/// not 16-byte aligned: its output must be zero.
template <typename T>
void run_case(const AttentionCase& c, uint64_t seed, int overstate = 0, bool misalign_last = false) {
  const int n_seqs = static_cast<int>(c.n_rows.size());
  const int max_rows = *std::max_element(c.n_rows.begin(), c.n_rows.end());
  const int64_t capacity = max_rows + 17;
  const int group = c.n_q_heads / c.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const size_t kv_elems = static_cast<size_t>(c.n_kv_heads) * capacity * c.head_dim;
  const size_t q_elems = static_cast<size_t>(c.n_q_heads) * c.head_dim;

  std::vector<std::vector<float>> q(n_seqs);
  std::vector<std::vector<T>> k(n_seqs);
  std::vector<std::vector<T>> v(n_seqs);
  std::vector<DeviceBuffer<float>> d_q;
  std::vector<DeviceBuffer<T>> d_k;
  std::vector<DeviceBuffer<T>> d_v;
  std::vector<DeviceBuffer<float>> d_out;
  std::vector<DecodeAttentionSeq> seqs(n_seqs);
  for (int s = 0; s < n_seqs; ++s) {
    const uint64_t base = seed + 10 * static_cast<uint64_t>(s);
    q[s] = random_normal<float>(q_elems, base, 2.0f);  // peaked attention, not a flat average
    k[s] = random_normal<T>(kv_elems, base + 1);
    v[s] = random_normal<T>(kv_elems, base + 2);
    d_q.emplace_back(q[s]);
    d_k.emplace_back(k[s]);
    d_v.emplace_back(v[s]);
    d_out.emplace_back(q_elems);
    d_out.back().fill_bytes(0xff);
    seqs[s].q = d_q.back().get();
    seqs[s].k = d_k.back().get();
    seqs[s].v = d_v.back().get();
    seqs[s].kv_capacity = capacity;
    seqs[s].n_rows = c.n_rows[s];
    seqs[s].out = d_out.back().get();
  }
  std::max_element(seqs.begin(), seqs.end(), [](const DecodeAttentionSeq& a, const DecodeAttentionSeq& b) {
    return a.n_rows < b.n_rows;
  })->n_rows += overstate;
  if (misalign_last) seqs.back().k = d_k.back().get() + 1;
  DeviceBuffer<DecodeAttentionSeq> d_seqs(seqs);
  DecodeAttentionParams p;
  p.seqs = d_seqs.get();
  p.n_seqs = n_seqs;
  p.n_q_heads = c.n_q_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.kv_type = elem_type_of<T>();
  p.max_rows = max_rows;
  p.rows_per_split = c.rows_per_split;
  DeviceBuffer<unsigned char> workspace(decode_attention_workspace_bytes(p));
  KVRET_LAUNCH_AND_SYNC(launch_decode_attention(p, workspace.get(), workspace.size(), nullptr));

  for (int s = 0; s < n_seqs; ++s) {
    const auto out = d_out[s].download();
    if (misalign_last && s == n_seqs - 1) {
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 0.0f) << "misaligned k: element " << i;
      continue;
    }
    for (int qh = 0; qh < c.n_q_heads; ++qh) {
      const int kvh = qh / group;
      const int n = c.n_rows[s];
      std::vector<double> logits(n);
      for (int r = 0; r < n; ++r) {
        double dot = 0;
        for (int d = 0; d < c.head_dim; ++d) {
          dot += static_cast<double>(q[s][qh * c.head_dim + d]) * to_float(k[s][(kvh * capacity + r) * c.head_dim + d]);
        }
        logits[r] = scale * dot;
      }
      const double max = n > 0 ? *std::max_element(logits.begin(), logits.end()) : 0.0;
      double sum = 0;
      for (auto& l : logits) sum += (l = std::exp(l - max));
      for (int d = 0; d < c.head_dim; ++d) {
        double want = 0;
        for (int r = 0; r < n; ++r) want += logits[r] / sum * to_float(v[s][(kvh * capacity + r) * c.head_dim + d]);
        const float got = out[qh * c.head_dim + d];
        ASSERT_TRUE(close(got, want, 2e-4, 1e-3))
            << "seq " << s << " q head " << qh << " dim " << d << ": got " << got << ", want " << want;
      }
    }
  }
}

class DecodeAttentionTest : public GpuTest {};

TEST_F(DecodeAttentionTest, F16HeadDim128Gqa4) { run_case<__half>({8, 2, 128, {1, 300, 2000, 0}, 0}, 61); }
TEST_F(DecodeAttentionTest, Bf16HeadDim128) { run_case<__nv_bfloat16>({8, 2, 128, {1, 300, 2000}, 0}, 62); }
TEST_F(DecodeAttentionTest, F32HeadDim128) { run_case<float>({8, 2, 128, {33, 1000}, 0}, 63); }
TEST_F(DecodeAttentionTest, F16HeadDim64NoGqa) { run_case<__half>({4, 4, 64, {700, 5}, 0}, 64); }
TEST_F(DecodeAttentionTest, F32HeadDim64) { run_case<float>({4, 2, 64, {129}, 0}, 65); }
TEST_F(DecodeAttentionTest, F16HeadDim256) { run_case<__half>({8, 2, 256, {1500, 64}, 0}, 66); }
TEST_F(DecodeAttentionTest, Bf16HeadDim256) { run_case<__nv_bfloat16>({8, 4, 256, {511}, 0}, 67); }
TEST_F(DecodeAttentionTest, MaxGroupSize) { run_case<__half>({32, 2, 128, {900, 31}, 0}, 68); }
TEST_F(DecodeAttentionTest, DeviceRowCountsPastMaxRowsAreClamped) {
  run_case<__half>({8, 2, 128, {700, 2000}, 0}, 70, 100000);
}

TEST_F(DecodeAttentionTest, MisalignedKeysGiveAZeroOutput) {
  run_case<__half>({8, 2, 128, {300, 200}, 0}, 71, 0, true);
  run_case<float>({8, 2, 64, {300, 200}, 64}, 72, 0, true);
}

TEST_F(DecodeAttentionTest, ManySmallSplitsMerge) { run_case<float>({8, 2, 128, {4100, 95, 32}, 32}, 69); }

TEST_F(DecodeAttentionTest, RejectsGroupsAboveTheLimit) {
  DecodeAttentionParams p;
  p.n_seqs = 1;
  p.n_q_heads = 64;
  p.n_kv_heads = 2;  // group 32 > kDecodeAttentionMaxGroup
  p.head_dim = 128;
  p.max_rows = 10;
  EXPECT_EQ(launch_decode_attention(p, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvret::cuda::testing
