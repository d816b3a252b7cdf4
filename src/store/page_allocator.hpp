#pragma once
// Where the KV store's pages come from: the backend's memory (plain host memory on the CPU backend; pinned,
// device-mapped host memory on a GPU backend, so that kernels read the pages directly).
#include <cstddef>

namespace kvret {

class PageAllocator {
 public:
  virtual ~PageAllocator() = default;
  /// `bytes` bytes aligned to 64, or nullptr when they cannot be had. Called from any thread.
  virtual std::byte* allocate(size_t bytes) noexcept = 0;
  /// Frees what allocate returned (with the same size). Called from any thread.
  virtual void deallocate(std::byte* p, size_t bytes) noexcept = 0;
};

/// Aligned operator new: the CPU backend's pages.
PageAllocator& host_page_allocator() noexcept;

}  // namespace kvret
