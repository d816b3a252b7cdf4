#include "index/pq_retriever.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/serial.hpp"
#include "core/vec_math.hpp"
#include "index/change_log.hpp"
#include "index/kmeans.hpp"
#include "math/pq_math.h"
#include "select/gqa_fold.hpp"
#include "select/grouped_take.hpp"
#include "select/topk.hpp"

namespace kvret {

namespace {
constexpr int64_t kEncodeBlock = 256;
constexpr int kAdaptiveMaxIters = 25;
/// An exact set grows past its share of the tokens by at most this factor between trainings.
constexpr int64_t kMaxExactShare = 2;

/// Grows v's capacity geometrically so that it holds `needed` elements (reserve(size() + n) at every decode step
/// would reallocate, and copy, at every step).
template <class T, class A>
void reserve_for(std::vector<T, A>& v, size_t needed) {
  // 1.5x: amortized O(1) appends with at most half the index's size held in reserve (2x held up to all of it)
  if (v.capacity() < needed) v.reserve(std::max(v.capacity() + v.capacity() / 2, needed));
}

/// Bit i of *take / *trim: whether state[cell[i]] is kTake / kTrim, for i < len <= 64. The states (kTake = 1,
/// kTrim = 2: a state is its two bits) are loaded into bytes and packed eight at a time by a multiply (byte i's low
/// bit to bit 56 + i), with no per-token shift or branch.
void cell_state_masks(const uint8_t* state, const uint16_t* cell, int len, uint64_t* take, uint64_t* trim) {
  uint8_t bytes[64] = {};
  for (int i = 0; i < len; ++i) bytes[i] = state[cell[i]];
  constexpr uint64_t kLow = 0x0101010101010101ull, kPack = 0x0102040810204080ull;
  uint64_t a = 0, b = 0;
  for (int w = 0; w < 8; ++w) {
    uint64_t x;
    std::memcpy(&x, bytes + 8 * w, sizeof x);
    a |= (((x & kLow) * kPack) >> 56) << (8 * w);
    b |= ((((x >> 1) & kLow) * kPack) >> 56) << (8 * w);
  }
  *take = a;
  *trim = b;
}

/// v's storage with at least n elements (grown, never shrunk; the contents are the caller's to set).
template <class T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

/// Select's per-head buffers, kept per thread (one KV head per OpenMP thread) so that a decode step allocates
/// nothing once they have grown: they hold O(group * (cells + exact tokens)) floats (O(group * tokens) on the
/// per-token path).
struct SelectScratch {
  std::vector<float> lut, logits, folded, exact;
  std::vector<int32_t> counts;
  std::vector<int64_t> offsets;
  std::vector<uint64_t> keys;
  std::vector<uint8_t> state;
};

/// scores[i] = folded[positions[i] - base] for the n selected positions.
void token_scores(const float* folded, int64_t base, const int32_t* positions, int64_t n, float* scores) {
  for (int64_t i = 0; i < n; ++i) scores[i] = folded[positions[i] - base];
}

SelectScratch& select_scratch() {
  thread_local SelectScratch scratch;
  return scratch;
}

/// The error a token ranks by for the exact set: NaN (a NaN key) ranks lowest.
inline float rank_error(float e) noexcept { return e == e ? e : -std::numeric_limits<float>::infinity(); }
}  // namespace

int64_t PqRetriever::exact_count(float fraction, int64_t n) noexcept {
  if (!(fraction > 0.0f) || n <= 0) return 0;
  const double x = static_cast<double>(fraction) * static_cast<double>(n);
  return std::min(n, static_cast<int64_t>(std::ceil(x - x * 1e-6)));
}

PqRetriever::PqRetriever(int n_kv_heads, int head_dim, const Params& params)
    : n_kv_(n_kv_heads),
      d_(head_dim),
      m_(params.m),
      dsub_(head_dim / params.m),
      k_(1 << params.bits),
      cells_(cuda::math::pq_cells(params.m, params.bits)),
      params_(params),
      codes_(static_cast<size_t>(n_kv_heads)),
      cell_counts_(static_cast<size_t>(n_kv_heads)),
      cells_of_(static_cast<size_t>(n_kv_heads)),
      exact_pos_(static_cast<size_t>(n_kv_heads)),
      exact_keys_(static_cast<size_t>(n_kv_heads)),
      exact_threshold_(static_cast<size_t>(n_kv_heads), std::numeric_limits<float>::infinity()),
      version_(ChangeLog::next_version()),
      layout_version_(version_) {}

int64_t PqRetriever::bytes() const noexcept {
  if (base_ < 0) return 0;  // nothing indexed yet
  int64_t b = static_cast<int64_t>(codebook_.size() * sizeof(float));
  for (const auto& c : codes_) b += static_cast<int64_t>(c.size());
  for (const auto& c : cell_counts_) b += static_cast<int64_t>(c.size() * sizeof(int32_t));
  for (const auto& c : cells_of_) b += static_cast<int64_t>(c.size() * sizeof(uint16_t));
  for (const auto& p : exact_pos_) b += static_cast<int64_t>(p.size() * sizeof(int64_t));
  for (const auto& k : exact_keys_) b += static_cast<int64_t>(k.size());
  b += static_cast<int64_t>(exact_threshold_.size() * sizeof(float));
  return b;
}

std::vector<float> PqRetriever::train(const HostKvStore& store, int64_t begin, int64_t end, int n_threads) const {
  const int64_t total = end - begin;
  std::vector<int64_t> sample(static_cast<size_t>(total));
  std::iota(sample.begin(), sample.end(), begin);
  if (params_.train_sample > 0 && total > params_.train_sample) {
    uint64_t state = params_.seed ^ 0x5851f42d4c957f2dull;
    for (int64_t i = 0; i < params_.train_sample; ++i) {
      const int64_t j = i + static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(total - i));
      std::swap(sample[static_cast<size_t>(i)], sample[static_cast<size_t>(j)]);
    }
    sample.resize(static_cast<size_t>(params_.train_sample));
    std::sort(sample.begin(), sample.end());
  }
  const int64_t n = static_cast<int64_t>(sample.size());
  std::vector<float> codebook(static_cast<size_t>(n_kv_) * m_ * k_ * dsub_);
  const int tasks = n_kv_ * m_;
  parallel_for(tasks, n_threads, true, Schedule::kDynamic, [&](int64_t task_i) {
    const auto task = static_cast<int>(task_i);
    const int h = task / m_;
    const int j = task % m_;
    std::vector<float> row(static_cast<size_t>(d_));
    std::vector<float> points(static_cast<size_t>(n) * dsub_);
    for (int64_t i = 0; i < n; ++i) {
      store.keys_f32(h, sample[static_cast<size_t>(i)], sample[static_cast<size_t>(i)] + 1, row.data());
      std::copy_n(row.data() + j * dsub_, dsub_, points.data() + i * dsub_);
    }
    KmeansOptions o;
    o.k = k_;
    o.adaptive = params_.iters == 0;
    o.max_iters = params_.iters > 0 ? params_.iters : kAdaptiveMaxIters;
    o.tol = params_.tol;
    uint64_t seed_state = params_.seed + static_cast<uint64_t>(task);
    o.seed = splitmix64(seed_state);
    o.parallel = false;
    const KmeansResult r = kmeans(points.data(), n, dsub_, dsub_, o);
    std::copy(r.centroids.begin(), r.centroids.end(), codebook.begin() + static_cast<int64_t>(task) * k_ * dsub_);
  });
  return codebook;
}

void PqRetriever::encode(const HostKvStore& store, const std::vector<float>& codebook, int64_t begin, int64_t end,
                         std::vector<LargeVector<uint8_t>>& out, std::vector<std::vector<float>>* errors,
                         int n_threads) const {
  const int64_t n = end - begin;
  const int64_t blocks = (n + kEncodeBlock - 1) / kEncodeBlock;
  const int64_t tasks = blocks * n_kv_;
  auto run = [&](int64_t task) {
    const int h = static_cast<int>(task % n_kv_);
    const int64_t b0 = (task / n_kv_) * kEncodeBlock;
    const int64_t nb = std::min(kEncodeBlock, n - b0);
    std::vector<float> rows(static_cast<size_t>(nb) * d_);
    std::vector<uint8_t> sub(static_cast<size_t>(nb));
    store.keys_f32(h, begin + b0, begin + b0 + nb, rows.data());
    uint8_t* dst = out[static_cast<size_t>(h)].data() + b0 * m_;
    for (int j = 0; j < m_; ++j) {
      const float* c = codebook.data() + (static_cast<size_t>(h) * m_ + j) * k_ * dsub_;
      assign_nearest(rows.data() + j * dsub_, nb, dsub_, d_, c, k_, sub.data(), nullptr, false);
      for (int64_t i = 0; i < nb; ++i) dst[i * m_ + j] = sub[static_cast<size_t>(i)];
    }
    if (errors) {
      float* err = (*errors)[static_cast<size_t>(h)].data() + b0;
      for (int64_t i = 0; i < nb; ++i) {
        float e = 0;
        for (int j = 0; j < m_; ++j) {
          const float* c = codebook.data() + ((static_cast<size_t>(h) * m_ + j) * k_ + dst[i * m_ + j]) * dsub_;
          e += squared_distance(rows.data() + i * d_ + j * dsub_, c, dsub_);
        }
        err[i] = e;
      }
    }
  };
  // One block per head (decode steps) or one thread: no OpenMP region, whose overhead would dominate.
  parallel_for(tasks, n_threads, blocks > 1, Schedule::kDynamic, run);
}

void PqRetriever::derive_cells(const std::vector<LargeVector<uint8_t>>& codes,
                               const std::vector<LargeVector<int64_t>>& exact_pos, int64_t base, int64_t n,
                               std::vector<std::vector<int32_t>>& counts,
                               std::vector<LargeVector<uint16_t>>& cells) const {
  counts.assign(static_cast<size_t>(n_kv_), {});
  cells.assign(static_cast<size_t>(n_kv_), {});
  if (!uses_cells() || n <= 0) return;
  for (int h = 0; h < n_kv_; ++h) {
    auto& count = counts[static_cast<size_t>(h)];
    auto& cell = cells[static_cast<size_t>(h)];
    count.assign(static_cast<size_t>(cells_), 0);
    cell.resize(static_cast<size_t>(n));
    const uint8_t* c = codes[static_cast<size_t>(h)].data();
    for (int64_t t = 0; t < n; ++t) {
      cell[static_cast<size_t>(t)] = static_cast<uint16_t>(cell_of(c + t * m_));
      ++count[cell[static_cast<size_t>(t)]];
    }
    for (const int64_t pos : exact_pos[static_cast<size_t>(h)]) --count[cell[static_cast<size_t>(pos - base)]];
  }
}

void PqRetriever::on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) {
  const int64_t base = base_ < 0 ? begin : base_;
  const int64_t total = end - base;
  // Retrain when the middle has doubled since the last training: always at prefill, and at decode while the
  // codebook was trained on too few tokens to be trusted (a sequence that grew from a short prefill).
  const bool undertrained = trained_on_ < 4 * static_cast<int64_t>(k_);
  const bool retrain = trained_on_ == 0 || ((may_retrain || undertrained) && total >= 2 * trained_on_);
  const size_t um = static_cast<size_t>(m_);

  if (retrain) {
    std::vector<float> codebook = train(store, base, end, n_threads);
    std::vector<LargeVector<uint8_t>> codes(static_cast<size_t>(n_kv_));
    for (auto& c : codes) c.resize(static_cast<size_t>(total) * um);
    std::vector<std::vector<float>> errors;
    if (keeps_exact()) errors.assign(static_cast<size_t>(n_kv_), std::vector<float>(static_cast<size_t>(total)));
    encode(store, codebook, base, end, codes, keeps_exact() ? &errors : nullptr, n_threads);
    // The exact set of each head: the top exact_count tokens by reconstruction error, ties to the earlier token.
    std::vector<LargeVector<int64_t>> exact_pos(static_cast<size_t>(n_kv_));
    std::vector<LargeVector<std::byte>> exact_keys(static_cast<size_t>(n_kv_));
    const DType key_dtype = store.dtype();
    const size_t row_bytes = static_cast<size_t>(d_) * dtype_size(key_dtype);
    std::vector<float> threshold(static_cast<size_t>(n_kv_), std::numeric_limits<float>::infinity());
    const int64_t n_exact = exact_count(params_.exact_fraction, total);
    if (n_exact > 0) {
      for (int h = 0; h < n_kv_; ++h) {
        const std::vector<float>& err = errors[static_cast<size_t>(h)];
        std::vector<int64_t> order(static_cast<size_t>(total));
        std::iota(order.begin(), order.end(), int64_t{0});
        auto before = [&](int64_t a, int64_t b) {
          const float ea = rank_error(err[static_cast<size_t>(a)]), eb = rank_error(err[static_cast<size_t>(b)]);
          return ea > eb || (ea == eb && a < b);
        };
        std::nth_element(order.begin(), order.begin() + (n_exact - 1), order.end(), before);
        threshold[static_cast<size_t>(h)] =
            rank_error(err[static_cast<size_t>(order[static_cast<size_t>(n_exact - 1)])]);
        order.resize(static_cast<size_t>(n_exact));
        std::sort(order.begin(), order.end());
        auto& keys = exact_keys[static_cast<size_t>(h)];
        keys.resize(static_cast<size_t>(n_exact) * row_bytes);
        for (int64_t e = 0; e < n_exact; ++e) {
          const int64_t pos = base + order[static_cast<size_t>(e)];
          std::memcpy(keys.data() + static_cast<size_t>(e) * row_bytes, store.key_row(h, pos), row_bytes);
          order[static_cast<size_t>(e)] = pos;
        }
        exact_pos[static_cast<size_t>(h)].assign(order.begin(), order.end());
      }
    }
    std::vector<std::vector<int32_t>> counts;
    std::vector<LargeVector<uint16_t>> cells;
    derive_cells(codes, exact_pos, base, total, counts, cells);
    // commit (no throw below)
    codebook_.swap(codebook);
    codes_.swap(codes);
    cell_counts_.swap(counts);
    cells_of_.swap(cells);
    exact_pos_.swap(exact_pos);
    exact_keys_.swap(exact_keys);
    key_dtype_ = key_dtype;
    exact_threshold_.swap(threshold);
    trained_on_ = total;
    layout_version_ = version_ = ChangeLog::next_version();
    return;
  }

  const int64_t n = end - begin;
  std::vector<LargeVector<uint8_t>> fresh(static_cast<size_t>(n_kv_));
  for (auto& c : fresh) c.resize(static_cast<size_t>(n) * um);
  std::vector<std::vector<float>> errors;
  if (keeps_exact()) errors.assign(static_cast<size_t>(n_kv_), std::vector<float>(static_cast<size_t>(n)));
  encode(store, codebook_, begin, end, fresh, keeps_exact() ? &errors : nullptr, n_threads);
  // New tokens whose error is strictly above the head's threshold become exact (strictly: when the threshold is
  // 0 because the bulk quantizes without error, equal tokens do not pile into the exact set), while the head's
  // exact set holds fewer than kMaxExactShare times its share of the tokens: when the new tokens quantize worse
  // than the training ones (a short prefill, then a long decode), most would pass the threshold.
  const int64_t cap = kMaxExactShare * exact_count(params_.exact_fraction, end - base_);
  std::vector<std::vector<int64_t>> new_exact(static_cast<size_t>(n_kv_));  // offsets in [0, n)
  std::vector<std::vector<std::byte>> new_keys(static_cast<size_t>(n_kv_));
  const size_t row_bytes = static_cast<size_t>(d_) * dtype_size(key_dtype_);
  if (keeps_exact()) {
    for (int h = 0; h < n_kv_; ++h) {
      const float threshold = exact_threshold_[static_cast<size_t>(h)];
      auto& picked = new_exact[static_cast<size_t>(h)];
      const auto held = static_cast<int64_t>(exact_pos_[static_cast<size_t>(h)].size());
      for (int64_t t = 0; t < n && held + static_cast<int64_t>(picked.size()) < cap; ++t)
        if (errors[static_cast<size_t>(h)][static_cast<size_t>(t)] > threshold) picked.push_back(t);
      auto& keys = new_keys[static_cast<size_t>(h)];
      keys.resize(picked.size() * row_bytes);
      for (size_t e = 0; e < picked.size(); ++e)
        std::memcpy(keys.data() + e * row_bytes, store.key_row(h, begin + picked[e]), row_bytes);
    }
  }
  // the only steps that may throw: nothing has changed yet
  for (auto& c : codes_) reserve_for(c, c.size() + static_cast<size_t>(n) * um);
  if (uses_cells())
    for (auto& c : cells_of_) reserve_for(c, c.size() + static_cast<size_t>(n));
  for (int h = 0; h < n_kv_; ++h) {
    const size_t added = new_exact[static_cast<size_t>(h)].size();
    if (added == 0) continue;
    auto& pos = exact_pos_[static_cast<size_t>(h)];
    auto& keys = exact_keys_[static_cast<size_t>(h)];
    reserve_for(pos, pos.size() + added);
    reserve_for(keys, keys.size() + added * row_bytes);
  }
  // commit (no throw below: every append fits the reserved capacity)
  for (int h = 0; h < n_kv_; ++h) {
    auto& dst = codes_[static_cast<size_t>(h)];
    const auto& src = fresh[static_cast<size_t>(h)];
    dst.insert(dst.end(), src.begin(), src.end());
    const auto& picked = new_exact[static_cast<size_t>(h)];
    if (uses_cells()) {
      size_t next = 0;  // the next of `picked`: exact tokens keep their cell id but are not counted in it
      for (int64_t t = 0; t < n; ++t) {
        const auto cell = static_cast<uint16_t>(cell_of(src.data() + t * m_));
        cells_of_[static_cast<size_t>(h)].push_back(cell);
        if (next < picked.size() && picked[next] == t)
          ++next;
        else
          ++cell_counts_[static_cast<size_t>(h)][cell];
      }
    }
    auto& pos = exact_pos_[static_cast<size_t>(h)];
    for (const int64_t t : picked) pos.push_back(begin + t);
    const auto& keys = new_keys[static_cast<size_t>(h)];
    exact_keys_[static_cast<size_t>(h)].insert(exact_keys_[static_cast<size_t>(h)].end(), keys.begin(), keys.end());
  }
  version_ = ChangeLog::next_version();
}

bool PqRetriever::can_cut(int64_t end) const noexcept { return base_ < 0 || end >= end_ || end >= base_ + trained_on_; }

void PqRetriever::on_cut(const HostKvStore&, int64_t end) noexcept {
  const int64_t kept = end - base_, old = end_ - base_;
  const size_t row_bytes = static_cast<size_t>(d_) * dtype_size(key_dtype_);
  for (int h = 0; h < n_kv_; ++h) {
    auto& pos = exact_pos_[static_cast<size_t>(h)];
    const auto first_cut = static_cast<size_t>(std::lower_bound(pos.begin(), pos.end(), end) - pos.begin());
    if (uses_cells()) {  // the dropped tokens leave their cells' counts (exact ones were never counted)
      auto& cell = cells_of_[static_cast<size_t>(h)];
      auto& count = cell_counts_[static_cast<size_t>(h)];
      size_t next = first_cut;
      for (int64_t t = kept; t < old; ++t) {
        if (next < pos.size() && pos[next] == base_ + t) {
          ++next;
          continue;
        }
        --count[cell[static_cast<size_t>(t)]];
      }
      cell.resize(static_cast<size_t>(kept));  // shrinking: no allocation
    }
    codes_[static_cast<size_t>(h)].resize(static_cast<size_t>(kept) * static_cast<size_t>(m_));
    pos.resize(first_cut);
    exact_keys_[static_cast<size_t>(h)].resize(first_cut * row_bytes);
  }
  layout_version_ = version_ = ChangeLog::next_version();
}

std::vector<float> PqRetriever::exact_keys_f32(int head) const {
  const auto& rows = exact_keys_[static_cast<size_t>(head)];
  const size_t n = exact_pos_[static_cast<size_t>(head)].size() * static_cast<size_t>(d_);
  std::vector<float> out(n);
  convert_row(rows.data(), key_dtype_, reinterpret_cast<std::byte*>(out.data()), DType::F32, n);
  return out;
}

namespace {
constexpr uint32_t kPqTag = 0x50514958u;  // "PQIX"
}

std::vector<std::byte> PqRetriever::save() const {
  ByteWriter w;
  write_header(w, kPqTag, 1);
  for (const int32_t x : {n_kv_, d_, m_, k_}) w.value(x);
  w.value<int64_t>(base_);
  w.value<int64_t>(end_);
  w.value<int64_t>(trained_on_);
  w.value<uint8_t>(static_cast<uint8_t>(key_dtype_));
  w.array(exact_threshold_);
  w.array(codebook_);
  for (int h = 0; h < n_kv_; ++h) {
    w.array(codes_[static_cast<size_t>(h)]);
    w.array(exact_pos_[static_cast<size_t>(h)]);
    w.array(exact_keys_[static_cast<size_t>(h)]);
  }
  return std::move(w.bytes());
}

void PqRetriever::restore(const HostKvStore& store, const std::byte* data, size_t size) {
  ByteReader r(data, size);
  read_header(r, kPqTag, 1);
  for (const int32_t x : {n_kv_, d_, m_, k_})
    require_intact(r.value<int32_t>() == x, "another geometry, m or bits than this context's");
  const auto base = r.value<int64_t>(), end = r.value<int64_t>(), trained_on = r.value<int64_t>();
  const auto key_dtype = static_cast<DType>(r.value<uint8_t>());
  const bool empty = base == -1 && end == -1 && trained_on == 0;
  require_intact(empty || (base >= 0 && base < end && end <= store.size() && trained_on > 0 &&
                           trained_on <= end - base && key_dtype == store.dtype()),
                 "an indexed range, training size or key dtype that does not fit the store");
  const int64_t n = empty ? 0 : end - base;
  std::vector<float> threshold = r.array<float>(n_kv_);
  std::vector<float> codebook = r.array<float>(empty ? 0 : static_cast<int64_t>(n_kv_) * m_ * k_ * dsub_);
  std::vector<LargeVector<uint8_t>> codes(static_cast<size_t>(n_kv_));
  std::vector<LargeVector<int64_t>> exact_pos(static_cast<size_t>(n_kv_));
  std::vector<LargeVector<std::byte>> exact_keys(static_cast<size_t>(n_kv_));
  const size_t row_bytes = static_cast<size_t>(d_) * dtype_size(store.dtype());
  for (int h = 0; h < n_kv_; ++h) {
    auto& c = codes[static_cast<size_t>(h)];
    c = r.array<uint8_t, LargeAllocator<uint8_t>>(n * m_);
    for (const uint8_t code : c) require_intact(code < k_, "a code past the codebook");
    auto& pos = exact_pos[static_cast<size_t>(h)];
    pos = r.array<int64_t, LargeAllocator<int64_t>>();
    for (size_t e = 0; e < pos.size(); ++e)
      require_intact(pos[e] >= base && pos[e] < end && (e == 0 || pos[e] > pos[e - 1]),
                     "exact positions outside the index or out of order");
    exact_keys[static_cast<size_t>(h)] =
        r.array<std::byte, LargeAllocator<std::byte>>(static_cast<int64_t>(pos.size() * row_bytes));
  }
  require_intact(r.left() == 0, "trailing bytes");
  std::vector<std::vector<int32_t>> counts;
  std::vector<LargeVector<uint16_t>> cells;
  derive_cells(codes, exact_pos, base, n, counts, cells);
  // commit (no throw below)
  codebook_.swap(codebook);
  codes_.swap(codes);
  cell_counts_.swap(counts);
  cells_of_.swap(cells);
  exact_pos_.swap(exact_pos);
  exact_keys_.swap(exact_keys);
  exact_threshold_.swap(threshold);
  key_dtype_ = empty ? key_dtype_ : key_dtype;
  base_ = base;
  end_ = end;
  trained_on_ = trained_on;
  layout_version_ = version_ = ChangeLog::next_version();
}

void PqRetriever::lookup_table(int head, const float* q, float scale, float* lut) const {
  for (int j = 0; j < m_; ++j) {
    const float* c = centroids(head, j);
    for (int code = 0; code < k_; ++code) lut[j * k_ + code] = scale * dot(q + j * dsub_, c + code * dsub_, dsub_);
  }
}

void PqRetriever::approximate_logits(int head, const float* q, float* out) const {
  std::vector<float> lut(static_cast<size_t>(m_) * k_);
  lookup_table(head, q, 1.0f, lut.data());
  pq_token_logits(lut.data(), 1, m_, k_, codes(head), size(), out);
}

int64_t PqRetriever::select(const HostKvStore&, const SelectRequest& r, int32_t* const* out_rows,
                            float* const* out_scores) const {
  require_covers(r, "PQ");
  const int64_t n = r.mid_end - r.mid_begin;
  parallel_for(n_kv_, r.n_threads, r.parallel(), Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    const int group = r.group;
    const float* qg = r.q + static_cast<int64_t>(h) * group * d_;
    SelectScratch& scratch = select_scratch();
    // The tables of the whole group, [group, m, k]: lut[g][j][c] = scale * <q_g,j, C_j[c]> (lookup_table's bits).
    float* lut = sized(scratch.lut, static_cast<size_t>(group) * m_ * k_);
    for (int j = 0; j < m_; ++j)
      scaled_dots(qg + j * dsub_, d_, group, centroids(h, j), dsub_, k_, dsub_, r.scale, lut + j * k_, m_ * k_);
    const uint8_t* codes = codes_[static_cast<size_t>(h)].data();
    int32_t* out = out_rows[h];
    const LargeVector<int64_t>& exact_pos = exact_pos_[static_cast<size_t>(h)];
    const int64_t n_exact = static_cast<int64_t>(exact_pos.size());
    const std::byte* exact_keys = exact_keys_[static_cast<size_t>(h)].data();

    if (!uses_cells()) {
      float* folded = sized(scratch.folded, static_cast<size_t>(n));
      // m = 4 with the sum-of-probabilities fold: no logits, no exp per token (pq4_softmax_fold), where it applies.
      if (m_ == 4 && r.fold == KVRET_FOLD_SUM_PROB) {
        float* exact_logits = sized(scratch.exact, static_cast<size_t>(group * n_exact));
        scaled_dots(qg, d_, group, exact_keys, key_dtype_, d_, n_exact, d_, r.scale, exact_logits, n_exact);
        int64_t* offsets = sized(scratch.offsets, static_cast<size_t>(n_exact));
        for (int64_t e = 0; e < n_exact; ++e) offsets[e] = exact_pos[static_cast<size_t>(e)] - base_;
        if (pq4_softmax_fold(lut, group, k_, codes, n, offsets, exact_logits, n_exact, folded)) {
          topk_positions(folded, n, r.budget, r.mid_begin, out);
          if (out_scores != nullptr) token_scores(folded, r.mid_begin, out, r.budget, out_scores[h]);
          return;
        }
      }
      // Per-token path: every token's logits from its own codes, [group, n], all heads in one pass over the codes;
      // the exact tokens' logits ([group, n_exact], each key row read once for the whole group) replace theirs.
      float* logits = sized(scratch.logits, static_cast<size_t>(group) * n);
      pq_token_logits(lut, group, m_, k_, codes, n, logits);
      if (n_exact > 0) {
        float* exact_logits = sized(scratch.exact, static_cast<size_t>(group * n_exact));
        scaled_dots(qg, d_, group, exact_keys, key_dtype_, d_, n_exact, d_, r.scale, exact_logits, n_exact);
        for (int g = 0; g < group; ++g)
          for (int64_t e = 0; e < n_exact; ++e)
            logits[g * n + exact_pos[static_cast<size_t>(e)] - base_] = exact_logits[g * n_exact + e];
      }
      fold_logits(logits, group, n, r.fold, folded);
      topk_positions(folded, n, r.budget, r.mid_begin, out);
      if (out_scores != nullptr) token_scores(folded, r.mid_begin, out, r.budget, out_scores[h]);
      return;
    }

    // Cell path: score every code tuple once. Cell u = sum_j code_j k^j, so the table of sub-space j is added to
    // k^j-strided copies of the cells built so far (no division per cell). The exact tokens follow the cells as
    // items cells_ + e of count 1, so that one weighted fold sees every token.
    const int64_t items = cells_ + n_exact;
    const std::vector<int32_t>& cell_counts = cell_counts_[static_cast<size_t>(h)];
    const int32_t* counts = cell_counts.data();
    if (n_exact > 0) {
      int32_t* c = sized(scratch.counts, static_cast<size_t>(items));
      std::copy(cell_counts.begin(), cell_counts.end(), c);
      std::fill(c + cells_, c + items, 1);
      counts = c;
    }
    float* cell_logits = sized(scratch.logits, static_cast<size_t>(group * items));
    for (int g = 0; g < group; ++g) {
      const float* l = lut + g * m_ * k_;
      float* s = cell_logits + g * items;
      std::copy_n(l, k_, s);
      int64_t size = k_;
      for (int j = 1; j < m_; ++j, size *= k_)
        for (int c = k_ - 1; c >= 0; --c) {
          const float add = l[j * k_ + c];
          float* dst = s + c * size;
          // c == 0 last: reads s before it changes; the bits of pq_math.h's pq_cell_logit (tests/cpu/test_pq_math.cpp)
          for (int64_t u = 0; u < size; ++u) dst[u] = s[u] + add;
        }
    }
    // The exact logits, straight into their items: [group, n_exact] at column cells_ (each key row is read once
    // for the whole group).
    scaled_dots(qg, d_, group, exact_keys, key_dtype_, d_, n_exact, d_, r.scale, cell_logits + cells_, items);
    float* folded = sized(scratch.folded, static_cast<size_t>(items));
    fold_weighted_logits(cell_logits, counts, group, items, r.fold, folded);

    // Take whole items (cells, exact tokens) best first; the cell that crosses the budget is trimmed to its
    // earliest tokens (an exact token, of count 1, never crosses). Ties: the lower item id first (every cell before
    // the exact tokens, which follow in position order).
    uint8_t* state = sized(scratch.state, static_cast<size_t>(items));
    int64_t quota = grouped_take(folded, counts, items, r.budget, scratch.keys, state);
    // The taken tokens in position order, 64 at a time: bit masks of the tokens whose cell is taken or trimmed,
    // the exact tokens of the block put in by position (every uint16 is a valid cell id, so their cell bits are
    // cleared and replaced by their own state), the trimmed cell's earliest `quota` tokens, then the set bits.
    const uint16_t* cell = cells_of_[static_cast<size_t>(h)].data();
    int64_t written = 0;
    int64_t next_exact = 0;
    int64_t next_exact_at = n_exact > 0 ? exact_pos[0] - r.mid_begin : n;
    for (int64_t t0 = 0; t0 < n && written < r.budget; t0 += 64) {
      const int len = static_cast<int>(std::min<int64_t>(64, n - t0));
      uint64_t take = 0, trim = 0;
      cell_state_masks(state, cell + t0, len, &take, &trim);
      for (; next_exact_at < t0 + len; ++next_exact) {
        const uint64_t bit = uint64_t{1} << (next_exact_at - t0);
        take &= ~bit;
        trim &= ~bit;
        if (state[cells_ + next_exact] == kTake) take |= bit;
        next_exact_at = next_exact + 1 < n_exact ? exact_pos[static_cast<size_t>(next_exact + 1)] - r.mid_begin : n;
      }
      for (; trim != 0 && quota > 0; trim &= trim - 1, --quota) take |= trim & (~trim + 1);
      for (; take != 0 && written < r.budget; take &= take - 1)
        out[written++] = static_cast<int32_t>(r.mid_begin + t0 + std::countr_zero(take));
    }
    if (out_scores != nullptr) {  // a token's item: its cell, or its own item if it is exact
      const int64_t* e = exact_pos.data();
      const int64_t* e_end = e + n_exact;
      for (int64_t i = 0; i < r.budget; ++i) {
        const int64_t pos = out[i];
        while (e != e_end && *e < pos) ++e;
        const int64_t item = e != e_end && *e == pos ? cells_ + (e - exact_pos.data()) : cell[pos - r.mid_begin];
        out_scores[h][i] = folded[item];
      }
    }
  });
  return r.budget;
}

}  // namespace kvret
