#include "index/page_retriever.hpp"

#include <algorithm>
#include <limits>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/serial.hpp"
#include "core/vec_math.hpp"
#include "math/page_math.h"
#include "select/gqa_fold.hpp"

namespace kvret {

namespace {
constexpr int64_t kKeyChunk = 256;         ///< keys converted to f32 at a time
constexpr int64_t kParallelTokens = 1024;  ///< below this an extend runs on the calling thread (decode)
}  // namespace

PageRetriever::PageRetriever(int n_kv_heads, int head_dim, int page_size)
    : n_kv_(n_kv_heads), d_(head_dim), page_size_(page_size), bounds_(static_cast<size_t>(n_kv_heads)) {
  require(page_size >= 1, KVRET_ERR_INVALID_ARGUMENT, "page_size must be >= 1");
  require(head_dim >= 1 && head_dim <= kMaxHeadDim, KVRET_ERR_INVALID_ARGUMENT, "head_dim above kMaxHeadDim");
}

int64_t PageRetriever::bytes() const noexcept {
  int64_t b = 0;
  for (const auto& h : bounds_) b += static_cast<int64_t>(h.size() * sizeof(float));
  return b;
}

int64_t PageRetriever::page_tokens(int64_t p) const noexcept {
  return std::min<int64_t>(page_size_, size() - p * page_size_);
}

void PageRetriever::on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool, int n_threads) {
  const int64_t base = base_ < 0 ? begin : base_;
  const int64_t old_size = size();
  const int64_t first_page = old_size / page_size_;  // the partial last page, or the first new one
  const int64_t total_pages = (end - base + page_size_ - 1) / page_size_;
  const size_t row = 2 * static_cast<size_t>(d_);
  const size_t d = static_cast<size_t>(d_);

  // Recompute pages [first_page, total_pages) aside; everything that may throw happens before the commit.
  std::vector<std::vector<float>> tail(static_cast<size_t>(n_kv_));
  std::vector<std::vector<float>> scratch(static_cast<size_t>(n_kv_));
  const int64_t chunk = std::min(kKeyChunk, end - begin);
  for (int h = 0; h < n_kv_; ++h) {
    auto& t = tail[static_cast<size_t>(h)];
    t.resize(static_cast<size_t>(total_pages - first_page) * row);
    for (size_t p = 0; p < t.size(); p += row) {
      std::fill_n(t.begin() + static_cast<int64_t>(p), d, std::numeric_limits<float>::infinity());
      std::fill_n(t.begin() + static_cast<int64_t>(p + d), d, -std::numeric_limits<float>::infinity());
    }
    if (old_size % page_size_ != 0) {  // continue the partial page from its current bounds
      const float* partial = bounds(h, first_page);
      std::copy(partial, partial + row, t.begin());
    }
    scratch[static_cast<size_t>(h)].resize(static_cast<size_t>(chunk) * d);
  }

  parallel_for(n_kv_, n_threads, end - begin >= kParallelTokens, Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    float* keys = scratch[static_cast<size_t>(h)].data();
    float* t = tail[static_cast<size_t>(h)].data();
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk);
      store.keys_f32(h, c0, c1, keys);
      for (int64_t pos = c0; pos < c1; ++pos) {
        const float* key = keys + static_cast<size_t>(pos - c0) * d;
        float* lo = t + static_cast<size_t>((pos - base) / page_size_ - first_page) * row;
        float* hi = lo + d;
        for (size_t i = 0; i < d; ++i) {
          lo[i] = std::min(lo[i], key[i]);
          hi[i] = std::max(hi[i], key[i]);
        }
      }
    }
  });

  // Grow geometrically: decode appends a page every page_size tokens. Reserving keeps the contents.
  const size_t needed = static_cast<size_t>(total_pages) * row;
  for (auto& b : bounds_)
    if (b.capacity() < needed) b.reserve(std::max(needed, b.capacity() + b.capacity() / 2));

  // commit (no throw below: every resize fits the reserved capacity)
  for (int h = 0; h < n_kv_; ++h) {
    auto& b = bounds_[static_cast<size_t>(h)];
    const auto& t = tail[static_cast<size_t>(h)];
    b.resize(static_cast<size_t>(first_page) * row);
    b.insert(b.end(), t.begin(), t.end());
  }
  log_.mark(first_page);
}

void PageRetriever::on_cut(const HostKvStore& store, int64_t end) noexcept {
  if (end <= base_) {
    for (auto& b : bounds_) b.clear();
    log_.mark(0);
    return;
  }
  const int64_t n_pages = (end - base_ + page_size_ - 1) / page_size_;
  const size_t row = 2 * static_cast<size_t>(d_);
  const size_t d = static_cast<size_t>(d_);
  const int64_t first = base_ + (n_pages - 1) * page_size_;  // the last page, summarized again from its tokens
  float key[kMaxHeadDim];
  for (int h = 0; h < n_kv_; ++h) {
    auto& b = bounds_[static_cast<size_t>(h)];
    b.resize(static_cast<size_t>(n_pages) * row);  // shrinking: no allocation
    float* lo = b.data() + static_cast<size_t>(n_pages - 1) * row;
    float* hi = lo + d;
    std::fill_n(lo, d, std::numeric_limits<float>::infinity());
    std::fill_n(hi, d, -std::numeric_limits<float>::infinity());
    for (int64_t pos = first; pos < end; ++pos) {
      store.keys_f32(h, pos, pos + 1, key);
      for (size_t i = 0; i < d; ++i) {
        lo[i] = std::min(lo[i], key[i]);
        hi[i] = std::max(hi[i], key[i]);
      }
    }
  }
  log_.mark(n_pages - 1);
}

void PageRetriever::upper_bounds(int head, const float* q, float* out) const {
  std::vector<float> split(2 * static_cast<size_t>(d_));
  cuda::math::page_split(q, d_, split.data());
  const int64_t n = pages();
  for (int64_t p = 0; p < n; ++p) out[p] = cuda::math::page_bound(split.data(), bounds(head, p), d_);
}

int64_t PageRetriever::select(const HostKvStore&, const SelectRequest& r, int32_t* const* out_rows,
                              float* const* out_scores) const {
  namespace pm = cuda::math;
  require_covers(r, "page");
  const int64_t n = pages();
  const int64_t tokens = size();
  const int group = r.group;
  const size_t per_head = static_cast<size_t>(n) * (group + 1) + static_cast<size_t>(group) * 2 * d_;
  std::vector<float> scratch(per_head * n_kv_);
  std::vector<std::vector<uint64_t>> keys(static_cast<size_t>(n_kv_), std::vector<uint64_t>(static_cast<size_t>(n)));
  std::vector<std::vector<int32_t>> taken(static_cast<size_t>(n_kv_), std::vector<int32_t>(static_cast<size_t>(n)));
  std::vector<int32_t> weight(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) weight[static_cast<size_t>(p)] = pm::page_weight(p, n, tokens, page_size_);

  // kernels/math/page_math.h, which the CUDA backend's device select runs too: the same bits on both
  parallel_for(n_kv_, r.n_threads, r.parallel(), Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    float* logits = scratch.data() + per_head * h;  // [group, n]
    float* folded = logits + static_cast<size_t>(group) * n;
    float* split = folded + n;  // [group, 2d]
    const float* q = r.q + static_cast<int64_t>(h) * group * d_;
    for (int g = 0; g < group; ++g) pm::page_split(q + g * d_, d_, split + g * 2 * d_);
    for (int64_t p = 0; p < n; ++p) {  // every query of the group while the page's row is in cache
      const float* row = bounds(h, p);
      for (int g = 0; g < group; ++g)
        logits[g * n + p] = pm::page_logit(r.scale, pm::page_bound(split + g * 2 * d_, row, d_));
    }
    if (r.fold == KVRET_FOLD_MAX_LOGIT) {
      std::fill(folded, folded + n, pm::neg_inf());
      for (int g = 0; g < group; ++g)
        for (int64_t p = 0; p < n; ++p) folded[p] = pm::page_max_step(folded[p], logits[g * n + p]);
    } else if (cpu_has_avx2()) {
      // the AVX2 softmax of gqa_fold.cpp: page_math.h's bits, eight pages at a time (test_device_select.cpp checks
      // that the two agree bit for bit)
      fold_weighted_logits(logits, weight.data(), group, n, r.fold, folded);
    } else {
      std::fill(folded, folded + n, 0.0f);
      for (int g = 0; g < group; ++g) {
        float* e = logits + g * n;
        const pm::PageSoftmax s = pm::page_softmax_terms(e, n, tokens, page_size_);
        if (s.used)
          for (int64_t p = 0; p < n; ++p) folded[p] = pm::page_sum_prob_step(folded[p], e[p], s);
      }
    }
    // whole pages best first; the page that crosses the budget keeps its earliest tokens
    uint64_t* key = keys[static_cast<size_t>(h)].data();
    for (int64_t p = 0; p < n; ++p) key[p] = pm::page_order_key(folded[p], static_cast<uint32_t>(p));
    const int64_t k = pm::page_pages_needed(r.budget, page_size_, n);
    std::nth_element(key, key + k - 1, key + n);
    std::sort(key, key + k);
    int32_t* take = taken[static_cast<size_t>(h)].data();
    std::fill(take, take + n, 0);
    int64_t before = 0;
    for (int64_t i = 0; i < k && before < r.budget; ++i) {
      const auto p = static_cast<int64_t>(key[i] & 0xffffffffu);
      const int64_t t = pm::page_take(before, weight[static_cast<size_t>(p)], r.budget);
      take[p] = static_cast<int32_t>(t);
      before += t;
    }
    int32_t* out = out_rows[h];
    float* score = out_scores != nullptr ? out_scores[h] : nullptr;
    for (int64_t p = 0; p < n; ++p) {
      const int64_t first = r.mid_begin + p * page_size_;
      for (int64_t t = 0; t < take[p]; ++t) *out++ = static_cast<int32_t>(first + t);
      if (score != nullptr) score = std::fill_n(score, take[p], folded[p]);  // a token shares its page's score
    }
  });
  return r.budget;
}

namespace {
constexpr uint32_t kPageTag = 0x50414745u;  // "PAGE"
}

std::vector<std::byte> PageRetriever::save() const {
  ByteWriter w;
  write_header(w, kPageTag, 1);
  w.value<int32_t>(n_kv_);
  w.value<int32_t>(d_);
  w.value<int32_t>(page_size_);
  w.value<int64_t>(base_);
  w.value<int64_t>(end_);
  for (const auto& b : bounds_) w.array(b);
  return std::move(w.bytes());
}

void PageRetriever::restore(const HostKvStore& store, const std::byte* data, size_t size) {
  ByteReader r(data, size);
  read_header(r, kPageTag, 1);
  require_intact(r.value<int32_t>() == n_kv_ && r.value<int32_t>() == d_ && r.value<int32_t>() == page_size_,
                 "another geometry or page size than this context's");
  const auto base = r.value<int64_t>(), end = r.value<int64_t>();
  const bool empty = base == -1 && end == -1;
  require_intact(empty || (base >= 0 && base < end && end <= store.size()), "an indexed range outside the store");
  const int64_t pages = empty ? 0 : (end - base + page_size_ - 1) / page_size_;
  std::vector<LargeVector<float>> bounds(static_cast<size_t>(n_kv_));
  for (auto& b : bounds) b = r.array<float, LargeAllocator<float>>(pages * 2 * d_);
  require_intact(r.left() == 0, "trailing bytes");
  bounds_.swap(bounds);  // commit
  base_ = base;
  end_ = end;
  log_.reset();
}

}  // namespace kvret
