#pragma once
// What a user can observe of a sequence through the C ABI, for tests that compare two sequences brought to the
// same state by different calls (truncate, fork): lengths, state stats, selections and working sets.
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "kvret.h"
#include "test_util.hpp"

namespace kvret::test {

/// The geometry of small_config().
constexpr int kHeads = 2, kDim = 64, kQHeads = 8, kLayers = 2;

/// A sequence handle closed at scope exit.
struct Seq {
  kvret_seq* s = nullptr;
  explicit Seq(kvret_context* ctx) { EXPECT_EQ(kvret_seq_open(ctx, &s), KVRET_OK) << kvret_last_error(); }
  explicit Seq(kvret_seq* handle) : s(handle) {}
  ~Seq() { kvret_seq_close(s); }
  Seq(const Seq&) = delete;
  Seq& operator=(const Seq&) = delete;
};

/// Every layer's length, then its keys and values read back raw (f32), for the first `layers` layers: equal for two
/// sequences that hold the same bytes.
inline std::vector<float> read_layers(kvret_seq* s, int32_t layers = kLayers) {
  std::vector<float> all;
  for (int32_t layer = 0; layer < layers; ++layer) {
    int64_t n = 0;
    EXPECT_EQ(kvret_seq_length(s, layer, &n), KVRET_OK) << kvret_last_error();
    all.push_back(static_cast<float>(n));
    if (n == 0) continue;
    F32 k({n, kHeads, kDim}), v({n, kHeads, kDim});
    EXPECT_EQ(kvret_seq_read(s, layer, 0, n, &k, &v), KVRET_OK) << kvret_last_error();
    all.insert(all.end(), k.data.begin(), k.data.end());
    all.insert(all.end(), v.data.begin(), v.data.end());
  }
  return all;
}

/// Tokens [begin, end) of k/v ([T, H, D]) as a prefill of `layer`.
inline void prefill(kvret_seq* s, int32_t layer, const F32& k, const F32& v, int64_t begin, int64_t end) {
  F32 kp({end - begin, kHeads, kDim}), vp({end - begin, kHeads, kDim});
  const size_t row = static_cast<size_t>(kHeads * kDim);
  std::copy(k.data.begin() + begin * row, k.data.begin() + end * row, kp.data.begin());
  std::copy(v.data.begin() + begin * row, v.data.begin() + end * row, vp.data.begin());
  expect_ok(kvret_append_prefill(s, layer, &kp, &vp));
}

/// Tokens [begin, end) of k/v as decode steps of `layer`.
inline void decode(kvret_seq* s, int32_t layer, const F32& k, const F32& v, int64_t begin, int64_t end) {
  const size_t row = static_cast<size_t>(kHeads * kDim);
  for (int64_t t = begin; t < end; ++t) {
    F32 kt({kHeads, kDim}), vt({kHeads, kDim});
    std::copy(k.data.begin() + t * row, k.data.begin() + (t + 1) * row, kt.data.begin());
    std::copy(v.data.begin() + t * row, v.data.begin() + (t + 1) * row, vt.data.begin());
    expect_ok(kvret_append_decode(s, layer, &kt, &vt));
  }
}

/// What a user can observe of a sequence: lengths, the stats that describe its state, and per layer the
/// selections of a few queries at a few budgets and the working set of one of them.
struct Observed {
  std::vector<int64_t> lengths;
  int64_t tokens = 0, host_bytes = 0, index_bytes = 0;
  std::vector<std::vector<int32_t>> selections;
  std::vector<std::vector<float>> working_sets;
  bool operator==(const Observed&) const = default;
};

inline Observed observe(kvret_seq* s) {
  Observed o;
  expect_ok(kvret_wait_index(s, -1));  // background builds done: the stats are final
  kvret_stats st;
  kvret_stats_init(&st);
  expect_ok(kvret_seq_stats(s, &st));
  o.tokens = st.tokens_stored;
  o.host_bytes = st.host_bytes;
  o.index_bytes = st.index_bytes;
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    int64_t length = 0;
    expect_ok(kvret_seq_length(s, layer, &length));
    o.lengths.push_back(length);
    if (length == 0) continue;
    for (const uint64_t seed : {3u, 4u}) {
      F32 q({kQHeads, kDim});
      q.data = random_vector(static_cast<size_t>(kQHeads * kDim), seed + static_cast<uint64_t>(layer));
      q.refresh();
      for (const int32_t budget : {1, 37, KVRET_BUDGET_DEFAULT}) {
        if (budget != KVRET_BUDGET_DEFAULT && budget > length) continue;
        int32_t width = budget;
        if (budget == KVRET_BUDGET_DEFAULT) expect_ok(kvret_seq_budget(s, layer, &width));
        I32 out({kHeads, std::max(width, 1)});
        int32_t count = 0;
        expect_ok(kvret_select(s, layer, &q, budget, &out, &count));
        o.selections.push_back(out.data);
        o.selections.back().push_back(count);
        if (budget != 37 || count == 0) continue;
        WorkingSetBuffers ws(s, layer, count, kHeads, kDim);
        int64_t rows = 0;
        expect_ok(kvret_fetch_async(s, layer, &out, count, &ws.ws, &rows, nullptr));
        std::vector<float> got(ws.k.data.begin(), ws.k.data.end());
        got.insert(got.end(), ws.v.data.begin(), ws.v.data.end());
        for (int32_t p : ws.positions.data) got.push_back(static_cast<float>(p));
        got.push_back(static_cast<float>(rows));
        o.working_sets.push_back(std::move(got));
      }
    }
  }
  return o;
}

inline void PrintTo(const Observed& o, std::ostream* os) {
  *os << "lengths";
  for (int64_t l : o.lengths) *os << " " << l;
  *os << ", tokens " << o.tokens << ", host bytes " << o.host_bytes << ", index bytes " << o.index_bytes << ", "
      << o.selections.size() << " selections, " << o.working_sets.size() << " working sets";
}

/// A test-name suffix for an index kind.
inline std::string kind_name(int kind) {
  switch (kind) {
    case KVRET_INDEX_EXACT:
      return "Exact";
    case KVRET_INDEX_PQ:
      return "Pq";
    case KVRET_INDEX_PAGE:
      return "Page";
    case KVRET_INDEX_CLUSTER:
      return "Cluster";
    case KVRET_INDEX_QUANT:
      return "Quant";
    default:
      return "Streaming";
  }
}

}  // namespace kvret::test
