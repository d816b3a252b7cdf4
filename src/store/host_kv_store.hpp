#pragma once
// The host KV store of one (sequence, layer): paged, growing with the sequence, in the context's KV dtype.
// A page holds kPageTokens tokens of every KV head, keys then values, each head's rows contiguous, so that the
// rows of one head are 256-byte (f16, D=128) records at a fixed stride: the unit fetch gathers.
// With a rotary embedding (config.rope_keys = 1, docs/rope.md) the keys appended are before RoPE: a page then
// holds a third part, the keys as given, and its keys are those keys rotated at their position (their index in the
// store), which is what every reader of key_row and keys_f32 sees.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/rope.hpp"
#include "core/tensor_view.hpp"
#include "store/page_allocator.hpp"

namespace kvret {

class HostKvStore {
 public:
  static constexpr int64_t kPageTokens = 256;

  /// Pages come from `pages` (which must outlive every page: the backend's allocator outlives the sequences).
  /// With `rope`, the keys appended are before RoPE (see above); rope->dims() <= head_dim.
  HostKvStore(int n_kv_heads, int head_dim, DType dtype, PageAllocator& pages = host_page_allocator(),
              std::shared_ptr<const rope::Rope> rope = nullptr);

  int64_t size() const noexcept { return size_; }
  DType dtype() const noexcept { return dtype_; }
  int head_dim() const noexcept { return head_dim_; }
  int n_kv_heads() const noexcept { return n_kv_heads_; }
  size_t row_bytes() const noexcept { return row_bytes_; }
  /// The rotary embedding of the keys; null when they are stored as given.
  const std::shared_ptr<const rope::Rope>& rope() const noexcept { return rope_; }
  /// Bytes held in pages.
  int64_t bytes() const noexcept { return static_cast<int64_t>(pages_.size()) * page_bytes_; }
  /// Extra page bytes an append of `tokens` more tokens adds to bytes() (INT64_MAX when that does not fit in 64
  /// bits). A shared page it copies first replaces the shared one, so it adds nothing here.
  int64_t bytes_to_grow(int64_t tokens) const noexcept;

  /// Appends `tokens` tokens. k and v are [tokens, H, D] views (or [H, D] when tokens_dim is false). Every page is
  /// allocated before any byte is written, so a failed allocation (Error OUT_OF_MEMORY) leaves the store as it was.
  /// With rope(), k is before RoPE: it is kept (pre_rope_key_row), and the key of the token at position p is its
  /// kept row, converted to f32, rotated at p and converted to the store's dtype.
  void append(const TensorView& k, const TensorView& v, int64_t tokens, bool tokens_dim);

  /// Drops the tokens from `size` on (keeps their pages for reuse). Never throws.
  void truncate(int64_t size) noexcept {
    if (size < size_) size_ = size;
  }
  /// Frees the pages past the last one holding a token; returns the bytes freed. Never throws.
  int64_t release_unused_pages() noexcept;

  /// A store holding the same tokens that shares this one's pages (copy on write: an append to either copies a
  /// shared page before it writes into it). Throws std::bad_alloc (its page list), changing nothing.
  HostKvStore fork() const;

  /// A store holding this one's tokens without [keep, keep + count): the tokens after them move `count` positions
  /// earlier (with rope(), their keys are rotated again, from the kept pre-RoPE rows, at the new positions). keep
  /// and count >= 0; a store of at most `keep` tokens is copied whole. The pages wholly before `keep` are shared
  /// (copy on write, as fork); the others are new. Throws Error OUT_OF_MEMORY or std::bad_alloc, changing nothing.
  HostKvStore without(int64_t keep, int64_t count) const;

  const std::byte* key_row(int head, int64_t pos) const noexcept { return row(0, head, pos); }
  const std::byte* value_row(int head, int64_t pos) const noexcept { return row(1, head, pos); }
  /// The key of `head` at `pos` as appended, before RoPE. Only with rope().
  const std::byte* pre_rope_key_row(int head, int64_t pos) const noexcept { return row(2, head, pos); }
  /// Keys of `head` at positions [begin, end) converted to f32, row-major [end-begin, D].
  void keys_f32(int head, int64_t begin, int64_t end, float* out) const noexcept;

 private:
  const std::byte* row(int kv, int head, int64_t pos) const noexcept {
    const std::byte* page = pages_[static_cast<size_t>(pos / kPageTokens)].get();
    return page + ((static_cast<int64_t>(kv) * n_kv_heads_ + head) * kPageTokens + pos % kPageTokens) *
                      static_cast<int64_t>(row_bytes_);
  }
  std::byte* row(int kv, int head, int64_t pos) noexcept {
    return const_cast<std::byte*>(static_cast<const HostKvStore*>(this)->row(kv, head, pos));
  }

  /// A page, shared by the stores of forked sequences until one of them writes into it.
  using Page = std::shared_ptr<std::byte>;
  /// A new page (Error OUT_OF_MEMORY when it cannot be allocated).
  Page new_page() const;
  /// Writes the key row of (head, pos): the pre-RoPE row rotated at pos. `scratch` holds head_dim floats; c and s,
  /// rope_->pairs() each, are the cosines and sines of pos.
  void rotate_key(int head, int64_t pos, float* scratch, const double* c, const double* s) noexcept;

  PageAllocator* allocator_;
  int n_kv_heads_;
  int head_dim_;
  DType dtype_;
  size_t row_bytes_;
  std::shared_ptr<const rope::Rope> rope_;
  int64_t page_bytes_;
  int64_t size_ = 0;
  std::vector<Page> pages_;
};

}  // namespace kvret
