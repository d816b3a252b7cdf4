// Sizes whose byte counts do not fit in 64 bits are refused with a status, never wrapped: a broadcast (stride-0)
// prefill of 2^54 or INT64_MAX tokens under a host limit (the byte count once wrapped negative and skipped the
// limit, or the page count to 0 and the append wrote through an empty page list), shapes whose element count
// overflows, an offset past 2^63 bytes; and NULL data with an offset on an empty tensor is accepted without
// pointer arithmetic on it. The sequence is unchanged after each refusal.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace kvret {
namespace {

using test::F32;

struct HugeSizes : ::testing::Test {
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  std::vector<float> row = std::vector<float>(2 * 64, 0.5f);

  void SetUp() override {
    kvret_config c = test::small_config(KVRET_INDEX_EXACT);
    c.host_bytes_limit = int64_t{1} << 30;
    ctx = test::make_context(c);
    test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  }
  /// A [tokens, 2, 64] f32 view of one token repeated (stride 0 over tokens).
  kvret_tensor broadcast(const int64_t* shape, const int64_t* strides) {
    kvret_tensor t{};
    t.data = row.data();
    t.device = test::device();
    t.ndim = 3;
    t.dtype = {KVRET_DTYPE_FLOAT, 32, 1};
    t.shape = shape;
    t.strides = strides;
    return t;
  }
  int64_t length() {
    int64_t n = -1;
    test::expect_ok(kvret_seq_length(seq, 0, &n));
    return n;
  }
};

TEST_F(HugeSizes, BroadcastPrefillsBeyondWhatALayerHoldsAreRefused) {
  const int64_t strides[] = {0, 64, 1};
  for (const int64_t tokens : {(int64_t{1} << 31), (int64_t{1} << 54), INT64_MAX}) {
    const int64_t shape[] = {tokens, 2, 64};
    const kvret_tensor k = broadcast(shape, strides), v = broadcast(shape, strides);
    EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_ERR_CAPACITY) << tokens << ": " << kvret_last_error();
    EXPECT_NE(std::string(kvret_last_error()).find("2^31 - 1"), std::string::npos) << kvret_last_error();
    EXPECT_EQ(length(), 0);
  }
  // within the token limit, the host limit (1 GiB) refuses it by its real byte count
  const int64_t shape[] = {(int64_t{1} << 31) - 1, 2, 64};
  const kvret_tensor k = broadcast(shape, strides), v = broadcast(shape, strides);
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_ERR_CAPACITY) << kvret_last_error();
  EXPECT_NE(std::string(kvret_last_error()).find("host_bytes_limit"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(length(), 0);
  // and a legal append still works
  const int64_t small[] = {40, 2, 64};
  const kvret_tensor ks = broadcast(small, strides), vs = broadcast(small, strides);
  test::expect_ok(kvret_append_prefill(seq, 0, &ks, &vs));
  EXPECT_EQ(length(), 40);
}

TEST_F(HugeSizes, ShapesAndOffsetsPast64BitsAreRefused) {
  const int64_t wide[] = {int64_t{1} << 40, int64_t{1} << 40, 64};  // contiguous: 2^86 elements
  kvret_tensor k = broadcast(wide, nullptr);
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &k), KVRET_ERR_SHAPE) << kvret_last_error();
  EXPECT_NE(std::string(kvret_last_error()).find("2^63 bytes"), std::string::npos) << kvret_last_error();
  const int64_t shape[] = {4, 2, 64};
  const int64_t strides[] = {INT64_MAX / 2, 64, 1};  // the last token's offset overflows
  k = broadcast(shape, strides);
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &k), KVRET_ERR_SHAPE) << kvret_last_error();
  const int64_t plain[] = {4, 2, 64};
  k = broadcast(plain, nullptr);
  k.byte_offset = UINT64_MAX - 8;
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &k), KVRET_ERR_SHAPE) << kvret_last_error();
  EXPECT_EQ(length(), 0);
}

TEST_F(HugeSizes, EmptyTensorWithNullDataAndAnOffsetIsAccepted) {
  const int64_t empty[] = {0, 2, 64};
  kvret_tensor k = broadcast(empty, nullptr);
  k.data = nullptr;
  k.byte_offset = 4096;
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &k));
  EXPECT_EQ(length(), 0);
  const int64_t one[] = {1, 2, 64};
  k.shape = one;  // not empty: NULL data is refused
  EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &k), KVRET_ERR_INVALID_ARGUMENT) << kvret_last_error();
}

}  // namespace
}  // namespace kvret
