#include "engine/retained_set.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "engine/context.hpp"
#include "engine/kvcrush_layer.hpp"
#include "engine/sequence.hpp"
#include "index/retriever.hpp"
#include "select/kvcrush.hpp"
#include "select/topk.hpp"

namespace kvret {

int64_t retained_set(Sequence& seq, int32_t layer, int32_t budget, const kvret_tensor* out_positions) {
  Context& ctx = seq.context();
  const kvret_config& c = ctx.config();
  const TensorView out = ctx.view(out_positions, "out_positions", {DType::I32}, {2});
  const HostKvStore& store = seq.store(layer);  // KVRET_ERR_OUT_OF_RANGE for a bad layer
  out.expect_dim(0, c.n_kv_heads, "n_kv_heads");
  require(store.size() > 0, KVRET_ERR_STATE,
          "retained set of layer " + std::to_string(layer) +
              ", which holds no tokens: there is no observation window (call kvret_append_prefill first)");
  const int64_t count = seq.resolve_budget(layer, budget);
  out.expect_dim_at_least(1, count, "retained positions per head");
  if (count == 0) return 0;  // no middle: nothing to choose

  // The importance and signatures of every token, from a state of its own (the accumulated sums, the observed
  // queries or the layer's last keys): the sequence's select state is neither read nor changed.
  const int threads = ctx.threads();
  KvCrushLayer crush;
  seq.refresh_crush(layer, crush);
  const TokenGroups g = seq.groups(layer);
  const BudgetSplit split = split_budget(count, c.hamming_fraction, c.hamming_buckets);
  const int heads = c.n_kv_heads;
  std::vector<int32_t> rows(static_cast<size_t>(heads * count));
  std::vector<int64_t> counts(static_cast<size_t>(heads), 0);
  const int64_t unit = c.hamming_granularity;  // > 1: representatives as whole units of that many positions
  KvCrushLayer::UnitOrder units;
  if (unit > 1 && split.representatives > 0) units = crush.unit_order(g.mid_begin, g.mid_end, unit);
  parallel_for(
      heads, threads, g.middle() * c.n_q_heads >= SelectRequest::kParallelLogits, Schedule::kStatic, [&](int64_t h) {
        std::vector<float> importance(static_cast<size_t>(g.middle()));
        crush.importance_range(static_cast<int>(h), g.mid_begin, g.mid_end, importance.data());
        int32_t* row = rows.data() + h * count;
        topk_positions(importance.data(), g.middle(), split.important, g.mid_begin, row);
        counts[static_cast<size_t>(h)] =
            unit > 1 ? crush.add_unit_representatives(units, row, nullptr, split.important, split.representatives)
                     : crush.add_representatives(static_cast<int>(h), g.mid_begin, g.mid_end, row, nullptr,
                                                 split.important, split.representatives);
      });
  for (const int64_t n : counts)
    require(n == count, KVRET_ERR_INTERNAL,
            "retained set: a head kept " + std::to_string(n) + " tokens, not " + std::to_string(count));
  Backend& backend = ctx.backend();
  std::vector<std::byte> copy;
  const TensorView host = backend.host_writable(out, copy);
  for (int h = 0; h < heads; ++h) {
    auto* dst = reinterpret_cast<int32_t*>(host.at({h}));
    for (int64_t i = 0; i < count; ++i) dst[i] = rows[static_cast<size_t>(h * count + i)];
  }
  backend.write_back(host, out);
  return count;
}

}  // namespace kvret
