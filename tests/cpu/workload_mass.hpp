#pragma once
// The synthetic workload of the KVCrush attention-mass reports (8k tokens of one layer, 2 KV heads of head_dim 128,
// 8 query heads, 4 decode queries) and the folded attention mass of the middle that a select on it holds.
#ifdef KVRET_HAVE_WORKLOAD
#include <gtest/gtest.h>

#include <vector>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"
#include "workload.hpp"

namespace kvret::test {

struct MassWorkload {
  static constexpr int64_t kTokens = 8192, kSink = 16, kLocal = 64;
  static constexpr int kSteps = 4;
  F32 k{{kTokens, 2, 128}}, v{{kTokens, 2, 128}};
  std::vector<float> qs = std::vector<float>(static_cast<size_t>(kSteps * 8 * 128));  ///< the 4 queries [8, 128]

  MassWorkload() {
    workload::Config wc;
    wc.n_layers = 1;
    wc.n_q_heads = 8;
    wc.n_kv_heads = 2;
    wc.head_dim = 128;
    wc.n_prefill = kTokens;
    wc.n_decode = kSteps;
    wc.seed = 3;
    const workload::Workload w(wc);
    w.keys_values(0, 0, kTokens, k.data.data(), v.data.data());
    w.queries(0, kSteps, qs.data());
  }

  /// A context of `c` (its geometry set to the workload's: one layer, head_dim 128, 16 sink and 64 local tokens)
  /// prefilled with the workload, then a select of `budget` for each of the 4 queries: the folded mass (exact
  /// logits, summed probabilities) of the middle the selections hold, averaged over the queries and KV heads, into
  /// `mass` (a fatal failure when a select does not fill the budget).
  void mass(kvret_config c, int32_t budget, double& mass) const {
    c.n_layers = 1;
    c.head_dim = 128;
    c.n_sink = kSink;
    c.n_local = kLocal;
    const int64_t mb = kSink, me = kTokens - kLocal;
    auto ctx = make_context(c);
    Seq seq(ctx.get());
    expect_ok(kvret_append_prefill(seq.s, 0, &k, &v));
    mass = 0;
    for (int step = 0; step < kSteps; ++step) {
      F32 qt({8, 128});
      qt.data.assign(qs.begin() + step * 1024, qs.begin() + (step + 1) * 1024);
      qt.refresh();
      I32 out({2, budget});
      int32_t n = 0;
      expect_ok(kvret_select(seq.s, 0, &qt, budget, &out, &n));
      ASSERT_EQ(n, budget);
      for (int h = 0; h < 2; ++h) {
        const auto scores = exact_folded(k.data, 2, 128, qt.data, 4, h, mb, me, false);
        double m = 0, total = 0;
        for (int i = 0; i < budget; ++i)
          m += scores[static_cast<size_t>(out.data[static_cast<size_t>(h * budget + i)] - mb)];
        for (const double x : scores) total += x;
        mass += m / total / 8.0;
      }
    }
  }
};

}  // namespace kvret::test
#endif
