// The model geometry is bounded at create: n_layers = 2^31 - 1 was accepted, and opening a sequence then grew RSS by
// gigabytes per second. Past its bound a field is KVRET_ERR_INVALID_ARGUMENT naming it and the limit, no context is
// made; a host_bytes_limit that cannot hold one token in every layer is refused the same way.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kvret.h"
#include "test_util.hpp"

namespace {

void expect_refused(const kvret_config& c, const char* field, const char* limit) {
  kvret_context* ctx = reinterpret_cast<kvret_context*>(0x1);
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << field;
  EXPECT_EQ(ctx, nullptr);
  const std::string message = kvret_last_error();
  EXPECT_NE(message.find(field), std::string::npos) << message;
  EXPECT_NE(message.find(limit), std::string::npos) << message;
}

TEST(GeometryBounds, HugeLayerAndHeadCountsAreRefusedNamingTheLimit) {
  kvret_config c = kvret::test::small_config(KVRET_INDEX_EXACT);
  c.n_layers = INT32_MAX;
  expect_refused(c, "n_layers", "1..4096");
  c.n_layers = 4097;
  expect_refused(c, "n_layers", "1..4096");
  c = kvret::test::small_config(KVRET_INDEX_EXACT);
  c.n_q_heads = 1 << 30;
  c.n_kv_heads = 1 << 30;
  expect_refused(c, "n_q_heads", "1..4096");
  c = kvret::test::small_config(KVRET_INDEX_EXACT);
  c.head_dim = INT32_MAX;
  expect_refused(c, "head_dim", "64, 128 or 256");
}

TEST(GeometryBounds, TheLargestGeometryIsAccepted) {
  kvret_config c = kvret::test::small_config(KVRET_INDEX_EXACT);
  c.n_layers = 4096;
  c.n_q_heads = 4096;
  c.n_kv_heads = 8;
  auto ctx = kvret::test::make_context(c);
  ASSERT_NE(ctx, nullptr);
  kvret_seq* seq = nullptr;
  KVRET_ASSERT_OK(kvret_seq_open(ctx.get(), &seq));
  int64_t tokens = -1;
  KVRET_ASSERT_OK(kvret_seq_length(seq, 4095, &tokens));
  EXPECT_EQ(tokens, 0);
  EXPECT_EQ(kvret_seq_length(seq, 4096, &tokens), KVRET_ERR_OUT_OF_RANGE);
  KVRET_ASSERT_OK(kvret_seq_close(seq));
}

TEST(GeometryBounds, HostBytesLimitMustHoldOneTokenInEveryLayer) {
  kvret_config c = kvret::test::small_config(KVRET_INDEX_EXACT);  // 2 layers, 2 KV heads x 64, f32
  const int64_t page = 256 * 2 * 2 * 64 * 4;                      // one 256-token page of K and V
  c.host_bytes_limit = 2 * page - 1;
  expect_refused(c, "host_bytes_limit", std::to_string(2 * page).c_str());
  c.host_bytes_limit = 2 * page;
  auto ctx = kvret::test::make_context(c);
  ASSERT_NE(ctx, nullptr);
  kvret_seq* seq = nullptr;
  KVRET_ASSERT_OK(kvret_seq_open(ctx.get(), &seq));
  kvret::test::F32 k({1, 2, 64}, 1.0f), v({1, 2, 64}, 1.0f);
  for (int32_t layer = 0; layer < 2; ++layer) KVRET_ASSERT_OK(kvret_append_prefill(seq, layer, &k, &v));
  KVRET_ASSERT_OK(kvret_seq_close(seq));
}

}  // namespace
