// Alignment checks and row clamps of the KV-reading kernels, and the device windows' rule (kernels/math/kv_math.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
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

/// The device windows over random grows, truncates and drop_fronts of a layer, against the layer itself (each
/// position's content a fresh id): a refresh loads exactly the wanted rows the windows lack (never one they hold,
/// never more than their rows), a row the windows hold always has the layer's content at that position, the sink
/// holds the first sink_slots positions and the local rows end at the layer's end, and once the local rows hold the
/// whole wanted window, refreshes with only grows in between keep it so.
TEST(KvMath, WindowsHoldOnlyTheLayersRowsAndLoadOnlyWhatTheyLack) {
  for (const int32_t sink_slots : {0, 3, 16}) {
    for (const int32_t local_slots : {0, 1, 5, 64}) {
      SCOPED_TRACE(sink_slots * 1000 + local_slots);
      std::mt19937_64 rng(static_cast<uint64_t>(sink_slots * 131 + local_slots));
      std::vector<int64_t> layer;                                                    // content id per position
      std::vector<int64_t> rows(static_cast<size_t>(sink_slots + local_slots), -1);  // content id per window row
      WindowRows held;
      held.sink_slots = sink_slots;
      held.local_slots = local_slots;
      int64_t next_id = 0;
      bool only_grew = true;  // since the windows last held all they want
      for (int op = 0; op < 3000; ++op) {
        const uint64_t kind = rng() % 10;
        const auto size = static_cast<int64_t>(layer.size());
        if (kind < 6) {  // a grow: a decode or a chunk
          const int64_t n = kind < 4 ? 1 : 1 + static_cast<int64_t>(rng() % 150);
          for (int64_t i = 0; i < n; ++i) layer.push_back(next_id++);
        } else if (kind == 6 && size > 0) {  // a truncate
          const int64_t to =
              size - 1 - static_cast<int64_t>(rng() % static_cast<uint64_t>(std::min<int64_t>(size, 40)));
          layer.resize(static_cast<size_t>(to));
          held = window_drop_from(held, to);
          only_grew = false;
        } else if (kind == 7 && size > 0) {  // a drop_front: the rows past `keep` move
          const int64_t keep = static_cast<int64_t>(rng() % static_cast<uint64_t>(size));
          const int64_t count = std::min<int64_t>(size - keep, 1 + static_cast<int64_t>(rng() % 30));
          layer.erase(layer.begin() + keep, layer.begin() + keep + count);
          held = window_drop_from(held, keep);
          only_grew = false;
        } else {  // a refresh, as a gather makes one
          const WindowRefresh r = window_refresh(held, size);
          ASSERT_EQ(r.next.sink_slots, sink_slots);
          ASSERT_EQ(r.next.local_slots, local_slots);
          const int64_t sink_to = std::min<int64_t>(sink_slots, size);
          const int64_t wanted = local_slots == 0 ? size : std::max(sink_to, size - local_slots);
          int64_t lacking = 0;  // wanted rows the windows lack now
          for (int64_t p = 0; p < size; ++p) {
            const bool is_wanted = p < sink_to || (p >= wanted && p >= r.next.local_begin);
            if (is_wanted && window_slot(held, p) < 0) ++lacking;
          }
          int64_t loaded = 0;
          for (const auto& [from, to] : {std::pair{r.sink_from, r.sink_to}, std::pair{r.local_from, r.local_to}}) {
            ASSERT_LE(from, to);
            for (int64_t p = from; p < to; ++p, ++loaded) {
              ASSERT_LT(window_slot(held, p), 0) << "loads position " << p << ", which the windows hold";
              const int32_t w = window_slot(r.next, p);
              ASSERT_GE(w, 0);
              rows[static_cast<size_t>(w)] = layer[static_cast<size_t>(p)];
            }
          }
          EXPECT_EQ(loaded, lacking);
          ASSERT_LE(loaded, sink_slots + local_slots);
          held = r.next;
          EXPECT_EQ(held.sink_end, sink_to);
          if (local_slots > 0 && size > sink_to) {
            EXPECT_EQ(held.local_end, size);
          }
          ASSERT_LE(held.local_end - held.local_begin, local_slots);
          const bool complete = held.local_begin == (local_slots == 0 ? held.local_end : wanted);
          EXPECT_TRUE(complete || !only_grew) << "op " << op;
          only_grew = complete;
        }
        for (int64_t p = -2; p < static_cast<int64_t>(layer.size()) + 2; ++p) {
          const int32_t w = window_slot(held, p);
          if (w < 0) continue;
          ASSERT_LT(p, static_cast<int64_t>(layer.size())) << "holds a position past the layer";
          ASSERT_GE(p, 0);
          ASSERT_EQ(rows[static_cast<size_t>(w)], layer[static_cast<size_t>(p)])
              << "stale row at " << p << ", op " << op;
        }
      }
    }
  }
}

}  // namespace
