// The parts of PqRetriever that the CUDA backend's device copy of the index reads (src/backend/cuda_backend.cu), in
// a translation unit of their own: with them in pq_retriever.cpp, GCC inlines differently into the CPU select, whose
// machine code is kept as it was.
#include <algorithm>

#include "index/pq_retriever.hpp"

namespace kvret {

std::vector<float> PqRetriever::exact_keys_f32(int head, int64_t from) const {
  const auto& rows = exact_keys_[static_cast<size_t>(head)];
  const auto total = static_cast<int64_t>(exact_pos_[static_cast<size_t>(head)].size());
  const size_t n = static_cast<size_t>(std::max<int64_t>(0, total - from)) * static_cast<size_t>(d_);
  std::vector<float> out(n);
  convert_row(rows.data() + static_cast<size_t>(from) * static_cast<size_t>(d_) * dtype_size(key_dtype_), key_dtype_,
              reinterpret_cast<std::byte*>(out.data()), DType::F32, n);
  return out;
}

void PqRetriever::items(int head, int64_t from, int64_t to, int32_t* out) const {
  if (uses_cells()) {
    const auto& cell = cells_of_[static_cast<size_t>(head)];
    for (int64_t t = from; t < to; ++t) out[t - from] = cell[static_cast<size_t>(t)];
  } else {
    std::fill(out, out + (to - from), -1);
  }
  const auto& pos = exact_pos_[static_cast<size_t>(head)];
  for (auto e = std::lower_bound(pos.begin(), pos.end(), base_ + from); e != pos.end() && *e < base_ + to; ++e)
    out[*e - base_ - from] = static_cast<int32_t>(cells_ + (e - pos.begin()));
}

}  // namespace kvret
