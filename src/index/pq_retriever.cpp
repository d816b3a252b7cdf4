#include "index/pq_retriever.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.hpp"
#include "core/vec_math.hpp"
#include "index/kmeans.hpp"
#include "select/gqa_fold.hpp"
#include "select/topk.hpp"

namespace kvret {

namespace {
constexpr int64_t kEncodeBlock = 256;
constexpr int kAdaptiveMaxIters = 25;
}  // namespace

PqRetriever::PqRetriever(int n_kv_heads, int head_dim, const Params& params)
    : n_kv_(n_kv_heads),
      d_(head_dim),
      m_(params.m),
      dsub_(head_dim / params.m),
      k_(1 << params.bits),
      cells_(params.bits * params.m <= 16 ? int64_t{1} << (params.bits * params.m) : 0),
      params_(params),
      codes_(static_cast<size_t>(n_kv_heads)),
      cell_counts_(static_cast<size_t>(n_kv_heads)),
      cells_of_(static_cast<size_t>(n_kv_heads)) {}

int64_t PqRetriever::bytes() const noexcept {
  int64_t b = static_cast<int64_t>(codebook_.size() * sizeof(float));
  for (const auto& c : codes_) b += static_cast<int64_t>(c.size());
  for (const auto& c : cell_counts_) b += static_cast<int64_t>(c.size() * sizeof(int32_t));
  for (const auto& c : cells_of_) b += static_cast<int64_t>(c.size() * sizeof(uint16_t));
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
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
  for (int task = 0; task < tasks; ++task) {
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
  }
  return codebook;
}

void PqRetriever::encode(const HostKvStore& store, const std::vector<float>& codebook, int64_t begin, int64_t end,
                         std::vector<std::vector<uint8_t>>& out, int n_threads) const {
  const int64_t n = end - begin;
  const int64_t blocks = (n + kEncodeBlock - 1) / kEncodeBlock;
  const int64_t tasks = blocks * n_kv_;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
  for (int64_t task = 0; task < tasks; ++task) {
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
  }
}

void PqRetriever::extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) {
  if (end <= begin) return;
  const int64_t base = base_ < 0 ? begin : base_;
  require(base_ < 0 || begin == end_, KVRET_ERR_INTERNAL, "PQ index extended out of order");
  const int64_t total = end - base;
  // Retrain when the middle has doubled since the last training: always at prefill, and at decode while the
  // codebook was trained on too few tokens to be trusted (a sequence that grew from a short prefill).
  const bool undertrained = trained_on_ < 4 * static_cast<int64_t>(k_);
  const bool retrain = trained_on_ == 0 || ((may_retrain || undertrained) && total >= 2 * trained_on_);
  const size_t um = static_cast<size_t>(m_);

  if (retrain) {
    std::vector<float> codebook = train(store, base, end, n_threads);
    std::vector<std::vector<uint8_t>> codes(static_cast<size_t>(n_kv_));
    for (auto& c : codes) c.resize(static_cast<size_t>(total) * um);
    encode(store, codebook, base, end, codes, n_threads);
    std::vector<std::vector<int32_t>> counts(static_cast<size_t>(n_kv_));
    std::vector<std::vector<uint16_t>> cells(static_cast<size_t>(n_kv_));
    if (uses_cells()) {
      for (int h = 0; h < n_kv_; ++h) {
        auto& count = counts[static_cast<size_t>(h)];
        auto& cell = cells[static_cast<size_t>(h)];
        count.assign(static_cast<size_t>(cells_), 0);
        cell.resize(static_cast<size_t>(total));
        const uint8_t* c = codes[static_cast<size_t>(h)].data();
        for (int64_t t = 0; t < total; ++t) {
          cell[static_cast<size_t>(t)] = static_cast<uint16_t>(cell_of(c + t * m_));
          ++count[cell[static_cast<size_t>(t)]];
        }
      }
    }
    // commit (no throw below)
    codebook_.swap(codebook);
    codes_.swap(codes);
    cell_counts_.swap(counts);
    cells_of_.swap(cells);
    base_ = base;
    end_ = end;
    trained_on_ = total;
    return;
  }

  const int64_t n = end - begin;
  std::vector<std::vector<uint8_t>> fresh(static_cast<size_t>(n_kv_));
  for (auto& c : fresh) c.resize(static_cast<size_t>(n) * um);
  encode(store, codebook_, begin, end, fresh, n_threads);
  // the only steps that may throw: nothing has changed yet
  for (auto& c : codes_) c.reserve(c.size() + static_cast<size_t>(n) * um);
  if (uses_cells())
    for (auto& c : cells_of_) c.reserve(c.size() + static_cast<size_t>(n));
  for (int h = 0; h < n_kv_; ++h) {
    auto& dst = codes_[static_cast<size_t>(h)];
    const auto& src = fresh[static_cast<size_t>(h)];
    dst.insert(dst.end(), src.begin(), src.end());
    if (uses_cells()) {
      for (int64_t t = 0; t < n; ++t) {
        const auto cell = static_cast<uint16_t>(cell_of(src.data() + t * m_));
        cells_of_[static_cast<size_t>(h)].push_back(cell);
        ++cell_counts_[static_cast<size_t>(h)][cell];
      }
    }
  }
  end_ = end;
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
  const uint8_t* c = codes(head);
  for (int64_t t = 0; t < size(); ++t) {
    float s = 0;
    for (int j = 0; j < m_; ++j) s += lut[static_cast<size_t>(j * k_ + c[t * m_ + j])];
    out[t] = s;
  }
}

int64_t PqRetriever::select(const HostKvStore&, const SelectRequest& r, int32_t* const* out_rows) const {
  require(base_ == r.mid_begin && end_ == r.mid_end, KVRET_ERR_INTERNAL,
          "PQ index covers [" + std::to_string(base_) + ", " + std::to_string(end_) + "), the middle is [" +
              std::to_string(r.mid_begin) + ", " + std::to_string(r.mid_end) + ")");
  const int64_t n = r.mid_end - r.mid_begin;
#pragma omp parallel for schedule(dynamic, 1) num_threads(r.n_threads)
  for (int h = 0; h < n_kv_; ++h) {
    const int group = r.group;
    const float* qg = r.q + static_cast<int64_t>(h) * group * d_;
    std::vector<float> lut(static_cast<size_t>(group) * m_ * k_);
    for (int g = 0; g < group; ++g) lookup_table(h, qg + g * d_, r.scale, lut.data() + g * m_ * k_);
    const uint8_t* codes = codes_[static_cast<size_t>(h)].data();
    int32_t* out = out_rows[h];

    if (!uses_cells()) {
      std::vector<float> logits(static_cast<size_t>(group) * n);
      for (int g = 0; g < group; ++g) {
        const float* l = lut.data() + g * m_ * k_;
        for (int64_t t = 0; t < n; ++t) {
          float s = 0;
          for (int j = 0; j < m_; ++j) s += l[j * k_ + codes[t * m_ + j]];
          logits[static_cast<size_t>(g * n + t)] = s;
        }
      }
      std::vector<float> folded(static_cast<size_t>(n));
      fold_logits(logits.data(), group, n, r.fold, folded.data());
      topk_positions(folded.data(), n, r.budget, r.mid_begin, out);
      continue;
    }

    // Cell path: score every code tuple once. Cell u = sum_j code_j k^j, so the table of sub-space j is added to
    // k^j-strided copies of the cells built so far (no division per cell).
    const auto& counts = cell_counts_[static_cast<size_t>(h)];
    std::vector<float> cell_logits(static_cast<size_t>(group * cells_));
    for (int g = 0; g < group; ++g) {
      const float* l = lut.data() + g * m_ * k_;
      float* s = cell_logits.data() + g * cells_;
      std::copy_n(l, k_, s);
      int64_t size = k_;
      for (int j = 1; j < m_; ++j, size *= k_)
        for (int c = k_ - 1; c >= 0; --c) {
          const float add = l[j * k_ + c];
          float* dst = s + c * size;
          for (int64_t u = 0; u < size; ++u) dst[u] = s[u] + add;  // c == 0 last: reads s before it changes
        }
    }
    std::vector<float> folded(static_cast<size_t>(cells_));
    fold_weighted_logits(cell_logits.data(), counts.data(), group, cells_, r.fold, folded.data());
    for (float& f : folded) f = f == f ? f : -std::numeric_limits<float>::infinity();  // NaN ranks lowest

    // Take whole cells best first (a heap: only the cells that fit the budget are ever ordered); the cell that
    // crosses the budget is trimmed to its earliest tokens. Ties: the lower cell id first.
    std::vector<int32_t> heap;
    heap.reserve(static_cast<size_t>(cells_));
    for (int64_t u = 0; u < cells_; ++u)
      if (counts[static_cast<size_t>(u)] > 0) heap.push_back(static_cast<int32_t>(u));
    auto worse = [&](int32_t a, int32_t b) {
      return folded[static_cast<size_t>(a)] < folded[static_cast<size_t>(b)] ||
             (folded[static_cast<size_t>(a)] == folded[static_cast<size_t>(b)] && a > b);
    };
    std::make_heap(heap.begin(), heap.end(), worse);
    enum : uint8_t { kSkip = 0, kTake = 1, kTrim = 2 };
    std::vector<uint8_t> state(static_cast<size_t>(cells_), kSkip);
    int64_t taken = 0;
    int64_t quota = 0;
    while (taken < r.budget && !heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      const int32_t u = heap.back();
      heap.pop_back();
      const int64_t c = counts[static_cast<size_t>(u)];
      if (taken + c <= r.budget) {
        state[static_cast<size_t>(u)] = kTake;
        taken += c;
      } else {
        state[static_cast<size_t>(u)] = kTrim;
        quota = r.budget - taken;
        taken = r.budget;
      }
    }
    const uint16_t* cell = cells_of_[static_cast<size_t>(h)].data();
    int64_t written = 0;
    for (int64_t t = 0; t < n && written < r.budget; ++t) {
      const uint8_t s = state[cell[t]];
      if (s == kTake || (s == kTrim && quota-- > 0)) out[written++] = static_cast<int32_t>(r.mid_begin + t);
    }
  }
  return r.budget;
}

}  // namespace kvret
