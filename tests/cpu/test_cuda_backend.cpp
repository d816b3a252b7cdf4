// The CUDA backend's logic without a GPU: its per-element math (device_math.hpp) against the CPU core, bit for
// bit, in every build; and, in a build on Thrust's OpenMP host system run with KVRET_TEST_DEVICE=cuda (where the
// whole suite runs on this backend), the memory rule, copies of device tensors that leave what lies between their
// elements alone, and results equal to the CPU backend's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "backend/backend.hpp"
#include "backend/device_math.hpp"
#include "backend/page_select_ops.hpp"
#include "core/half.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

TEST(CudaBackendMath, HalfAndBfloat16LoadsEqualTheCoreBitForBit) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto x = static_cast<uint16_t>(h);
    ASSERT_EQ(bits(device_math::f16_to_f32(x)), bits(f16_to_f32(x))) << "f16 " << h;
    ASSERT_EQ(bits(device_math::bf16_to_f32(x)), bits(bf16_to_f32(x))) << "bf16 " << h;
  }
}

TEST(CudaBackendMath, TheGatherCopiesRowsAndConvertsToF32Exactly) {
  std::vector<uint16_t> src(8);
  for (size_t i = 0; i < src.size(); ++i) src[i] = f32_to_f16(0.37f * static_cast<float>(i) - 1.0f);
  src[3] = 0x7e01;  // a NaN with a payload: copied as it is, widened to the quiet NaN as the core does
  std::vector<uint16_t> same(8, 0);
  std::vector<float> widened(8, 0.0f);
  for (int64_t i = 0; i < 8; ++i) {
    device_math::copy_element(reinterpret_cast<const std::byte*>(src.data()), device_math::kF16,
                              reinterpret_cast<std::byte*>(same.data()), device_math::kF16, i);
    device_math::copy_element(reinterpret_cast<const std::byte*>(src.data()), device_math::kF16,
                              reinterpret_cast<std::byte*>(widened.data()), device_math::kF32, i);
  }
  EXPECT_EQ(same, src);
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(bits(widened[i]), bits(f16_to_f32(src[i]))) << i;
}

/// The write after the tuned top-k (TopkWrite: entries ascending per row, their positions and their scores looked up
/// in the folded row) writes what the reference's write (TopWrite: sorted keys and their scores) writes for the same
/// selection: per job its own tensors (strided, here), its positions (a middle's entries, or candidates' positions),
/// and the folded score of each.
TEST(CudaBackendMath, TheTunedTopksWriteIsTheReferenceWrite) {
  namespace dm = device_math;
  const int64_t jobs = 2, heads = 2, width = 6, budget = 3, stride = 4;  // out rows of 4: one past the budget
  const int64_t base_of[jobs] = {100, 7};
  const int32_t chosen[jobs * heads][budget] = {{0, 2, 5}, {1, 3, 4}, {0, 1, 2}, {2, 3, 5}};  // entries, ascending
  std::vector<float> folded(static_cast<size_t>(jobs * heads * width));
  for (size_t i = 0; i < folded.size(); ++i) folded[i] = 0.25f * static_cast<float>(i) - 2.0f;
  std::vector<int32_t> candidates(folded.size());  // re-ranking: each row's entries are candidates' positions
  for (size_t i = 0; i < candidates.size(); ++i) candidates[i] = static_cast<int32_t>(40 + 3 * i);
  for (const bool middle : {true, false}) {
    SCOPED_TRACE(middle ? "a middle's entries" : "candidates");
    std::vector<int32_t> index;
    std::vector<uint64_t> keys;
    std::vector<float> score;
    for (int64_t seg = 0; seg < jobs * heads; ++seg)
      for (int64_t j = 0; j < budget; ++j) {
        const int64_t e = chosen[seg][j], at = seg * width + e;
        const int64_t pos = middle ? base_of[seg / heads] + e : candidates[static_cast<size_t>(at)];
        index.push_back(static_cast<int32_t>(e));
        keys.push_back(static_cast<uint64_t>(seg) << 32 | static_cast<uint32_t>(pos));
        score.push_back(folded[static_cast<size_t>(at)]);
      }
    // [jobs][heads, stride] positions and scores, each writer its own
    std::vector<int32_t> out[2];
    std::vector<float> scores[2];
    std::vector<dm::DeviceTensor> outs[2], score_tensors[2];
    for (int w = 0; w < 2; ++w) {
      out[w].assign(static_cast<size_t>(jobs * heads * stride), -7);
      scores[w].assign(out[w].size(), -7.0f);
      for (int64_t job = 0; job < jobs; ++job) {
        const size_t at = static_cast<size_t>(job * heads * stride);
        outs[w].push_back({reinterpret_cast<std::byte*>(out[w].data() + at), dm::kI32, {stride, 1, 0}});
        score_tensors[w].push_back({reinterpret_cast<std::byte*>(scores[w].data() + at), dm::kF32, {stride, 1, 0}});
      }
    }
    const dm::TopWrite reference{keys.data(), score.data(), outs[0].data(), score_tensors[0].data(), budget, heads};
    const dm::TopkWrite tuned{index.data(), folded.data(),  middle ? nullptr : candidates.data(),
                              base_of,      outs[1].data(), score_tensors[1].data(),
                              budget,       heads,          width};
    for (int64_t i = 0; i < jobs * heads * budget; ++i) {
      reference(i);
      tuned(i);
    }
    EXPECT_EQ(out[1], out[0]);
    for (size_t i = 0; i < scores[0].size(); ++i) EXPECT_EQ(bits(scores[1][i]), bits(scores[0][i])) << i;
    // job 1, head 0, entry 2 (row 2's entry 2)
    EXPECT_EQ(out[1][static_cast<size_t>(2 * stride + 2)], middle ? 7 + 2 : 40 + 3 * (2 * width + 2));
    EXPECT_EQ(out[1][static_cast<size_t>(stride - 1)], -7) << "nothing past the budget";
  }
}

TEST(CudaBackendMath, TheThreePassAttentionIsASoftmaxAverage) {
  // one query head, three rows: logits 0, ln 2, ln 4 after scaling -> weights 1/7, 2/7, 4/7
  const int d = 2;
  std::vector<float> q = {1.0f, 0.0f}, k = {0.0f, 5.0f, std::log(2.0f), 1.0f, std::log(4.0f), -3.0f};
  std::vector<float> v = {7.0f, 0.0f, 0.0f, 7.0f, 7.0f, 7.0f}, out(2, -1.0f), w(3), z(1);
  device_math::DeviceTensor qt{reinterpret_cast<std::byte*>(q.data()), device_math::kF32, {d, 1, 0}};
  device_math::DeviceTensor kt{reinterpret_cast<std::byte*>(k.data()), device_math::kF32, {3 * d, d, 1}};
  device_math::DeviceTensor vt{reinterpret_cast<std::byte*>(v.data()), device_math::kF32, {3 * d, d, 1}};
  device_math::DeviceTensor ot{reinterpret_cast<std::byte*>(out.data()), device_math::kF32, {d, 1, 0}};
  for (int64_t i = 0; i < 3; ++i) device_math::AttentionLogits{qt, kt, w.data(), 3, d, 1, 1.0f}(i);
  device_math::AttentionNormaliser{w.data(), z.data(), 3}(0);
  for (int64_t i = 0; i < d; ++i) device_math::AttentionOutput{vt, ot, w.data(), z.data(), 3, d, 1}(i);
  EXPECT_NEAR(out[0], 7.0f * (1.0f + 4.0f) / 7.0f, 1e-5f);
  EXPECT_NEAR(out[1], 7.0f * (2.0f + 4.0f) / 7.0f, 1e-5f);
}

/// Tests of the backend itself: only where the suite runs on it.
class OnCudaBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

TEST_F(OnCudaBackend, TheSuiteRunsOnIt) {
  const kvret_config c = test::small_config();
  EXPECT_EQ(c.device_type, KVRET_DEVICE_CUDA);
  EXPECT_STREQ(make_backend(c)->name(), "cuda");
}

TEST_F(OnCudaBackend, ItReadsDeviceAndPinnedMemoryAndRefusesTheRest) {
  auto ctx = test::make_context(test::small_config(KVRET_INDEX_EXACT));
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  F32 k({300, 2, 64}), v({300, 2, 64});
  test::clustered_kv(300, 2, 64, 5, k, v);
  k.t.device = {KVRET_DEVICE_CPU, 0};  // pageable host memory: the device cannot reach it
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k.t, &v.t), KVRET_ERR_DEVICE);
  EXPECT_NE(std::string(kvret_last_error()).find("k: device type 1"), std::string::npos) << kvret_last_error();
  k.t.device = {KVRET_DEVICE_CUDA, 3};  // another GPU's memory
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k.t, &v.t), KVRET_ERR_DEVICE);
  EXPECT_NE(std::string(kvret_last_error()).find("device 3"), std::string::npos) << kvret_last_error();
  int64_t length = -1;
  test::expect_ok(kvret_seq_length(seq, 0, &length));
  EXPECT_EQ(length, 0) << "a refused append stores nothing";
  k.t.device = {KVRET_DEVICE_CUDA_HOST, 0};  // pinned host memory: mapped, so the device reads it
  test::expect_ok(kvret_append_prefill(seq, 0, &k.t, &v.t));
  test::expect_ok(kvret_seq_close(seq));
}

#if KVRET_TEST_CUDA_RUNTIME
/// On a GPU: memory that does not match its label is refused before anything runs: device memory labelled as pinned
/// (the host would fault reading it), and pageable host memory where a kernel would read or write it in place (the
/// working set, attention's q and out) on a GPU without pageable memory access (a fault on the device would end
/// every later call of the process). The context goes on working.
TEST_F(OnCudaBackend, OnAGpuMemoryThatDoesNotMatchItsLabelIsRefused) {
  int devices = 0, pageable = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0), cudaSuccess);
  auto ctx = test::make_context(test::small_config(KVRET_INDEX_EXACT));
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  F32 k({300, 2, 64}), v({300, 2, 64});
  test::clustered_kv(300, 2, 64, 5, k, v);
  void* device_keys = nullptr;
  ASSERT_EQ(cudaMalloc(&device_keys, k.data.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device_keys, k.data.data(), k.data.size() * sizeof(float), cudaMemcpyDefault), cudaSuccess);
  kvret_tensor kt = k.t;
  kt.data = device_keys;
  kt.device = {KVRET_DEVICE_CUDA_HOST, 0};
  EXPECT_EQ(kvret_append_prefill(seq, 0, &kt, &v.t), KVRET_ERR_DEVICE);
  EXPECT_NE(std::string(kvret_last_error()).find("k: is labelled KVRET_DEVICE_CUDA_HOST but is device memory"),
            std::string::npos)
      << kvret_last_error();
  int64_t length = -1;
  test::expect_ok(kvret_seq_length(seq, 0, &length));
  EXPECT_EQ(length, 0) << "a refused append stores nothing";
  kt.device = {KVRET_DEVICE_CUDA, 0};  // rightly labelled: stored
  test::expect_ok(kvret_append_prefill(seq, 0, &kt, &v.t));
  EXPECT_EQ(cudaFree(device_keys), cudaSuccess);

  F32 q({8, 64});
  q.data = test::random_vector(8 * 64, 3);
  I32 sel({2, 20});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq, 0, &q.t, 20, &sel.t, &count));
  test::WorkingSetBuffers ws(seq, 0, count, 2, 64);
  std::vector<float> pageable_k(ws.k.data.size()), pageable_q(q.data.begin(), q.data.end()), pageable_out(8 * 64);
  kvret_working_set pageable_ws = ws.ws;
  pageable_ws.k.data = pageable_k.data();
  kvret_tensor pageable_qt = q.t, pageable_outt = q.t;
  pageable_qt.data = pageable_q.data();
  pageable_outt.data = pageable_out.data();
  F32 out({8, 64});
  kvret_stats before, after;
  test::expect_ok(kvret_stats_init(&before));
  test::expect_ok(kvret_stats_init(&after));
  test::expect_ok(kvret_seq_stats(seq, &before));
  int64_t rows = 0;
  if (pageable == 0) {
    EXPECT_EQ(kvret_fetch_async(seq, 0, &sel.t, count, &pageable_ws, &rows, nullptr), KVRET_ERR_DEVICE);
    EXPECT_NE(std::string(kvret_last_error()).find("out.k: is pageable host memory"), std::string::npos)
        << kvret_last_error();
    EXPECT_EQ(kvret_seq_attend(seq, 0, &pageable_qt, 20, 0.0f, &out.t, nullptr), KVRET_ERR_DEVICE);
    EXPECT_NE(std::string(kvret_last_error()).find("q: is pageable host memory"), std::string::npos)
        << kvret_last_error();
    EXPECT_EQ(kvret_seq_attend(seq, 0, &q.t, 20, 0.0f, &pageable_outt, nullptr), KVRET_ERR_DEVICE);
    EXPECT_NE(std::string(kvret_last_error()).find("out: is pageable host memory"), std::string::npos)
        << kvret_last_error();
    test::expect_ok(kvret_seq_stats(seq, &after));
    EXPECT_EQ(after.fetches, before.fetches) << "refused calls change nothing";
    EXPECT_EQ(after.selections, before.selections);
  }
  // the context goes on working
  test::expect_ok(kvret_fetch_async(seq, 0, &sel.t, count, &ws.ws, &rows, nullptr));
  test::expect_ok(kvret_synchronize(ctx.get(), nullptr));
  ws.expect_stored_keys(rows, k.data, 2, 64);
  test::expect_ok(kvret_seq_attend(seq, 0, &q.t, 20, 0.0f, &out.t, nullptr));
  test::expect_ok(kvret_seq_close(seq));
}
#endif

/// config.device_bytes_limit bounds the device memory a context keeps between calls (kvret_seq_attend's working
/// sets): a call that would pass it is KVRET_ERR_CAPACITY naming the field, before anything changes.
TEST_F(OnCudaBackend, DeviceBytesLimitRefusesBeforeAnythingChanges) {
  for (const int64_t limit : {int64_t{1024}, int64_t{1} << 24}) {
    SCOPED_TRACE(limit);
    kvret_config c = test::small_config(KVRET_INDEX_EXACT);
    c.device_bytes_limit = limit;
    auto ctx = test::make_context(c);
    kvret_seq* seq = nullptr;
    test::expect_ok(kvret_seq_open(ctx.get(), &seq));
    F32 k({300, 2, 64}), v({300, 2, 64});
    test::clustered_kv(300, 2, 64, 5, k, v);
    test::expect_ok(kvret_append_prefill(seq, 0, &k.t, &v.t));
    F32 q({8, 64}), out({8, 64}, 7.0f);
    q.data = test::random_vector(8 * 64, 3);
    q.refresh();
    kvret_stats before, after;
    test::expect_ok(kvret_stats_init(&before));
    test::expect_ok(kvret_stats_init(&after));
    test::expect_ok(kvret_seq_stats(seq, &before));
    const kvret_status s = kvret_seq_attend(seq, 0, &q.t, 20, 0.0f, &out.t, nullptr);
    test::expect_ok(kvret_synchronize(ctx.get(), nullptr));
    test::expect_ok(kvret_seq_stats(seq, &after));
    if (limit == 1024) {
      EXPECT_EQ(s, KVRET_ERR_CAPACITY);
      EXPECT_NE(std::string(kvret_last_error()).find("config.device_bytes_limit"), std::string::npos)
          << kvret_last_error();
      EXPECT_EQ(after.selections, before.selections) << "a refused call changes nothing";
      EXPECT_EQ(after.fetches, before.fetches);
      EXPECT_EQ(after.device_bytes, 0);
      EXPECT_EQ(out.data[0], 7.0f) << "nothing written";
    } else {
      EXPECT_EQ(s, KVRET_OK) << kvret_last_error();
      EXPECT_GT(after.device_bytes, 0);
      EXPECT_LE(after.device_bytes, limit);
      EXPECT_EQ(after.selections, before.selections + 1);
    }
    test::expect_ok(kvret_seq_close(seq));
  }
}

TEST(DeviceBytesLimit, IsValidatedAndTheCpuBackendIgnoresIt) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.device_bytes_limit = -1;
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("device_bytes_limit"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(ctx, nullptr);
  if (test::device_type() != KVRET_DEVICE_CPU) return;
  c.device_bytes_limit = 1;  // the CPU backend keeps no device memory
  auto cpu = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(cpu.get(), &seq));
  F32 k({300, 2, 64}), v({300, 2, 64});
  test::clustered_kv(300, 2, 64, 5, k, v);
  test::expect_ok(kvret_append_prefill(seq, 0, &k.t, &v.t));
  F32 q({8, 64}), out({8, 64});
  q.data = test::random_vector(8 * 64, 3);
  q.refresh();
  test::expect_ok(kvret_seq_attend(seq, 0, &q.t, 20, 0.0f, &out.t, nullptr));
  test::expect_ok(kvret_seq_close(seq));
}

/// select, fetch, attend and read on this backend equal the CPU backend's, bit for bit where no arithmetic is
/// involved (positions, gathered rows, read rows), and the copies of device outputs leave every element between
/// the written ones as it was.
TEST_F(OnCudaBackend, ResultsEqualTheCpuBackendsAndGapsStayUntouched) {
  for (const int kind : {KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE}) {
    SCOPED_TRACE(kind);
    kvret_config cuda_config = test::small_config(kind), cpu_config = cuda_config;
    cpu_config.device_type = KVRET_DEVICE_CPU;
    cuda_config.cache_capacity_tokens = 0;  // no block cache: every row over the bus (test_block_cache_backend.cpp)
    auto cuda = test::make_context(cuda_config), cpu = test::make_context(cpu_config);
    kvret_seq *a = nullptr, *b = nullptr;
    test::expect_ok(kvret_seq_open(cuda.get(), &a));
    test::expect_ok(kvret_seq_open(cpu.get(), &b));
    F32 k({900, 2, 64}), v({900, 2, 64});
    test::clustered_kv(900, 2, 64, 11, k, v);
    F32 k_cpu = k, v_cpu = v;
    k_cpu.refresh();
    v_cpu.refresh();
    k_cpu.t.device = v_cpu.t.device = {KVRET_DEVICE_CPU, 0};
    test::expect_ok(kvret_append_prefill(a, 0, &k.t, &v.t));
    test::expect_ok(kvret_append_prefill(b, 0, &k_cpu.t, &v_cpu.t));
    F32 q({8, 64});
    q.data = test::random_vector(8 * 64, 3);
    q.refresh();
    F32 q_cpu = q;
    q_cpu.refresh();
    q_cpu.t.device = {KVRET_DEVICE_CPU, 0};
    // a strided output: 30 columns, of which select writes 20; the rest hold a marker that must survive
    I32 sel({2, 30}, -7), sel_cpu({2, 30}, -7);
    sel_cpu.t.device = {KVRET_DEVICE_CPU, 0};
    int32_t na = 0, nb = 0;
    test::expect_ok(kvret_select(a, 0, &q.t, 20, &sel.t, &na));
    test::expect_ok(kvret_select(b, 0, &q_cpu.t, 20, &sel_cpu.t, &nb));
    ASSERT_EQ(na, 20);
    EXPECT_EQ(sel.data, sel_cpu.data);
    for (int h = 0; h < 2; ++h)
      for (int i = 20; i < 30; ++i) EXPECT_EQ(sel.data[static_cast<size_t>(h * 30 + i)], -7);
    int64_t capacity = 0, rows_a = 0, rows_b = 0;
    test::expect_ok(kvret_working_set_capacity(a, 0, na, &capacity));
    F32 wk({2, capacity, 64}), wv({2, capacity, 64}), wk_cpu({2, capacity, 64}), wv_cpu({2, capacity, 64});
    I32 wp({2, capacity}), wp_cpu({2, capacity});
    for (auto* t : {&wk_cpu.t, &wv_cpu.t, &wp_cpu.t}) t->device = {KVRET_DEVICE_CPU, 0};
    const kvret_working_set ws{wk.t, wv.t, wp.t}, ws_cpu{wk_cpu.t, wv_cpu.t, wp_cpu.t};
    test::expect_ok(kvret_fetch_async(a, 0, &sel.t, na, &ws, &rows_a, nullptr));
    test::expect_ok(kvret_fetch_async(b, 0, &sel_cpu.t, nb, &ws_cpu, &rows_b, nullptr));
    ASSERT_EQ(rows_a, rows_b);
    kvret_stats stats_a, stats_b;
    kvret_stats_init(&stats_a);
    kvret_stats_init(&stats_b);
    test::expect_ok(kvret_seq_stats(a, &stats_a));
    test::expect_ok(kvret_seq_stats(b, &stats_b));
    // (EXACT's select reads every middle key over the bus too: 900 tokens less 4 sink and 16 local, 2 KV heads)
    const int64_t select_bytes = kind == KVRET_INDEX_EXACT ? (900 - 4 - 16) * 2 * 64 * 4 : 0;
    EXPECT_EQ(stats_a.bytes_h2d, 2 * rows_a * 2 * 64 * 4 + select_bytes) << "every key and value row read over the bus";
    EXPECT_EQ(stats_b.bytes_h2d, 0);
    EXPECT_EQ(wp.data, wp_cpu.data);
    EXPECT_EQ(wk.data, wk_cpu.data);
    EXPECT_EQ(wv.data, wv_cpu.data);
    F32 out({8, 64}), out_cpu({8, 64});
    out_cpu.t.device = {KVRET_DEVICE_CPU, 0};
    test::expect_ok(kvret_attend(cuda.get(), &q.t, &wk.t, &wv.t, rows_a, 0.0f, &out.t, nullptr));
    test::expect_ok(kvret_attend(cpu.get(), &q_cpu.t, &wk_cpu.t, &wv_cpu.t, rows_b, 0.0f, &out_cpu.t, nullptr));
    for (size_t i = 0; i < out.data.size(); ++i) EXPECT_NEAR(out.data[i], out_cpu.data[i], 1e-5f) << i;
    F32 seq_out({8, 64});
    test::expect_ok(kvret_seq_attend(a, 0, &q.t, 20, 0.0f, &seq_out.t, nullptr));
    for (size_t i = 0; i < out.data.size(); ++i) EXPECT_NEAR(seq_out.data[i], out_cpu.data[i], 1e-5f) << i;
    test::expect_ok(kvret_seq_stats(a, &stats_a));
    // PAGE: kvret_select ran on the device, which keeps a copy of the page bounds ([2, pages, 2, 64] f32)
    const int64_t bounds = kind == KVRET_INDEX_PAGE ? 2 * ((900 - 4 - 16 + 15) / 16) * 2 * 64 * 4 : 0;
    // PQ likewise keeps a copy of its index (m = 4 x 6 bits over the 880 middle tokens, 44 of them exact, per KV
    // head: the f32 codebook, the exact count, an i32 item and 4 code bytes per token, the exact keys as f32)
    const int64_t pq_index = kind == KVRET_INDEX_PQ ? 2 * ((4 * 64 * 16 + 1 + 880 + 44 * 64) * 4 + 880 * 4) : 0;
    // every kind here selects on the device, so kvret_seq_attend's selection stays there, in a buffer of [2, 20]
    // positions
    const int64_t selection = 2 * 20 * 4;
    EXPECT_EQ(stats_a.device_bytes, 2 * (2 * capacity * 64 * 4) + 2 * capacity * 4 + bounds + pq_index + selection)
        << "seq_attend's f32 working set and positions, in device memory";
    F32 rk({10, 2, 64}, 5.0f), rv({10, 2, 64});
    test::expect_ok(kvret_seq_read(a, 0, 100, 110, &rk.t, &rv.t));
    for (int64_t t = 0; t < 10; ++t)
      for (int i = 0; i < 2 * 64; ++i)
        ASSERT_EQ(rk.data[static_cast<size_t>(t * 128 + i)], k.data[static_cast<size_t>((100 + t) * 128 + i)]);
    test::expect_ok(kvret_seq_close(a));
    test::expect_ok(kvret_seq_close(b));
  }
}

}  // namespace
