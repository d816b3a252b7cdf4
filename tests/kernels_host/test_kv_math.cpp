// Alignment checks and row clamps of the KV-reading kernels (kernels/math/kv_math.h).
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "math/kv_math.h"

namespace {

using namespace kvret::cuda;
using namespace kvret::cuda::math;

TEST(KvMath, HostViewAlignment) {
  alignas(16) static std::byte store[4][4096];
  const void* k_pages[2] = {store[0], store[1]};
  const void* v_pages[2] = {store[2], store[3]};
  HostKvView view;
  view.page_tokens = 8;
  view.token_stride = 512;  // 2 heads x 128 x f16
  view.head_stride = 256;
  view.n_tokens = 16;
  EXPECT_TRUE(host_kv_view_aligned(view, k_pages, v_pages, 2));

  const void* odd_k[2] = {store[0] + 8, store[1]};  // a page base off by 8 bytes
  EXPECT_FALSE(host_kv_view_aligned(view, odd_k, v_pages, 2));
  const void* odd_v[2] = {store[2], store[3] + 2};
  EXPECT_FALSE(host_kv_view_aligned(view, k_pages, odd_v, 2));

  HostKvView strided = view;
  strided.token_stride = 520;  // rows at 8-byte offsets
  EXPECT_FALSE(host_kv_view_aligned(strided, k_pages, v_pages, 2));
  strided = view;
  strided.head_stride = 200;
  EXPECT_FALSE(host_kv_view_aligned(strided, k_pages, v_pages, 2));

  HostKvView too_many = view;
  too_many.n_tokens = 17;  // two pages of 8 tokens hold 16
  EXPECT_FALSE(host_kv_view_aligned(too_many, k_pages, v_pages, 2));
  HostKvView no_pages = view;
  no_pages.page_tokens = 0;
  EXPECT_FALSE(host_kv_view_aligned(no_pages, k_pages, v_pages, 2));
  HostKvView empty = view;
  empty.n_tokens = 0;
  EXPECT_TRUE(host_kv_view_aligned(empty, nullptr, nullptr, 0));
}

TEST(KvMath, DenseRowsAlignment) {
  alignas(16) static std::byte buf[64];
  EXPECT_TRUE(dense_rows_aligned(buf, 256));
  EXPECT_FALSE(dense_rows_aligned(buf + 4, 256));
  EXPECT_FALSE(dense_rows_aligned(buf, 72));
}

TEST(KvMath, RowClamps) {
  EXPECT_EQ(attention_clamp_rows(100, 200, 150), 100);
  EXPECT_EQ(attention_clamp_rows(300, 200, 400), 200);  // rows past kv_capacity belong to the next head
  EXPECT_EQ(attention_clamp_rows(300, 400, 256), 256);  // past the launch's max_rows: no chunk for them
  EXPECT_EQ(attention_clamp_rows(-1, 400, 256), 0);
  EXPECT_EQ(gather_clamp_rows(50, 40, 64), 40);
  EXPECT_EQ(gather_clamp_rows(50, 400, 32), 32);
  EXPECT_EQ(gather_clamp_rows(-2, 400, 32), 0);
}

TEST(KvMath, AttentionRowsZeroForMisalignedBases) {
  alignas(16) static std::byte k[64], v[64];
  EXPECT_EQ(attention_rows(300, 200, 400, k, v), 200);    // the clamp
  EXPECT_EQ(attention_rows(300, 200, 400, k + 2, v), 0);  // two-byte aligned K: no 16-byte pieces, zero output
  EXPECT_EQ(attention_rows(300, 200, 400, k, v + 8), 0);
}

TEST(KvMath, AttentionTilesFitTheSharedMemory) {
  // two stages of a K and a V tile of 32 rows
  EXPECT_EQ(attention_kv_smem_bytes(128, 2), size_t{2} * 2 * 32 * 256);
  for (int head_dim : {64, 128, 256}) {
    for (int elem : {2, 4}) {
      const size_t bytes = attention_kv_smem_bytes(head_dim, elem);
      EXPECT_EQ(bytes % 16, 0u);  // every piece is 16 bytes
      EXPECT_EQ(bytes / (static_cast<size_t>(kAttentionStages) * 2 * kAttentionTileRows),
                static_cast<size_t>(head_dim) * static_cast<size_t>(elem));
      // with the kernel's static part (16 query heads of head_dim floats, the weights, 1 KiB reserved) within an
      // H100's 227 KiB per block
      EXPECT_LE(bytes + 4 * (16 * static_cast<size_t>(head_dim) + 16 * 32 + 48) + 1024, size_t{227} * 1024);
    }
  }
}

}  // namespace
