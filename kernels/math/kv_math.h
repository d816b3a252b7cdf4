#pragma once
// Checks and clamps of where the kernels read keys and values: 16-byte alignment of host-store rows and page bases
// (the gather, the block-cache fill and decode attention move 16-byte pieces), and the rows a sequence really has.
#include "../kv_source.h"
#include "hd.h"

namespace kvret::cuda::math {

/// True when every row of a host store described by `view` is 16-byte aligned: every page base (given here as the
/// host's copy of the page-pointer array, which view.k_pages / v_pages point to on the device side) is a multiple
/// of 16, and so are token_stride and head_stride. Also checks that the pages cover n_tokens. A builder of a
/// HostKvView calls this before handing it to a launch; false means the view must not be used (the launchers
/// answer cudaErrorInvalidValue for such a view).
inline bool host_kv_view_aligned(const HostKvView& view, const void* const* k_pages_host,
                                 const void* const* v_pages_host, int64_t n_pages) {
  if (view.page_tokens <= 0 || view.n_tokens < 0 || n_pages < 0) return false;
  if (view.token_stride % 16 != 0 || view.head_stride % 16 != 0) return false;
  if (view.n_tokens > 0 && (n_pages == 0 || view.n_tokens > n_pages * view.page_tokens)) return false;
  if (n_pages > 0 && (k_pages_host == nullptr || v_pages_host == nullptr)) return false;
  for (int64_t i = 0; i < n_pages; ++i) {
    if (!aligned16(k_pages_host[i]) || !aligned16(v_pages_host[i])) return false;
  }
  return true;
}

/// True when a dense [heads, capacity, head_dim] buffer of `row_bytes`-byte rows can be read 16 bytes at a time.
KVRET_HD bool dense_rows_aligned(const void* base, int64_t row_bytes) { return aligned16(base) && row_bytes % 16 == 0; }

/// The rows decode attention attends for a sequence: n_rows clamped to [0, min(kv_capacity, max_rows)] (the launch
/// sizes its chunks by max_rows; rows at or beyond kv_capacity belong to the next head).
KVRET_HD int32_t attention_clamp_rows(int32_t n_rows, int64_t kv_capacity, int32_t max_rows) {
  int64_t hi = kv_capacity < max_rows ? kv_capacity : max_rows;
  return static_cast<int32_t>(clamp_i64(n_rows, 0, hi < 0 ? 0 : hi));
}

/// Rows per tile of decode attention's chunk kernel, and tiles in flight (cp.async double buffering).
inline constexpr int32_t kAttentionTileRows = 32;
inline constexpr int32_t kAttentionStages = 2;

/// Dynamic shared memory of decode attention's chunk kernel: kAttentionStages x (a K tile and a V tile) of
/// kAttentionTileRows rows of head_dim elements of elem_bytes bytes, loaded 16 bytes at a time.
constexpr size_t attention_kv_smem_bytes(int32_t head_dim, int32_t elem_bytes) {
  return static_cast<size_t>(kAttentionStages) * 2 * kAttentionTileRows * static_cast<size_t>(head_dim) *
         static_cast<size_t>(elem_bytes);
}

/// The rows decode attention attends for a sequence, as both of its kernels see them: attention_clamp_rows, or 0
/// when k or v is not 16-byte aligned (the chunks load 16-byte pieces; such a sequence gets a zero output).
KVRET_HD int32_t attention_rows(int32_t n_rows, int64_t kv_capacity, int32_t max_rows, const void* k, const void* v) {
  return aligned16(k) && aligned16(v) ? attention_clamp_rows(n_rows, kv_capacity, max_rows) : 0;
}

/// The rows the gather writes for a sequence: n_rows clamped to [0, min(out_capacity, max_rows)].
KVRET_HD int32_t gather_clamp_rows(int32_t n_rows, int64_t out_capacity, int32_t max_rows) {
  int64_t hi = out_capacity < max_rows ? out_capacity : max_rows;
  return static_cast<int32_t>(clamp_i64(n_rows, 0, hi < 0 ? 0 : hi));
}

/// The row of the device windows holding `position` (WindowRows), or -1 when they do not hold it.
KVRET_HD int32_t window_slot(const WindowRows& w, int64_t position) {
  if (position >= 0 && position < w.sink_end) return static_cast<int32_t>(position);
  if (position >= w.local_begin && position < w.local_end && w.local_slots > 0)
    return w.sink_slots + static_cast<int32_t>(position % w.local_slots);
  return -1;
}

/// What the windows must load for a layer of `size` tokens: positions [sink_from, sink_to) into the sink rows and
/// [local_from, local_to) into the local rows, after which they hold `next`.
struct WindowRefresh {
  int64_t sink_from = 0, sink_to = 0;
  int64_t local_from = 0, local_to = 0;
  WindowRows next;
};

/// The refresh of windows that hold `held`, for a layer of `size` tokens: the sink rows are to hold the first
/// min(sink_slots, size) positions; the local rows the last local_slots positions past the sink. Rows already held
/// stay (and are not loaded again) while they are still wanted and contiguous with the new ones; a gap (the layer
/// grew by more than local_slots since) loads the whole local window. Never more than sink_slots + local_slots rows.
KVRET_HD WindowRefresh window_refresh(const WindowRows& held, int64_t size) {
  WindowRefresh r;
  r.next = held;
  if (size < 0) size = 0;
  r.sink_to = size < held.sink_slots ? size : held.sink_slots;
  r.sink_from = held.sink_end < r.sink_to ? held.sink_end : r.sink_to;
  r.next.sink_end = static_cast<int32_t>(r.sink_to);
  if (held.local_slots <= 0) {
    r.next.local_begin = r.next.local_end = 0;
    return r;
  }
  const int64_t last = size - held.local_slots;
  const int64_t wanted = last > r.sink_to ? last : r.sink_to;  // the first position the local rows are to hold
  const bool keeps = held.local_begin < held.local_end && held.local_end >= wanted && held.local_end <= size;
  r.local_from = keeps ? held.local_end : wanted;
  r.local_to = size > r.local_from ? size : r.local_from;
  r.next.local_begin = keeps && held.local_begin > wanted ? held.local_begin : wanted;
  r.next.local_end = r.local_to;
  if (r.next.local_begin > r.next.local_end) r.next.local_begin = r.next.local_end;
  return r;
}

/// The windows after the rows at or past `from` changed (a truncate to `from`, a drop_front keeping `from` rows):
/// they hold no position at or past it.
KVRET_HD WindowRows window_drop_from(const WindowRows& held, int64_t from) {
  WindowRows w = held;
  if (from < 0) from = 0;
  if (w.sink_end > from) w.sink_end = static_cast<int32_t>(from);
  if (w.local_end > from) w.local_end = from;
  if (w.local_begin > w.local_end) w.local_begin = w.local_end;
  return w;
}

}  // namespace kvret::cuda::math
