// A sequence's attention calls (kvret_seq_attend, kvret_prefetch_async) and the importance inputs KVCrush reads
// (observed queries, accumulated attention): Sequence's members beside the store, index, select and fetch of
// sequence.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "core/attention.hpp"
#include "core/error.hpp"
#include "core/vec_math.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"
#include "fetch/working_set.hpp"
#include "index/quant_retriever.hpp"
#include "math/kvcrush_math.h"
#include "select/kvcrush.hpp"

namespace kvret {

namespace {

/// A tensor descriptor over `data` in `device`'s memory with `shape` (row-major); `shape` must outlive it.
template <class T>
kvret_tensor own_tensor(T* data, kvret_device device, const std::vector<int64_t>& shape) {
  kvret_tensor t{};
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = std::is_same_v<T, float> ? kvret_dtype{KVRET_DTYPE_FLOAT, 32, 1} : kvret_dtype{KVRET_DTYPE_INT, 32, 1};
  t.shape = const_cast<int64_t*>(shape.data());
  return t;
}

/// `buffer` grown to at least `bytes` of the backend's memory (kept when it is large enough).
void reserve(Backend& backend, std::unique_ptr<DeviceBuffer>& buffer, size_t bytes) {
  if (!buffer || buffer->bytes() < bytes) {
    buffer.reset();
    buffer = backend.allocate(bytes);
  }
}

}  // namespace

void Sequence::note_cache_use() {
  const Backend::CacheUse use = ctx_.backend().take_cache_use(this);
  stats_.bytes_h2d += use.loaded_bytes;  // blocks copied into the block cache
  int64_t held = use.held_bytes;
  for (const auto* b :
       {&attend_scratch_.k, &attend_scratch_.v, &attend_scratch_.positions, &attend_scratch_.device_selected})
    if (*b && (*b)->device().device_type == KVRET_DEVICE_CUDA) held += static_cast<int64_t>((*b)->bytes());
  stats_.device_bytes = held;
}

void Sequence::fold_device_counts() const noexcept {
  if (!device_counted_.load()) return;
  const Backend::DeviceFetchCounts d = ctx_.backend().device_fetch_counts(this);
  // cumulative on the device: what a fold adds is the difference to the last (a reader on another thread may fold
  // at the same time; each difference is added once)
  const int64_t hits = d.cache_hits - folded_hits_.exchange(d.cache_hits);
  const int64_t bytes = d.bytes_h2d - folded_bytes_.exchange(d.bytes_h2d);
  stats_.cache_hits += hits;
  stats_.cache_misses -= hits;  // counted as misses by finish_fetch and attend_on_device
  stats_.bytes_h2d += bytes;
}

bool Sequence::attend_on_device(int32_t layer, const TensorView& q, int32_t budget, int64_t width, float scale,
                                const TensorView& out, kvret_stream stream) {
  const kvret_config& c = ctx_.config();
  Backend& backend = ctx_.backend();
  AttendScratch& a = attend_scratch_;
  // the kinds of the tensors first (q stands in for the positions' buffer, device memory too), so that a layer whose
  // select cannot run on the device allocates nothing
  if (!backend.selects_on_device(layer_at(layer).index(), q, q, nullptr)) return false;
  try {
    reserve(backend, a.device_selected, static_cast<size_t>(c.n_kv_heads * width) * sizeof(int32_t));
  } catch (const Error& e) {
    if (e.status() != KVRET_ERR_CAPACITY && e.status() != KVRET_ERR_OUT_OF_MEMORY) throw;
    return false;  // no room for the selection on the device: the host path
  } catch (const std::bad_alloc&) {
    return false;
  }
  if (a.device_selected->device().device_type != KVRET_DEVICE_CUDA) return false;
  const std::vector<int64_t> selected_shape{c.n_kv_heads, width};
  const kvret_tensor st =
      own_tensor(reinterpret_cast<int32_t*>(a.device_selected->data()), a.device_selected->device(), selected_shape);
  const TensorView sv = ctx_.view(&st, "positions", {DType::I32}, {2});
  int64_t count = 0;
  if (!select_on_device(layer, q, budget, sv, nullptr, &count, stream, true)) return false;
  // the working set of sink + count + local rows, from the positions on the device (ours: not checked again)
  const TokenGroups g = groups(layer);
  const int64_t capacity = working_set_capacity(layer, static_cast<int32_t>(count));
  const std::vector<int64_t> kv_shape{c.n_kv_heads, capacity, c.head_dim}, pos_shape{c.n_kv_heads, capacity};
  const kvret_working_set ws{
      own_tensor(reinterpret_cast<float*>(a.k->data()), a.k->device(), kv_shape),
      own_tensor(reinterpret_cast<float*>(a.v->data()), a.v->device(), kv_shape),
      own_tensor(reinterpret_cast<int32_t*>(a.positions->data()), a.positions->device(), pos_shape)};
  const WorkingSetViews views{ctx_.view(&ws.k, "k", {DType::F32}, {3}), ctx_.view(&ws.v, "v", {DType::F32}, {3}),
                              ctx_.view(&ws.positions, "positions", {DType::I32}, {2})};
  const HostKvStore& store = layer_at(layer).store();
  int64_t rows = backend.gather_device_selected(store, g.mid_begin, g.mid_end,
                                                reinterpret_cast<const int32_t*>(a.device_selected->data()), width,
                                                count, views, this, layer, ctx_.threads(), stream);
  if (rows < 0) {  // the backend cannot: the selection through the host, as kvret_fetch_async takes it
    std::vector<std::byte> copy;
    const TensorView host = backend.host_readable(sv, copy);
    const std::vector<int64_t> host_shape{c.n_kv_heads, width};
    const kvret_tensor ht =
        own_tensor(reinterpret_cast<int32_t*>(host.data()), kvret_device{KVRET_DEVICE_CPU, 0}, host_shape);
    rows = fetch(layer, &ht, static_cast<int32_t>(count), &ws, stream);
  } else {  // finish_fetch's stats, every row counted a miss until the device's hit count is folded in
    if (c.index_kind == KVRET_INDEX_CLUSTER && dynamic_cast<const ClusterRetriever*>(&layer_at(layer).index()))
      stats_.cluster_reuse_rows += count * c.n_kv_heads;
    device_counted_ = true;
    stats_.fetches += 1;
    stats_.fetched_rows += rows * c.n_kv_heads;
    stats_.cache_misses += rows * c.n_kv_heads;
    stats_.bytes_h2d += backend.bytes_to_device(rows * c.n_kv_heads, store.row_bytes());
    note_cache_use();
  }
  backend.attend(c, q, views.k, views.v, rows, scale, out, ctx_.threads(), stream);
  return true;
}

void Sequence::prefetch(int32_t layer, const kvret_tensor* q_guess, int32_t budget, kvret_stream stream) {
  const kvret_config& c = ctx_.config();
  const TensorView qv = ctx_.view(q_guess, "q_guess", kFloatTypes, {2});
  check_layer(layer);
  const int64_t width = std::max<int64_t>(resolve_budget(layer, budget), 1);
  std::vector<int32_t> rows(static_cast<size_t>(c.n_kv_heads * width));
  const std::vector<int64_t> shape{c.n_kv_heads, width};
  const kvret_tensor st = own_tensor(rows.data(), ctx_.backend().host_memory(), shape);
  const int64_t count = select_checked(layer, qv, budget, ctx_.view(&st, "positions", {DType::I32}, {2}));
  std::vector<std::vector<int32_t>> kept(static_cast<size_t>(c.n_kv_heads));
  std::vector<const int32_t*> kept_rows(static_cast<size_t>(c.n_kv_heads));
  for (int h = 0; h < c.n_kv_heads; ++h) {
    auto& k = kept[static_cast<size_t>(h)];
    k.assign(rows.begin() + h * width, rows.begin() + h * width + count);
    std::sort(k.begin(), k.end());
    kept_rows[static_cast<size_t>(h)] = k.data();
  }
  // a backend with a block cache loads the blocks of the guessed selection now (the CPU backend: nothing)
  ctx_.backend().prefetch(layer_at(layer).store(), kept_rows.data(), count, this, layer, stream);
  if (ctx_.backend().counts_fetches_on_device()) device_counted_ = true;  // the bytes it loaded: fold_device_counts
  note_cache_use();
  if (prefetched_.empty()) prefetched_.resize(static_cast<size_t>(c.n_layers));
  prefetched_[static_cast<size_t>(layer)] = std::move(kept);  // no throw from here
}

void Sequence::attend(int32_t layer, const kvret_tensor* q, int32_t budget, float scale, const kvret_tensor* out,
                      kvret_stream stream) {
  const kvret_config& c = ctx_.config();
  const TensorView qv = ctx_.view(q, "q", kFloatTypes, {2});
  const TensorView ov = ctx_.view(out, "out", kFloatTypes, {2});
  ov.expect_dim(0, c.n_q_heads, "n_q_heads");
  ov.expect_dim(1, c.head_dim, "head_dim");
  require(std::isfinite(scale), KVRET_ERR_INVALID_ARGUMENT, "scale is not finite");
  ctx_.backend().check_kernel_access(qv);
  ctx_.backend().check_kernel_access(ov);
  // select into a buffer of our own
  check_layer(layer);
  require(length(layer) > 0, KVRET_ERR_STATE, "attend on " + layer_name(layer) + ", which holds no tokens");
  const int64_t width = std::max<int64_t>(resolve_budget(layer, budget), 1);
  // buffers of this sequence kept between calls (calls on one sequence do not overlap): a decode step allocates
  // nothing once they have grown
  AttendScratch& a = attend_scratch_;
  a.selected.resize(std::max(a.selected.size(), static_cast<size_t>(c.n_kv_heads * width)));
  const std::vector<int64_t> selected_shape{c.n_kv_heads, width};
  Backend& backend = ctx_.backend();
  if (c.quant_attention == 0) {
    // f32 buffers of our own for the working set, for up to `width` selected rows, before anything changes (the
    // CUDA backend refuses them past config.device_bytes_limit)
    const TokenGroups g = groups(layer);
    const int64_t most = g.mid_begin + width + (g.length - g.mid_end);
    const size_t kv_bytes = static_cast<size_t>(c.n_kv_heads * most * c.head_dim) * sizeof(float);
    reserve(backend, a.k, kv_bytes);
    reserve(backend, a.v, kv_bytes);
    reserve(backend, a.positions, static_cast<size_t>(c.n_kv_heads * most) * sizeof(int32_t));
  }
  // the selection kept on the device where the call allows it (no host wait: docs/cuda_backend.md)
  const auto sources = ctx_.row_sources();
  if (c.quant_attention == 0 && c.hamming_importance != KVRET_IMPORTANCE_ACCUMULATED &&
      !(sources && !sources->empty()) && !(c.index_kind == KVRET_INDEX_CLUSTER && c.cluster_reuse_steps > 0) &&
      (prefetched_.empty() || prefetched_[static_cast<size_t>(layer)].empty()) &&
      qv.device().device_type == KVRET_DEVICE_CUDA && attend_on_device(layer, qv, budget, width, scale, ov, stream))
    return;
  const kvret_tensor st = own_tensor(a.selected.data(), backend.host_memory(), selected_shape);
  const int64_t count = select_checked(layer, qv, budget, ctx_.view(&st, "positions", {DType::I32}, {2}));
  if (c.quant_attention != 0) {  // SpeCache's output rule, over the whole low-bit copy
    attend_quantized(layer, qv, a.selected.data(), width, count, scale, ov);
    if (c.hamming_importance == KVRET_IMPORTANCE_ACCUMULATED)
      accumulate_attend(layer, qv, a.selected.data(), width, count, scale);
    return;
  }
  // fetch into the buffers, then attend over them
  const int64_t capacity = working_set_capacity(layer, static_cast<int32_t>(count));
  int64_t on_device = 0;
  for (const auto* b : {&a.k, &a.v, &a.positions})
    if ((*b)->device().device_type == KVRET_DEVICE_CUDA) on_device += static_cast<int64_t>((*b)->bytes());
  stats_.device_bytes = on_device;
  const std::vector<int64_t> kv_shape{c.n_kv_heads, capacity, c.head_dim}, pos_shape{c.n_kv_heads, capacity};
  const kvret_working_set ws{
      own_tensor(reinterpret_cast<float*>(a.k->data()), a.k->device(), kv_shape),
      own_tensor(reinterpret_cast<float*>(a.v->data()), a.v->device(), kv_shape),
      own_tensor(reinterpret_cast<int32_t*>(a.positions->data()), a.positions->device(), pos_shape)};
  const int64_t rows = fetch(layer, &st, static_cast<int32_t>(count), &ws, stream);
  backend.attend(c, qv, ctx_.view(&ws.k, "k", {DType::F32}, {3}), ctx_.view(&ws.v, "v", {DType::F32}, {3}), rows, scale,
                 ov, ctx_.threads(), stream);
  if (c.hamming_importance == KVRET_IMPORTANCE_ACCUMULATED)
    accumulate_attend(layer, qv, a.selected.data(), width, count, scale);
}

void Sequence::accumulate_attend(int32_t layer, const TensorView& q, const int32_t* selected, int64_t width,
                                 int64_t count, float scale) {
  const kvret_config& c = ctx_.config();
  const HostKvStore& store = layer_at(layer).store();
  const TokenGroups g = groups(layer);
  std::vector<std::byte> q_copy;
  const std::vector<float> qf = load_query(ctx_.backend().host_readable(q, q_copy), false);
  const int d = c.head_dim, group = c.n_q_heads / c.n_kv_heads;
  const float s = attend_scale(c, scale);
  std::vector<float> probs(static_cast<size_t>(c.n_q_heads) * static_cast<size_t>(g.length), 0.0f);
  std::vector<int32_t> rows;
  std::vector<float> keys, logits;
  for (int h = 0; h < c.n_kv_heads; ++h) {
    // the working set's positions of head h: sink, selection, local (as fetch gathers them)
    rows.clear();
    for (int64_t p = 0; p < g.mid_begin; ++p) rows.push_back(static_cast<int32_t>(p));
    rows.insert(rows.end(), selected + h * width, selected + h * width + count);
    for (int64_t p = g.mid_end; p < g.length; ++p) rows.push_back(static_cast<int32_t>(p));
    const auto n = static_cast<int64_t>(rows.size());
    keys.resize(static_cast<size_t>(n * d));
    for (int64_t i = 0; i < n; ++i)
      store.keys_f32(h, rows[static_cast<size_t>(i)], rows[static_cast<size_t>(i)] + 1, keys.data() + i * d);
    logits.resize(static_cast<size_t>(group * n));
    scaled_dots(qf.data() + static_cast<int64_t>(h) * group * d, d, group, keys.data(), d, n, d, s, logits.data(), n);
    for (int j = 0; j < group; ++j) {
      float* l = logits.data() + static_cast<int64_t>(j) * n;
      float mx = 0;
      const double z = exp_from_max(l, n, &mx);
      const auto inv = static_cast<float>(1.0 / z);
      float* out = probs.data() + (static_cast<int64_t>(h) * group + j) * g.length;
      for (int64_t i = 0; i < n; ++i) out[rows[static_cast<size_t>(i)]] = l[i] * inv;
    }
  }
  accumulate(layer, probs.data(), g.length);
}

void Sequence::accumulate(int32_t layer, const float* probs, int64_t n) {
  ImportanceInputs& in = importance_[static_cast<size_t>(layer)];
  in.sums.add(probs, n);  // strong: grows aside first
  ++in.steps;
}

void Sequence::observe(int32_t layer, const kvret_tensor* q_window) {
  const kvret_config& c = ctx_.config();
  const TensorView qv = ctx_.view(q_window, "q_window", kFloatTypes, {3});
  const HostKvStore& store = layer_at(layer).store();
  require(store.size() > 0, KVRET_ERR_STATE,
          "kvret_seq_observe on " + layer_name(layer) + ", which holds no tokens (call kvret_append_prefill first)");
  const int64_t w = qv.dim(0);
  require(w >= 1 && w <= store.size(), KVRET_ERR_SHAPE,
          "q_window: " + std::to_string(w) + " rows (dimension 0), but the window must hold 1 to the " +
              std::to_string(store.size()) + " tokens of " + layer_name(layer));
  qv.expect_dim(1, c.n_q_heads, "n_q_heads");
  qv.expect_dim(2, c.head_dim, "head_dim");
  std::vector<std::byte> copy;
  const TensorView host = ctx_.backend().host_readable(qv, copy);
  const int64_t d = c.head_dim;
  std::vector<float> rows(static_cast<size_t>(c.n_q_heads * w * d));
  for (int64_t j = 0; j < w; ++j)
    for (int64_t i = 0; i < c.n_q_heads; ++i)
      host.load_f32(host.at({j, i}), static_cast<size_t>(d), rows.data() + (i * w + j) * d);
  if (c.check_finite)
    for (const float f : rows) KVRET_REQUIRE(std::isfinite(f), KVRET_ERR_NONFINITE, "q_window: contains NaN or Inf");
  // commit (no throw below)
  ImportanceInputs& in = importance_[static_cast<size_t>(layer)];
  in.window.swap(rows);
  in.w = static_cast<int>(w);
  in.observed_at = store.size();
  if (!crush_.empty()) crush_[static_cast<size_t>(layer)] = KvCrushLayer{};  // recomputed at the next select
}

void Sequence::observe_attention(int32_t layer, const kvret_tensor* probs) {
  const kvret_config& c = ctx_.config();
  require(c.hamming_importance == KVRET_IMPORTANCE_ACCUMULATED, KVRET_ERR_STATE,
          "kvret_seq_observe_attention: config.hamming_importance is not KVRET_IMPORTANCE_ACCUMULATED (the context "
          "keeps no accumulated attention)");
  const TensorView pv = ctx_.view(probs, "probs", kFloatTypes, {2});
  const HostKvStore& store = layer_at(layer).store();
  require(store.size() > 0, KVRET_ERR_STATE,
          "kvret_seq_observe_attention on " + layer_name(layer) +
              ", which holds no tokens (call kvret_append_prefill first)");
  pv.expect_dim(0, c.n_q_heads, "n_q_heads");
  const int64_t n = pv.dim(1);
  require(n >= 1 && n <= store.size(), KVRET_ERR_SHAPE,
          "probs: " + std::to_string(n) + " tokens (dimension 1), but a step covers 1 to the " +
              std::to_string(store.size()) + " tokens of " + layer_name(layer));
  std::vector<std::byte> copy;
  const TensorView host = ctx_.backend().host_readable(pv, copy);
  std::vector<float> p(static_cast<size_t>(c.n_q_heads * n));
  for (int64_t i = 0; i < c.n_q_heads; ++i) {
    float* row = p.data() + i * n;
    host.load_f32(host.at({i}), static_cast<size_t>(n), row);
    for (int64_t t = 0; t < n; ++t)
      KVRET_REQUIRE(std::isfinite(row[t]) && row[t] >= 0.0f, KVRET_ERR_INVALID_ARGUMENT,
                    "probs: query head " + std::to_string(i) + ", position " + std::to_string(t) + " is " +
                        std::to_string(row[t]) + ": a probability must be finite and >= 0");
  }
  accumulate(layer, p.data(), n);
}

void Sequence::refresh_crush(int32_t layer, KvCrushLayer& crush) const {
  const kvret_config& c = ctx_.config();
  const HostKvStore& store = layer_at(layer).store();
  const ImportanceInputs& in = importance_[static_cast<size_t>(layer)];
  if (c.hamming_importance == KVRET_IMPORTANCE_ACCUMULATED && in.steps > 0) {
    if (!crush.from_sums() || crush.sums_steps() != in.steps || crush.tokens() != store.size())
      crush.rebuild_from_sums(in.sums.importance().data(), c.n_q_heads, in.sums.tokens(), c.n_kv_heads, store.size(),
                              in.steps);
    return;
  }
  if (crush.from_sums()) crush = KvCrushLayer{};
  crush.update(store, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), ctx_.threads(),
               in.window.empty() ? nullptr : in.window.data(), c.n_q_heads, in.w);
}

const AttentionAccumulator& Sequence::accumulated(int32_t layer) const {
  check_layer(layer);
  return importance_[static_cast<size_t>(layer)].sums;
}

int64_t Sequence::accumulated_steps(int32_t layer) const {
  check_layer(layer);
  return importance_[static_cast<size_t>(layer)].steps;
}

bool Sequence::holds_importance_inputs() const noexcept {
  return std::any_of(importance_.begin(), importance_.end(),
                     [](const ImportanceInputs& in) { return !in.window.empty() || in.steps > 0; });
}

const KvCrushLayer* Sequence::crush(int32_t layer) const {
  check_layer(layer);
  return crush_.empty() ? nullptr : &crush_[static_cast<size_t>(layer)];
}

void Sequence::attend_quantized(int32_t layer, const TensorView& q, const int32_t* selected, int64_t width,
                                int64_t count, float scale, const TensorView& out) {
  const kvret_config& c = ctx_.config();
  LayerState& l = layer_at(layer);
  const auto* quant = dynamic_cast<const QuantRetriever*>(l.index().selects_as());
  require(quant != nullptr, KVRET_ERR_INTERNAL, "config.quant_attention is set but the index is not the quant index");
  Backend& backend = ctx_.backend();
  std::vector<const int32_t*> rows(static_cast<size_t>(c.n_kv_heads));
  for (int h = 0; h < c.n_kv_heads; ++h) rows[static_cast<size_t>(h)] = selected + h * width;
  int64_t key_rows = 0;
  const QuantAttendJob job{
      quant,          &l.store(), &q,   &out, rows.data(), count, c.n_q_heads / c.n_kv_heads, attend_scale(c, scale),
      ctx_.threads(), this,       layer};
  if (backend.attend_quantized_on_device(job, &key_rows, nullptr)) {
    backend.synchronize(nullptr);  // out is written when the call returns, whatever stream the caller reads it on
    note_cache_use();              // the device's copy of the index counts in device_bytes
  } else {
    std::vector<std::byte> q_copy, out_copy;
    const std::vector<float> qf = load_query(backend.host_readable(q, q_copy), false);
    const TensorView out_host = backend.host_writable(out, out_copy);
    std::vector<float> o(static_cast<size_t>(c.n_q_heads) * c.head_dim);
    key_rows =
        quant->attend_dense(l.store(), rows.data(), count, qf.data(), job.group, job.scale, o.data(), ctx_.threads());
    for (int h = 0; h < c.n_q_heads; ++h)
      convert_row(reinterpret_cast<const std::byte*>(o.data() + static_cast<size_t>(h) * c.head_dim), DType::F32,
                  out_host.at({h}), out_host.dtype(), static_cast<size_t>(c.head_dim));
    backend.write_back(out_host, out);
  }
  const TokenGroups g = groups(layer);
  // sink, selected and local rows, and the candidates whose keys alone were read (each counted as a row)
  const int64_t exact_rows = (g.mid_begin + count + (g.length - g.mid_end)) * c.n_kv_heads + key_rows;
  stats_.fetches += 1;
  stats_.fetched_rows += exact_rows;
  stats_.cache_misses += exact_rows;
}

}  // namespace kvret
