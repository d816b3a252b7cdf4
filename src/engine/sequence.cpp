#include "engine/sequence.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "engine/context.hpp"
#include "fetch/working_set.hpp"

namespace kvret {

namespace {

/// Most tokens one layer holds: positions are int32 everywhere (selections, working-set rows).
constexpr int64_t kMaxLayerTokens = INT32_MAX;

std::string layer_name(int32_t layer) { return "layer " + std::to_string(layer); }

/// Converts a [Hq, D] query view to f32, checking finiteness when asked.
std::vector<float> load_query(const TensorView& q, bool check_finite) {
  const int64_t heads = q.dim(0);
  const int64_t d = q.dim(1);
  std::vector<float> out(static_cast<size_t>(heads * d));
  for (int64_t h = 0; h < heads; ++h) q.load_f32(q.at({h}), static_cast<size_t>(d), out.data() + h * d);
  if (check_finite)
    for (float f : out) KVRET_REQUIRE(std::isfinite(f), KVRET_ERR_NONFINITE, q.name() + ": contains NaN or Inf");
  return out;
}

}  // namespace

Sequence::Sequence(Context& ctx) : ctx_(ctx) {
  const kvret_config& c = ctx.config();
  layers_.reserve(static_cast<size_t>(c.n_layers));
  for (int32_t l = 0; l < c.n_layers; ++l)
    layers_.push_back(std::make_unique<Layer>(c.n_kv_heads, c.head_dim, kv_dtype_to_dtype(c.kv_dtype),
                                              ctx.backend().pages(), ctx.kind().make(c, l)));
}

Sequence::~Sequence() {
  drain();
  ctx_.release_host_bytes(stats_.host_bytes.load());
}

void Sequence::drain() noexcept {
  for (auto& l : layers_) {
    std::unique_lock<std::mutex> lock(l->mu);
    l->cv.wait(lock, [&] { return !l->build_pending; });
  }
}

void Sequence::check_layer(int32_t layer) const {
  require(layer >= 0 && layer < ctx_.config().n_layers, KVRET_ERR_OUT_OF_RANGE,
          layer_name(layer) + " is out of range: the model has " + std::to_string(ctx_.config().n_layers) + " layers");
}

Sequence::Layer& Sequence::layer_at(int32_t layer) const {
  check_layer(layer);
  return *layers_[static_cast<size_t>(layer)];
}

void Sequence::wait_layer(int32_t layer, Layer& l) {
  std::unique_lock<std::mutex> lock(l.mu);
  l.cv.wait(lock, [&] { return !l.build_pending; });
  if (l.build_status != KVRET_OK) {
    const kvret_status status = l.build_status;
    const std::string message = l.build_message;
    l.build_status = KVRET_OK;
    l.build_message.clear();
    throw Error(status, "the background index build of " + layer_name(layer) + " failed: " + message +
                            " (the next select of this layer rebuilds it)");
  }
}

int64_t Sequence::length(int32_t layer) const { return layer_at(layer).store.size(); }

TokenGroups Sequence::groups(int32_t layer) const { return groups_at(length(layer)); }

TokenGroups Sequence::groups_at(int64_t length) const noexcept {
  const kvret_config& c = ctx_.config();
  TokenGroups g;
  g.length = length;
  g.mid_begin = std::min<int64_t>(c.n_sink, g.length);
  g.mid_end = std::max<int64_t>(g.mid_begin, g.length - c.n_local);
  return g;
}

void Sequence::index_range(int32_t layer, Layer& l, int64_t end, bool may_retrain) {
  if (end <= l.indexed_end) return;
  const auto start = std::chrono::steady_clock::now();
  const int64_t begin = std::max<int64_t>(l.indexed_end, groups(layer).mid_begin);
  l.index->extend(l.store, begin, end, may_retrain, ctx_.threads());
  l.indexed_end = end;
  const int64_t bytes = l.index->bytes();
  stats_.index_bytes += bytes - l.index_bytes;
  l.index_bytes = bytes;
  if (may_retrain) {  // a layer build (prefill), not a decode token's code
    stats_.index_builds += 1;
    stats_.index_build_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
}

void Sequence::append(int32_t layer, const kvret_tensor* k, const kvret_tensor* v, bool prefill) {
  const kvret_config& c = ctx_.config();
  Layer& l = layer_at(layer);
  const char* kname = prefill ? "k" : "k (decode)";
  const char* vname = prefill ? "v" : "v (decode)";
  const TensorView kv = TensorView::from(k, kname, kFloatTypes,
                                         prefill ? std::initializer_list<int>{3} : std::initializer_list<int>{2, 3});
  const TensorView vv = TensorView::from(v, vname, kFloatTypes,
                                         prefill ? std::initializer_list<int>{3} : std::initializer_list<int>{2, 3});
  require(kv.ndim() == vv.ndim(), KVRET_ERR_SHAPE, "k and v must have the same number of dimensions");
  const bool tokens_dim = kv.ndim() == 3;
  const int off = tokens_dim ? 1 : 0;
  const int64_t tokens = tokens_dim ? kv.dim(0) : 1;
  if (tokens_dim) {
    vv.expect_dim(0, tokens, "tokens, as in k");
    if (!prefill) kv.expect_dim(0, 1, "tokens of one decode step");
  }
  kv.expect_dim(off, c.n_kv_heads, "n_kv_heads");
  vv.expect_dim(off, c.n_kv_heads, "n_kv_heads");
  kv.expect_dim(off + 1, c.head_dim, "head_dim");
  vv.expect_dim(off + 1, c.head_dim, "head_dim");
  if (tokens == 0) return;
  if (c.check_finite) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const std::byte* kr = tokens_dim ? kv.at({t, h}) : kv.at({h});
        const std::byte* vr = tokens_dim ? vv.at({t, h}) : vv.at({h});
        KVRET_REQUIRE(!has_nonfinite(kr, kv.dtype(), static_cast<size_t>(c.head_dim)) &&
                          !has_nonfinite(vr, vv.dtype(), static_cast<size_t>(c.head_dim)),
                      KVRET_ERR_NONFINITE,
                      std::string(prefill ? "prefill" : "decode") + " k/v of " + layer_name(layer) +
                          " contain NaN or Inf (token " + std::to_string(t) + ", head " + std::to_string(h) + ")");
      }
  }
  wait_layer(layer, l);  // the store must not grow under a running build
  const int64_t length = l.store.size();
  require(length > 0 || prefill, KVRET_ERR_STATE,
          "append_decode on " + layer_name(layer) + " before any prefill of it (call kvret_append_prefill first)");
  require(c.max_seq_tokens == 0 || length + tokens <= c.max_seq_tokens, KVRET_ERR_CAPACITY,
          layer_name(layer) + " holds " + std::to_string(length) + " tokens; appending " + std::to_string(tokens) +
              " exceeds config.max_seq_tokens = " + std::to_string(c.max_seq_tokens));

  require(tokens <= kMaxLayerTokens - length, KVRET_ERR_CAPACITY,
          layer_name(layer) + " holds " + std::to_string(length) + " tokens; appending " + std::to_string(tokens) +
              " exceeds the 2^31 - 1 tokens a layer can hold (positions are int32)");
  const int64_t grow = l.store.bytes_to_grow(tokens);
  require(grow < INT64_MAX, KVRET_ERR_OUT_OF_MEMORY,
          "appending " + std::to_string(tokens) + " tokens needs more than 2^63 bytes of host memory");
  ctx_.reserve_host_bytes(grow);
  try {
    l.store.append(kv, vv, tokens, tokens_dim);
  } catch (...) {
    ctx_.release_host_bytes(grow);
    throw;
  }
  stats_.host_bytes += grow;
  stats_.tokens_stored += tokens;
  // Until the call returns, a failure undoes the append (the pages stay for reuse), so the caller may retry it:
  // the entry of the token leaving the local window at decode, and a synchronous prefill build.
  try {
    const int64_t mid_end = groups(layer).mid_end;
    if (!prefill) {
      index_range(layer, l, mid_end, false);
      return;
    }
    if (mid_end <= l.indexed_end) return;
    if (!c.background_build) {
      index_range(layer, l, mid_end, true);
      return;
    }
    schedule_build(layer, l, mid_end);
  } catch (...) {
    l.store.truncate(length);
    stats_.tokens_stored -= tokens;
    throw;
  }
}

void Sequence::schedule_build(int32_t layer, Layer& l, int64_t mid_end) {
  {
    std::lock_guard<std::mutex> lock(l.mu);
    l.build_pending = true;
  }
  try {
    submit_build(layer, l, mid_end);
  } catch (...) {  // the job was not queued: nothing will clear the flag
    std::lock_guard<std::mutex> lock(l.mu);
    l.build_pending = false;
    l.cv.notify_all();
    throw;
  }
}

void Sequence::submit_build(int32_t layer, Layer& l, int64_t mid_end) {
  ctx_.builds().submit([this, layer, &l, mid_end] {
    kvret_status status = KVRET_OK;
    std::string message;
    try {
      index_range(layer, l, mid_end, true);
    } catch (...) {
      status = current_exception_status(message);
    }
    std::lock_guard<std::mutex> lock(l.mu);
    l.build_status = status;
    l.build_message = message;
    l.build_pending = false;
    l.cv.notify_all();
  });
}

void Sequence::append_prefill(int32_t layer, const kvret_tensor* k, const kvret_tensor* v) {
  append(layer, k, v, true);
}

void Sequence::append_decode(int32_t layer, const kvret_tensor* k, const kvret_tensor* v) {
  append(layer, k, v, false);
}

void Sequence::wait_index(int32_t layer) {
  if (layer == -1) {
    for (int32_t l = 0; l < ctx_.config().n_layers; ++l) wait_layer(l, *layers_[static_cast<size_t>(l)]);
    return;
  }
  wait_layer(layer, layer_at(layer));
}

void Sequence::truncate(int64_t length) {
  require(length >= 0, KVRET_ERR_INVALID_ARGUMENT, "length must be >= 0, got " + std::to_string(length));
  drain();  // no build runs while the layers change (a failed one keeps its status for the next wait)
  // Everything that may throw first: the indexes that cannot be cut are rebuilt aside from the tokens that stay.
  struct Plan {
    Layer* layer;
    TokenGroups after;
    int64_t indexed_end;
    std::unique_ptr<Retriever> rebuilt;
  };
  std::vector<Plan> plans;
  const auto start = std::chrono::steady_clock::now();
  int64_t rebuilds = 0;
  for (int32_t i = 0; i < ctx_.config().n_layers; ++i) {
    Layer& l = *layers_[static_cast<size_t>(i)];
    if (l.store.size() <= length) continue;
    Plan p{&l, groups_at(length), 0, nullptr};
    p.indexed_end = std::min(l.indexed_end, p.after.mid_end);
    if (!l.index->can_cut(p.indexed_end)) {
      p.rebuilt = ctx_.kind().make(ctx_.config(), i);
      p.rebuilt->extend(l.store, p.after.mid_begin, p.after.mid_end, true, ctx_.threads());
      p.indexed_end = p.after.mid_end;
      ++rebuilds;
    }
    plans.push_back(std::move(p));
  }
  if (rebuilds > 0) {
    stats_.index_builds += rebuilds;
    stats_.index_build_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
  // commit (no throw below)
  for (Plan& p : plans) {
    Layer& l = *p.layer;
    if (p.rebuilt) {
      l.index.swap(p.rebuilt);
    } else {
      l.index->cut(l.store, p.indexed_end);
    }
    l.indexed_end = p.indexed_end;
    const int64_t index_bytes = l.index->bytes();
    stats_.index_bytes += index_bytes - l.index_bytes;
    l.index_bytes = index_bytes;
    stats_.tokens_stored -= l.store.size() - length;
    l.store.truncate(length);
    const int64_t freed = l.store.release_unused_pages();
    stats_.host_bytes -= freed;
    ctx_.release_host_bytes(freed);
  }
}

std::unique_ptr<Sequence> Sequence::fork() {
  drain();  // no build changes a layer while it is copied (a failed one keeps its status here)
  auto child = std::make_unique<Sequence>(ctx_, ForkTag{});
  child->layers_.reserve(layers_.size());
  int64_t host_bytes = 0;
  for (const auto& l : layers_) {
    child->layers_.push_back(std::make_unique<Layer>(l->store.fork(), l->index->clone()));
    Layer& c = *child->layers_.back();
    c.indexed_end = l->indexed_end;
    c.index_bytes = l->index_bytes;
    host_bytes += l->store.bytes();
  }
  // A page the two share counts in each (so the host limit holds whichever of them writes to it first).
  ctx_.reserve_host_bytes(host_bytes);
  // no throw below
  child->stats_.host_bytes = host_bytes;
  child->stats_.tokens_stored = stats_.tokens_stored.load();
  child->stats_.index_bytes = stats_.index_bytes.load();
  return child;
}

int64_t Sequence::resolve_budget(int32_t layer, int32_t budget) const {
  const kvret_config& c = ctx_.config();
  const TokenGroups g = groups(layer);
  if (budget == KVRET_BUDGET_DEFAULT) {
    const int64_t wanted =
        c.budget > 0
            ? c.budget
            : static_cast<int64_t>(std::llround(static_cast<double>(c.budget_ratio) * static_cast<double>(g.length)));
    return std::clamp<int64_t>(wanted, g.middle() > 0 ? 1 : 0, g.middle());
  }
  require(budget > 0, KVRET_ERR_BUDGET, "budget must be >= 1 (or KVRET_BUDGET_DEFAULT), got " + std::to_string(budget));
  require(budget <= g.length, KVRET_ERR_BUDGET,
          "budget " + std::to_string(budget) + " is above the context length of " + layer_name(layer) + " (" +
              std::to_string(g.length) + " tokens)");
  return std::min<int64_t>(budget, g.middle());
}

int64_t Sequence::check_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out) const {
  const kvret_config& c = ctx_.config();
  check_layer(layer);
  q.expect_dim(0, c.n_q_heads, "n_q_heads");
  q.expect_dim(1, c.head_dim, "head_dim");
  out.expect_dim(0, c.n_kv_heads, "n_kv_heads");
  require(length(layer) > 0, KVRET_ERR_STATE, "select on " + layer_name(layer) + ", which holds no tokens");
  int64_t count = resolve_budget(layer, budget);
  if (!ctx_.kind().selects()) count = 0;
  out.expect_dim_at_least(1, count, "selected positions per head");
  return count;
}

void Sequence::prepare_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                              PreparedSelect& p) {
  const kvret_config& c = ctx_.config();
  const int64_t count = check_select(layer, q, budget, out);
  p.q = load_query(q, c.check_finite != 0);
  Layer& l = *layers_[static_cast<size_t>(layer)];
  wait_layer(layer, l);
  const TokenGroups g = groups(layer);
  index_range(layer, l, g.mid_end, true);  // no-op unless a failed build left a gap
  p.rows.resize(static_cast<size_t>(c.n_kv_heads));
  for (int h = 0; h < c.n_kv_heads; ++h) p.rows[static_cast<size_t>(h)] = reinterpret_cast<int32_t*>(out.at({h}));
  stats_.selections += 1;
  SelectJob& job = p.job;
  job = SelectJob{};
  if (count == 0) return;
  job.retriever = l.index.get();
  job.store = &l.store;
  job.out_rows = p.rows.data();
  SelectRequest& r = job.request;
  r.q = p.q.data();
  r.n_q_heads = c.n_q_heads;
  r.group = c.n_q_heads / c.n_kv_heads;
  r.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  r.mid_begin = g.mid_begin;
  r.mid_end = g.mid_end;
  r.budget = count;
  r.fold = static_cast<kvret_gqa_fold>(c.gqa_fold);
  r.n_threads = ctx_.threads();
}

int64_t Sequence::select_checked(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out) {
  PreparedSelect p;
  prepare_select(layer, q, budget, out, p);
  if (p.job.retriever != nullptr) ctx_.kind().select_batch(&p.job, 1);
  return p.job.count;
}

int64_t Sequence::select(int32_t layer, const kvret_tensor* q, int32_t budget, const kvret_tensor* out) {
  const TensorView qv = TensorView::from(q, "q", kFloatTypes, {2});
  const TensorView ov = TensorView::from(out, "out_positions", {DType::I32}, {2});
  return select_checked(layer, qv, budget, ov);
}

int64_t Sequence::working_set_capacity(int32_t layer, int32_t budget) const {
  const TokenGroups g = groups(layer);
  int64_t count = budget == 0 ? 0 : resolve_budget(layer, budget);  // 0: what kvret_seq_budget may answer
  if (!ctx_.kind().selects()) count = 0;
  return g.mid_begin + count + (g.length - g.mid_end);
}

int64_t Sequence::fetch(int32_t layer, const kvret_tensor* positions, int32_t count, const kvret_working_set* out) {
  const kvret_config& c = ctx_.config();
  Layer& l = layer_at(layer);
  require(out != nullptr, KVRET_ERR_INVALID_ARGUMENT, "working set (out) is NULL");
  require(count >= 0, KVRET_ERR_INVALID_ARGUMENT, "count must be >= 0, got " + std::to_string(count));
  const TokenGroups g = groups(layer);
  require(count <= g.middle(), KVRET_ERR_BUDGET,
          "count " + std::to_string(count) + " exceeds the " + std::to_string(g.middle()) + " middle tokens of " +
              layer_name(layer));
  const DType store_type = l.store.dtype();
  const DTypeSet out_types{store_type, DType::F32};
  WorkingSetViews ws{TensorView::from(&out->k, "out.k", out_types, {3}),
                     TensorView::from(&out->v, "out.v", out_types, {3}),
                     TensorView::from(&out->positions, "out.positions", {DType::I32}, {2})};
  const int64_t rows = g.mid_begin + count + (g.length - g.mid_end);
  for (const TensorView* t : {&ws.k, &ws.v}) {
    t->expect_dim(0, c.n_kv_heads, "n_kv_heads");
    t->expect_dim_at_least(1, rows, "working-set rows");
    t->expect_dim(2, c.head_dim, "head_dim");
  }
  ws.positions.expect_dim(0, c.n_kv_heads, "n_kv_heads");
  ws.positions.expect_dim_at_least(1, rows, "working-set rows");

  std::vector<std::vector<int32_t>> selected(static_cast<size_t>(c.n_kv_heads));
  std::vector<const int32_t*> rows_ptr(static_cast<size_t>(c.n_kv_heads));
  if (count > 0) {
    const TensorView pv = TensorView::from(positions, "positions", {DType::I32}, {2});
    pv.expect_dim(0, c.n_kv_heads, "n_kv_heads");
    pv.expect_dim_at_least(1, count, "selected positions per head");
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const auto* p = reinterpret_cast<const int32_t*>(pv.at({h}));
      auto& s = selected[static_cast<size_t>(h)];
      s.assign(p, p + count);
      std::sort(s.begin(), s.end());
      for (int64_t i = 0; i < count; ++i) {
        KVRET_REQUIRE(s[static_cast<size_t>(i)] >= g.mid_begin && s[static_cast<size_t>(i)] < g.mid_end,
                      KVRET_ERR_OUT_OF_RANGE,
                      "positions: " + std::to_string(s[static_cast<size_t>(i)]) + " (head " + std::to_string(h) +
                          ") is not a middle position of " + layer_name(layer) + " [" + std::to_string(g.mid_begin) +
                          ", " + std::to_string(g.mid_end) + ")");
        KVRET_REQUIRE(
            i == 0 || s[static_cast<size_t>(i)] != s[static_cast<size_t>(i - 1)], KVRET_ERR_INVALID_ARGUMENT,
            "positions: " + std::to_string(s[static_cast<size_t>(i)]) + " appears twice for head " + std::to_string(h));
      }
      rows_ptr[static_cast<size_t>(h)] = s.data();
    }
  }
  const auto sources = ctx_.row_sources();
  int64_t from_sources = 0;
  ctx_.backend().gather(l.store, g.mid_begin, g.mid_end, rows_ptr.data(), count, ws, ctx_.threads(),
                        sources ? *sources : std::vector<std::shared_ptr<const RowSource>>{}, this, layer,
                        &from_sources);
  stats_.fetches += 1;
  stats_.fetched_rows += rows * c.n_kv_heads;
  stats_.cache_hits += from_sources;  // rows a source before the host store served
  stats_.cache_misses += rows * c.n_kv_heads - from_sources;
  return rows;
}

namespace {

/// A CPU tensor descriptor over `data` with `shape` (row-major); `shape` must outlive it.
template <class T>
kvret_tensor host_tensor(T* data, const std::vector<int64_t>& shape) {
  kvret_tensor t{};
  t.data = data;
  t.device = {KVRET_DEVICE_CPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = std::is_same_v<T, float> ? kvret_dtype{KVRET_DTYPE_FLOAT, 32, 1} : kvret_dtype{KVRET_DTYPE_INT, 32, 1};
  t.shape = const_cast<int64_t*>(shape.data());
  return t;
}

}  // namespace

void Sequence::attend(int32_t layer, const kvret_tensor* q, int32_t budget, float scale, const kvret_tensor* out) {
  const kvret_config& c = ctx_.config();
  const TensorView qv = TensorView::from(q, "q", kFloatTypes, {2});
  const TensorView ov = TensorView::from(out, "out", {DType::F32}, {2});
  ov.expect_dim(0, c.n_q_heads, "n_q_heads");
  ov.expect_dim(1, c.head_dim, "head_dim");
  require(std::isfinite(scale), KVRET_ERR_INVALID_ARGUMENT, "scale is not finite");
  // select into a buffer of our own
  check_layer(layer);
  require(length(layer) > 0, KVRET_ERR_STATE, "attend on " + layer_name(layer) + ", which holds no tokens");
  const int64_t width = std::max<int64_t>(resolve_budget(layer, budget), 1);
  // buffers of this sequence kept between calls (calls on one sequence do not overlap): a decode step allocates
  // nothing once they have grown
  AttendScratch& a = attend_scratch_;
  a.selected.resize(std::max(a.selected.size(), static_cast<size_t>(c.n_kv_heads * width)));
  const std::vector<int64_t> selected_shape{c.n_kv_heads, width};
  const kvret_tensor st = host_tensor(a.selected.data(), selected_shape);
  const int64_t count = select_checked(layer, qv, budget, TensorView::from(&st, "positions", {DType::I32}, {2}));
  // fetch into f32 buffers of our own, then attend over them
  const int64_t capacity = working_set_capacity(layer, static_cast<int32_t>(count));
  const size_t rows_f = static_cast<size_t>(c.n_kv_heads * capacity * c.head_dim);
  a.k.resize(std::max(a.k.size(), rows_f));
  a.v.resize(std::max(a.v.size(), rows_f));
  a.positions.resize(std::max(a.positions.size(), static_cast<size_t>(c.n_kv_heads * capacity)));
  const std::vector<int64_t> kv_shape{c.n_kv_heads, capacity, c.head_dim}, pos_shape{c.n_kv_heads, capacity};
  const kvret_working_set ws{host_tensor(a.k.data(), kv_shape), host_tensor(a.v.data(), kv_shape),
                             host_tensor(a.positions.data(), pos_shape)};
  const int64_t rows = fetch(layer, &st, static_cast<int32_t>(count), &ws);
  ctx_.backend().attend(c, qv, TensorView::from(&ws.k, "k", {DType::F32}, {3}),
                        TensorView::from(&ws.v, "v", {DType::F32}, {3}), rows, scale, ov, ctx_.threads());
}

void Sequence::read(int32_t layer, int64_t begin, int64_t end, const kvret_tensor* k, const kvret_tensor* v) const {
  const kvret_config& c = ctx_.config();
  const Layer& l = layer_at(layer);
  require(begin >= 0 && begin <= end && end <= l.store.size(), KVRET_ERR_OUT_OF_RANGE,
          "range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is outside the " +
              std::to_string(l.store.size()) + " tokens of " + layer_name(layer));
  const DTypeSet types{l.store.dtype(), DType::F32};
  const TensorView kv = TensorView::from(k, "k", types, {3});
  const TensorView vv = TensorView::from(v, "v", types, {3});
  for (const TensorView* t : {&kv, &vv}) {
    t->expect_dim(0, end - begin, "tokens");
    t->expect_dim(1, c.n_kv_heads, "n_kv_heads");
    t->expect_dim(2, c.head_dim, "head_dim");
  }
  for (int64_t p = begin; p < end; ++p)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      convert_row(l.store.key_row(h, p), l.store.dtype(), kv.at({p - begin, h}), kv.dtype(),
                  static_cast<size_t>(c.head_dim));
      convert_row(l.store.value_row(h, p), l.store.dtype(), vv.at({p - begin, h}), vv.dtype(),
                  static_cast<size_t>(c.head_dim));
    }
}

const Retriever& Sequence::index(int32_t layer) {
  Layer& l = layer_at(layer);
  wait_layer(layer, l);
  return *l.index;
}

}  // namespace kvret
