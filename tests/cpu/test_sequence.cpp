// Behaviour through the C ABI: exact recall, both GQA folds, fetched bytes, sink/local membership, background
// builds, batching, threads, strided inputs, stats, and recall on the synthetic workload.
#include <gtest/gtest.h>

#include <thread>

#include "core/half.hpp"
#include "test_util.hpp"
#ifdef KVRET_HAVE_WORKLOAD
#include "workload.hpp"
#endif

namespace kvret {
namespace {

using test::F32;
using test::I32;

struct Prefilled {
  test::ContextPtr ctx;
  kvret_seq* seq = nullptr;
  F32 k, v;
  Prefilled(const kvret_config& c, int64_t n, uint64_t seed = 1)
      : k({n, c.n_kv_heads, c.head_dim}), v({n, c.n_kv_heads, c.head_dim}) {
    ctx = test::make_context(c);
    EXPECT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    test::clustered_kv(n, c.n_kv_heads, c.head_dim, seed, k, v);
    for (int l = 0; l < c.n_layers; ++l)
      EXPECT_EQ(kvret_append_prefill(seq, l, &k, &v), KVRET_OK) << kvret_last_error();
  }
  std::vector<int32_t> select(const std::vector<float>& q, int32_t budget, int layer = 0, int32_t* count = nullptr) {
    const kvret_config c = config();
    F32 qt({c.n_q_heads, c.head_dim});
    qt.data = q;
    qt.refresh();
    I32 out({c.n_kv_heads, std::max(budget, 1)}, -1);
    int32_t n = 0;
    EXPECT_EQ(kvret_select(seq, layer, &qt, budget, &out, &n), KVRET_OK) << kvret_last_error();
    if (count) *count = n;
    return out.data;
  }
  kvret_config config() const {
    kvret_config c;
    kvret::test::init_config(&c);
    kvret_get_config(ctx.get(), &c);
    return c;
  }
};

class ExactFold : public ::testing::TestWithParam<int> {};

TEST_P(ExactFold, ExactIndexSelectsTheExactTopB) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.gqa_fold = GetParam();
  Prefilled r(c, 1200);
  const auto q = test::random_vector(8 * 64, 4, 0.5f);
  const int32_t budget = 100;
  const auto got = r.select(q, budget);
  for (int h = 0; h < 2; ++h) {
    const auto scores = test::exact_folded(r.k.data, 2, 64, q, 4, h, 4, 1200 - 16, GetParam() == KVRET_FOLD_MAX_LOGIT);
    const auto want = test::top_positions(scores, budget, 4);
    const std::set<int32_t> have(got.begin() + h * budget, got.begin() + (h + 1) * budget);
    EXPECT_EQ(have, want) << "head " << h;  // token recall 1.0
  }
}

INSTANTIATE_TEST_SUITE_P(Folds, ExactFold, ::testing::Values(KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT));

TEST(Gqa, FoldsDifferWhenHeadsDisagree) {
  // one head of the group is very peaked on token A, the others mildly prefer B: max-logit picks A first, the
  // probability sum picks B's many tokens.
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.n_q_heads = 2;
  c.n_kv_heads = 1;
  c.n_layers = 1;
  c.n_sink = 0;
  c.n_local = 0;
  for (int fold : {KVRET_FOLD_SUM_PROB, KVRET_FOLD_MAX_LOGIT}) {
    c.gqa_fold = fold;
    auto ctx = test::make_context(c);
    kvret_seq* seq = nullptr;
    test::expect_ok(kvret_seq_open(ctx.get(), &seq));
    F32 k({3, 1, 64}), v({3, 1, 64});
    k.data[0] = 40.0f;       // token 0: axis 0 (head 0 loves it: logit 40*2/8 = 10)
    k.data[64 + 1] = 8.0f;   // token 1: axis 1
    k.data[128 + 1] = 8.0f;  // token 2: axis 1
    test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
    F32 q({2, 64});
    q.data[0] = 2.0f;       // head 0 -> token 0
    q.data[64 + 1] = 3.0f;  // head 1 -> tokens 1, 2 (logit 3)
    I32 out({1, 1});
    int32_t n = 0;
    test::expect_ok(kvret_select(seq, 0, &q, 1, &out, &n));
    ASSERT_EQ(n, 1);
    // sum of probs: token 0 gets ~1.0 (head 0) + ~0 ; tokens 1, 2 get ~0 + ~0.5 each -> token 0 as well.
    // max logit: token 0 has 10, tokens 1/2 have 3 -> token 0.
    EXPECT_EQ(out.data[0], 0);
    I32 out2({1, 2});
    test::expect_ok(kvret_select(seq, 0, &q, 2, &out2, &n));
    // the second pick: sum-prob prefers token 1 (0.5 + ~0) over token 2 (tie broken by position); max-logit too.
    EXPECT_EQ(out2.data[0], 0);
    EXPECT_EQ(out2.data[1], 1);
  }
}

TEST(Fetch, FetchedBytesEqualStoredBytesF16) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.kv_dtype = KVRET_KV_F16;
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  const int64_t n = 900;
  test::Buffer<uint16_t> k({n, 2, 64}), v({n, 2, 64});
  const auto kf = test::random_vector(static_cast<size_t>(n * 128), 1),
             vf = test::random_vector(static_cast<size_t>(n * 128), 2);
  for (size_t i = 0; i < kf.size(); ++i) {
    k.data[i] = f32_to_f16(kf[i]);
    v.data[i] = f32_to_f16(vf[i]);
  }
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
  F32 q({8, 64});
  q.data = test::random_vector(512, 3);
  q.refresh();
  I32 sel({2, 90});
  int32_t count = 0;
  test::expect_ok(kvret_select(seq, 0, &q, KVRET_BUDGET_DEFAULT, &sel, &count));
  ASSERT_EQ(count, 90);  // 0.1 * 900
  int64_t cap = 0;
  test::expect_ok(kvret_working_set_capacity(seq, 0, KVRET_BUDGET_DEFAULT, &cap));
  ASSERT_EQ(cap, 4 + 90 + 16);
  test::Buffer<uint16_t> wk({2, cap, 64}), wv({2, cap, 64});
  I32 wp({2, cap});
  kvret_working_set ws{*wk.get(), *wv.get(), *wp.get()};
  int64_t rows = 0;
  test::expect_ok(kvret_fetch_async(seq, 0, &sel, count, &ws, &rows, nullptr));
  ASSERT_EQ(rows, cap);
  for (int h = 0; h < 2; ++h) {
    std::vector<int32_t> want;
    for (int p = 0; p < 4; ++p) want.push_back(p);
    for (int i = 0; i < count; ++i) want.push_back(sel.data[static_cast<size_t>(h * 90 + i)]);
    for (int64_t p = n - 16; p < n; ++p) want.push_back(static_cast<int32_t>(p));
    const std::vector<int32_t> got(wp.data.begin() + h * cap, wp.data.begin() + (h + 1) * cap);
    ASSERT_EQ(got, want) << "sink + selected + local, in position order";
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = got[static_cast<size_t>(r)];
      for (int i = 0; i < 64; ++i) {
        ASSERT_EQ(wk.data[static_cast<size_t>((h * cap + r) * 64 + i)],
                  k.data[static_cast<size_t>((p * 2 + h) * 64 + i)]);
        ASSERT_EQ(wv.data[static_cast<size_t>((h * cap + r) * 64 + i)],
                  v.data[static_cast<size_t>((p * 2 + h) * 64 + i)]);
      }
    }
  }
  // an f32 working set holds the same values, converted
  F32 fk({2, cap, 64}), fv({2, cap, 64});
  kvret_working_set ws32{*fk.get(), *fv.get(), *wp.get()};
  test::expect_ok(kvret_fetch_async(seq, 0, &sel, count, &ws32, &rows, nullptr));
  for (size_t i = 0; i < fk.data.size(); ++i) ASSERT_EQ(fk.data[i], f16_to_f32(wk.data[i]));
}

TEST(Fetch, SinksAndLocalAlwaysInTheWorkingSetDuringDecode) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.n_layers = 1;
  Prefilled r(c, 600);
  F32 k1({1, 2, 64}), v1({1, 2, 64});
  for (int step = 0; step < 30; ++step) {
    k1.data = test::random_vector(128, 50 + static_cast<uint64_t>(step));
    k1.refresh();
    test::expect_ok(kvret_append_decode(r.seq, 0, &k1, &v1));
    const int64_t len = 600 + step + 1;
    int32_t count = 0;
    const auto sel = r.select(test::random_vector(512, 7 + static_cast<uint64_t>(step)), 40, 0, &count);
    ASSERT_EQ(count, 40);
    I32 cnt_sel({2, 40});
    cnt_sel.data = sel;
    cnt_sel.refresh();
    const int64_t cap = 4 + 40 + 16;
    F32 wk({2, cap, 64}), wv({2, cap, 64});
    I32 wp({2, cap});
    kvret_working_set ws{*wk.get(), *wv.get(), *wp.get()};
    int64_t rows = 0;
    test::expect_ok(kvret_fetch_async(r.seq, 0, &cnt_sel, count, &ws, &rows, nullptr));
    ASSERT_EQ(rows, cap);
    for (int h = 0; h < 2; ++h) {
      const int32_t* p = wp.data.data() + h * cap;
      for (int i = 0; i < 4; ++i) EXPECT_EQ(p[i], i);
      for (int i = 0; i < 16; ++i) EXPECT_EQ(p[cap - 16 + i], len - 16 + i);
      EXPECT_TRUE(std::is_sorted(p, p + cap));
      // the newest token's key is the one just appended
      for (int i = 0; i < 64; ++i)
        EXPECT_EQ(wk.data[static_cast<size_t>((h * cap + cap - 1) * 64 + i)], k1.data[static_cast<size_t>(h * 64 + i)]);
    }
  }
}

TEST(Build, BackgroundBuildGivesTheSameResultAsSynchronous) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.n_layers = 3;
  c.background_build = 1;
  Prefilled bg(c, 2000, 8);
  c.background_build = 0;
  Prefilled sync(c, 2000, 8);
  for (int layer = 0; layer < 3; ++layer) {
    const auto q = test::random_vector(512, 30 + static_cast<uint64_t>(layer));
    EXPECT_EQ(bg.select(q, 150, layer), sync.select(q, 150, layer)) << "layer " << layer;
  }
  test::expect_ok(kvret_wait_index(bg.seq, -1));
  kvret_stats s;
  kvret_stats_init(&s);
  test::expect_ok(kvret_seq_stats(bg.seq, &s));
  EXPECT_EQ(s.index_builds, 3);
  EXPECT_GT(s.index_build_ms, 0.0);
  EXPECT_EQ(s.tokens_stored, 3 * 2000);
  EXPECT_GE(s.host_bytes, 3 * 2000 * 2 * 2 * 64 * 4);
  EXPECT_GT(s.index_bytes, 0);
  EXPECT_EQ(s.selections, 3);
}

TEST(Batch, SelectBatchEqualsOneByOne) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  std::vector<kvret_seq*> seqs(3);
  std::vector<F32> ks, vs;
  for (int i = 0; i < 3; ++i) {
    test::expect_ok(kvret_seq_open(ctx.get(), &seqs[static_cast<size_t>(i)]));
    F32 k({800, 2, 64}), v({800, 2, 64});
    test::clustered_kv(800, 2, 64, 40 + static_cast<uint64_t>(i), k, v);
    test::expect_ok(kvret_append_prefill(seqs[static_cast<size_t>(i)], 0, &k, &v));
  }
  F32 q({3, 8, 64});
  q.data = test::random_vector(3 * 512, 9);
  q.refresh();
  I32 out({3, 2, 50});
  std::vector<int32_t> counts(3);
  test::expect_ok(kvret_select_batch(ctx.get(), 3, seqs.data(), 0, &q, 50, &out, counts.data()));
  for (int i = 0; i < 3; ++i) {
    F32 qi({8, 64});
    qi.data.assign(q.data.begin() + i * 512, q.data.begin() + (i + 1) * 512);
    qi.refresh();
    I32 oi({2, 50});
    int32_t n = 0;
    test::expect_ok(kvret_select(seqs[static_cast<size_t>(i)], 0, &qi, 50, &oi, &n));
    EXPECT_EQ(n, counts[static_cast<size_t>(i)]);
    EXPECT_EQ(oi.data, std::vector<int32_t>(out.data.begin() + i * 100, out.data.begin() + (i + 1) * 100));
  }
  // a repeated sequence is refused before anything runs
  std::vector<kvret_seq*> dup{seqs[0], seqs[0]};
  F32 q2({2, 8, 64});
  I32 out2({2, 2, 50}, -7);
  EXPECT_EQ(kvret_select_batch(ctx.get(), 2, dup.data(), 0, &q2, 50, &out2, counts.data()), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvret_last_error()).find("twice"), std::string::npos);
  EXPECT_EQ(out2.data, std::vector<int32_t>(200, -7));
}

TEST(Threads, DistinctSequencesFromDistinctThreads) {
  kvret_config c = test::small_config(KVRET_INDEX_PQ);
  auto ctx = test::make_context(c);
  auto work = [&](uint64_t seed, std::vector<int32_t>* result) {
    kvret_seq* seq = nullptr;
    ASSERT_EQ(kvret_seq_open(ctx.get(), &seq), KVRET_OK);
    F32 k({700, 2, 64}), v({700, 2, 64});
    test::clustered_kv(700, 2, 64, seed, k, v);
    for (int l = 0; l < 2; ++l) ASSERT_EQ(kvret_append_prefill(seq, l, &k, &v), KVRET_OK);
    F32 q({8, 64});
    q.data = test::random_vector(512, seed);
    q.refresh();
    I32 out({2, 60});
    int32_t n = 0;
    for (int rep = 0; rep < 5; ++rep) ASSERT_EQ(kvret_select(seq, 1, &q, 60, &out, &n), KVRET_OK);
    *result = out.data;
    ASSERT_EQ(kvret_seq_close(seq), KVRET_OK);
  };
  std::vector<std::vector<int32_t>> parallel(4), serial(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back(work, 100 + i, &parallel[static_cast<size_t>(i)]);
  for (auto& t : threads) t.join();
  for (int i = 0; i < 4; ++i) work(100 + static_cast<uint64_t>(i), &serial[static_cast<size_t>(i)]);
  EXPECT_EQ(parallel, serial);
  kvret_stats s;
  kvret_stats_init(&s);
  test::expect_ok(kvret_context_stats(ctx.get(), &s));
  EXPECT_EQ(s.sequences, 0);
  EXPECT_EQ(s.selections, 8 * 5);
  EXPECT_EQ(s.index_builds, 8 * 2);
}

TEST(Append, StridedHeadMajorInputEqualsRowMajor) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  c.n_layers = 1;
  auto ctx = test::make_context(c);
  kvret_seq *a = nullptr, *b = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &a));
  test::expect_ok(kvret_seq_open(ctx.get(), &b));
  const int64_t n = 300;
  F32 k({n, 2, 64}), v({n, 2, 64});
  test::clustered_kv(n, 2, 64, 77, k, v);
  test::expect_ok(kvret_append_prefill(a, 0, &k, &v));
  // the same data laid out [H, T, D], passed as a [T, H, D] view with strides
  F32 kh({2, n, 64}), vh({2, n, 64});
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 64; ++i) {
        kh.data[static_cast<size_t>((h * n + t) * 64 + i)] = k.data[static_cast<size_t>((t * 2 + h) * 64 + i)];
        vh.data[static_cast<size_t>((h * n + t) * 64 + i)] = v.data[static_cast<size_t>((t * 2 + h) * 64 + i)];
      }
  std::vector<int64_t> shape{n, 2, 64}, strides{64, n * 64, 1};
  kvret_tensor kt = *kh.get(), vt = *vh.get();
  kt.shape = vt.shape = shape.data();
  kt.strides = vt.strides = strides.data();
  test::expect_ok(kvret_append_prefill(b, 0, &kt, &vt));
  F32 ra({n, 2, 64}), rva({n, 2, 64}), rb({n, 2, 64}), rvb({n, 2, 64});
  test::expect_ok(kvret_seq_read(a, 0, 0, n, &ra, &rva));
  test::expect_ok(kvret_seq_read(b, 0, 0, n, &rb, &rvb));
  EXPECT_EQ(ra.data, k.data);
  EXPECT_EQ(rb.data, k.data);
  EXPECT_EQ(rvb.data, v.data);
}

TEST(Attend, MatchesAReferenceSoftmax) {
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  auto ctx = test::make_context(c);
  F32 q({8, 64}), k({2, 50, 64}), v({2, 50, 64}), out({8, 64});
  q.data = test::random_vector(512, 1);
  k.data = test::random_vector(2 * 50 * 64, 2);
  v.data = test::random_vector(2 * 50 * 64, 3);
  q.refresh();
  k.refresh();
  v.refresh();
  test::expect_ok(kvret_attend(ctx.get(), &q, &k, &v, 40, 0.0f, &out, nullptr));
  for (int h = 0; h < 8; ++h) {
    const int g = h / 4;
    std::vector<double> w(40);
    double mx = -1e300, z = 0;
    for (int r = 0; r < 40; ++r) {
      double s = 0;
      for (int i = 0; i < 64; ++i)
        s += q.data[static_cast<size_t>(h * 64 + i)] * k.data[static_cast<size_t>((g * 50 + r) * 64 + i)];
      w[static_cast<size_t>(r)] = s / 8.0;
      mx = std::max(mx, w[static_cast<size_t>(r)]);
    }
    for (auto& x : w) z += (x = std::exp(x - mx));
    for (int i = 0; i < 64; ++i) {
      double o = 0;
      for (int r = 0; r < 40; ++r)
        o += w[static_cast<size_t>(r)] / z * v.data[static_cast<size_t>((g * 50 + r) * 64 + i)];
      EXPECT_NEAR(out.data[static_cast<size_t>(h * 64 + i)], o, 1e-4);
    }
  }
}

#ifdef KVRET_HAVE_WORKLOAD
// Every approximate index: recall and folded mass rise with the budget on the synthetic workload.
class RecallVsBudget : public ::testing::TestWithParam<int> {};

TEST_P(RecallVsBudget, RisesWithTheBudgetOnTheSyntheticWorkload) {
  workload::Config wc;
  wc.n_layers = 1;
  wc.n_q_heads = 8;
  wc.n_kv_heads = 2;
  wc.head_dim = 128;
  wc.n_prefill = 8192;
  wc.n_decode = 4;
  wc.seed = 3;
  const workload::Workload w(wc);
  kvret_config c = test::small_config(GetParam());
  c.n_layers = 1;
  c.head_dim = 128;
  c.n_sink = 16;
  c.n_local = 64;
  auto ctx = test::make_context(c);
  kvret_seq* seq = nullptr;
  test::expect_ok(kvret_seq_open(ctx.get(), &seq));
  F32 k({wc.n_prefill, 2, 128}), v({wc.n_prefill, 2, 128});
  w.keys_values(0, 0, wc.n_prefill, k.data.data(), v.data.data());
  test::expect_ok(kvret_append_prefill(seq, 0, &k, &v));
  std::vector<float> qs(static_cast<size_t>(4 * 8 * 128));
  w.queries(0, 4, qs.data());
  const int64_t mb = 16, me = wc.n_prefill - 64;
  std::vector<double> recall_by_budget, mass_by_budget;
  for (int32_t budget : {82, 164, 410, 819, 1638}) {  // 1/100 .. 1/5 of the context
    double recall = 0, mass = 0;
    for (int step = 0; step < 4; ++step) {
      const std::vector<float> q(qs.begin() + step * 1024, qs.begin() + (step + 1) * 1024);
      F32 qt({8, 128});
      qt.data = q;
      qt.refresh();
      I32 out({2, budget});
      int32_t n = 0;
      test::expect_ok(kvret_select(seq, 0, &qt, budget, &out, &n));
      for (int h = 0; h < 2; ++h) {
        const auto scores = test::exact_folded(k.data, 2, 128, q, 4, h, mb, me, false);
        const auto want = test::top_positions(scores, budget, mb);
        int hit = 0;
        double m = 0, total = 0;
        for (int i = 0; i < budget; ++i) {
          const int32_t pos = out.data[static_cast<size_t>(h * budget + i)];
          hit += want.count(pos) ? 1 : 0;
          m += scores[static_cast<size_t>(pos - mb)];
        }
        for (double s : scores) total += s;
        recall += static_cast<double>(hit) / budget / 8.0;
        mass += m / total / 8.0;
      }
    }
    recall_by_budget.push_back(recall);
    mass_by_budget.push_back(mass);
  }
  // the selections are nested as the budget grows, so the folded mass they hold never drops
  for (size_t i = 1; i < mass_by_budget.size(); ++i) EXPECT_GE(mass_by_budget[i], mass_by_budget[i - 1] - 1e-9);
  for (size_t i = 1; i < recall_by_budget.size(); ++i)
    EXPECT_GE(recall_by_budget[i], recall_by_budget[i - 1] - 0.02) << "budget step " << i;
  EXPECT_GT(recall_by_budget.back(), recall_by_budget.front());
  EXPECT_GT(recall_by_budget.back(), 0.3);
  EXPECT_GT(mass_by_budget.back(), 0.5);
}

INSTANTIATE_TEST_SUITE_P(Indexes, RecallVsBudget,
                         ::testing::Values(KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT));
#endif

}  // namespace
}  // namespace kvret
