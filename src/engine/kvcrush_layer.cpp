#include "engine/kvcrush_layer.hpp"

#include <algorithm>
#include <limits>

#include "select/kvcrush.hpp"

namespace kvret {

void KvCrushLayer::update(const HostKvStore& store, float scale) {
  const int64_t length = store.size();
  if (length <= n_) return;
  const int heads = store.n_kv_heads();
  const int d = store.head_dim();
  const int words = signature_words(heads);
  if (window_end_ == 0) {
    // the first signatures: every token against the store's last keys
    const int w = static_cast<int>(std::min<int64_t>(kWindow, length));
    std::vector<float> window(static_cast<size_t>(heads) * w * d), lse(static_cast<size_t>(heads) * w),
        threshold(static_cast<size_t>(heads)), keys(static_cast<size_t>(length) * d),
        flat(static_cast<size_t>(heads) * static_cast<size_t>(length));
    std::vector<std::vector<float>> importance(static_cast<size_t>(heads));
    std::vector<uint64_t> bits(static_cast<size_t>(length) * words);
    for (int h = 0; h < heads; ++h) {
      float* win = window.data() + static_cast<int64_t>(h) * w * d;
      store.keys_f32(h, length - w, length, win);
      store.keys_f32(h, 0, length, keys.data());
      float* imp = flat.data() + static_cast<int64_t>(h) * length;
      snapkv_importance(win, w, keys.data(), length, d, scale, imp, lse.data() + static_cast<int64_t>(h) * w);
      importance[static_cast<size_t>(h)].assign(imp, imp + length);
    }
    signatures(flat.data(), heads, length, kMarkedFraction, bits.data());
    for (int h = 0; h < heads; ++h) {  // the smallest importance a head marked
      float t = std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < length; ++p)
        if ((bits[static_cast<size_t>(p * words + h / 64)] >> (h % 64)) & 1u)
          t = std::min(t, flat[static_cast<size_t>(h * length + p)]);
      threshold[static_cast<size_t>(h)] = t;
    }
    // commit (no throw below)
    heads_ = heads;
    words_ = words;
    d_ = d;
    w_ = w;
    scale_ = scale;
    window_.swap(window);
    lse_.swap(lse);
    threshold_.swap(threshold);
    importance_.swap(importance);
    bits_.swap(bits);
    window_end_ = length;
    n_ = length;
    return;
  }
  // later tokens: scored against the same window, marked at or above each head's threshold
  const int64_t added = length - n_;
  std::vector<float> keys(static_cast<size_t>(added) * d);
  std::vector<std::vector<float>> imp(static_cast<size_t>(heads_), std::vector<float>(static_cast<size_t>(added)));
  std::vector<uint64_t> bits(static_cast<size_t>(added) * words_, 0);
  for (int h = 0; h < heads_; ++h) {
    store.keys_f32(h, n_, length, keys.data());
    std::vector<float>& ih = imp[static_cast<size_t>(h)];
    window_importance(window_.data() + static_cast<int64_t>(h) * w_ * d_, w_,
                      lse_.data() + static_cast<int64_t>(h) * w_, keys.data(), added, d_, scale_, ih.data());
    for (int64_t t = 0; t < added; ++t)
      if (ih[static_cast<size_t>(t)] >= threshold_[static_cast<size_t>(h)])
        bits[static_cast<size_t>(t * words_ + h / 64)] |= uint64_t{1} << (h % 64);
  }
  for (int h = 0; h < heads_; ++h)
    importance_[static_cast<size_t>(h)].reserve(static_cast<size_t>(length));  // may throw: before any change
  bits_.reserve(static_cast<size_t>(length) * words_);
  for (int h = 0; h < heads_; ++h) {
    std::vector<float>& all = importance_[static_cast<size_t>(h)];
    all.resize(static_cast<size_t>(n_));
    all.insert(all.end(), imp[static_cast<size_t>(h)].begin(), imp[static_cast<size_t>(h)].end());
  }
  bits_.resize(static_cast<size_t>(n_) * words_);
  bits_.insert(bits_.end(), bits.begin(), bits.end());
  n_ = length;
}

void KvCrushLayer::truncate(int64_t length) noexcept {
  if (length >= n_) return;
  if (length < window_end_) {  // the window's keys are gone: start again
    *this = KvCrushLayer{};
    return;
  }
  n_ = length;  // the vectors keep their tail until the next update overwrites it
}

int64_t KvCrushLayer::add_representatives(int h, int64_t mid_begin, int64_t mid_end, int32_t* row, float* scores,
                                          int64_t n_important, int64_t n_rep) const {
  if (n_rep <= 0 || n_ < mid_end) return n_important;
  thread_local std::vector<int32_t> candidates, ordered, reps;
  const auto c_max = static_cast<size_t>(mid_end - mid_begin);
  if (candidates.size() < c_max) {
    candidates.resize(c_max);
    ordered.resize(c_max);
  }
  if (reps.size() < static_cast<size_t>(n_rep)) reps.resize(static_cast<size_t>(n_rep));
  const int64_t c = complement(mid_begin, mid_end, row, n_important, candidates.data());
  thread_local std::vector<uint64_t> anchor;
  anchor.resize(static_cast<size_t>(words_));
  make_anchor(Anchor::kAlternating, heads_, 0, nullptr, nullptr, 0, anchor.data());
  const int64_t r = representatives(bits_.data(), words_, heads_, anchor.data(), importance(h), candidates.data(), c,
                                    n_rep, ordered.data(), reps.data());
  return merge_selection(row, scores, n_important, reps.data(), r, -std::numeric_limits<float>::infinity(), row,
                         scores);
}

}  // namespace kvret
