#pragma once
// The backend a context runs on: where KV pages live, how working sets are gathered and attended, and which streams
// it orders work on. The CPU backend implements all of it; a CUDA backend fills the same interface (pinned,
// device-mapped pages; kernels on the caller's stream). The context owns one, made from config.device_type.
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor_view.hpp"
#include "fetch/working_set.hpp"
#include "kvret.h"
#include "store/host_kv_store.hpp"
#include "store/page_allocator.hpp"

namespace kvret {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const noexcept = 0;
  /// Where the KV stores' pages come from (outlives every sequence of the context).
  virtual PageAllocator& pages() noexcept = 0;
  /// Throws KVRET_ERR_DEVICE unless this backend's calls can read and write `t`'s memory.
  virtual void check_access(const TensorView& t) const = 0;
  /// Checks that work can be ordered on `stream` (the CPU backend completes every call before it returns and
  /// accepts any stream).
  virtual void check_stream(kvret_stream stream) const = 0;
  /// Waits for the work enqueued on `stream`.
  virtual void synchronize(kvret_stream stream) = 0;
  /// gather_working_set's contract: sink + selected + local rows of `store` into `out`, the row sources first.
  virtual int64_t gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                         int64_t count, const WorkingSetViews& out, int n_threads,
                         const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence,
                         int32_t layer, int64_t* served_by_sources) = 0;
  /// attend's contract (core/attention.hpp).
  virtual void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                      int64_t rows, float scale, const TensorView& out, int n_threads) = 0;
};

/// Host pages, the OpenMP gather and the reference attention.
class CpuBackend : public Backend {
 public:
  const char* name() const noexcept override { return "cpu"; }
  PageAllocator& pages() noexcept override { return host_page_allocator(); }
  /// Host memory: KVRET_DEVICE_CPU and pinned KVRET_DEVICE_CUDA_HOST.
  void check_access(const TensorView& t) const override;
  void check_stream(kvret_stream) const override {}
  void synchronize(kvret_stream) override {}
  int64_t gather(const HostKvStore& store, int64_t mid_begin, int64_t mid_end, const int32_t* const* selected,
                 int64_t count, const WorkingSetViews& out, int n_threads,
                 const std::vector<std::shared_ptr<const RowSource>>& sources, const void* sequence, int32_t layer,
                 int64_t* served_by_sources) override;
  void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
              float scale, const TensorView& out, int n_threads) override;
};

/// The backend of config.device_type: the CPU backend, or KVRET_ERR_UNSUPPORTED for a device this build lacks.
std::unique_ptr<Backend> make_backend(const kvret_config& config);

}  // namespace kvret
