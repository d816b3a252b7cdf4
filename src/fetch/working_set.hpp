#pragma once
// Working-set assembly on the CPU backend: for every KV head, sink + selected + local rows in position order,
// gathered from the host KV store into the caller's buffers.
#include <cstdint>

#include "core/tensor_view.hpp"
#include "store/host_kv_store.hpp"

namespace kvret {

struct WorkingSetViews {
  TensorView k;          ///< [H, capacity, D], store dtype or f32
  TensorView v;          ///< same
  TensorView positions;  ///< int32 [H, capacity]
};

/// Writes the rows and returns the row count per head: mid_begin + count + (store.size() - mid_end).
/// selected[h] holds `count` ascending middle positions. Capacity must have been checked by the caller.
int64_t gather_working_set(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                           int64_t count, const WorkingSetViews& out, int n_threads);

}  // namespace kvret
