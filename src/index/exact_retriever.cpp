#include "index/exact_retriever.hpp"

#include <algorithm>
#include <vector>

#include "core/parallel.hpp"
#include "core/serial.hpp"
#include "core/vec_math.hpp"
#include "select/gqa_fold.hpp"
#include "select/topk.hpp"

namespace kvret {

int64_t ExactRetriever::select(const HostKvStore& store, const SelectRequest& r, int32_t* const* out_rows,
                               float* const* out_scores) const {
  const int64_t n = r.mid_end - r.mid_begin;
  const int d = store.head_dim();
  const int n_kv = store.n_kv_heads();
  parallel_for(n_kv, r.n_threads, r.parallel(), Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    constexpr int64_t kBlock = 256;  // keys converted to f32 a block at a time, shared by the group's heads
    std::vector<float> logits(static_cast<size_t>(r.group) * n);
    std::vector<float> keys(static_cast<size_t>(kBlock * d));
    const float* qg = r.q + static_cast<int64_t>(h) * r.group * d;
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t nb = std::min(kBlock, n - b);
      store.keys_f32(h, r.mid_begin + b, r.mid_begin + b + nb, keys.data());
      for (int g = 0; g < r.group; ++g)
        for (int64_t t = 0; t < nb; ++t) logits[g * n + b + t] = r.scale * dot(qg + g * d, keys.data() + t * d, d);
    }
    std::vector<float> folded(static_cast<size_t>(n));
    fold_logits(logits.data(), r.group, n, r.fold, folded.data());
    take_top_tokens(folded.data(), n, r.budget, r.mid_begin, out_rows[h],
                    out_scores != nullptr ? out_scores[h] : nullptr);
  });
  return r.budget;
}

std::vector<std::byte> RangeOnlyRetriever::save() const {
  ByteWriter w;
  write_header(w, tag_, 2);
  write_range(w);
  return std::move(w.bytes());
}

void RangeOnlyRetriever::restore(const HostKvStore& store, const std::byte* data, size_t size) {
  ByteReader r(data, size);
  read_header(r, tag_, 2);
  const auto range = read_range(r, store);
  require_intact(r.left() == 0, "trailing bytes");
  set_range(range);
}

}  // namespace kvret
