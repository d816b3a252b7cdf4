#pragma once
// The sequence the KVCrush selection tests select from (small_config's geometry: 4 sink and 16 local tokens):
// 1300 clustered tokens of layer 0, a prefill and then three decode steps, in a context of the test's config; and
// the tests' random queries.
#include <cstdint>
#include <memory>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

namespace kvret::test {

struct CrushFixture {
  static constexpr int64_t kTokens = 1300;
  ContextPtr ctx;
  std::unique_ptr<Seq> seq;
  F32 k{{kTokens, kHeads, kDim}}, v{{kTokens, kHeads, kDim}};
  explicit CrushFixture(const kvret_config& c) {
    ctx = make_context(c);
    seq = std::make_unique<Seq>(ctx.get());
    clustered_kv(kTokens, kHeads, kDim, 5, k, v);
    prefill(seq->s, 0, k, v, 0, kTokens - 3);
    decode(seq->s, 0, k, v, kTokens - 3, kTokens);
  }
};

/// A random query [kQHeads, kDim] of `seed`.
inline F32 query(uint64_t seed) {
  F32 q({kQHeads, kDim});
  q.data = random_vector(static_cast<size_t>(kQHeads * kDim), seed, 2.0f);
  q.refresh();
  return q;
}

}  // namespace kvret::test
