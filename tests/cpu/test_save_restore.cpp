// Saved index state: every kind's save() restores, into a fresh retriever of the same kind and config, an index
// that selects exactly as the original and saves to the same bytes; truncated, corrupted or foreign state is
// refused with KVRET_ERR_CORRUPT and leaves the retriever as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "c_api/handles.hpp"
#include "core/error.hpp"
#include "engine/sequence.hpp"
#include "index/retriever.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret;
using namespace kvret::test;

namespace {

struct Setting {
  int kind;
  int pq_m;
  float exact_fraction;
};

class SaveRestore : public ::testing::TestWithParam<Setting> {
 protected:
  SaveRestore() : config(small_config(GetParam().kind)), k({2100, kHeads, kDim}), v({2100, kHeads, kDim}) {
    config.pq_m = GetParam().pq_m;
    config.pq_exact_fraction = GetParam().exact_fraction;
    config.n_layers = 1;
    clustered_kv(2100, kHeads, kDim, 12, k, v);
  }
  kvret_config config;
  F32 k, v;
};

/// Every head's selection by `r` for a few queries and budgets.
std::vector<int32_t> selections(const Retriever& r, const Sequence& seq, const kvret_config& c) {
  const TokenGroups g = seq.groups(0);
  std::vector<int32_t> all;
  for (const uint64_t seed : {1u, 2u, 3u})
    for (const int64_t budget : {int64_t{1}, int64_t{50}, g.middle() / 3}) {
      const auto q = random_vector(static_cast<size_t>(c.n_q_heads * c.head_dim), seed);
      SelectRequest req;
      req.q = q.data();
      req.n_q_heads = c.n_q_heads;
      req.group = c.n_q_heads / c.n_kv_heads;
      req.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      req.mid_begin = g.mid_begin;
      req.mid_end = g.mid_end;
      req.budget = budget;
      req.n_threads = 1;
      std::vector<int32_t> out(static_cast<size_t>(c.n_kv_heads * budget), -1);
      std::vector<int32_t*> rows;
      for (int h = 0; h < c.n_kv_heads; ++h) rows.push_back(out.data() + h * budget);
      r.select(seq.store(0), req, rows.data(), nullptr);
      all.insert(all.end(), out.begin(), out.end());
    }
  return all;
}

TEST_P(SaveRestore, RestoredIndexSelectsAsTheOriginal) {
  auto ctx = make_context(config);
  Seq seq(ctx.get());
  prefill(seq.s, 0, k, v, 0, 2000);
  decode(seq.s, 0, k, v, 2000, 2030);
  Sequence& s = *sequence_from_handle(seq.s);
  const Retriever& original = s.index(0);
  const std::vector<std::byte> state = original.save();
  auto restored = make_retriever(config, 0);
  restored->restore(s.store(0), state.data(), state.size());
  EXPECT_EQ(restored->bytes(), original.bytes());
  EXPECT_EQ(restored->save(), state);
  EXPECT_EQ(selections(*restored, s, config), selections(original, s, config));
}

TEST_P(SaveRestore, DamagedStateIsRefusedAndChangesNothing) {
  auto ctx = make_context(config);
  Seq seq(ctx.get());
  prefill(seq.s, 0, k, v, 0, 1200);
  Sequence& s = *sequence_from_handle(seq.s);
  const std::vector<std::byte> state = s.index(0).save();
  auto fresh = make_retriever(config, 0);
  const std::vector<std::byte> empty = fresh->save();
  const auto refused = [&](const std::vector<std::byte>& bytes, const char* what) {
    try {
      fresh->restore(s.store(0), bytes.data(), bytes.size());
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), KVRET_ERR_CORRUPT) << what << ": " << e.what();
    }
    ASSERT_EQ(fresh->save(), empty) << what << ": the retriever changed";
  };
  // every truncation (sampled), a trailing byte, another kind's state, and a bad header
  const size_t step = std::max<size_t>(1, state.size() / 97);
  for (size_t len = 0; len < state.size(); len += step)
    refused(std::vector<std::byte>(state.begin(), state.begin() + static_cast<std::ptrdiff_t>(len)), "truncated");
  auto longer = state;
  longer.push_back(std::byte{0});
  refused(longer, "trailing byte");
  auto magic = state;
  magic[0] ^= std::byte{0xff};
  refused(magic, "magic");
  for (const int other : {KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                          KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT}) {
    if (other == config.index_kind) continue;
    kvret_config c = config;
    c.index_kind = other;
    refused(make_retriever(c, 0)->save(), "another kind's state");
  }
  // a restore into a store holding fewer tokens than the state indexes
  if (config.index_kind == KVRET_INDEX_PQ || config.index_kind == KVRET_INDEX_PAGE ||
      config.index_kind == KVRET_INDEX_CLUSTER || config.index_kind == KVRET_INDEX_QUANT) {
    HostKvStore shorter(kHeads, kDim, DType::F32);
    EXPECT_THROW(fresh->restore(shorter, state.data(), state.size()), Error);
    ASSERT_EQ(fresh->save(), empty);
  }
}

// Any byte flipped: refused, or accepted as a well-formed state (a changed float); never a crash (run under ASan).
TEST_P(SaveRestore, FlippedBytesNeverCrash) {
  auto ctx = make_context(config);
  Seq seq(ctx.get());
  prefill(seq.s, 0, k, v, 0, 900);
  Sequence& s = *sequence_from_handle(seq.s);
  const std::vector<std::byte> state = s.index(0).save();
  const size_t step = std::max<size_t>(1, state.size() / 211);
  for (size_t at = 0; at < state.size(); at += step) {
    auto damaged = state;
    damaged[at] ^= std::byte{0x5a};
    auto fresh = make_retriever(config, 0);
    try {
      fresh->restore(s.store(0), damaged.data(), damaged.size());
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), KVRET_ERR_CORRUPT) << "byte " << at;
      continue;
    }
    try {  // a state that passed the checks selects, or refuses (another indexed range), without reading out of bounds
      (void)selections(*fresh, s, config);
    } catch (const Error&) {
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, SaveRestore,
                         ::testing::Values(Setting{KVRET_INDEX_EXACT, 4, 0.05f}, Setting{KVRET_INDEX_PQ, 4, 0.05f},
                                           Setting{KVRET_INDEX_PQ, 2, 0.05f}, Setting{KVRET_INDEX_PQ, 2, 0.0f},
                                           Setting{KVRET_INDEX_PAGE, 4, 0.05f},
                                           Setting{KVRET_INDEX_STREAMING, 4, 0.05f},
                                           Setting{KVRET_INDEX_CLUSTER, 4, 0.05f},
                                           Setting{KVRET_INDEX_QUANT, 4, 0.05f}),
                         [](const ::testing::TestParamInfo<Setting>& i) {
                           return kind_name(i.param.kind) + "M" + std::to_string(i.param.pq_m) +
                                  (i.param.exact_fraction > 0 ? "Exact" : "Plain");
                         });

}  // namespace
