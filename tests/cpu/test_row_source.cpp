// Row sources: a source added from a test serves the working-set rows it holds before the host store (with no
// change to Sequence or the C layer); fetch takes the rest from the store, counts the source's rows as cache hits,
// converts the source's rows to the output dtype, and reports a source's failure as its status.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <vector>

#include "c_api/handles.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "engine/context.hpp"
#include "fetch/working_set.hpp"
#include "kvret.h"
#include "position_rows.hpp"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

/// Holds every even position: its key row is all `position`, its value row all `-position` (f32 rows).
class EvenPositions final : public RowSource {
 public:
  const char* name() const noexcept override { return "even positions"; }
  int64_t serve(const RowRequest& r) const override {
    ++calls;
    if (fail) throw Error(KVRET_ERR_IO, "the test source is down");
    return test::serve_position_rows(r, 2);
  }
  mutable std::atomic<int64_t> calls{0};
  bool fail = false;
};

struct Fixture {
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  F32 k{{600, 2, 64}}, v{{600, 2, 64}};
  explicit Fixture(int kv_dtype) {
    kvret_config c = test::small_config(KVRET_INDEX_EXACT);
    c.kv_dtype = kv_dtype;
    ctx = test::make_context(c);
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    test::clustered_kv(600, 2, 64, 4, k, v);
    EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK) << kvret_last_error();
  }
  ~Fixture() { kvret_seq_close(seq); }
  Context& context() { return *context_from_handle(ctx.get()); }
};

TEST(RowSource, ServesItsRowsBeforeTheStore) {
  Fixture f(KVRET_KV_F32);
  auto source = std::make_shared<EvenPositions>();
  f.context().add_row_source(source);
  F32 q({8, 64}, 0.25f);
  I32 selected({2, 40});
  int32_t count = 0;
  test::expect_ok(kvret_select(f.seq, 0, &q, 40, &selected, &count));
  test::WorkingSetBuffers ws(f.seq, 0, count, 2, 64);
  int64_t rows = 0;
  test::expect_ok(kvret_fetch_async(f.seq, 0, &selected, count, &ws.ws, &rows, nullptr));
  EXPECT_EQ(source->calls.load(), 2) << "once per KV head";
  int64_t even = 0;
  for (int h = 0; h < 2; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t pos = ws.positions.data[static_cast<size_t>(h * ws.capacity + r)];
      const float key = ws.k.data[static_cast<size_t>((h * ws.capacity + r) * 64)];
      const float value = ws.v.data[static_cast<size_t>((h * ws.capacity + r) * 64 + 63)];
      if (pos % 2 == 0) {
        ++even;
        ASSERT_EQ(key, static_cast<float>(pos)) << "head " << h << " row " << r;
        ASSERT_EQ(value, -static_cast<float>(pos));
      } else {
        ASSERT_EQ(key, f.k.data[static_cast<size_t>((pos * 2 + h) * 64)]) << "from the store";
        ASSERT_EQ(value, f.v.data[static_cast<size_t>((pos * 2 + h) * 64 + 63)]);
      }
    }
  kvret_stats st;
  kvret_stats_init(&st);
  test::expect_ok(kvret_seq_stats(f.seq, &st));
  EXPECT_EQ(st.cache_hits, even);
  EXPECT_EQ(st.cache_misses, 2 * rows - even);
}

// The source writes f32 rows; an f16 store with f16 output buffers gets them converted.
TEST(RowSource, RowsAreConvertedToTheOutputDtype) {
  Fixture f(KVRET_KV_F16);
  f.context().add_row_source(std::make_shared<EvenPositions>());
  F32 q({8, 64}, 0.25f);
  I32 selected({2, 8});
  int32_t count = 0;
  test::expect_ok(kvret_select(f.seq, 0, &q, 8, &selected, &count));
  int64_t capacity = 0;
  test::expect_ok(kvret_working_set_capacity(f.seq, 0, count, &capacity));
  test::Buffer<uint16_t> k({2, capacity, 64}), v({2, capacity, 64});
  I32 positions({2, capacity});
  kvret_working_set ws{k.t, v.t, positions.t};
  int64_t rows = 0;
  test::expect_ok(kvret_fetch_async(f.seq, 0, &selected, count, &ws, &rows, nullptr));
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t pos = positions.data[static_cast<size_t>(r)];
    if (pos % 2 == 0) {
      ASSERT_EQ(k.data[static_cast<size_t>(r * 64)], f32_to_f16(static_cast<float>(pos)));
    }
  }
}

// A source that fails fails the fetch with its status and message.
TEST(RowSource, AFailingSourceFailsTheFetch) {
  Fixture f(KVRET_KV_F32);
  auto source = std::make_shared<EvenPositions>();
  source->fail = true;
  f.context().add_row_source(source);
  F32 q({8, 64}, 0.25f);
  I32 selected({2, 8});
  int32_t count = 0;
  test::expect_ok(kvret_select(f.seq, 0, &q, 8, &selected, &count));
  test::WorkingSetBuffers ws(f.seq, 0, count, 2, 64);
  int64_t rows = 0;
  EXPECT_EQ(kvret_fetch_async(f.seq, 0, &selected, count, &ws.ws, &rows, nullptr), KVRET_ERR_IO);
  EXPECT_NE(std::string(kvret_last_error()).find("test source"), std::string::npos) << kvret_last_error();
}

}  // namespace
