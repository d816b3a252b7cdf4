#include "index/quant_retriever.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "core/attention.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/serial.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "math/quant_math.h"
#include "select/gqa_fold.hpp"
#include "select/topk.hpp"

namespace kvret {

namespace {
constexpr int64_t kChunk = 256;              ///< tokens read from the store at a time
constexpr int64_t kParallelTokens = 1024;    ///< below this an extend runs on the calling thread (decode)
constexpr uint32_t kQuantTag = 0x5155414eu;  // "QUAN"
constexpr uint32_t kQuantVersion = 1;
}  // namespace

QuantRetriever::QuantRetriever(int n_kv_heads, int head_dim, const KiviParams& params, int rerank)
    : n_kv_(n_kv_heads), d_(head_dim), p_(params), rerank_(rerank < 1 ? 1 : rerank) {
  heads_.reserve(static_cast<size_t>(n_kv_heads));
  for (int h = 0; h < n_kv_heads; ++h) heads_.emplace_back(head_dim, params);
}

void QuantRetriever::low_bit_candidates(int h, const float* qh, int group, float scale, int64_t base, int64_t n,
                                        int64_t k, float* logits, int32_t* cand) const {
  heads_[static_cast<size_t>(h)].logits(qh, group, scale, logits, n);
  if (k <= 0) return;
  std::vector<float> folded(static_cast<size_t>(n));
  fold_logits(logits, group, n, KVRET_FOLD_MAX_LOGIT, folded.data());
  take_top_tokens(folded.data(), n, k, base, cand, nullptr);
}

int64_t QuantRetriever::attend_dense(const HostKvStore& store, const int32_t* const* selected, int64_t count,
                                     const float* q, int group, float scale, float* out, int n_threads) const {
  const int64_t n = store.size();
  const int64_t begin = indexed_begin(), end = indexed_end(), middle = end - begin;
  const int64_t candidates = rerank_ > 1 && count > 0 ? std::min(middle, count * rerank_) : 0;
  // the low-bit logits are select's (scale 1/sqrt(head_dim)); the softmax's are scaled by `scale`
  const float select_scale = 1.0f / std::sqrt(static_cast<float>(d_));
  // the rule's arithmetic is kernels/math/quant_math.h's (the CUDA backend compiles it too)
  namespace qm = cuda::math;
  const double rescale = qm::quant_rescale(scale, select_scale);
  const AttendIsa isa = attend_isa();
  std::vector<int64_t> key_only(static_cast<size_t>(n_kv_), 0);
  parallel_for(n_kv_, n_threads, n * group >= kParallelTokens, Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    const KiviHead& head = heads_[static_cast<size_t>(h)];
    const float* qh = q + static_cast<size_t>(h) * group * d_;
    // how each middle token enters: 0 low-bit row, 1 exact key and low-bit value (a candidate), 2 exact row
    std::vector<uint8_t> kind(static_cast<size_t>(middle), 0);
    std::vector<float> low(static_cast<size_t>(group) * middle);
    std::vector<int32_t> cand(static_cast<size_t>(candidates));
    low_bit_candidates(h, qh, group, select_scale, begin, middle, candidates, low.data(), cand.data());
    for (const int32_t t : cand) kind[static_cast<size_t>(t - begin)] = 1;
    for (int64_t i = 0; i < count; ++i) {
      if (selected[h][i] < begin || selected[h][i] >= end) continue;  // not a middle token: exact anyway
      uint8_t& k = kind[static_cast<size_t>(selected[h][i] - begin)];
      key_only[static_cast<size_t>(h)] -= k == 1;
      k = 2;
    }
    key_only[static_cast<size_t>(h)] += candidates;
    // the exact rows (sink, local, selected) in position order, through attend's blocked attention (attend_head)
    const auto exact = [&](int64_t t) { return t < begin || t >= end || kind[static_cast<size_t>(t - begin)] == 2; };
    const size_t row_bytes = store.row_bytes();
    thread_local std::vector<std::byte> exact_k, exact_v;  // kept by the thread: reused from call to call
    int64_t rows = 0;
    for (int64_t t = 0; t < n; ++t) rows += exact(t);
    exact_k.resize(static_cast<size_t>(rows) * row_bytes);
    exact_v.resize(exact_k.size());
    rows = 0;
    for (int64_t t = 0; t < n; ++t) {
      if (!exact(t)) continue;
      std::memcpy(exact_k.data() + static_cast<size_t>(rows) * row_bytes, store.key_row(h, t), row_bytes);
      std::memcpy(exact_v.data() + static_cast<size_t>(rows) * row_bytes, store.value_row(h, t), row_bytes);
      ++rows;
    }
    std::vector<double> m(static_cast<size_t>(group)), z(static_cast<size_t>(group));
    std::vector<double> acc(static_cast<size_t>(group) * d_);
    const std::unique_ptr<bool[]> nan(new bool[static_cast<size_t>(group)]);
    attend_head(qh, group, d_, scale, exact_k.data(), store.dtype(), exact_v.data(), store.dtype(), rows, isa, m.data(),
                z.data(), acc.data(), nan.get());
    const std::vector<double> exact_max = m;
    // the other tokens' logits: a candidate's from its exact key, the rest from the low-bit copy
    std::vector<double> logit(static_cast<size_t>(group) * middle);
    std::vector<float> key(static_cast<size_t>(d_)), value(static_cast<size_t>(d_));
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t k = kind[static_cast<size_t>(t - begin)];
      if (k == 2) continue;
      if (k == 1) load_row_f32(store.key_row(h, t), store.dtype(), key.data(), static_cast<size_t>(d_));
      for (int g = 0; g < group; ++g) {
        const double l = k == 0 ? qm::quant_low_logit(rescale, low[static_cast<size_t>(g) * middle + (t - begin)])
                                : qm::quant_exact_logit(qh + static_cast<size_t>(g) * d_, key.data(), d_, scale);
        logit[static_cast<size_t>(g) * middle + (t - begin)] = l;
        m[static_cast<size_t>(g)] = std::max(m[static_cast<size_t>(g)], l);
      }
    }
    // the softmax: the exact rows' share, then the other tokens' weights and values in position order
    for (int g = 0; g < group; ++g) {
      const size_t gi = static_cast<size_t>(g);
      const double share = qm::quant_exact_share(exact_max[gi], m[gi]);
      z[gi] = qm::dmul_rn(share, z[gi]);
      for (int i = 0; i < d_; ++i) acc[gi * d_ + i] = qm::dmul_rn(share, acc[gi * d_ + i]);
    }
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t k = kind[static_cast<size_t>(t - begin)];
      if (k == 2) continue;
      head.reconstruct_value(t - begin, value.data());
      for (int g = 0; g < group; ++g) {
        const double w =
            qm::quant_weight(logit[static_cast<size_t>(g) * middle + (t - begin)], m[static_cast<size_t>(g)]);
        z[static_cast<size_t>(g)] = qm::dadd_rn(z[static_cast<size_t>(g)], w);
        double* ag = acc.data() + static_cast<size_t>(g) * d_;
        for (int i = 0; i < d_; ++i) ag[i] = qm::quant_accumulate(ag[i], w, value[static_cast<size_t>(i)]);
      }
    }
    for (int g = 0; g < group; ++g) {
      float* o = out + static_cast<size_t>((h * group + g) * d_);
      for (int i = 0; i < d_; ++i)
        o[i] = nan[static_cast<size_t>(g)]
                   ? qm::bits_float(0x7fc00000u)
                   : qm::quant_output(acc[static_cast<size_t>(g) * d_ + i], z[static_cast<size_t>(g)]);
    }
  });
  int64_t total = 0;
  for (const int64_t k : key_only) total += k;
  return total;
}

int64_t QuantRetriever::bytes() const noexcept {
  int64_t b = 0;
  for (const auto& h : heads_) b += h.bytes();
  return b;
}

void QuantRetriever::on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool, int n_threads) {
  // Everything that may throw happens before the first token is appended: the heads' room and the read buffers.
  const int64_t n = end - begin;
  for (auto& h : heads_) h.reserve(n);
  const int64_t first = blocks();  // the blocks before it stay as they are
  const int64_t chunk = std::min(kChunk, n);
  const size_t rows = static_cast<size_t>(chunk) * d_;
  std::vector<float> buffers(static_cast<size_t>(n_kv_) * 2 * rows);
  parallel_for(n_kv_, n_threads, n >= kParallelTokens, Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    float* keys = buffers.data() + static_cast<size_t>(h) * 2 * rows;
    float* values = keys + rows;
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk);
      store.keys_f32(h, c0, c1, keys);
      for (int64_t pos = c0; pos < c1; ++pos)
        load_row_f32(store.value_row(h, pos), store.dtype(), values + static_cast<size_t>(pos - c0) * d_,
                     static_cast<size_t>(d_));
      heads_[static_cast<size_t>(h)].append(keys, values, c1 - c0);
    }
  });
  log_.mark(first);
}

void QuantRetriever::on_cut(const HostKvStore& store, int64_t end) noexcept {
  const int64_t base = base_;
  const int64_t n = end <= base ? 0 : end - base;
  for (int h = 0; h < n_kv_; ++h)
    heads_[static_cast<size_t>(h)].truncate(n, [&](int64_t t, float* key, float* value) {
      store.keys_f32(h, base + t, base + t + 1, key);
      load_row_f32(store.value_row(h, base + t), store.dtype(), value, static_cast<size_t>(d_));
    });
  log_.mark(blocks());  // blocks from here on are gone (a later extend quantizes them anew)
}

int64_t QuantRetriever::select(const HostKvStore& store, const SelectRequest& r, int32_t* const* out_rows,
                               float* const* out_scores) const {
  require_covers(r, "quant");
  const int64_t n = r.mid_end - r.mid_begin;
  // Candidates for the exact re-ranking: rerank_ x budget, at most the middle (then it is EXACT's ranking and scores).
  const int64_t candidates = rerank_ > 1 ? std::min(n, r.budget * rerank_) : r.budget;
  parallel_for(n_kv_, r.n_threads, r.parallel(), Schedule::kDynamic, [&](int64_t h_i) {
    const auto h = static_cast<int>(h_i);
    const float* qh = r.q + static_cast<int64_t>(h) * r.group * d_;
    std::vector<float> logits(static_cast<size_t>(r.group) * n);
    if (rerank_ == 1) {
      heads_[static_cast<size_t>(h)].logits(qh, r.group, r.scale, logits.data(), n);
      std::vector<float> folded(static_cast<size_t>(n));
      fold_logits(logits.data(), r.group, n, r.fold, folded.data());
      take_top_tokens(folded.data(), n, r.budget, r.mid_begin, out_rows[h],
                      out_scores != nullptr ? out_scores[h] : nullptr);
      return;
    }
    // The candidates (ascending positions), their exact logits as EXACT computes them, the fold over them, the top.
    std::vector<int32_t> cand(static_cast<size_t>(candidates));
    low_bit_candidates(h, qh, r.group, r.scale, r.mid_begin, n, candidates, logits.data(), cand.data());
    std::vector<float> key(static_cast<size_t>(d_));
    std::vector<float> exact(static_cast<size_t>(r.group) * candidates);
    for (int64_t i = 0; i < candidates; ++i) {
      store.keys_f32(h, cand[static_cast<size_t>(i)], cand[static_cast<size_t>(i)] + 1, key.data());
      for (int g = 0; g < r.group; ++g)
        exact[static_cast<size_t>(g * candidates + i)] = r.scale * dot(qh + g * d_, key.data(), d_);
    }
    std::vector<float> refolded(static_cast<size_t>(candidates));
    fold_logits(exact.data(), r.group, candidates, r.fold, refolded.data());
    int32_t* out = out_rows[h];
    take_top_tokens(refolded.data(), candidates, r.budget, 0, out, out_scores != nullptr ? out_scores[h] : nullptr);
    for (int64_t i = 0; i < r.budget; ++i) out[i] = cand[static_cast<size_t>(out[i])];  // ascending stays ascending
  });
  return r.budget;
}

std::vector<std::byte> QuantRetriever::save() const {
  ByteWriter w;
  write_header(w, kQuantTag, kQuantVersion);
  w.value<int32_t>(n_kv_);
  w.value<int32_t>(d_);
  w.value<int32_t>(p_.bits);
  w.value<int32_t>(p_.group);
  w.value<int32_t>(p_.residual);
  write_range(w);
  for (const auto& h : heads_) {
    w.array(h.key_code_array());
    w.array(h.key_param_array());
    w.array(h.value_code_array());
    w.array(h.value_param_array());
    w.array(h.residual_key_array());
    w.array(h.residual_value_array());
  }
  return std::move(w.bytes());
}

void QuantRetriever::restore(const HostKvStore& store, const std::byte* data, size_t size) {
  ByteReader r(data, size);
  read_header(r, kQuantTag, kQuantVersion);
  require_intact(r.value<int32_t>() == n_kv_ && r.value<int32_t>() == d_ && r.value<int32_t>() == p_.bits &&
                     r.value<int32_t>() == p_.group && r.value<int32_t>() == p_.residual,
                 "another geometry or quantization than this context's");
  const auto range = read_range(r, store);
  const int64_t n = range.first < 0 ? 0 : range.second - range.first;
  std::vector<KiviHead> heads;
  heads.reserve(static_cast<size_t>(n_kv_));
  for (int h = 0; h < n_kv_; ++h) {
    heads.emplace_back(d_, p_);
    auto key_codes = r.array<uint8_t, LargeAllocator<uint8_t>>();
    auto key_params = r.array<uint16_t, LargeAllocator<uint16_t>>();
    auto value_codes = r.array<uint8_t, LargeAllocator<uint8_t>>();
    auto value_params = r.array<uint16_t, LargeAllocator<uint16_t>>();
    auto res_k = r.array<uint16_t>();
    auto res_v = r.array<uint16_t>();
    require_intact(heads.back().restore_arrays(n, std::move(key_codes), std::move(key_params), std::move(value_codes),
                                               std::move(value_params), std::move(res_k), std::move(res_v)),
                   "quantized arrays that do not fit the indexed range, or a group whose min exceeds its max");
  }
  require_intact(r.left() == 0, "trailing bytes");
  heads_.swap(heads);  // commit
  set_range(range);
  log_.reset();  // unknown to every copy
}

namespace {

class QuantKind final : public RetrieverKind {
 public:
  const char* name() const noexcept override { return "quant"; }
  // Under quantized attention the re-ranking's candidates also enter the softmax with their exact keys
  // (attend_dense): a token the low-bit keys over-rate keeps no inflated logit.
  std::unique_ptr<Retriever> make(const kvret_config& c, int) const override {
    return std::make_unique<QuantRetriever>(
        c.n_kv_heads, c.head_dim, KiviParams{c.quant_bits, c.quant_group_size, c.quant_residual}, c.quant_rerank);
  }
};

}  // namespace

std::shared_ptr<const RetrieverKind> make_quant_kind() { return std::make_shared<QuantKind>(); }

}  // namespace kvret
