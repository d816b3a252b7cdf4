// Bad input for every call: a specific status, a message, and the sequence exactly as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;
using test::I32;

/// Everything observable about a sequence, to compare before and after a failed call.
struct Snapshot {
  std::vector<int64_t> lengths;
  std::vector<int32_t> selection;
  std::vector<float> keys;
  int64_t tokens = 0, host_bytes = 0;
  bool operator==(const Snapshot& o) const {
    return lengths == o.lengths && selection == o.selection && keys == o.keys && tokens == o.tokens &&
           host_bytes == o.host_bytes;
  }
};

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = test::small_config(KVRET_INDEX_PQ);
    config_.max_seq_tokens = 1000;
    ctx_ = test::make_context(config_);
    ASSERT_EQ(kvret_seq_open(ctx_.get(), &seq_), KVRET_OK);
    test::clustered_kv(600, 2, 64, 1, k_, v_);
    for (int l = 0; l < 2; ++l) ASSERT_EQ(kvret_append_prefill(seq_, l, &k_, &v_), KVRET_OK);
    q_.data = test::random_vector(512, 2);
    q_.refresh();
    k1_.data = test::random_vector(128, 3);
    k1_.refresh();
  }

  Snapshot snapshot() {
    Snapshot s;
    for (int l = 0; l < 2; ++l) {
      int64_t n = 0;
      EXPECT_EQ(kvret_seq_length(seq_, l, &n), KVRET_OK);
      s.lengths.push_back(n);
      I32 out({2, 50});
      int32_t count = 0;
      EXPECT_EQ(kvret_select(seq_, l, &q_, 50, &out, &count), KVRET_OK) << kvret_last_error();
      s.selection.insert(s.selection.end(), out.data.begin(), out.data.end());
      F32 rk({n, 2, 64}), rv({n, 2, 64});
      EXPECT_EQ(kvret_seq_read(seq_, l, 0, n, &rk, &rv), KVRET_OK);
      s.keys.insert(s.keys.end(), rk.data.begin(), rk.data.end());
    }
    kvret_stats st;
    kvret_stats_init(&st);
    EXPECT_EQ(kvret_seq_stats(seq_, &st), KVRET_OK);
    s.tokens = st.tokens_stored;
    s.host_bytes = st.host_bytes;
    return s;
  }

  /// Runs a call that must fail with `want`, leave a message naming `needle`, and change nothing.
  void expect_rejected(kvret_status want, const std::string& needle, const std::function<kvret_status()>& call) {
    const Snapshot before = snapshot();
    kvret_clear_error();
    const kvret_status got = call();
    EXPECT_EQ(got, want) << "got " << kvret_status_string(got) << ": " << kvret_last_error();
    const std::string message = kvret_last_error();
    EXPECT_FALSE(message.empty());
    EXPECT_NE(message.find(needle), std::string::npos) << "message: " << message;
    EXPECT_TRUE(snapshot() == before) << "the sequence changed after a rejected call: " << message;
  }

  kvret_config config_;
  test::ContextPtr ctx_;
  kvret_seq* seq_ = nullptr;
  F32 k_{{600, 2, 64}}, v_{{600, 2, 64}};
  F32 q_{{8, 64}};
  F32 k1_{{2, 64}}, v1_{{2, 64}};
};

// A closed sequence's or destroyed context's handle stays dead when the allocator gives its memory to a new one
// (the registry once keyed on the object's address, so the new sequence answered for the old handle).
TEST_F(BadInput, HandlesAreNotRevivedByAddressReuse) {
  int64_t n = 0;
  for (int round = 0; round < 50; ++round) {
    kvret_seq* old_seq = nullptr;
    ASSERT_EQ(kvret_seq_open(ctx_.get(), &old_seq), KVRET_OK);
    ASSERT_EQ(kvret_seq_close(old_seq), KVRET_OK);
    kvret_seq* new_seq = nullptr;
    ASSERT_EQ(kvret_seq_open(ctx_.get(), &new_seq), KVRET_OK);  // often at the same address
    EXPECT_NE(new_seq, old_seq);
    expect_rejected(KVRET_ERR_INVALID_HANDLE, "closed", [&] { return kvret_seq_length(old_seq, 0, &n); });
    ASSERT_EQ(kvret_seq_length(new_seq, 0, &n), KVRET_OK);
    ASSERT_EQ(kvret_seq_close(new_seq), KVRET_OK);

    kvret_context* old_ctx = nullptr;
    ASSERT_EQ(kvret_create(&config_, &old_ctx), KVRET_OK);
    ASSERT_EQ(kvret_destroy(old_ctx), KVRET_OK);
    auto new_ctx = test::make_context(config_);
    EXPECT_NE(new_ctx.get(), old_ctx);
    kvret_stats st;
    kvret_stats_init(&st);
    expect_rejected(KVRET_ERR_INVALID_HANDLE, "destroyed", [&] { return kvret_context_stats(old_ctx, &st); });
  }
}

TEST_F(BadInput, Handles) {
  int64_t n = 0;
  int fake = 0;
  auto* foreign_seq = reinterpret_cast<kvret_seq*>(&fake);
  auto* foreign_ctx = reinterpret_cast<kvret_context*>(&fake);
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "NULL", [&] { return kvret_seq_length(nullptr, 0, &n); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live", [&] { return kvret_seq_length(foreign_seq, 0, &n); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live",
                  [&] { return kvret_append_prefill(foreign_seq, 0, &k_, &v_); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live",
                  [&] { return kvret_append_decode(foreign_seq, 0, &k1_, &v1_); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live", [&] { return kvret_wait_index(foreign_seq, 0); });
  I32 out({2, 10});
  int32_t count = 0;
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live",
                  [&] { return kvret_select(foreign_seq, 0, &q_, 10, &out, &count); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live", [&] { return kvret_seq_close(foreign_seq); });
  kvret_seq* seq2 = nullptr;
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live", [&] { return kvret_seq_open(foreign_ctx, &seq2); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "NULL", [&] { return kvret_seq_open(nullptr, &seq2); });
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live", [&] { return kvret_destroy(foreign_ctx); });
  kvret_stats st;
  kvret_stats_init(&st);
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "not a live", [&] { return kvret_context_stats(foreign_ctx, &st); });
  F32 o({8, 64});
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "NULL",
                  [&] { return kvret_attend(nullptr, &q_, &k_, &v_, 1, 0, &o, nullptr); });

  // a closed sequence handle is no longer live
  kvret_seq* closed = nullptr;
  ASSERT_EQ(kvret_seq_open(ctx_.get(), &closed), KVRET_OK);
  ASSERT_EQ(kvret_seq_close(closed), KVRET_OK);
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "closed", [&] { return kvret_seq_length(closed, 0, &n); });
  // a sequence of another context cannot join this context's batch
  auto other = test::make_context(config_);
  kvret_seq* alien = nullptr;
  ASSERT_EQ(kvret_seq_open(other.get(), &alien), KVRET_OK);
  ASSERT_EQ(kvret_append_prefill(alien, 0, &k_, &v_), KVRET_OK);
  F32 qb({1, 8, 64});
  I32 ob({1, 2, 10});
  expect_rejected(KVRET_ERR_INVALID_HANDLE, "another context",
                  [&] { return kvret_select_batch(ctx_.get(), 1, &alien, 0, &qb, 10, &ob, &count); });
}

TEST_F(BadInput, NullPointers) {
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "NULL", [&] { return kvret_append_prefill(seq_, 0, nullptr, &v_); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "out_tokens", [&] { return kvret_seq_length(seq_, 0, nullptr); });
  I32 out({2, 10});
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "out_count",
                  [&] { return kvret_select(seq_, 0, &q_, 10, &out, nullptr); });
  F32 k = k_;
  k.refresh();
  k.t.data = nullptr;
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "data is NULL", [&] { return kvret_append_prefill(seq_, 0, &k, &v_); });
  EXPECT_EQ(kvret_config_init(nullptr), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvret_create(nullptr, nullptr), KVRET_ERR_INVALID_ARGUMENT);
}

TEST_F(BadInput, Shapes) {
  F32 wrong_heads({10, 3, 64}), wrong_dim({10, 2, 32}), rank2({10, 128}), mismatched({11, 2, 64});
  F32 ok({10, 2, 64});
  expect_rejected(KVRET_ERR_SHAPE, "n_kv_heads", [&] { return kvret_append_prefill(seq_, 0, &wrong_heads, &ok); });
  expect_rejected(KVRET_ERR_SHAPE, "head_dim", [&] { return kvret_append_prefill(seq_, 0, &ok, &wrong_dim); });
  expect_rejected(KVRET_ERR_SHAPE, "dimensions", [&] { return kvret_append_prefill(seq_, 0, &rank2, &ok); });
  expect_rejected(KVRET_ERR_SHAPE, "tokens", [&] { return kvret_append_prefill(seq_, 0, &ok, &mismatched); });
  F32 two_tokens({2, 2, 64});
  expect_rejected(KVRET_ERR_SHAPE, "one decode step",
                  [&] { return kvret_append_decode(seq_, 0, &two_tokens, &two_tokens); });
  F32 q_bad({4, 64});
  I32 out({2, 10}), out_small({2, 5}), out_heads({3, 10});
  int32_t count = 0;
  expect_rejected(KVRET_ERR_SHAPE, "n_q_heads", [&] { return kvret_select(seq_, 0, &q_bad, 10, &out, &count); });
  expect_rejected(KVRET_ERR_SHAPE, "at least 10", [&] { return kvret_select(seq_, 0, &q_, 10, &out_small, &count); });
  expect_rejected(KVRET_ERR_SHAPE, "n_kv_heads", [&] { return kvret_select(seq_, 0, &q_, 10, &out_heads, &count); });
  // a working set too small for sink + selected + local
  ASSERT_EQ(kvret_select(seq_, 0, &q_, 10, &out, &count), KVRET_OK);
  F32 wk({2, 29, 64}), wv({2, 29, 64});
  I32 wp({2, 29});
  kvret_working_set ws{*wk.get(), *wv.get(), *wp.get()};
  int64_t rows = 0;
  expect_rejected(KVRET_ERR_SHAPE, "needs at least 30",
                  [&] { return kvret_fetch_async(seq_, 0, &out, count, &ws, &rows, nullptr); });
}

TEST_F(BadInput, DtypesStridesDevices) {
  test::Buffer<int32_t> ints({10, 2, 64});
  F32 ok({10, 2, 64});
  expect_rejected(KVRET_ERR_DTYPE, "int32", [&] { return kvret_append_prefill(seq_, 0, &ints, &ok); });
  F32 f64 = ok;
  f64.refresh();
  f64.t.dtype = {KVRET_DTYPE_FLOAT, 64, 1};
  expect_rejected(KVRET_ERR_DTYPE, "unsupported dtype", [&] { return kvret_append_prefill(seq_, 0, &f64, &ok); });
  F32 vec = ok;
  vec.refresh();
  vec.t.dtype.lanes = 4;
  expect_rejected(KVRET_ERR_DTYPE, "lanes", [&] { return kvret_append_prefill(seq_, 0, &vec, &ok); });
  I32 out({2, 10});
  int32_t count = 0;
  F32 out_float({2, 10});
  expect_rejected(KVRET_ERR_DTYPE, "float32", [&] { return kvret_select(seq_, 0, &q_, 10, &out_float, &count); });

  std::vector<int64_t> shape{5, 2, 64}, bad_inner{256, 128, 2}, negative{128, -64, 1};
  F32 big({10, 2, 128});
  kvret_tensor strided = *big.get();
  strided.shape = shape.data();
  strided.strides = bad_inner.data();
  expect_rejected(KVRET_ERR_STRIDE, "innermost", [&] { return kvret_append_prefill(seq_, 0, &strided, &strided); });
  strided.strides = negative.data();
  expect_rejected(KVRET_ERR_STRIDE, "negative", [&] { return kvret_append_prefill(seq_, 0, &strided, &strided); });

  F32 gpu = ok;
  gpu.refresh();
  gpu.t.device = test::foreign_device();
  expect_rejected(KVRET_ERR_DEVICE, "k: device type " + std::to_string(gpu.t.device.device_type),
                  [&] { return kvret_append_prefill(seq_, 0, &gpu, &ok); });
  F32 qgpu = q_;
  qgpu.refresh();
  qgpu.t.device = test::foreign_device();
  expect_rejected(KVRET_ERR_DEVICE, "device type", [&] { return kvret_select(seq_, 0, &qgpu, 10, &out, &count); });
}

TEST_F(BadInput, LayersAndBudgets) {
  F32 ok({10, 2, 64});
  int64_t n = 0;
  I32 out({2, 700});
  int32_t count = 0;
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "layer 2", [&] { return kvret_append_prefill(seq_, 2, &ok, &ok); });
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "layer -1", [&] { return kvret_append_decode(seq_, -1, &k1_, &v1_); });
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "layer 7", [&] { return kvret_seq_length(seq_, 7, &n); });
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "layer 2", [&] { return kvret_select(seq_, 2, &q_, 10, &out, &count); });
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "-1", [&] { return kvret_wait_index(seq_, -5); });
  expect_rejected(KVRET_ERR_BUDGET, ">= 1", [&] { return kvret_select(seq_, 0, &q_, 0, &out, &count); });
  expect_rejected(KVRET_ERR_BUDGET, ">= 1", [&] { return kvret_select(seq_, 0, &q_, -7, &out, &count); });
  expect_rejected(KVRET_ERR_BUDGET, "above the context", [&] { return kvret_select(seq_, 0, &q_, 601, &out, &count); });
  // a budget above the middle but within the context selects the whole middle
  ASSERT_EQ(kvret_select(seq_, 0, &q_, 600, &out, &count), KVRET_OK);
  EXPECT_EQ(count, 600 - 4 - 16);
  // fetch: a position outside the middle, a duplicate, a count above the middle
  I32 sel({2, 3});
  sel.data = {2, 100, 200, 5, 6, 7};
  F32 wk({2, 100, 64}), wv({2, 100, 64});
  I32 wp({2, 100});
  kvret_working_set ws{*wk.get(), *wv.get(), *wp.get()};
  int64_t rows = 0;
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "not a middle position",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, 3, &ws, &rows, nullptr); });
  sel.data = {10, 100, 100, 5, 6, 7};
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "twice",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, 3, &ws, &rows, nullptr); });
  expect_rejected(KVRET_ERR_BUDGET, "exceeds",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, 999, &ws, &rows, nullptr); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "count",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, -1, &ws, &rows, nullptr); });
}

TEST_F(BadInput, CapacityAndState) {
  F32 too_many({401, 2, 64});  // 600 + 401 > max_seq_tokens = 1000
  expect_rejected(KVRET_ERR_CAPACITY, "max_seq_tokens",
                  [&] { return kvret_append_prefill(seq_, 0, &too_many, &too_many); });
  F32 exactly({400, 2, 64});
  ASSERT_EQ(kvret_append_prefill(seq_, 1, &exactly, &exactly), KVRET_OK);  // fills layer 1 to 1000
  expect_rejected(KVRET_ERR_CAPACITY, "max_seq_tokens", [&] { return kvret_append_decode(seq_, 1, &k1_, &v1_); });

  // decode before any prefill of a layer
  kvret_seq* fresh = nullptr;
  ASSERT_EQ(kvret_seq_open(ctx_.get(), &fresh), KVRET_OK);
  EXPECT_EQ(kvret_append_decode(fresh, 0, &k1_, &v1_), KVRET_ERR_STATE);
  I32 out({2, 10});
  int32_t count = 0;
  EXPECT_EQ(kvret_select(fresh, 0, &q_, 10, &out, &count), KVRET_ERR_STATE);
  EXPECT_NE(std::string(kvret_last_error()).find("holds no tokens"), std::string::npos);
  int64_t n = -1;
  ASSERT_EQ(kvret_seq_length(fresh, 0, &n), KVRET_OK);
  EXPECT_EQ(n, 0);
}

TEST_F(BadInput, AttendCapacityConfigAndStats) {
  F32 q({8, 64}), k({2, 40, 64}), v({2, 40, 64}), out({8, 64});
  F32 k_heads({3, 40, 64}), out_small({8, 32});
  test::Buffer<int32_t> out_int({8, 64});
  expect_rejected(KVRET_ERR_SHAPE, "n_kv_heads",
                  [&] { return kvret_attend(ctx_.get(), &q, &k_heads, &v, 10, 0, &out, nullptr); });
  expect_rejected(KVRET_ERR_SHAPE, "rows", [&] { return kvret_attend(ctx_.get(), &q, &k, &v, 41, 0, &out, nullptr); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "rows",
                  [&] { return kvret_attend(ctx_.get(), &q, &k, &v, 0, 0, &out, nullptr); });
  expect_rejected(KVRET_ERR_SHAPE, "head_dim",
                  [&] { return kvret_attend(ctx_.get(), &q, &k, &v, 10, 0, &out_small, nullptr); });
  expect_rejected(KVRET_ERR_DTYPE, "int32",
                  [&] { return kvret_attend(ctx_.get(), &q, &k, &v, 10, 0, &out_int, nullptr); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "scale",
                  [&] { return kvret_attend(ctx_.get(), &q, &k, &v, 10, NAN, &out, nullptr); });

  int64_t rows = 0;
  expect_rejected(KVRET_ERR_BUDGET, "above the context",
                  [&] { return kvret_working_set_capacity(seq_, 0, 100000, &rows); });
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "layer 9", [&] { return kvret_working_set_capacity(seq_, 9, 10, &rows); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "out_rows",
                  [&] { return kvret_working_set_capacity(seq_, 0, 10, nullptr); });
  ASSERT_EQ(kvret_working_set_capacity(seq_, 0, 0, &rows), KVRET_OK);  // 0: sink + local
  EXPECT_EQ(rows, 4 + 16);

  kvret_config c;
  c.struct_size = 0;
  expect_rejected(KVRET_ERR_VERSION, "kvret_config_init", [&] { return kvret_get_config(ctx_.get(), &c); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "out", [&] { return kvret_get_config(ctx_.get(), nullptr); });
  kvret_stats st;
  st.struct_size = 0;
  expect_rejected(KVRET_ERR_VERSION, "kvret_stats_init", [&] { return kvret_seq_stats(seq_, &st); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "out", [&] { return kvret_context_stats(ctx_.get(), nullptr); });
  int32_t budget = 0;
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "out_budget", [&] { return kvret_seq_budget(seq_, 0, nullptr); });
  expect_rejected(KVRET_ERR_OUT_OF_RANGE, "layer 2", [&] { return kvret_seq_budget(seq_, 2, &budget); });

  // fetch into buffers of the wrong dtype or device
  I32 sel({2, 10});
  int32_t count = 0;
  ASSERT_EQ(kvret_select(seq_, 0, &q_, 10, &sel, &count), KVRET_OK);
  test::Buffer<uint16_t> half_k({2, 30, 64}), half_v({2, 30, 64});  // the store is f32: f16 output is not offered
  F32 wk({2, 30, 64}), wv({2, 30, 64});
  I32 wp({2, 30});
  kvret_working_set ws_half{*half_k.get(), *half_v.get(), *wp.get()};
  expect_rejected(KVRET_ERR_DTYPE, "float16",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, count, &ws_half, &rows, nullptr); });
  kvret_working_set ws_gpu{*wk.get(), *wv.get(), *wp.get()};
  ws_gpu.k.device = test::foreign_device();
  expect_rejected(KVRET_ERR_DEVICE, "out.k",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, count, &ws_gpu, &rows, nullptr); });
  expect_rejected(KVRET_ERR_INVALID_ARGUMENT, "NULL",
                  [&] { return kvret_fetch_async(seq_, 0, &sel, count, nullptr, &rows, nullptr); });
}

TEST_F(BadInput, HostBytesLimit) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.host_bytes_limit = 3 * 256 * 1024;  // three 256 KiB pages (256 tokens x 2 heads x 64 x f32 x K,V)
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  ASSERT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
  F32 k({512, 2, 64}), v({512, 2, 64});
  ASSERT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK);            // 2 pages
  EXPECT_EQ(kvret_append_prefill(seq, 1, &k, &v), KVRET_ERR_CAPACITY);  // would need 2 more
  EXPECT_NE(std::string(kvret_last_error()).find("host_bytes_limit"), std::string::npos);
  int64_t n = -1;
  ASSERT_EQ(kvret_seq_length(seq, 1, &n), KVRET_OK);
  EXPECT_EQ(n, 0);
  ASSERT_EQ(kvret_seq_close(seq), KVRET_OK);  // frees its pages: the next sequence fits again
  ASSERT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
  EXPECT_EQ(kvret_append_prefill(seq, 1, &k, &v), KVRET_OK);
}

TEST_F(BadInput, NonFiniteWhenChecking) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.check_finite = 1;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  ASSERT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
  F32 k({100, 2, 64}), v({100, 2, 64});
  k.data[777] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_ERR_NONFINITE);
  EXPECT_NE(std::string(kvret_last_error()).find("NaN"), std::string::npos);
  k.data[777] = 0;
  v.data[5] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_ERR_NONFINITE);
  v.data[5] = 0;
  ASSERT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK);
  F32 q({8, 64});
  q.data[3] = std::numeric_limits<float>::infinity();
  I32 out({2, 10});
  int32_t count = 0;
  EXPECT_EQ(kvret_select(seq, 0, &q, 10, &out, &count), KVRET_ERR_NONFINITE);
}

TEST(Config, BadConfigsAreRejectedWithTheFieldName) {
  struct Case {
    std::function<void(kvret_config&)> edit;
    kvret_status status;
    const char* field;
  };
  const std::vector<Case> cases = {
      {[](kvret_config& c) { c.n_q_heads = 30; }, KVRET_ERR_INVALID_ARGUMENT, "n_q_heads"},
      {[](kvret_config& c) { c.head_dim = 100; }, KVRET_ERR_INVALID_ARGUMENT, "head_dim"},
      {[](kvret_config& c) { c.n_layers = 0; }, KVRET_ERR_INVALID_ARGUMENT, "n_layers"},
      {[](kvret_config& c) { c.kv_dtype = 9; }, KVRET_ERR_INVALID_ARGUMENT, "kv_dtype"},
      {[](kvret_config& c) { c.pq_m = 3; }, KVRET_ERR_INVALID_ARGUMENT, "pq_m"},
      {[](kvret_config& c) { c.pq_bits = 9; }, KVRET_ERR_INVALID_ARGUMENT, "pq_bits"},
      {[](kvret_config& c) { c.budget_ratio = 0; }, KVRET_ERR_INVALID_ARGUMENT, "budget_ratio"},
      {[](kvret_config& c) { c.gqa_fold = 7; }, KVRET_ERR_INVALID_ARGUMENT, "gqa_fold"},
      {[](kvret_config& c) { c.quant_bits = 3; }, KVRET_ERR_INVALID_ARGUMENT, "quant_bits"},
      {[](kvret_config& c) { c.quant_group_size = 48; }, KVRET_ERR_INVALID_ARGUMENT, "quant_group_size"},
      {[](kvret_config& c) { c.quant_residual = -1; }, KVRET_ERR_INVALID_ARGUMENT, "quant_residual"},
      {[](kvret_config& c) { c.device_type = KVRET_DEVICE_CUDA_HOST; }, KVRET_ERR_INVALID_ARGUMENT, "device_type"},
      {[](kvret_config& c) { c.struct_size = 4; }, KVRET_ERR_VERSION, "struct_size"},
  };
  for (const Case& cs : cases) {
    kvret_config c;
    kvret::test::init_config(&c);
    cs.edit(c);
    kvret_context* ctx = reinterpret_cast<kvret_context*>(0x1);
    EXPECT_EQ(kvret_create(&c, &ctx), cs.status) << cs.field;
    EXPECT_EQ(ctx, nullptr);
    EXPECT_NE(std::string(kvret_last_error()).find(cs.field), std::string::npos) << kvret_last_error();
  }
  // an older, smaller struct gets defaults for the fields it lacks
  kvret_config c;
  kvret::test::init_config(&c);
  c.struct_size = offsetof(kvret_config, pq_m);
  c.pq_m = 77;  // beyond the declared size: must be ignored
  kvret_context* ctx = nullptr;
  ASSERT_EQ(kvret_create(&c, &ctx), KVRET_OK) << kvret_last_error();
  kvret_config got;
  kvret::test::init_config(&got);
  ASSERT_EQ(kvret_get_config(ctx, &got), KVRET_OK);
  EXPECT_EQ(got.pq_m, 4);
  kvret_destroy(ctx);
}

// A struct_size that ends inside a field is no version of the struct: half of disk_path's pointer was once copied
// and dereferenced (a segfault). Every size that ends a field, or that end rounded to the struct's alignment (an
// older version's sizeof), is accepted.
TEST(Config, StructSizeInsideAFieldIsRefused) {
  std::string path = "/nonexistent-kvret-disk-tier";
  for (const size_t size : {offsetof(kvret_config, disk_path) + 4, offsetof(kvret_config, disk_path) + 1,
                            offsetof(kvret_config, pq_m) + 2, offsetof(kvret_config, seed) + 4}) {
    kvret_config c;
    kvret::test::init_config(&c);
    c.disk_path = path.c_str();
    c.struct_size = size;
    kvret_context* ctx = reinterpret_cast<kvret_context*>(0x1);
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_VERSION) << size;
    EXPECT_EQ(ctx, nullptr);
    EXPECT_NE(std::string(kvret_last_error()).find("ends inside a field"), std::string::npos) << kvret_last_error();
  }
  for (const size_t size :
       {offsetof(kvret_config, disk_path), offsetof(kvret_config, block_tokens), offsetof(kvret_config, seed),
        offsetof(kvret_config, pq_exact_fraction), sizeof(kvret_config)}) {
    kvret_config c;
    kvret::test::init_config(&c);
    c.struct_size = size;
    kvret_context* ctx = nullptr;
    ASSERT_EQ(kvret_create(&c, &ctx), KVRET_OK) << size << ": " << kvret_last_error();
    kvret_destroy(ctx);
  }
}

TEST(Config, PqExactFractionIsValidated) {
  kvret_config c;
  kvret::test::init_config(&c);
  EXPECT_FLOAT_EQ(c.pq_exact_fraction, 0.05f);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -0.01f, -0.0001f, 0.5001f, 0.75f, 1.0f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    kvret::test::init_config(&c);
    c.pq_exact_fraction = bad;
    kvret_context* ctx = reinterpret_cast<kvret_context*>(0x1);
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_EQ(ctx, nullptr) << bad;
    const std::string message = kvret_last_error();
    EXPECT_NE(message.find("config.pq_exact_fraction"), std::string::npos) << message;
    EXPECT_NE(message.find("[0, 0.5]"), std::string::npos) << message;
  }
  for (const float good : {0.0f, 0.001f, 0.25f, 0.5f}) {
    kvret::test::init_config(&c);
    c.pq_exact_fraction = good;
    kvret_context* ctx = nullptr;
    ASSERT_EQ(kvret_create(&c, &ctx), KVRET_OK) << good << ": " << kvret_last_error();
    kvret_config got;
    kvret::test::init_config(&got);
    ASSERT_EQ(kvret_get_config(ctx, &got), KVRET_OK);
    EXPECT_EQ(got.pq_exact_fraction, good);
    kvret_destroy(ctx);
  }
  // a struct from before the field existed gets its default
  kvret::test::init_config(&c);
  c.struct_size = offsetof(kvret_config, pq_exact_fraction);
  c.pq_exact_fraction = -5.0f;  // beyond the declared size: must be ignored
  kvret_context* ctx = nullptr;
  ASSERT_EQ(kvret_create(&c, &ctx), KVRET_OK) << kvret_last_error();
  kvret_config got;
  kvret::test::init_config(&got);
  ASSERT_EQ(kvret_get_config(ctx, &got), KVRET_OK);
  EXPECT_FLOAT_EQ(got.pq_exact_fraction, 0.05f);
  kvret_destroy(ctx);
}

}  // namespace
}  // namespace kvret
