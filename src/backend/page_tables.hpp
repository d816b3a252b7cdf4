#pragma once
// The device addresses of the KV pages of each (sequence, layer), kept between calls (cuda_backend.cu includes it
// after device_memory.hpp). A pass that reads a store's pinned pages in place (the gather, the windows, the block
// cache's admissions, EXACT's and QUANT's keys) takes its page table from here: only the pages added or replaced
// since the last call (an append into a new page, a copy on write after a fork, a cut) are looked up
// (cudaHostGetDevicePointer) and sent, so a steady decode step makes no per-page driver call and sends nothing for
// its pages but the rare new one.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "store/host_kv_store.hpp"

namespace kvret::device_runtime {

/// The pages holding a store's first `tokens` tokens.
inline int64_t pages_for(int64_t tokens) noexcept {
  return (tokens + HostKvStore::kPageTokens - 1) / HostKvStore::kPageTokens;
}

/// Page `i` of `store` as the device addresses it (PinnedPages: read in place over the bus). A page holds the keys
/// of every head, head after head, then the values (HostKvStore's layout).
inline const std::byte* device_page_address(const HostKvStore& store, int64_t i) {
  note_page_lookup();
  const std::byte* page = store.key_row(0, i * HostKvStore::kPageTokens);
#if KVRET_ON_GPU
  void* device = nullptr;
  check_cuda(cudaHostGetDevicePointer(&device, const_cast<std::byte*>(page), 0), "cudaHostGetDevicePointer");
  page = static_cast<const std::byte*>(device);
#endif
  return page;
}

class PageTables {
 public:
  /// A layer's page table in device memory: keys[i] is page i's first key byte, values[i] its first value byte.
  struct Table {
    const std::byte* const* keys = nullptr;
    const std::byte* const* values = nullptr;
  };

  /// The table of `store`'s pages (every page holding one of its tokens) for (sequence, layer), brought up to date
  /// on `stream`; valid for work on `stream` until the next call for the same (sequence, layer). Throws
  /// std::bad_alloc (the device is full) or KVRET_ERR_CUDA, keeping no table for it.
  Table of(const HostKvStore& store, const void* sequence, int32_t layer, kvret_stream stream) {
    const int64_t n = pages_for(store.size());
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = map_[{sequence, layer}];
    try {
      if (n > e.capacity || !e.device) {
        const int64_t capacity = std::max<int64_t>({n, e.capacity + e.capacity / 2, 16});
        e.device.reset();
        e.host.clear();  // every page sent again into the new array
        e.device = std::make_unique<DeviceArray<const std::byte*>>(static_cast<size_t>(2 * capacity));
        e.capacity = capacity;
      }
      int64_t first = 0;  // the first page the table does not hold as the store has it
      const auto held = static_cast<int64_t>(e.host.size());
      while (first < n && first < held &&
             e.host[static_cast<size_t>(first)] == store.key_row(0, first * HostKvStore::kPageTokens))
        ++first;
      if (first < n) {
        const size_t row_set = static_cast<size_t>(store.n_kv_heads()) * HostKvStore::kPageTokens * store.row_bytes();
        std::vector<const std::byte*> keys, values;
        for (int64_t i = first; i < n; ++i) {
          keys.push_back(device_page_address(store, i));
          values.push_back(keys.back() + row_set);
        }
        const size_t bytes = keys.size() * sizeof(const std::byte*);
        upload(e.device->get() + first, keys.data(), bytes, stream);
        upload(e.device->get() + e.capacity + first, values.data(), bytes, stream);
      }
      e.host.resize(static_cast<size_t>(n));
      for (int64_t i = first; i < n; ++i)
        e.host[static_cast<size_t>(i)] = store.key_row(0, i * HostKvStore::kPageTokens);
    } catch (...) {
      map_.erase({sequence, layer});
      throw;
    }
    return {e.device->get(), e.device->get() + e.capacity};
  }

  /// Drops the tables of `sequence`'s `layer` (-1: every layer). Never throws.
  void forget(const void* sequence, int32_t layer) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = map_.lower_bound({sequence, INT32_MIN}); it != map_.end() && it->first.first == sequence;)
      it = layer == -1 || it->first.second == layer ? map_.erase(it) : std::next(it);
  }

 private:
  struct Entry {
    std::vector<const std::byte*> host;  ///< the pages (host addresses) the device array holds, in order
    std::unique_ptr<DeviceArray<const std::byte*>> device;  ///< [2 * capacity]: key bases, then value bases
    int64_t capacity = 0;
  };
  std::mutex mutex_;
  std::map<std::pair<const void*, int32_t>, Entry> map_;
};

}  // namespace kvret::device_runtime
