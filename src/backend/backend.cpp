#include "backend/backend.hpp"

#include "core/attention.hpp"
#include "core/error.hpp"

namespace kvret {

void CpuBackend::check_access(const TensorView& t) const {
  const int32_t type = t.device().device_type;
  require(type == KVRET_DEVICE_CPU || type == KVRET_DEVICE_CUDA_HOST, KVRET_ERR_DEVICE,
          t.name() + ": device type " + std::to_string(type) +
              " is not readable by the CPU backend (use KVRET_DEVICE_CPU or KVRET_DEVICE_CUDA_HOST)");
}

int64_t CpuBackend::gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                           int64_t count, const WorkingSetViews& out, int n_threads,
                           const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence,
                           int32_t layer, int64_t* served_by_sources) {
  return gather_working_set(store, mid_begin, mid_end, selected, count, out, n_threads, sources, sequence, layer,
                            served_by_sources);
}

void CpuBackend::attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                        int64_t rows, float scale, const TensorView& out, int n_threads) {
  kvret::attend(config, q, k, v, rows, scale, out, n_threads);
}

std::unique_ptr<Backend> make_backend(const kvret_config& config) {
  require(
      config.device_type == KVRET_DEVICE_CPU, KVRET_ERR_UNSUPPORTED,
      "the CUDA backend (config.device_type = KVRET_DEVICE_CUDA) is not implemented in kvret " KVRET_VERSION_STRING);
  return std::make_unique<CpuBackend>();
}

}  // namespace kvret
