// kvret_fetch_batch_async: for every index kind and sequences of different lengths, the working sets, row counts
// and stats of one batched fetch equal those of n kvret_fetch_async calls bit for bit (over two decode steps, with a
// prefetch counted, ClusterKV's resident clusters hit on the second step); every argument of every entry is checked
// before anything is written (a bad entry in the middle of the batch leaves every working set, row count and stats
// as they were, with a message naming the entry); a failure while gathering leaves every sequence's stats as they
// were; one Backend::gather_batch call serves the whole batch.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"
#include "fetch/working_set.hpp"
#include "kvret.h"
#include "test_util.hpp"

using namespace kvret;
using test::F32;
using test::I32;

namespace {

constexpr int kHeads = 2, kQHeads = 8, kDim = 64, kLayer = 1;
constexpr float kFill = -7.0f;
const int64_t kLengths[] = {300, 650, 1000, 1400};
constexpr int32_t kN = 4;

/// The fetch-side stats of a sequence (cumulative).
std::vector<int64_t> fetch_stats(const kvret_seq* seq) {
  kvret_stats s;
  kvret_stats_init(&s);
  EXPECT_EQ(kvret_seq_stats(seq, &s), KVRET_OK) << kvret_last_error();
  return {s.fetches,       s.fetched_rows,       s.cache_hits,         s.cache_misses,        s.prefetch_hits,
          s.bytes_h2d,     s.cluster_reuse_rows, s.cluster_reuse_hits, s.cluster_reuse_bytes, s.selections,
          s.tokens_stored, s.host_bytes};
}

std::vector<int64_t> minus(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
  return a;
}

/// f32 working-set buffers of one sequence, filled with kFill.
struct Outs {
  std::vector<std::unique_ptr<test::WorkingSetBuffers>> bufs;
  std::vector<kvret_working_set> ws;
  Outs(const std::vector<kvret_seq*>& seqs, const std::vector<int32_t>& counts) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      bufs.push_back(std::make_unique<test::WorkingSetBuffers>(seqs[i], kLayer, counts[i], kHeads, kDim));
      auto& b = *bufs.back();
      std::fill(b.k.data.begin(), b.k.data.end(), kFill);
      std::fill(b.v.data.begin(), b.v.data.end(), kFill);
      std::fill(b.positions.data.begin(), b.positions.data.end(), -7);
      ws.push_back(b.ws);
    }
  }
  /// Every byte of every buffer.
  std::vector<std::vector<std::byte>> bytes() const {
    std::vector<std::vector<std::byte>> out;
    for (const auto& b : bufs) {
      for (const void* p : {static_cast<const void*>(b->k.data.data()), static_cast<const void*>(b->v.data.data())}) {
        const size_t n = b->k.data.size() * sizeof(float);
        out.emplace_back(static_cast<const std::byte*>(p), static_cast<const std::byte*>(p) + n);
      }
      const auto* q = reinterpret_cast<const std::byte*>(b->positions.data.data());
      out.emplace_back(q, q + b->positions.data.size() * sizeof(int32_t));
    }
    return out;
  }
};

/// n sequences of different lengths in one context, each prefilled on kLayer.
struct Batch {
  test::ContextPtr ctx;
  std::vector<kvret_seq*> seqs;
  explicit Batch(const kvret_config& c, int32_t n = kN) {
    ctx = test::make_context(c);
    for (int32_t i = 0; i < n; ++i) {
      kvret_seq* s = nullptr;
      EXPECT_EQ(kvret_seq_open(ctx.get(), &s), KVRET_OK) << kvret_last_error();
      const int64_t t = kLengths[i % 4];
      F32 k({t, kHeads, kDim}), v({t, kHeads, kDim});
      test::clustered_kv(t, kHeads, kDim, 100 + static_cast<uint64_t>(i), k, v);
      EXPECT_EQ(kvret_append_prefill(s, kLayer, &k, &v), KVRET_OK) << kvret_last_error();
      EXPECT_EQ(kvret_wait_index(s, -1), KVRET_OK) << kvret_last_error();
      seqs.push_back(s);
    }
  }
  ~Batch() {
    for (kvret_seq* s : seqs) kvret_seq_close(s);
  }
  /// kvret_select_batch with random queries: positions [n, kHeads, budget] and the counts.
  std::pair<I32, std::vector<int32_t>> select(int32_t budget, uint64_t seed) {
    const auto n = static_cast<int64_t>(seqs.size());
    F32 q({n, kQHeads, kDim});
    q.data = test::random_vector(static_cast<size_t>(n * kQHeads * kDim), seed);
    q.refresh();
    I32 positions({n, kHeads, budget}, -1);
    std::vector<int32_t> counts(seqs.size());
    EXPECT_EQ(kvret_select_batch(ctx.get(), static_cast<int32_t>(n), seqs.data(), kLayer, &q, budget, &positions,
                                 counts.data()),
              KVRET_OK)
        << kvret_last_error();
    return {std::move(positions), counts};
  }
};

/// positions[i] of a [n, kHeads, width] selection as its own [kHeads, width] tensor.
I32 row_of(const I32& positions, int64_t i) {
  const int64_t width = positions.shape[2];
  I32 row({kHeads, width});
  std::copy(positions.data.begin() + i * kHeads * width, positions.data.begin() + (i + 1) * kHeads * width,
            row.data.begin());
  return row;
}

/// Query i of Batch::select's [n, kQHeads, kDim] queries drawn from `seed`.
F32 query_of(int64_t n, uint64_t seed, int64_t i) {
  const auto all = test::random_vector(static_cast<size_t>(n * kQHeads * kDim), seed);
  F32 q({kQHeads, kDim});
  std::copy(all.begin() + i * kQHeads * kDim, all.begin() + (i + 1) * kQHeads * kDim, q.data.begin());
  return q;
}

/// One decode token, the same for a sequence and its fork.
void decode_both(kvret_seq* a, kvret_seq* b, uint64_t seed) {
  F32 k({kHeads, kDim}), v({kHeads, kDim});
  k.data = test::random_vector(kHeads * kDim, seed);
  v.data = test::random_vector(kHeads * kDim, seed + 1);
  k.refresh();
  v.refresh();
  test::expect_ok(kvret_append_decode(a, kLayer, &k, &v));
  test::expect_ok(kvret_append_decode(b, kLayer, &k, &v));
}

class FetchBatch : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {};

// The batched fetch of the original sequences against single fetches of their forks (the same tokens and index):
// two decode steps, a prefetch before the second, every byte of the working sets, the row counts and the stats.
TEST_P(FetchBatch, EqualsOneFetchPerSequenceBitForBit) {
  const auto [kind, kv_dtype] = GetParam();
  kvret_config c = test::small_config(kind);
  c.kv_dtype = kv_dtype;
  Batch batch(c);
  std::vector<kvret_seq*> forks(batch.seqs.size());
  for (size_t i = 0; i < forks.size(); ++i) test::expect_ok(kvret_seq_fork(batch.seqs[i], &forks[i]));
  for (int step = 0; step < 2; ++step) {
    if (step == 1) {
      for (size_t i = 0; i < forks.size(); ++i) {
        decode_both(batch.seqs[i], forks[i], 70 + i);
        const F32 guess = query_of(kN, 8, static_cast<int64_t>(i));  // the query of the select below
        test::expect_ok(kvret_prefetch_async(batch.seqs[i], kLayer, &guess, 30, nullptr));
        test::expect_ok(kvret_prefetch_async(forks[i], kLayer, &guess, 30, nullptr));
      }
    }
    auto [positions, counts] = batch.select(30, 7 + static_cast<uint64_t>(step));
    positions.refresh();
    if (kind == KVRET_INDEX_STREAMING) {
      EXPECT_EQ(counts, std::vector<int32_t>(kN, 0));
    } else {
      EXPECT_EQ(counts, std::vector<int32_t>(kN, 30));
    }
    Outs batched(batch.seqs, counts), single(forks, counts);
    std::vector<std::vector<int64_t>> before_b, before_s;
    for (size_t i = 0; i < forks.size(); ++i) {
      before_b.push_back(fetch_stats(batch.seqs[i]));
      before_s.push_back(fetch_stats(forks[i]));
    }
    std::vector<int64_t> rows_b(kN, -1), rows_s(kN, -1);
    test::expect_ok(kvret_fetch_batch_async(batch.ctx.get(), kN, batch.seqs.data(), kLayer, &positions, counts.data(),
                                            batched.ws.data(), rows_b.data(), nullptr));
    for (size_t i = 0; i < forks.size(); ++i) {
      const I32 row = row_of(positions, static_cast<int64_t>(i));
      test::expect_ok(kvret_fetch_async(forks[i], kLayer, &row, counts[i], &single.ws[i], &rows_s[i], nullptr));
    }
    EXPECT_EQ(rows_b, rows_s);
    for (size_t i = 0; i < forks.size(); ++i) {
      int64_t length = 0;
      test::expect_ok(kvret_seq_length(forks[i], kLayer, &length));
      EXPECT_EQ(rows_b[i], c.n_sink + counts[i] + c.n_local) << "sequence " << i << " of " << length << " tokens";
      EXPECT_EQ(minus(fetch_stats(batch.seqs[i]), before_b[i]), minus(fetch_stats(forks[i]), before_s[i]))
          << "step " << step << ", sequence " << i;
    }
    EXPECT_TRUE(batched.bytes() == single.bytes()) << "step " << step;
    if (kind == KVRET_INDEX_CLUSTER && step == 1) {
      kvret_stats s;
      kvret_stats_init(&s);
      test::expect_ok(kvret_seq_stats(batch.seqs[0], &s));
      EXPECT_GT(s.cluster_reuse_hits, 0) << "the second step reuses resident clusters";
    }
    if (step == 1 && kind != KVRET_INDEX_STREAMING) {
      kvret_stats s;
      kvret_stats_init(&s);
      test::expect_ok(kvret_seq_stats(batch.seqs[3], &s));
      EXPECT_GT(s.prefetch_hits, 0) << "the prefetch before the step is counted";
    }
  }
  for (kvret_seq* f : forks) kvret_seq_close(f);
}

INSTANTIATE_TEST_SUITE_P(KindsAndDtypes, FetchBatch,
                         ::testing::Combine(::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE,
                                                              KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT,
                                                              KVRET_INDEX_STREAMING),
                                            ::testing::Values(KVRET_KV_F32, KVRET_KV_F16)));

// With every count 0 (a streaming selection) positions is not read: NULL is accepted, and n = 0 does nothing.
TEST(FetchBatchEdges, NothingSelectedNeedsNoPositionsAndAnEmptyBatchIsANoOp) {
  Batch batch(test::small_config(KVRET_INDEX_STREAMING), 2);
  const std::vector<int32_t> counts{0, 0};
  Outs outs(batch.seqs, counts);
  std::vector<int64_t> rows(2, -1);
  test::expect_ok(kvret_fetch_batch_async(batch.ctx.get(), 2, batch.seqs.data(), kLayer, nullptr, counts.data(),
                                          outs.ws.data(), rows.data(), nullptr));
  EXPECT_EQ(rows, (std::vector<int64_t>{4 + 16, 4 + 16}));
  EXPECT_EQ(outs.bufs[1]->positions.data[0], 0);
  EXPECT_EQ(outs.bufs[1]->positions.data[4], 650 - 16);
  test::expect_ok(kvret_fetch_batch_async(batch.ctx.get(), 0, nullptr, 9, nullptr, nullptr, nullptr, nullptr, nullptr));
  EXPECT_EQ(kvret_fetch_batch_async(batch.ctx.get(), -1, batch.seqs.data(), kLayer, nullptr, counts.data(),
                                    outs.ws.data(), rows.data(), nullptr),
            KVRET_ERR_INVALID_ARGUMENT);
}

/// A batch of kN sequences selected at budget 30, its working sets and row counts, to break one argument of.
struct Refusal : ::testing::Test {
  Batch batch{test::small_config(KVRET_INDEX_EXACT)};
  I32 positions{std::vector<int64_t>{1}};
  std::vector<int32_t> counts;
  std::unique_ptr<Outs> outs;
  std::vector<int64_t> rows = std::vector<int64_t>(kN, -5);
  std::vector<kvret_seq*> originals;  ///< the batch's sequences (a test may put others in batch.seqs)
  std::vector<std::vector<int64_t>> stats_before;
  std::vector<std::vector<std::byte>> bytes_before;

  void SetUp() override {
    auto [p, c] = batch.select(30, 3);
    positions = std::move(p);
    positions.refresh();
    counts = c;
    outs = std::make_unique<Outs>(batch.seqs, counts);
    originals = batch.seqs;
    for (kvret_seq* s : batch.seqs) stats_before.push_back(fetch_stats(s));
    bytes_before = outs->bytes();
  }
  kvret_status call(const kvret_tensor* pos) {
    return kvret_fetch_batch_async(batch.ctx.get(), kN, batch.seqs.data(), kLayer, pos, counts.data(), outs->ws.data(),
                                   rows.data(), nullptr);
  }
  /// The call failed with `status`, its message names `what`, and nothing was written or counted.
  void expect_refused(kvret_status got, kvret_status status, const std::string& what) {
    EXPECT_EQ(got, status) << kvret_status_string(got) << ": " << kvret_last_error();
    EXPECT_NE(std::string(kvret_last_error()).find(what), std::string::npos)
        << "'" << kvret_last_error() << "' does not name " << what;
    EXPECT_TRUE(outs->bytes() == bytes_before) << "a working set was written";
    EXPECT_EQ(rows, std::vector<int64_t>(kN, -5));
    for (size_t i = 0; i < originals.size(); ++i) EXPECT_EQ(fetch_stats(originals[i]), stats_before[i]) << i;
  }
};

TEST_F(Refusal, HandlesAndArrays) {
  expect_refused(kvret_fetch_batch_async(nullptr, kN, batch.seqs.data(), kLayer, &positions, counts.data(),
                                         outs->ws.data(), rows.data(), nullptr),
                 KVRET_ERR_INVALID_HANDLE, "context");
  expect_refused(kvret_fetch_batch_async(batch.ctx.get(), kN, nullptr, kLayer, &positions, counts.data(),
                                         outs->ws.data(), rows.data(), nullptr),
                 KVRET_ERR_INVALID_ARGUMENT, "seqs");
  expect_refused(kvret_fetch_batch_async(batch.ctx.get(), kN, batch.seqs.data(), kLayer, &positions, nullptr,
                                         outs->ws.data(), rows.data(), nullptr),
                 KVRET_ERR_INVALID_ARGUMENT, "counts");
  expect_refused(kvret_fetch_batch_async(batch.ctx.get(), kN, batch.seqs.data(), kLayer, &positions, counts.data(),
                                         nullptr, rows.data(), nullptr),
                 KVRET_ERR_INVALID_ARGUMENT, "outs");
  expect_refused(kvret_fetch_batch_async(batch.ctx.get(), kN, batch.seqs.data(), kLayer, &positions, counts.data(),
                                         outs->ws.data(), nullptr, nullptr),
                 KVRET_ERR_INVALID_ARGUMENT, "out_row_counts");
  expect_refused(kvret_fetch_batch_async(batch.ctx.get(), kN, batch.seqs.data(), 2, &positions, counts.data(),
                                         outs->ws.data(), rows.data(), nullptr),
                 KVRET_ERR_OUT_OF_RANGE, "layer 2");
}

TEST_F(Refusal, SequencesNullClosedForeignOrRepeated) {
  kvret_seq* kept = batch.seqs[2];
  batch.seqs[2] = nullptr;
  expect_refused(call(&positions), KVRET_ERR_INVALID_HANDLE, "seqs[2] is NULL");
  // another context's sequence
  Batch other(test::small_config(KVRET_INDEX_EXACT), 1);
  batch.seqs[2] = other.seqs[0];
  expect_refused(call(&positions), KVRET_ERR_INVALID_HANDLE, "seqs[2] belongs to another context");
  // a closed one
  kvret_seq* closed = nullptr;
  test::expect_ok(kvret_seq_open(batch.ctx.get(), &closed));
  test::expect_ok(kvret_seq_close(closed));
  batch.seqs[2] = closed;
  expect_refused(call(&positions), KVRET_ERR_INVALID_HANDLE, "seqs[2] is not a live");
  batch.seqs[2] = batch.seqs[1];
  expect_refused(call(&positions), KVRET_ERR_INVALID_ARGUMENT, "seqs[2] appears twice");
  batch.seqs[2] = kept;
  test::expect_ok(call(&positions));  // the same arguments, repaired, are accepted
}

TEST_F(Refusal, Counts) {
  counts[2] = -1;
  expect_refused(call(&positions), KVRET_ERR_INVALID_ARGUMENT, "counts[2]");
  counts[2] = static_cast<int32_t>(1000 - 4 - 16 + 1);  // sequence 2 holds 1000 tokens
  expect_refused(call(&positions), KVRET_ERR_BUDGET, "counts[2]");
  counts[2] = 31;  // one row more than outs[2] holds
  expect_refused(call(&positions), KVRET_ERR_SHAPE, "outs[2].k");
}

TEST_F(Refusal, PositionsTensor) {
  expect_refused(call(nullptr), KVRET_ERR_INVALID_ARGUMENT, "positions");
  I32 short_batch({kN - 1, kHeads, 30});
  expect_refused(call(&short_batch), KVRET_ERR_SHAPE, "positions");
  I32 rank2({kHeads, 30});
  expect_refused(call(&rank2), KVRET_ERR_SHAPE, "positions");
  I32 heads({kN, kHeads + 1, 30});
  expect_refused(call(&heads), KVRET_ERR_SHAPE, "positions[0]");
  F32 floats({kN, kHeads, 30});
  expect_refused(call(&floats), KVRET_ERR_DTYPE, "positions");
  I32 narrow({kN, kHeads, 29});
  expect_refused(call(&narrow), KVRET_ERR_SHAPE, "positions[0]");
  I32 elsewhere = positions;
  elsewhere.refresh();
  elsewhere.t.device = test::foreign_device();
  expect_refused(call(&elsewhere), KVRET_ERR_DEVICE, "positions");
}

TEST_F(Refusal, PositionsOfOneEntry) {
  I32 bad = positions;
  bad.refresh();
  // entry 2, head 1: a local position of its 1000-token layer, then a repeated one
  const size_t at = static_cast<size_t>((2 * kHeads + 1) * 30 + 5);
  bad.data[at] = 1000 - 3;
  expect_refused(call(&bad), KVRET_ERR_OUT_OF_RANGE, "positions[2]");
  bad.data[at] = bad.data[at + 1];
  expect_refused(call(&bad), KVRET_ERR_INVALID_ARGUMENT, "positions[2]");
  // a position in entry 0's range but outside entry 0's middle: entry 0 holds 300 tokens
  bad = positions;
  bad.refresh();
  bad.data[3] = 600;
  expect_refused(call(&bad), KVRET_ERR_OUT_OF_RANGE, "positions[0]");
}

TEST_F(Refusal, WorkingSetOfOneEntry) {
  kvret_working_set keep = outs->ws[2];
  // k with one row too few
  const std::vector<int64_t> short_shape{kHeads, outs->bufs[2]->capacity - 1, kDim};
  outs->ws[2].k.shape = short_shape.data();
  expect_refused(call(&positions), KVRET_ERR_SHAPE, "outs[2].k");
  outs->ws[2] = keep;
  outs->ws[2].v.dtype = {KVRET_DTYPE_INT, 32, 1};
  expect_refused(call(&positions), KVRET_ERR_DTYPE, "outs[2].v");
  outs->ws[2] = keep;
  outs->ws[2].positions.device = test::foreign_device();
  expect_refused(call(&positions), KVRET_ERR_DEVICE, "outs[2].positions");
  outs->ws[2] = keep;
  const std::vector<int64_t> wrong_dim{kHeads, outs->bufs[2]->capacity, kDim / 2};
  outs->ws[3].k.shape = wrong_dim.data();
  expect_refused(call(&positions), KVRET_ERR_SHAPE, "outs[3].k");
}

/// A row source that fails for one sequence (the third one fetched).
class FailsForOne final : public RowSource {
 public:
  const char* name() const noexcept override { return "fails for one"; }
  int64_t serve(const RowRequest& r) const override {
    if (r.sequence == victim) throw Error(KVRET_ERR_IO, "the test source is down for this sequence");
    return 0;
  }
  const void* victim = nullptr;
};

// A failure while gathering (here a row source's, for the third sequence) leaves every sequence's stats as they
// were; the same batch then succeeds.
TEST_F(Refusal, AFailingGatherCountsNothing) {
  auto source = std::make_shared<FailsForOne>();
  source->victim = sequence_from_handle(batch.seqs[2]);
  context_from_handle(batch.ctx.get())->add_row_source(source);
  const kvret_status s = call(&positions);
  EXPECT_EQ(s, KVRET_ERR_IO) << kvret_last_error();
  EXPECT_NE(std::string(kvret_last_error()).find("test source"), std::string::npos);
  for (size_t i = 0; i < batch.seqs.size(); ++i) EXPECT_EQ(fetch_stats(batch.seqs[i]), stats_before[i]) << i;
  source->victim = nullptr;
  test::expect_ok(call(&positions));
  for (size_t i = 0; i < batch.seqs.size(); ++i) EXPECT_EQ(fetch_stats(batch.seqs[i])[0], stats_before[i][0] + 1);
}

// Every allocation of the call failing in turn: each failure leaves every sequence's stats and prefetched selection
// as they were (the fetch after it counts the same prefetch hits), and a cluster layer's resident copy is dropped or
// kept whole.
TEST(FetchBatchStrong, EachFailedAllocationChangesNoSequence) {
  kvret_config c = test::small_config(KVRET_INDEX_CLUSTER);
  Batch batch(c, 3);
  auto selected = batch.select(30, 5);  // named members, not a structured binding: the lambdas below capture them
  I32& positions = selected.first;
  std::vector<int32_t>& counts = selected.second;
  positions.refresh();
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const F32 guess = query_of(3, 5, static_cast<int64_t>(i));  // the query of the select: every row a hit
    test::expect_ok(kvret_prefetch_async(batch.seqs[i], kLayer, &guess, 30, nullptr));
  }
  Outs outs(batch.seqs, counts);
  std::vector<int64_t> rows(3, 0);
  std::vector<Sequence*> seqs;
  for (kvret_seq* s : batch.seqs) seqs.push_back(sequence_from_handle(s));
  Context& ctx = *context_from_handle(batch.ctx.get());
  std::vector<std::vector<int64_t>> before;
  for (kvret_seq* s : batch.seqs) before.push_back(fetch_stats(s));
  const auto call = [&] {
    Sequence::fetch_batch(ctx, seqs.data(), 3, kLayer, &positions.t, counts.data(), outs.ws.data(), rows.data(),
                          nullptr);
  };
  const int failures = test::fail_each_allocation(call, [&](int64_t fail_at) {
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      auto now = fetch_stats(batch.seqs[i]);
      now[8] = before[i][8];  // cluster_reuse_bytes: a dropped copy may leave less
      ASSERT_EQ(now, before[i]) << "allocation " << fail_at << ", sequence " << i;
    }
  });
  EXPECT_GT(failures, 3);
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const auto after = fetch_stats(batch.seqs[i]);
    EXPECT_EQ(after[0], before[i][0] + 1);
    EXPECT_GT(after[4], before[i][4]) << "the prefetch survived every failure";
  }
}

/// The CPU backend, counting gather_batch calls and their jobs.
class BatchCountingBackend final : public CpuBackend {
 public:
  const char* name() const noexcept override { return "batch counting"; }
  void gather_batch(GatherJob* jobs, size_t n, int n_threads, kvret_stream stream) override {
    ++calls;
    jobs_seen += static_cast<int64_t>(n);
    CpuBackend::gather_batch(jobs, n, n_threads, stream);
  }
  std::atomic<int64_t> calls{0}, jobs_seen{0};
};

// One gather_batch call carries the whole batch (the place a device backend fuses the gathers).
TEST(FetchBatchBackend, OneGatherBatchCallForTheBatch) {
  if (test::device_type() != KVRET_DEVICE_CPU) GTEST_SKIP() << "a backend of the test's own, on the CPU";
  kvret_config c = test::small_config(KVRET_INDEX_EXACT);
  std::string disk;
  const kvret_config config = read_config(&c, &disk);
  auto backend = std::make_unique<BatchCountingBackend>();
  BatchCountingBackend& b = *backend;
  Context ctx(config, disk, std::move(backend));
  std::vector<Sequence*> seqs;
  for (int i = 0; i < 3; ++i) {
    Sequence* s = ctx.open_sequence();
    const int64_t t = kLengths[i];
    F32 k({t, kHeads, kDim}), v({t, kHeads, kDim});
    test::clustered_kv(t, kHeads, kDim, 300 + static_cast<uint64_t>(i), k, v);
    s->append_prefill(kLayer, &k.t, &v.t);
    seqs.push_back(s);
  }
  I32 positions({3, kHeads, 5});
  for (int i = 0; i < 3; ++i)
    for (int h = 0; h < kHeads; ++h)
      for (int j = 0; j < 5; ++j) positions.data[static_cast<size_t>((i * kHeads + h) * 5 + j)] = 10 + 7 * j + h;
  const std::vector<int32_t> counts{5, 5, 5};
  std::vector<test::F32> ks, vs;
  std::vector<test::I32> ps;
  std::vector<kvret_working_set> outs;
  ks.reserve(3);
  vs.reserve(3);
  ps.reserve(3);
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = 4 + 5 + 16;
    ks.emplace_back(std::vector<int64_t>{kHeads, rows, kDim});
    vs.emplace_back(std::vector<int64_t>{kHeads, rows, kDim});
    ps.emplace_back(std::vector<int64_t>{kHeads, rows});
  }
  for (int i = 0; i < 3; ++i)
    outs.push_back({ks[static_cast<size_t>(i)].t, vs[static_cast<size_t>(i)].t, ps[static_cast<size_t>(i)].t});
  std::vector<int64_t> rows(3);
  Sequence::fetch_batch(ctx, seqs.data(), 3, kLayer, &positions.t, counts.data(), outs.data(), rows.data(), nullptr);
  EXPECT_EQ(b.calls.load(), 1);
  EXPECT_EQ(b.jobs_seen.load(), 3);
  EXPECT_EQ(rows, (std::vector<int64_t>{25, 25, 25}));
  EXPECT_EQ(ps[2].data[4], 10);
  EXPECT_EQ(ps[2].data[5], 17);
  EXPECT_EQ(ps[2].data[9], 1000 - 16);
}

}  // namespace
