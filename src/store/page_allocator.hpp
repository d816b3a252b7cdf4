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

/// Pages of at least this many bytes are mapped from the kernel (mmap) rather than taken from malloc's heap: their
/// memory goes back to the system when they are freed (a closed sequence's KV leaves no free heap behind it), and
/// they never fragment the heap the index and the caller use.
inline constexpr size_t kMappedPageBytes = size_t{512} << 10;

/// The CPU backend's pages: mapped (page-aligned) from kMappedPageBytes up, else aligned operator new (to 64).
PageAllocator& host_page_allocator() noexcept;

}  // namespace kvret
