#include "index/exact_retriever.hpp"

#include <vector>

#include "core/vec_math.hpp"
#include "select/gqa_fold.hpp"
#include "select/topk.hpp"

namespace kvret {

int64_t ExactRetriever::select(const HostKvStore& store, const SelectRequest& r, int32_t* const* out_rows) const {
  const int64_t n = r.mid_end - r.mid_begin;
  const int d = store.head_dim();
  const int n_kv = store.n_kv_heads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(r.n_threads)
  for (int h = 0; h < n_kv; ++h) {
    std::vector<float> logits(static_cast<size_t>(r.group) * n);
    std::vector<float> key(static_cast<size_t>(d));
    const float* qg = r.q + static_cast<int64_t>(h) * r.group * d;
    for (int64_t t = 0; t < n; ++t) {
      store.keys_f32(h, r.mid_begin + t, r.mid_begin + t + 1, key.data());
      for (int g = 0; g < r.group; ++g) logits[g * n + t] = r.scale * dot(qg + g * d, key.data(), d);
    }
    std::vector<float> folded(static_cast<size_t>(n));
    fold_logits(logits.data(), r.group, n, r.fold, folded.data());
    topk_positions(folded.data(), n, r.budget, r.mid_begin, out_rows[h]);
  }
  return r.budget;
}

}  // namespace kvret
