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

HostKvStore::HostKvStore(int n_kv_heads, int head_dim, DType dtype, PageAllocator& pages,
                         std::shared_ptr<const rope::Rope> rope)
    : allocator_(&pages),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      dtype_(dtype),
      row_bytes_(static_cast<size_t>(head_dim) * dtype_size(dtype)),
      rope_(std::move(rope)),
      page_bytes_((rope_ ? 3 : 2) * n_kv_heads * kPageTokens * static_cast<int64_t>(row_bytes_)) {}

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
  HostKvStore copy(n_kv_heads_, head_dim_, dtype_, *allocator_, rope_);
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
  // the rotation's scratch: a row, and the cosines and sines of a position
  std::vector<float> scratch(rope_ ? static_cast<size_t>(head_dim_) : 0);
  std::vector<double> angles(rope_ ? static_cast<size_t>(2 * rope_->pairs()) : 0);
  for (auto& [p, page] : copies) pages_[p].swap(page);
  for (auto& p : fresh) pages_.push_back(std::move(p));
  // Nothing below can fail.
  const auto d = static_cast<size_t>(head_dim_);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = size_ + t;
    double* c = angles.data();
    double* s = rope_ ? c + rope_->pairs() : nullptr;
    if (rope_) rope_->cos_sin_at(pos, c, s);
    for (int h = 0; h < n_kv_heads_; ++h) {
      const std::byte* ks = tokens_dim ? k.at({t, h}) : k.at({h});
      const std::byte* vs = tokens_dim ? v.at({t, h}) : v.at({h});
      if (rope_) {
        convert_row(ks, k.dtype(), row(2, h, pos), dtype_, d);
        rotate_key(h, pos, scratch.data(), c, s);
      } else {
        convert_row(ks, k.dtype(), row(0, h, pos), dtype_, d);
      }
      convert_row(vs, v.dtype(), row(1, h, pos), dtype_, d);
    }
  }
  size_ += tokens;
}

void HostKvStore::rotate_key(int head, int64_t pos, float* scratch, const double* c, const double* s) noexcept {
  const auto d = static_cast<size_t>(head_dim_);
  load_row_f32(row(2, head, pos), dtype_, scratch, d);
  rope_->rotate(scratch, c, s);
  convert_row(reinterpret_cast<const std::byte*>(scratch), DType::F32, row(0, head, pos), dtype_, d);
}

HostKvStore HostKvStore::without(int64_t keep, int64_t count) const {
  HostKvStore out(n_kv_heads_, head_dim_, dtype_, *allocator_, rope_);
  const int64_t kept_after = size_ > keep ? std::max<int64_t>(0, size_ - keep - std::min(count, size_ - keep)) : 0;
  const int64_t size = std::min(size_, keep) + kept_after;
  const auto pages = static_cast<size_t>(size / kPageTokens + (size % kPageTokens != 0 ? 1 : 0));
  // the pages wholly before `keep` (and before the end) are the same: shared
  const auto same = std::min(pages, static_cast<size_t>(std::min(keep, size_) / kPageTokens));
  out.pages_.reserve(pages);
  out.pages_.assign(pages_.begin(), pages_.begin() + static_cast<std::ptrdiff_t>(same));
  for (size_t p = same; p < pages; ++p) out.pages_.push_back(new_page());
  std::vector<float> scratch(rope_ ? static_cast<size_t>(head_dim_) : 0);
  std::vector<double> angles(rope_ ? static_cast<size_t>(2 * rope_->pairs()) : 0);
  // Nothing below can fail.
  out.size_ = size;
  double* c = angles.data();
  double* s = rope_ ? c + rope_->pairs() : nullptr;
  for (int64_t pos = static_cast<int64_t>(same) * kPageTokens; pos < size; ++pos) {
    const bool moved = pos >= keep;
    const int64_t from = moved ? pos + (size_ - keep - kept_after) : pos;
    if (moved && rope_) rope_->cos_sin_at(pos, c, s);
    for (int h = 0; h < n_kv_heads_; ++h) {
      std::memcpy(out.row(1, h, pos), row(1, h, from), row_bytes_);
      if (!rope_) {
        std::memcpy(out.row(0, h, pos), row(0, h, from), row_bytes_);
        continue;
      }
      std::memcpy(out.row(2, h, pos), row(2, h, from), row_bytes_);
      if (moved) {
        out.rotate_key(h, pos, scratch.data(), c, s);
      } else {
        std::memcpy(out.row(0, h, pos), row(0, h, from), row_bytes_);
      }
    }
  }
  return out;
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
