#pragma once
// Vectors for an index's large, growing arrays (PQ codes and exact keys, PAGE bounds): from kMappedBytes up their
// storage is mapped from the kernel instead of taken from malloc's heap, so that the buffer a growth leaves behind,
// and the whole index when its sequence closes, go back to the system at once instead of staying in the heap as
// free memory (a long decode grows every index array step by step).
#include <sys/mman.h>

#include <cstddef>
#include <limits>
#include <new>
#include <vector>

namespace kvret {

template <class T>
class LargeAllocator {
 public:
  using value_type = T;
  static constexpr size_t kMappedBytes = size_t{256} << 10;

  LargeAllocator() noexcept = default;
  template <class U>
  LargeAllocator(const LargeAllocator<U>&) noexcept {}  // NOLINT: rebinding, as std::allocator

  T* allocate(size_t n) {
    if (n > std::numeric_limits<size_t>::max() / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes < kMappedBytes) return static_cast<T*>(::operator new(bytes));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMappedBytes) {
      ::operator delete(p);
      return;
    }
    munmap(p, bytes);
  }
  template <class U>
  bool operator==(const LargeAllocator<U>&) const noexcept {
    return true;
  }
};

template <class T>
using LargeVector = std::vector<T, LargeAllocator<T>>;

}  // namespace kvret
