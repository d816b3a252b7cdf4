#pragma once
// A row source's serve for tests: rows whose content is their position, so that a working set shows which rows a
// source served.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fetch/working_set.hpp"

namespace kvret::test {

/// Serves every row not yet served whose position is a multiple of `every`: its key row all `position`, its value
/// row all `-position` (f32 rows). Returns the rows it wrote.
inline int64_t serve_position_rows(const RowRequest& r, int64_t every) {
  std::vector<float> row(static_cast<size_t>(r.store->head_dim()));
  int64_t wrote = 0;
  for (int64_t i = 0; i < r.rows; ++i) {
    if (r.served[i] != 0 || r.positions[i] % every != 0) continue;
    std::fill(row.begin(), row.end(), static_cast<float>(r.positions[i]));
    write_row(r, 0, i, reinterpret_cast<const std::byte*>(row.data()), DType::F32);
    std::fill(row.begin(), row.end(), -static_cast<float>(r.positions[i]));
    write_row(r, 1, i, reinterpret_cast<const std::byte*>(row.data()), DType::F32);
    r.served[i] = 1;
    ++wrote;
  }
  return wrote;
}

}  // namespace kvret::test
