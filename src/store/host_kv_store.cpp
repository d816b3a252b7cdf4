#include "store/host_kv_store.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "core/error.hpp"

namespace kvret {

namespace {
constexpr std::align_val_t kPageAlignment{64};

class HostPages final : public PageAllocator {
 public:
  std::byte* allocate(size_t bytes) noexcept override {
    if (bytes >= kMappedPageBytes) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      return p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
    }
    return static_cast<std::byte*>(::operator new[](bytes, kPageAlignment, std::nothrow));
  }
  void deallocate(std::byte* p, size_t bytes) noexcept override {
    if (bytes >= kMappedPageBytes) {
      munmap(p, bytes);
      return;
    }
    ::operator delete[](p, kPageAlignment);
  }
};
}  // namespace

PageAllocator& host_page_allocator() noexcept {
  static HostPages pages;
  return pages;
}

HostKvStore::HostKvStore(int n_kv_heads, int head_dim, DType dtype, PageAllocator& pages)
    : allocator_(&pages),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      dtype_(dtype),
      row_bytes_(static_cast<size_t>(head_dim) * dtype_size(dtype)),
      page_bytes_(2 * n_kv_heads * kPageTokens * static_cast<int64_t>(row_bytes_)) {}

int64_t HostKvStore::bytes_to_grow(int64_t tokens) const noexcept {
  if (tokens > INT64_MAX - size_) return INT64_MAX;
  const int64_t total = size_ + tokens;
  const int64_t have = static_cast<int64_t>(pages_.size());
  const int64_t need = total / kPageTokens + (total % kPageTokens != 0 ? 1 : 0);
  int64_t bytes = 0;
  if (need <= have) return 0;
  return __builtin_mul_overflow(need - have, page_bytes_, &bytes) ? INT64_MAX : bytes;
}

HostKvStore::Page HostKvStore::new_page() const {
  const auto bytes = static_cast<size_t>(page_bytes_);
  std::byte* raw = allocator_->allocate(bytes);
  if (raw == nullptr)
    throw Error(KVRET_ERR_OUT_OF_MEMORY,
                "could not allocate a " + std::to_string(page_bytes_) + "-byte KV page in host memory");
  PageAllocator* allocator = allocator_;
  // the deleter frees raw also when the control block cannot be allocated
  return Page(raw, [allocator, bytes](std::byte* p) noexcept { allocator->deallocate(p, bytes); });
}

HostKvStore HostKvStore::fork() const {
  HostKvStore copy(n_kv_heads_, head_dim_, dtype_, *allocator_);
  const auto used = static_cast<size_t>(size_ / kPageTokens + (size_ % kPageTokens != 0 ? 1 : 0));
  copy.pages_.assign(pages_.begin(), pages_.begin() + static_cast<std::ptrdiff_t>(used));
  copy.size_ = size_;
  return copy;
}

namespace {
/// Whether another store holds `page`. use_count() is a relaxed load: a count of 1 would not order this store's
/// writes after the last reads of an owner that dropped the page on another thread (a data race). Dropping a copy
/// of the handle does: its decrement, an acquire, reads the count through the release of every earlier owner's.
bool shared(const std::shared_ptr<std::byte>& page) noexcept {
  { const std::shared_ptr<std::byte> probe = page; }
  return page.use_count() > 1;
}
}  // namespace

void HostKvStore::append(const TensorView& k, const TensorView& v, int64_t tokens, bool tokens_dim) {
  const int64_t grow = bytes_to_grow(tokens);
  require(grow < INT64_MAX, KVRET_ERR_OUT_OF_MEMORY,
          "appending " + std::to_string(tokens) + " tokens needs more than 2^63 bytes of host memory");
  const size_t new_pages = static_cast<size_t>(grow / page_bytes_);
  std::vector<Page> fresh;
  fresh.reserve(new_pages);
  for (size_t i = 0; i < new_pages; ++i) fresh.push_back(new_page());
  // Pages this append writes into that a forked store shares: copied first (copy on write).
  const auto first = static_cast<size_t>(size_ / kPageTokens);
  const int64_t total = size_ + tokens;
  const auto last = std::min(pages_.size(), static_cast<size_t>(total / kPageTokens + (total % kPageTokens != 0)));
  std::vector<std::pair<size_t, Page>> copies;
  for (size_t p = first; p < last; ++p) {
    if (!shared(pages_[p])) continue;
    Page page = new_page();
    std::memcpy(page.get(), pages_[p].get(), static_cast<size_t>(page_bytes_));
    copies.emplace_back(p, std::move(page));
  }
  // may throw bad_alloc before anything changed; grows geometrically (decode adds a page every kPageTokens tokens)
  if (pages_.capacity() < pages_.size() + new_pages)
    pages_.reserve(std::max(2 * pages_.capacity(), pages_.size() + new_pages));
  for (auto& [p, page] : copies) pages_[p].swap(page);
  for (auto& p : fresh) pages_.push_back(std::move(p));
  // Nothing below can fail.
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = size_ + t;
    for (int h = 0; h < n_kv_heads_; ++h) {
      const std::byte* ks = tokens_dim ? k.at({t, h}) : k.at({h});
      const std::byte* vs = tokens_dim ? v.at({t, h}) : v.at({h});
      convert_row(ks, k.dtype(), row(0, h, pos), dtype_, static_cast<size_t>(head_dim_));
      convert_row(vs, v.dtype(), row(1, h, pos), dtype_, static_cast<size_t>(head_dim_));
    }
  }
  size_ += tokens;
}

int64_t HostKvStore::release_unused_pages() noexcept {
  const auto need = static_cast<size_t>(size_ / kPageTokens + (size_ % kPageTokens != 0 ? 1 : 0));
  if (pages_.size() <= need) return 0;
  const int64_t freed = static_cast<int64_t>(pages_.size() - need) * page_bytes_;
  pages_.resize(need);  // shrinking: no allocation
  return freed;
}

void HostKvStore::keys_f32(int head, int64_t begin, int64_t end, float* out) const noexcept {
  for (int64_t pos = begin; pos < end; ++pos)
    load_row_f32(key_row(head, pos), dtype_, out + (pos - begin) * head_dim_, static_cast<size_t>(head_dim_));
}

}  // namespace kvret
