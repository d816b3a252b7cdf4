// The backend seam: a context made with a backend of a test's own puts every KV page, gather and attention of its
// sequences through it (allocation balanced by frees when they close), with no other change; the CPU backend is
// the default and a device this build lacks is refused.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "backend/backend.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

/// Host pages, counted.
class CountedPages final : public PageAllocator {
 public:
  std::byte* allocate(size_t bytes) noexcept override {
    ++allocations;
    live += static_cast<int64_t>(bytes);
    return host_page_allocator().allocate(bytes);
  }
  void deallocate(std::byte* p, size_t bytes) noexcept override {
    ++frees;
    live -= static_cast<int64_t>(bytes);
    host_page_allocator().deallocate(p, bytes);
  }
  std::atomic<int64_t> allocations{0}, frees{0}, live{0};
};

/// The CPU backend, counting what goes through it.
class CountingBackend final : public CpuBackend {
 public:
  const char* name() const noexcept override { return "counting"; }
  PageAllocator& pages() noexcept override { return *counted; }
  int64_t gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                 int64_t count, const WorkingSetViews& out, int n_threads,
                 const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence, int32_t layer,
                 int64_t* served, kvret_stream stream) override {
    ++gathers;
    return CpuBackend::gather(store, mid_begin, mid_end, selected, count, out, n_threads, sources, sequence, layer,
                              served, stream);
  }
  void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
              float scale, const TensorView& out, int n_threads, kvret_stream stream) override {
    ++attends;
    CpuBackend::attend(config, q, k, v, rows, scale, out, n_threads, stream);
  }
  std::shared_ptr<CountedPages> counted = std::make_shared<CountedPages>();
  std::atomic<int64_t> gathers{0}, attends{0};
};

TEST(Backend, EverythingGoesThroughTheContextsBackend) {
  if (test::device_type() != KVRET_DEVICE_CPU) GTEST_SKIP() << "a backend of the test's own, on the CPU";
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  std::string disk;
  const kvret_config config = read_config(&c, &disk);
  auto backend = std::make_unique<CountingBackend>();
  CountingBackend& b = *backend;
  const std::shared_ptr<CountedPages> pages = b.counted;  // outlives the context
  {
    Context ctx(config, disk, std::move(backend));
    EXPECT_STREQ(ctx.backend().name(), "counting");
    Sequence* seq = ctx.open_sequence();
    F32 k({700, 2, 64}), v({700, 2, 64});
    test::clustered_kv(700, 2, 64, 2, k, v);
    seq->append_prefill(0, &k.t, &v.t);
    seq->append_prefill(1, &k.t, &v.t);
    kvret_stats st;
    kvret_stats_init(&st);
    seq->stats().add_to(&st);
    EXPECT_EQ(pages->live.load(), st.host_bytes) << "every byte of the store is the backend's";
    EXPECT_GT(pages->allocations.load(), 0);
    F32 q({8, 64}, 0.3f), out({8, 64});
    I32 selected({2, 20});
    const int64_t count = seq->select(0, &q.t, 20, &selected.t);
    F32 wk({2, 4 + 20 + 16, 64}), wv({2, 4 + 20 + 16, 64});
    I32 wp({2, 4 + 20 + 16});
    const kvret_working_set set{wk.t, wv.t, wp.t};
    seq->fetch(0, &selected.t, static_cast<int32_t>(count), &set);
    EXPECT_EQ(b.gathers.load(), 1);
    seq->attend(0, &q.t, 20, 0.0f, &out.t);
    EXPECT_EQ(b.gathers.load(), 2);
    EXPECT_EQ(b.attends.load(), 1);
    ctx.close_sequence(seq);
    EXPECT_EQ(pages->live.load(), 0) << "closing the sequence gave its pages back";
    EXPECT_EQ(pages->frees.load(), pages->allocations.load());
  }
}

/// The CPU backend, claiming to also reach memory labelled KVRET_DEVICE_CUDA (the test's buffers are host memory):
/// what memory a call may use is the backend's answer alone.
class DeviceLabelBackend final : public CpuBackend {
 public:
  void check_access(const TensorView& t) const override {
    if (t.device().device_type != KVRET_DEVICE_CUDA) CpuBackend::check_access(t);
  }
};

TEST(Backend, TheBackendDecidesWhichMemoryACallMayUse) {
  if (test::device_type() != KVRET_DEVICE_CPU) GTEST_SKIP() << "the CPU backend's memory rule";
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  std::string disk;
  const kvret_config config = read_config(&c, &disk);
  F32 k({700, 2, 64}), v({700, 2, 64});
  test::clustered_kv(700, 2, 64, 2, k, v);
  F32 q({8, 64}, 0.3f), out({8, 64});
  I32 selected({2, 20});
  for (auto* t : {&k.t, &v.t, &q.t, &out.t, &selected.t}) t->device = {KVRET_DEVICE_CUDA, 0};
  // the layout checks pass for any memory
  EXPECT_EQ(TensorView::from(&q.t, "q", kFloatTypes, {2}).device().device_type, KVRET_DEVICE_CUDA);
  {  // the CPU backend refuses device memory, naming the tensor, and nothing changes
    Context ctx(config, disk);
    Sequence* seq = ctx.open_sequence();
    try {
      seq->append_prefill(0, &k.t, &v.t);
      ADD_FAILURE() << "the CPU backend accepted device memory";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), KVRET_ERR_DEVICE);
      EXPECT_NE(std::string(e.what()).find("k: device type 2"), std::string::npos) << e.what();
    }
    EXPECT_EQ(seq->length(0), 0);
    ctx.close_sequence(seq);
  }
  {  // a backend that reaches that memory runs every call on it
    Context ctx(config, disk, std::make_unique<DeviceLabelBackend>());
    Sequence* seq = ctx.open_sequence();
    seq->append_prefill(0, &k.t, &v.t);
    EXPECT_EQ(seq->select(0, &q.t, 20, &selected.t), 20);
    seq->attend(0, &q.t, 20, 0.0f, &out.t);
    ctx.close_sequence(seq);
  }
}

TEST(Backend, HostPagesAreAlignedWritableAndLargeOnesMapped) {
  PageAllocator& pages = host_page_allocator();
  for (const size_t bytes : {size_t{4096}, size_t{256} << 10, kMappedPageBytes, size_t{1} << 20}) {
    std::byte* p = pages.allocate(bytes);
    ASSERT_NE(p, nullptr) << bytes;
    const auto address = reinterpret_cast<uintptr_t>(p);
    EXPECT_EQ(address % 64, 0u) << bytes;
    if (bytes >= kMappedPageBytes) {
      EXPECT_EQ(address % 4096, 0u) << "a mapped page starts a system page";
    }
    for (size_t i = 0; i < bytes; i += 1024) p[i] = static_cast<std::byte>(i / 1024);
    for (size_t i = 0; i < bytes; i += 1024) ASSERT_EQ(p[i], static_cast<std::byte>(i / 1024));
    pages.deallocate(p, bytes);
  }
}

TEST(Backend, TheCpuIsTheDefaultAndCudaNeedsTheBackendAndADevice) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.device_type = KVRET_DEVICE_CPU;
  EXPECT_STREQ(make_backend(c)->name(), "cpu");
  c.device_type = KVRET_DEVICE_CUDA;
  const char* system = cuda_backend_system();
  const auto expect_error = [&](kvret_status status, const char* needle) {
    try {
      (void)make_backend(c);
      ADD_FAILURE() << "a CUDA backend was made";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), status) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  if (system == nullptr) {  // a build without the CUDA toolkit
    expect_error(KVRET_ERR_UNSUPPORTED, "CUDA");
    return;
  }
  c.device_id = 64;  // more devices than any machine has
  expect_error(KVRET_ERR_CUDA, "CUDA");
  c.device_id = 0;
  if (std::string(system) == "thrust-omp") {  // one "device", the host
    EXPECT_STREQ(make_backend(c)->name(), "cuda");
    return;
  }
  // built with nvcc: device 0 works where a GPU is, and is refused, by name, where none is
  try {
    EXPECT_STREQ(make_backend(c)->name(), "cuda");
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), KVRET_ERR_CUDA);
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
}

}  // namespace
