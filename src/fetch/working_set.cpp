#include "fetch/working_set.hpp"

namespace kvret {

int64_t gather_working_set(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                           int64_t count, const WorkingSetViews& out, int n_threads) {
  const int64_t length = store.size();
  const int64_t rows = mid_begin + count + (length - mid_end);
  const int n_kv = store.n_kv_heads();
  const size_t d = static_cast<size_t>(store.head_dim());
#pragma omp parallel for schedule(static) num_threads(n_threads) if (rows * n_kv >= 4096)
  for (int h = 0; h < n_kv; ++h) {
    int64_t r = 0;
    auto put = [&](int64_t pos) {
      convert_row(store.key_row(h, pos), store.dtype(), out.k.at({h, r}), out.k.dtype(), d);
      convert_row(store.value_row(h, pos), store.dtype(), out.v.at({h, r}), out.v.dtype(), d);
      *reinterpret_cast<int32_t*>(out.positions.at({h, r})) = static_cast<int32_t>(pos);
      ++r;
    };
    for (int64_t p = 0; p < mid_begin; ++p) put(p);
    for (int64_t i = 0; i < count; ++i) put(selected[h][i]);
    for (int64_t p = mid_end; p < length; ++p) put(p);
  }
  return rows;
}

}  // namespace kvret
