#pragma once
// A paged host KV store in mapped pinned memory and a device block cache, as the gather and block-cache tests
// need them: random bytes (the kernels copy rows, whatever their element type), known on the host.
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "kv_source.h"

namespace kvret::cuda::testing {

/// Pages of page_tokens tokens, each [page_tokens, n_kv_heads, row_bytes] (token-major), for keys and values.
class HostKvStore {
 public:
  HostKvStore(const KvGeometry& geo, int64_t n_tokens, int64_t page_tokens, uint64_t seed)
      : geo_(geo), n_tokens_(n_tokens), page_tokens_(page_tokens), row_bytes_(kv_row_bytes(geo)) {
    const int64_t n_pages = ceil_div(n_tokens, page_tokens);
    const auto page_bytes = static_cast<size_t>(page_tokens * geo.n_kv_heads * row_bytes_);
    std::mt19937_64 rng(seed);
    std::vector<const void*> k_ptrs;
    std::vector<const void*> v_ptrs;
    for (int64_t i = 0; i < n_pages; ++i) {
      k_pages_.push_back(std::make_unique<MappedHostBuffer>(page_bytes));
      v_pages_.push_back(std::make_unique<MappedHostBuffer>(page_bytes));
      for (size_t b = 0; b < page_bytes; ++b) {
        k_pages_.back()->host()[b] = static_cast<unsigned char>(rng());
        v_pages_.back()->host()[b] = static_cast<unsigned char>(rng());
      }
      k_ptrs.push_back(k_pages_.back()->device());
      v_ptrs.push_back(v_pages_.back()->device());
    }
    d_k_pages_ = DeviceBuffer<const void*>(k_ptrs);
    d_v_pages_ = DeviceBuffer<const void*>(v_ptrs);
  }

  HostKvView view() const {
    HostKvView view;
    view.k_pages = d_k_pages_.get();
    view.v_pages = d_v_pages_.get();
    view.page_tokens = page_tokens_;
    view.token_stride = geo_.n_kv_heads * row_bytes_;
    view.head_stride = row_bytes_;
    view.n_tokens = n_tokens_;
    return view;
  }

  /// The stored bytes of row (position, head).
  const unsigned char* key_row(int64_t position, int head) const { return row(k_pages_, position, head); }
  const unsigned char* value_row(int64_t position, int head) const { return row(v_pages_, position, head); }
  int64_t row_bytes() const { return row_bytes_; }
  int64_t n_tokens() const { return n_tokens_; }

 private:
  const unsigned char* row(const std::vector<std::unique_ptr<MappedHostBuffer>>& pages, int64_t position,
                           int head) const {
    const int64_t page = position / page_tokens_;
    const int64_t in_page = position % page_tokens_;
    return pages[page]->host() + (in_page * geo_.n_kv_heads + head) * row_bytes_;
  }

  KvGeometry geo_;
  int64_t n_tokens_;
  int64_t page_tokens_;
  int64_t row_bytes_;
  std::vector<std::unique_ptr<MappedHostBuffer>> k_pages_;
  std::vector<std::unique_ptr<MappedHostBuffer>> v_pages_;
  DeviceBuffer<const void*> d_k_pages_;
  DeviceBuffer<const void*> d_v_pages_;
};

/// The device arrays of one block cache, with host mirrors of its tables.
struct DeviceBlockCache {
  DeviceBlockCache(const KvGeometry& geo, int32_t max_blocks_, int32_t n_slots_)
      : max_blocks(max_blocks_),
        n_slots(n_slots_),
        row_bytes(kv_row_bytes(geo)),
        block_table(std::vector<int32_t>(static_cast<size_t>(geo.n_kv_heads) * max_blocks_, -1)),
        slot_block(std::vector<int32_t>(static_cast<size_t>(geo.n_kv_heads) * n_slots_, -1)),
        slot_stamp(std::vector<uint32_t>(static_cast<size_t>(geo.n_kv_heads) * n_slots_, 0)),
        slot_prefetched(std::vector<uint8_t>(static_cast<size_t>(geo.n_kv_heads) * n_slots_, 0)),
        k(static_cast<size_t>(geo.n_kv_heads) * n_slots_ * geo.block_tokens * row_bytes),
        v(static_cast<size_t>(geo.n_kv_heads) * n_slots_ * geo.block_tokens * row_bytes) {
    k.fill_bytes(0);
    v.fill_bytes(0);
  }

  BlockCacheView view() const {
    BlockCacheView view;
    view.block_table = block_table.get();
    view.slot_block = slot_block.get();
    view.slot_stamp = slot_stamp.get();
    view.slot_prefetched = slot_prefetched.get();
    view.k = k.get();
    view.v = v.get();
    view.max_blocks = max_blocks;
    view.n_slots = n_slots;
    return view;
  }

  int32_t max_blocks;
  int32_t n_slots;
  int64_t row_bytes;
  DeviceBuffer<int32_t> block_table;
  DeviceBuffer<int32_t> slot_block;
  DeviceBuffer<uint32_t> slot_stamp;
  DeviceBuffer<uint8_t> slot_prefetched;
  DeviceBuffer<unsigned char> k;
  DeviceBuffer<unsigned char> v;
};

}  // namespace kvret::cuda::testing
