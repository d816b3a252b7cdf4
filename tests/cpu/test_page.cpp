// PAGE index (Quest) properties: a page's bound is at least the logit of every key in the page; selection is the
// top pages by the folded bound, whole pages best first with the last one trimmed; growing by decode tokens gives
// the index a build from scratch gives; recall on the synthetic workload rises with the budget.
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>

#include "c_api/handles.hpp"
#include "engine/sequence.hpp"
#include "index/page_retriever.hpp"
#include "test_util.hpp"

// Fault injection for the strong guarantee: while armed, the calling thread's n-th allocation from now fails.
// The replacement new is malloc-backed and replaced together with its deletes (free); noinline keeps GCC from
// pairing the inlined malloc with delete (-Wmismatched-new-delete). The counter is declared in
// test_util.hpp (the PQ tests use it too).
namespace kvret::test {
thread_local int64_t g_allocations_until_failure = -1;
}  // namespace kvret::test

__attribute__((noinline)) void* operator new(std::size_t size) {
  int64_t& until_failure = kvret::test::g_allocations_until_failure;
  if (until_failure == 0) {
    until_failure = -1;
    throw std::bad_alloc();
  }
  if (until_failure > 0) --until_failure;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// The nothrow form (std::stable_sort's buffer) fails the same way, and the matching deletes: under AddressSanitizer
// every form not replaced here is the sanitizer's, which checks that new and delete come in pairs.
__attribute__((noinline)) void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return operator new(size);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace kvret {
namespace {

using test::F32;
using test::I32;

struct PageFixture {
  kvret_config config;
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  F32 k, v;

  PageFixture(int64_t n, int page_size, uint64_t seed = 1, int fold = KVRET_FOLD_SUM_PROB)
      : config(test::small_config(KVRET_INDEX_PAGE)), k({n, 2, 64}), v({n, 2, 64}) {
    config.n_layers = 1;
    config.page_size = page_size;
    config.gqa_fold = fold;
    ctx = test::make_context(config);
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    test::clustered_kv(n, 2, 64, seed, k, v);
    EXPECT_EQ(kvret_append_prefill(seq, 0, &k, &v), KVRET_OK) << kvret_last_error();
  }
  Sequence& sequence() { return *sequence_from_handle(seq); }
  const PageRetriever& page() { return dynamic_cast<const PageRetriever&>(sequence().index(0)); }
};

/// |q| . max|k| over a page: the scale of the rounding error of a bound.
double magnitude(const float* q, const float* lo, const float* hi, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += std::fabs(q[i]) * std::max(std::fabs(lo[i]), std::fabs(hi[i]));
  return s;
}

class PageSizes : public ::testing::TestWithParam<int> {};

TEST_P(PageSizes, BoundIsAtLeastEveryTokensLogit) {
  const int page_size = GetParam();
  PageFixture f(1500, page_size, 7);
  const PageRetriever& idx = f.page();
  ASSERT_EQ(idx.base(), f.config.n_sink);
  ASSERT_EQ(idx.size(), 1500 - f.config.n_sink - f.config.n_local);
  ASSERT_EQ(idx.pages(), (idx.size() + page_size - 1) / page_size);
  for (uint64_t trial = 0; trial < 8; ++trial) {
    const auto q = test::random_vector(64, 50 + trial, trial % 2 ? 3.0f : 0.3f);
    for (int h = 0; h < 2; ++h) {
      std::vector<float> bound(static_cast<size_t>(idx.pages()));
      idx.upper_bounds(h, q.data(), bound.data());
      for (int64_t p = 0; p < idx.pages(); ++p) {
        const float* lo = idx.page_min(h, p);
        const float* hi = idx.page_max(h, p);
        const double tol = 1e-5 * magnitude(q.data(), lo, hi, 64);
        double exact_bound = 0;
        for (int i = 0; i < 64; ++i)
          exact_bound += std::max(static_cast<double>(q[static_cast<size_t>(i)]) * lo[i],
                                  static_cast<double>(q[static_cast<size_t>(i)]) * hi[i]);
        ASSERT_NEAR(bound[static_cast<size_t>(p)], exact_bound, tol) << "page " << p;
        for (int64_t t = 0; t < idx.page_tokens(p); ++t) {
          const int64_t pos = idx.base() + p * page_size + t;
          const float* key = f.k.data.data() + (pos * 2 + h) * 64;
          double logit = 0;
          for (int i = 0; i < 64; ++i) {
            ASSERT_LE(lo[i], key[i]);
            ASSERT_GE(hi[i], key[i]);
            logit += static_cast<double>(q[static_cast<size_t>(i)]) * key[i];
          }
          ASSERT_GE(bound[static_cast<size_t>(p)], logit - tol) << "head " << h << " page " << p << " pos " << pos;
        }
      }
    }
  }
}

/// Independent reference: the folded score of each page (bound as a logit weighted by the page's token count).
std::vector<double> folded_pages(const PageRetriever& idx, const std::vector<float>& q, int kv_head, int group,
                                 bool max_logit) {
  const int64_t n = idx.pages();
  std::vector<double> folded(static_cast<size_t>(n), max_logit ? -1e300 : 0.0);
  for (int g = 0; g < group; ++g) {
    const float* qg = q.data() + (kv_head * group + g) * 64;
    std::vector<double> logit(static_cast<size_t>(n));
    for (int64_t p = 0; p < n; ++p) {
      double s = 0;
      for (int i = 0; i < 64; ++i)
        s += std::max(static_cast<double>(qg[i]) * idx.page_min(kv_head, p)[i],
                      static_cast<double>(qg[i]) * idx.page_max(kv_head, p)[i]);
      logit[static_cast<size_t>(p)] = s / 8.0;
    }
    if (max_logit) {
      for (int64_t p = 0; p < n; ++p)
        folded[static_cast<size_t>(p)] = std::max(folded[static_cast<size_t>(p)], logit[static_cast<size_t>(p)]);
      continue;
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0;
    for (int64_t p = 0; p < n; ++p)
      z += static_cast<double>(idx.page_tokens(p)) * std::exp(logit[static_cast<size_t>(p)] - mx);
    for (int64_t p = 0; p < n; ++p) folded[static_cast<size_t>(p)] += std::exp(logit[static_cast<size_t>(p)] - mx) / z;
  }
  return folded;
}

void expect_top_pages(PageFixture& f, int32_t budget, uint64_t seed, bool max_logit) {
  const PageRetriever& idx = f.page();
  const int ps = idx.page_size();
  F32 qt({8, 64});
  qt.data = test::random_vector(8 * 64, seed);
  qt.refresh();
  I32 out({2, budget});
  int32_t count = 0;
  test::expect_ok(kvret_select(f.seq, 0, &qt, budget, &out, &count));
  ASSERT_EQ(count, budget);
  for (int h = 0; h < 2; ++h) {
    const int32_t* rows = out.data.data() + h * budget;
    ASSERT_TRUE(std::is_sorted(rows, rows + budget));
    ASSERT_EQ(std::set<int32_t>(rows, rows + budget).size(), static_cast<size_t>(budget));
    std::vector<int64_t> per_page(static_cast<size_t>(idx.pages()), 0);
    for (int i = 0; i < budget; ++i) {
      ASSERT_GE(rows[i], idx.base());
      ASSERT_LT(rows[i], idx.base() + idx.size());
      ++per_page[static_cast<size_t>((rows[i] - idx.base()) / ps)];
    }
    // whole pages, except one page that keeps its earliest tokens
    int partial = 0;
    for (int i = 0; i < budget; ++i) {
      const int64_t p = (rows[i] - idx.base()) / ps;
      const int64_t offset = rows[i] - idx.base() - p * ps;
      if (per_page[static_cast<size_t>(p)] < idx.page_tokens(p)) {
        ASSERT_LT(offset, per_page[static_cast<size_t>(p)]);
      }
    }
    for (int64_t p = 0; p < idx.pages(); ++p)
      partial += per_page[static_cast<size_t>(p)] > 0 && per_page[static_cast<size_t>(p)] < idx.page_tokens(p);
    ASSERT_LE(partial, 1);
    // every page taken (whole or trimmed) scores at least every page left out
    const auto folded = folded_pages(idx, qt.data, h, 4, max_logit);
    double min_in = 1e300, max_out = -1e300;
    for (int64_t p = 0; p < idx.pages(); ++p) {
      if (per_page[static_cast<size_t>(p)] > 0)
        min_in = std::min(min_in, folded[static_cast<size_t>(p)]);
      else
        max_out = std::max(max_out, folded[static_cast<size_t>(p)]);
    }
    EXPECT_GE(min_in, max_out - 1e-5 * std::fabs(max_out)) << "head " << h;
  }
}

TEST_P(PageSizes, SelectionIsTheTopPagesByFoldedBound) {
  const int page_size = GetParam();
  PageFixture f(3000, page_size, 5);
  for (int32_t budget : {1, 7, 100, 301, 2000, 2980}) expect_top_pages(f, budget, 21 + budget, false);
}

TEST_P(PageSizes, MaxLogitFoldSelectsTheTopPages) {
  const int page_size = GetParam();
  PageFixture f(2500, page_size, 6, KVRET_FOLD_MAX_LOGIT);
  for (int32_t budget : {5, 250, 999}) expect_top_pages(f, budget, 77 + budget, true);
}

INSTANTIATE_TEST_SUITE_P(Sizes, PageSizes, ::testing::Values(1, 16, 13, 64));

TEST(Page, DecodeGrowthEqualsABuildFromScratch) {
  for (int page_size : {16, 5}) {
    constexpr int64_t kPrefill = 700, kDecode = 90, kTotal = kPrefill + kDecode;
    kvret_config c = test::small_config(KVRET_INDEX_PAGE);
    c.n_layers = 1;
    c.page_size = page_size;
    auto ctx = test::make_context(c);
    F32 k({kTotal, 2, 64}), v({kTotal, 2, 64});
    test::clustered_kv(kTotal, 2, 64, 17, k, v);
    // the grown sequence: a prefill, then one decode token at a time
    kvret_seq* grown = nullptr;
    test::expect_ok(kvret_seq_open(ctx.get(), &grown));
    F32 kp({kPrefill, 2, 64}), vp({kPrefill, 2, 64});
    std::copy_n(k.data.begin(), kp.data.size(), kp.data.begin());
    std::copy_n(v.data.begin(), vp.data.size(), vp.data.begin());
    test::expect_ok(kvret_append_prefill(grown, 0, &kp, &vp));
    for (int64_t t = kPrefill; t < kTotal; ++t) {
      F32 k1({2, 64}), v1({2, 64});
      std::copy_n(k.data.begin() + t * 128, 128, k1.data.begin());
      std::copy_n(v.data.begin() + t * 128, 128, v1.data.begin());
      test::expect_ok(kvret_append_decode(grown, 0, &k1, &v1));
    }
    // the same tokens in one prefill
    kvret_seq* scratch = nullptr;
    test::expect_ok(kvret_seq_open(ctx.get(), &scratch));
    test::expect_ok(kvret_append_prefill(scratch, 0, &k, &v));
    const auto& a = dynamic_cast<const PageRetriever&>(sequence_from_handle(grown)->index(0));
    const auto& b = dynamic_cast<const PageRetriever&>(sequence_from_handle(scratch)->index(0));
    ASSERT_EQ(a.base(), b.base());
    ASSERT_EQ(a.size(), b.size());
    ASSERT_EQ(a.size(), kTotal - c.n_sink - c.n_local);
    ASSERT_EQ(a.bytes() >= b.bytes(), true);
    for (int h = 0; h < 2; ++h)
      for (int64_t p = 0; p < a.pages(); ++p) {
        ASSERT_EQ(a.page_tokens(p), b.page_tokens(p));
        for (int i = 0; i < 64; ++i) {
          ASSERT_EQ(a.page_min(h, p)[i], b.page_min(h, p)[i]) << "page size " << page_size << " page " << p;
          ASSERT_EQ(a.page_max(h, p)[i], b.page_max(h, p)[i]) << "page size " << page_size << " page " << p;
        }
      }
    F32 qt({8, 64});
    qt.data = test::random_vector(8 * 64, 4);
    qt.refresh();
    for (int32_t budget : {3, 64, 333}) {
      I32 oa({2, budget}), ob({2, budget});
      int32_t na = 0, nb = 0;
      test::expect_ok(kvret_select(grown, 0, &qt, budget, &oa, &na));
      test::expect_ok(kvret_select(scratch, 0, &qt, budget, &ob, &nb));
      EXPECT_EQ(na, nb);
      EXPECT_EQ(oa.data, ob.data) << "page size " << page_size << " budget " << budget;
    }
  }
}

TEST(Page, ChunkedPrefillContinuesThePartialPage) {
  kvret_config c = test::small_config(KVRET_INDEX_PAGE);
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  F32 k({1000, 2, 64}), v({1000, 2, 64});
  test::clustered_kv(1000, 2, 64, 23, k, v);
  kvret_seq* chunked = nullptr;
  kvret_seq* whole = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &chunked));
  test::expect_ok(kvret_seq_open(ctx.get(), &whole));
  for (int64_t begin : {0, 333, 517}) {
    const int64_t end = begin == 0 ? 333 : begin == 333 ? 517 : 1000;
    F32 kc({end - begin, 2, 64}), vc({end - begin, 2, 64});
    std::copy_n(k.data.begin() + begin * 128, kc.data.size(), kc.data.begin());
    std::copy_n(v.data.begin() + begin * 128, vc.data.size(), vc.data.begin());
    test::expect_ok(kvret_append_prefill(chunked, 0, &kc, &vc));
  }
  test::expect_ok(kvret_append_prefill(whole, 0, &k, &v));
  const auto& a = dynamic_cast<const PageRetriever&>(sequence_from_handle(chunked)->index(0));
  const auto& b = dynamic_cast<const PageRetriever&>(sequence_from_handle(whole)->index(0));
  ASSERT_EQ(a.pages(), b.pages());
  for (int h = 0; h < 2; ++h)
    for (int64_t p = 0; p < a.pages(); ++p)
      for (int i = 0; i < 64; ++i) {
        ASSERT_EQ(a.page_min(h, p)[i], b.page_min(h, p)[i]);
        ASSERT_EQ(a.page_max(h, p)[i], b.page_max(h, p)[i]);
      }
}

/// A direct index over a store, to inject allocation failures into extend.
struct DirectPageIndex {
  HostKvStore store{2, 64, DType::F32};
  PageRetriever index{2, 64, 16};
  F32 k{{400, 2, 64}}, v{{400, 2, 64}};
  DirectPageIndex() {
    test::clustered_kv(400, 2, 64, 31, k, v);
    store.append(TensorView::from(&k, "k", kFloatTypes, {3}), TensorView::from(&v, "v", kFloatTypes, {3}), 400, true);
  }
  std::vector<std::vector<float>> snapshot() const {
    std::vector<std::vector<float>> s(2);
    for (int h = 0; h < 2; ++h)
      for (int64_t p = 0; p < index.pages(); ++p) {
        s[static_cast<size_t>(h)].insert(s[static_cast<size_t>(h)].end(), index.page_min(h, p),
                                         index.page_max(h, p) + 64);
      }
    return s;
  }
};

TEST(Page, ExtendLeavesTheIndexAsItWasWhenAnAllocationFails) {
  DirectPageIndex f;
  f.index.extend(f.store, 4, 100, true, 1);  // 96 tokens: 6 full pages
  // decode steps that open a page, fill a partial one, and a chunk that crosses several pages
  const std::pair<int64_t, int64_t> steps[] = {{100, 101}, {101, 102}, {102, 117}, {117, 118}, {118, 390}};
  for (const auto& step : steps) {
    const int64_t begin = step.first, end = step.second;  // plain locals: lambdas capture them (clang 14)
    const auto before = f.snapshot();
    const int64_t size_before = f.index.size();
    const int64_t bytes_before = f.index.bytes();
    const int failures = test::fail_each_allocation(
        [&] { f.index.extend(f.store, begin, end, false, 1); },
        [&](int64_t fail_at) {
          ASSERT_EQ(f.index.size(), size_before) << "failure " << fail_at << " at [" << begin << ", " << end << ")";
          ASSERT_EQ(f.index.bytes(), bytes_before);
          ASSERT_EQ(f.snapshot(), before);
        });
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_GT(failures, 0);
    ASSERT_EQ(f.index.base() + f.index.size(), end);
  }
  // the index that survived the failures equals one built in one go
  PageRetriever whole(2, 64, 16);
  whole.extend(f.store, 4, 390, true, 2);
  for (int h = 0; h < 2; ++h)
    for (int64_t p = 0; p < whole.pages(); ++p)
      for (int i = 0; i < 64; ++i) {
        ASSERT_EQ(whole.page_min(h, p)[i], f.index.page_min(h, p)[i]);
        ASSERT_EQ(whole.page_max(h, p)[i], f.index.page_max(h, p)[i]);
      }
}

TEST(Page, NonFiniteKeysDoNotBreakTheSelection) {
  kvret_config c = test::small_config(KVRET_INDEX_PAGE);
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  F32 k({600, 2, 64}), v({600, 2, 64});
  test::clustered_kv(600, 2, 64, 41, k, v);
  // NaN, +inf and -inf keys (check_finite is off): bounds of 0 * inf are NaN, which must rank lowest
  for (int64_t t = 100; t < 400; t += 7) k.data[static_cast<size_t>(t * 128 + 5)] = std::nanf("");
  for (int64_t t = 103; t < 400; t += 11) k.data[static_cast<size_t>(t * 128 + 9)] = INFINITY;
  for (int64_t t = 105; t < 400; t += 13) k.data[static_cast<size_t>(t * 128 + 70)] = -INFINITY;
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
  F32 qt({8, 64});
  qt.data = test::random_vector(8 * 64, 8);
  qt.refresh();
  for (int32_t budget : {10, 200, 500}) {
    I32 out({2, budget});
    int32_t count = 0;
    test::expect_ok(kvret_select(seq, 0, &qt, budget, &out, &count));
    ASSERT_EQ(count, budget);
    for (int h = 0; h < 2; ++h) {
      const int32_t* rows = out.data.data() + h * budget;
      EXPECT_TRUE(std::is_sorted(rows, rows + budget));
      EXPECT_EQ(std::set<int32_t>(rows, rows + budget).size(), static_cast<size_t>(budget));
      EXPECT_GE(rows[0], c.n_sink);
      EXPECT_LT(rows[budget - 1], 600 - c.n_local);
    }
  }
}

TEST(Page, ConfigRejectsABadPageSize) {
  kvret_config c = test::small_config(KVRET_INDEX_PAGE);
  c.page_size = 0;
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ctx, nullptr);
  EXPECT_NE(std::string(kvret_last_error()).find("page_size"), std::string::npos);
}

}  // namespace
}  // namespace kvret
