#include "backend/backend.hpp"

#include <new>

#include "backend/cuda_backend.hpp"
#include "core/attention.hpp"
#include "core/error.hpp"

namespace kvret {

namespace {

class HostBuffer final : public DeviceBuffer {
 public:
  explicit HostBuffer(size_t bytes) : bytes_(bytes), data_(new std::byte[bytes == 0 ? 1 : bytes]) {}
  std::byte* data() const noexcept override { return data_.get(); }
  size_t bytes() const noexcept override { return bytes_; }
  kvret_device device() const noexcept override { return {KVRET_DEVICE_CPU, 0}; }

 private:
  size_t bytes_;
  std::unique_ptr<std::byte[]> data_;
};

}  // namespace

TensorView Backend::host_readable(const TensorView& t, std::vector<std::byte>&) { return t; }

TensorView Backend::host_writable(const TensorView& t, std::vector<std::byte>&) { return t; }

void Backend::write_back(const TensorView&, const TensorView&) {}

std::unique_ptr<DeviceBuffer> Backend::allocate(size_t bytes) { return std::make_unique<HostBuffer>(bytes); }

void Backend::gather_batch(GatherJob* jobs, size_t n, int n_threads, kvret_stream stream) {
  for (size_t i = 0; i < n; ++i) {
    GatherJob& j = jobs[i];
    j.rows = gather(*j.store, j.mid_begin, j.mid_end, j.selected, j.count, *j.out, n_threads, *j.sources, j.sequence,
                    j.layer, &j.served_by_sources, stream);
  }
}

void CpuBackend::check_access(const TensorView& t) const {
  const int32_t type = t.device().device_type;
  require(type == KVRET_DEVICE_CPU || type == KVRET_DEVICE_CUDA_HOST, KVRET_ERR_DEVICE,
          t.name() + ": device type " + std::to_string(type) +
              " is not readable by the CPU backend (use KVRET_DEVICE_CPU or KVRET_DEVICE_CUDA_HOST)");
}

int64_t CpuBackend::gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                           int64_t count, const WorkingSetViews& out, int n_threads,
                           const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence,
                           int32_t layer, int64_t* served_by_sources, kvret_stream) {
  return gather_working_set(store, mid_begin, mid_end, selected, count, out, n_threads, sources, sequence, layer,
                            served_by_sources);
}

void CpuBackend::attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                        int64_t rows, float scale, const TensorView& out, int n_threads, kvret_stream) {
  kvret::attend(config, q, k, v, rows, scale, out, n_threads);
}

std::unique_ptr<Backend> make_backend(const kvret_config& config) {
  if (config.device_type == KVRET_DEVICE_CPU) return std::make_unique<CpuBackend>();
  require(
      config.device_type == KVRET_DEVICE_CUDA, KVRET_ERR_INVALID_ARGUMENT,
      "config.device_type: must be KVRET_DEVICE_CPU or KVRET_DEVICE_CUDA, got " + std::to_string(config.device_type));
#if KVRET_CUDA_BACKEND
  return make_cuda_backend(config);
#else
  throw Error(
      KVRET_ERR_UNSUPPORTED,
      "the CUDA backend (config.device_type = KVRET_DEVICE_CUDA) is not in this build of kvret " KVRET_VERSION_STRING
      " (it was built without the CUDA toolkit)");
#endif
}

const char* cuda_backend_system() noexcept {
#if KVRET_CUDA_BACKEND
  return cuda_backend_system_name();
#else
  return nullptr;
#endif
}

}  // namespace kvret
