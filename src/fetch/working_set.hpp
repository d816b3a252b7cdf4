#pragma once
// Working-set assembly on the CPU backend: for every KV head, sink + selected + local rows in position order,
// gathered from the host KV store into the caller's buffers.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor_view.hpp"
#include "store/host_kv_store.hpp"

namespace kvret {

struct WorkingSetViews {
  TensorView k;          ///< [H, capacity, D], store dtype or f32
  TensorView v;          ///< same
  TensorView positions;  ///< int32 [H, capacity]
};

/// The rows of one KV head's working set that fetch asks a row source for.
struct RowRequest {
  const void* sequence = nullptr;  ///< identifies the sequence (its rows' owner), for sources that cache by sequence
  int32_t layer = 0;
  int head = 0;
  const HostKvStore* store = nullptr;  ///< the layer's full-precision store (the last source of every chain)
  const int32_t* positions = nullptr;  ///< the working set's positions, in order: row i holds positions[i]
  int64_t rows = 0;
  const WorkingSetViews* out = nullptr;  ///< row i of `head` goes to out->k.at({head, i}) and out->v.at({head, i})
  uint8_t* served = nullptr;             ///< [rows]: nonzero where a source has written the row
};

/// Where working-set rows come from. Fetch asks the context's sources in order; each writes the rows it holds
/// that no source before it served (converted to the output dtype, see write_row), marks them, and returns how
/// many it wrote; the host store serves the rest. Sources are called for different heads from different threads
/// at once. A GPU block cache, a low-bit copy or a disk tier is a source: adding one changes neither Sequence nor
/// the C layer (Context::add_row_source).
class RowSource {
 public:
  virtual ~RowSource() = default;
  virtual const char* name() const noexcept = 0;
  virtual int64_t serve(const RowRequest& request) const = 0;
};

/// Writes one row (`head_dim` elements of dtype `type`) to row i of request.out for `kv` 0 (keys) or 1 (values).
void write_row(const RowRequest& request, int kv, int64_t i, const std::byte* row, DType type);

/// One KV head's working-set positions in row order: the sink [0, mid_begin), the `count` selected positions, the
/// local window [mid_end, length). `out` receives mid_begin + count + (length - mid_end) entries.
void working_set_positions(int64_t mid_begin, int64_t mid_end, int64_t length, const int32_t* selected, int64_t count,
                           int32_t* out) noexcept;

/// Writes the rows and returns the row count per head: mid_begin + count + (store.size() - mid_end).
/// selected[h] holds `count` ascending middle positions. Capacity must have been checked by the caller. The
/// `sources` are asked first (none: every row from the store); *served_by_sources counts the rows they wrote.
int64_t gather_working_set(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                           int64_t count, const WorkingSetViews& out, int n_threads,
                           const std::vector<std::shared_ptr<const RowSource>>& sources = {},
                           const void* sequence = nullptr, int32_t layer = 0, int64_t* served_by_sources = nullptr);

}  // namespace kvret
