#include "fetch/working_set.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "core/parallel.hpp"

namespace kvret {

namespace {

/// Rows this far ahead are prefetched: scattered 256-byte rows are latency-bound, and keeping ~16 rows (64 cache
/// lines) in flight turns the gather into a bandwidth-bound copy.
constexpr int64_t kPrefetchDistance = 16;

inline void prefetch_row(const std::byte* row, size_t bytes) noexcept {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 0);
}

}  // namespace

void write_row(const RowRequest& request, int kv, int64_t i, const std::byte* row, DType type) {
  const TensorView& view = kv == 0 ? request.out->k : request.out->v;
  convert_row(row, type, view.at({request.head, i}), view.dtype(), static_cast<size_t>(request.store->head_dim()));
}

void working_set_positions(int64_t mid_begin, int64_t mid_end, int64_t length, const int32_t* selected, int64_t count,
                           int32_t* out) noexcept {
  for (int64_t p = 0; p < mid_begin; ++p) *out++ = static_cast<int32_t>(p);
  for (int64_t i = 0; i < count; ++i) *out++ = selected[i];
  for (int64_t p = mid_end; p < length; ++p) *out++ = static_cast<int32_t>(p);
}

int64_t gather_working_set(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                           int64_t count, const WorkingSetViews& out, int n_threads,
                           const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence,
                           int32_t layer, int64_t* served_by_sources) {
  const int64_t length = store.size();
  const int64_t rows = mid_begin + count + (length - mid_end);
  const int n_kv = store.n_kv_heads();
  const size_t d = static_cast<size_t>(store.head_dim());
  const size_t row_bytes = store.row_bytes();
  const bool same_type = out.k.dtype() == store.dtype() && out.v.dtype() == store.dtype();
  std::atomic<int64_t> from_sources{0};
  parallel_for(n_kv, n_threads, rows * n_kv >= 4096, Schedule::kStatic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    std::vector<int32_t> positions(static_cast<size_t>(rows));
    working_set_positions(mid_begin, mid_end, length, count > 0 ? selected[h] : nullptr, count, positions.data());
    std::vector<uint8_t> served;
    if (!sources.empty()) {
      served.assign(static_cast<size_t>(rows), 0);
      const RowRequest request{sequence, layer, h, &store, positions.data(), rows, &out, served.data()};
      int64_t wrote = 0;
      for (const auto& source : sources) wrote += source->serve(request);
      from_sources += wrote;
    }
    const uint8_t* skip = served.empty() ? nullptr : served.data();

    for (int64_t i = 0; i < std::min(rows, kPrefetchDistance); ++i) {
      if (skip != nullptr && skip[i] != 0) continue;  // a source wrote it: the store's row is not read
      prefetch_row(store.key_row(h, positions[static_cast<size_t>(i)]), row_bytes);
      prefetch_row(store.value_row(h, positions[static_cast<size_t>(i)]), row_bytes);
    }
    auto* out_pos = reinterpret_cast<int32_t*>(out.positions.at({h}));
    const int64_t pos_stride = out.positions.stride(1);
    for (int64_t i = 0; i < rows; ++i) {
      if (i + kPrefetchDistance < rows && (skip == nullptr || skip[i + kPrefetchDistance] == 0)) {
        const int64_t ahead = positions[static_cast<size_t>(i + kPrefetchDistance)];
        prefetch_row(store.key_row(h, ahead), row_bytes);
        prefetch_row(store.value_row(h, ahead), row_bytes);
      }
      const int64_t pos = positions[static_cast<size_t>(i)];
      out_pos[i * pos_stride] = static_cast<int32_t>(pos);
      if (skip != nullptr && skip[i] != 0) continue;  // a source wrote it
      if (same_type) {
        std::memcpy(out.k.at({h, i}), store.key_row(h, pos), row_bytes);
        std::memcpy(out.v.at({h, i}), store.value_row(h, pos), row_bytes);
      } else {
        convert_row(store.key_row(h, pos), store.dtype(), out.k.at({h, i}), out.k.dtype(), d);
        convert_row(store.value_row(h, pos), store.dtype(), out.v.at({h, i}), out.v.dtype(), d);
      }
    }
  });
  if (served_by_sources != nullptr) *served_by_sources = from_sources.load();
  return rows;
}

}  // namespace kvret
