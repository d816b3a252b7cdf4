#include "engine/sequence.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "core/attention.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/vec_math.hpp"
#include "engine/context.hpp"
#include "fetch/working_set.hpp"
#include "index/cluster_retriever.hpp"
#include "index/quant_retriever.hpp"
#include "math/kvcrush_math.h"
#include "select/kvcrush.hpp"

namespace kvret {

namespace {

/// Most tokens one layer holds: positions are int32 everywhere (selections, working-set rows).
constexpr int64_t kMaxLayerTokens = INT32_MAX;

}  // namespace

std::vector<float> load_query(const TensorView& q, bool check_finite) {
  const int64_t heads = q.dim(0);
  const int64_t d = q.dim(1);
  std::vector<float> out(static_cast<size_t>(heads * d));
  for (int64_t h = 0; h < heads; ++h) q.load_f32(q.at({h}), static_cast<size_t>(d), out.data() + h * d);
  if (check_finite)
    for (float f : out) KVRET_REQUIRE(std::isfinite(f), KVRET_ERR_NONFINITE, q.name() + ": contains NaN or Inf");
  return out;
}

Sequence::Sequence(Context& ctx) : ctx_(ctx) {
  const kvret_config& c = ctx.config();
  layers_.reserve(static_cast<size_t>(c.n_layers));
  const std::shared_ptr<const rope::Rope> rope = rope_of(c);
  for (int32_t l = 0; l < c.n_layers; ++l)
    layers_.push_back(std::make_unique<LayerState>(
        l, HostKvStore(c.n_kv_heads, c.head_dim, kv_dtype_to_dtype(c.kv_dtype), ctx.backend().pages(), rope),
        ctx.kind().make(c, l)));
  if (c.hamming_fraction > 0.0f) crush_.resize(static_cast<size_t>(c.n_layers));
  importance_.resize(static_cast<size_t>(c.n_layers));
  for (ImportanceInputs& in : importance_) in.sums = AttentionAccumulator(c.n_q_heads);
}

Sequence::Sequence(Context& ctx, ForkTag) : ctx_(ctx) {
  const kvret_config& c = ctx.config();
  importance_.resize(static_cast<size_t>(c.n_layers));
  for (ImportanceInputs& in : importance_) in.sums = AttentionAccumulator(c.n_q_heads);
}

Sequence::~Sequence() {
  if (load_) load_->stop();
  drain();
  ctx_.backend().release_caches(this);
  ctx_.release_host_bytes(stats_.host_bytes.load());
}

void Sequence::drain() noexcept {
  // While a load runs, only the layers it made ready are read here (the loader writes the others; they start no
  // build). Null: a layer a stopped load never filled.
  const size_t ready = load_ ? static_cast<size_t>(load_->ready()) : layers_.size();
  for (size_t i = 0; i < ready && i < layers_.size(); ++i)
    if (layers_[i]) layers_[i]->drain();
}

void Sequence::wait_loaded() const {
  if (load_) load_->wait_all();
}

void Sequence::check_layer(int32_t layer) const {
  require(layer >= 0 && layer < ctx_.config().n_layers, KVRET_ERR_OUT_OF_RANGE,
          layer_name(layer) + " is out of range: the model has " + std::to_string(ctx_.config().n_layers) + " layers");
  if (load_) load_->wait(layer);  // a layer of a session still loading: in once this returns
}

LayerState& Sequence::layer_at(int32_t layer) const {
  check_layer(layer);
  return *layers_[static_cast<size_t>(layer)];
}

int64_t Sequence::length(int32_t layer) const { return layer_at(layer).store().size(); }

TokenGroups Sequence::groups(int32_t layer) const { return groups_at(length(layer)); }

TokenGroups Sequence::groups_at(int64_t length) const noexcept {
  const kvret_config& c = ctx_.config();
  TokenGroups g;
  g.length = length;
  g.mid_begin = std::min<int64_t>(c.n_sink, g.length);
  g.mid_end = std::max<int64_t>(g.mid_begin, g.length - c.n_local);
  return g;
}

Sequence::AppendRows Sequence::check_append(int32_t layer, const kvret_tensor* k, const kvret_tensor* v,
                                            bool prefill) const {
  const kvret_config& c = ctx_.config();
  check_layer(layer);
  const char* kname = prefill ? "k" : "k (decode)";
  const char* vname = prefill ? "v" : "v (decode)";
  // (an initializer_list's array lives until the end of its full-expression: one per call)
  AppendRows a{
      ctx_.view(k, kname, kFloatTypes, prefill ? std::initializer_list<int>{3} : std::initializer_list<int>{2, 3}),
      ctx_.view(v, vname, kFloatTypes, prefill ? std::initializer_list<int>{3} : std::initializer_list<int>{2, 3}), 1,
      false};
  require(a.k.ndim() == a.v.ndim(), KVRET_ERR_SHAPE, "k and v must have the same number of dimensions");
  a.tokens_dim = a.k.ndim() == 3;
  const int off = a.tokens_dim ? 1 : 0;
  if (a.tokens_dim) {
    a.tokens = a.k.dim(0);
    a.v.expect_dim(0, a.tokens, "tokens, as in k");
    if (!prefill) a.k.expect_dim(0, 1, "tokens of one decode step");
  }
  for (const TensorView* t : {&a.k, &a.v}) {
    t->expect_dim(off, c.n_kv_heads, "n_kv_heads");
    t->expect_dim(off + 1, c.head_dim, "head_dim");
  }
  a.k = ctx_.backend().host_readable(a.k, a.k_copy);
  a.v = ctx_.backend().host_readable(a.v, a.v_copy);
  if (!c.check_finite) return a;
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const std::byte* kr = a.tokens_dim ? a.k.at({t, h}) : a.k.at({h});
      const std::byte* vr = a.tokens_dim ? a.v.at({t, h}) : a.v.at({h});
      KVRET_REQUIRE(!has_nonfinite(kr, a.k.dtype(), static_cast<size_t>(c.head_dim)) &&
                        !has_nonfinite(vr, a.v.dtype(), static_cast<size_t>(c.head_dim)),
                    KVRET_ERR_NONFINITE,
                    std::string(prefill ? "prefill" : "decode") + " k/v of " + layer_name(layer) +
                        " contain NaN or Inf (token " + std::to_string(t) + ", head " + std::to_string(h) + ")");
    }
  return a;
}

void Sequence::check_capacity(int32_t layer, int64_t length, int64_t tokens, bool prefill) const {
  const kvret_config& c = ctx_.config();
  require(length > 0 || prefill, KVRET_ERR_STATE,
          "append_decode on " + layer_name(layer) + " before any prefill of it (call kvret_append_prefill first)");
  require(c.max_seq_tokens == 0 || length + tokens <= c.max_seq_tokens, KVRET_ERR_CAPACITY,
          layer_name(layer) + " holds " + std::to_string(length) + " tokens; appending " + std::to_string(tokens) +
              " exceeds config.max_seq_tokens = " + std::to_string(c.max_seq_tokens));
  require(tokens <= kMaxLayerTokens - length, KVRET_ERR_CAPACITY,
          layer_name(layer) + " holds " + std::to_string(length) + " tokens; appending " + std::to_string(tokens) +
              " exceeds the 2^31 - 1 tokens a layer can hold (positions are int32)");
}

void Sequence::append(int32_t layer, const kvret_tensor* k, const kvret_tensor* v, bool prefill) {
  const AppendRows rows = check_append(layer, k, v, prefill);
  if (rows.tokens == 0) return;
  LayerState& l = *layers_[static_cast<size_t>(layer)];
  l.wait();  // the store must not grow under a running build
  HostKvStore& store = l.store();
  const int64_t length = store.size();
  check_capacity(layer, length, rows.tokens, prefill);
  const int64_t grow = store.bytes_to_grow(rows.tokens);
  require(grow < INT64_MAX, KVRET_ERR_OUT_OF_MEMORY,
          "appending " + std::to_string(rows.tokens) + " tokens needs more than 2^63 bytes of host memory");
  ctx_.reserve_host_bytes(grow);
  try {
    store.append(rows.k, rows.v, rows.tokens, rows.tokens_dim);
  } catch (...) {
    ctx_.release_host_bytes(grow);
    throw;
  }
  stats_.host_bytes += grow;
  stats_.tokens_stored += rows.tokens;
  // Until the call returns, a failure undoes the append (the pages stay for reuse), so the caller may retry it.
  try {
    index_appended(layer, l, prefill);
  } catch (...) {
    store.truncate(length);
    stats_.tokens_stored -= rows.tokens;
    throw;
  }
}

void Sequence::index_appended(int32_t layer, LayerState& l, bool prefill) {
  const TokenGroups g = groups(layer);
  if (!prefill || !ctx_.config().background_build) {
    l.index_to(g.mid_begin, g.mid_end, prefill, ctx_.threads(), stats_);
  } else if (g.mid_end > l.indexed_end()) {
    l.schedule_build(ctx_.builds(), g.mid_begin, g.mid_end, ctx_.threads(), stats_);
  }
}

void Sequence::append_prefill(int32_t layer, const kvret_tensor* k, const kvret_tensor* v) {
  append(layer, k, v, true);
}

void Sequence::append_decode(int32_t layer, const kvret_tensor* k, const kvret_tensor* v) {
  append(layer, k, v, false);
}

void Sequence::wait_index(int32_t layer) {
  if (layer == -1) {
    wait_loaded();
    for (auto& l : layers_) l->wait();
    return;
  }
  layer_at(layer).wait();
}

void Sequence::drop_front(int64_t keep, int64_t count) {
  require(keep >= 0, KVRET_ERR_INVALID_ARGUMENT,
          "kvret_seq_drop_front: keep must be >= 0, got " + std::to_string(keep));
  require(count >= 0, KVRET_ERR_INVALID_ARGUMENT,
          "kvret_seq_drop_front: count must be >= 0, got " + std::to_string(count));
  if (count == 0) return;
  wait_loaded();
  drain();  // no build runs while the layers change (a failed one of an unchanged layer keeps its status)
  // Everything that may throw first: every shortened layer built aside (its store without the tokens, the keys
  // after them rotated at their new positions, and a new index over its middle), as a prefill of them would be.
  const kvret_config& c = ctx_.config();
  struct Plan {
    size_t layer;
    std::unique_ptr<LayerState> next;
  };
  std::vector<Plan> plans;
  StatCounters built;  // the new indexes' bytes, builds and build time
  for (int32_t i = 0; i < c.n_layers; ++i) {
    const LayerState& l = *layers_[static_cast<size_t>(i)];
    if (l.store().size() <= keep) continue;  // nothing after `keep`: unchanged
    auto next = std::make_unique<LayerState>(i, l.store().without(keep, count), ctx_.kind().make(c, i));
    const TokenGroups g = groups_at(next->store().size());
    next->index_to(g.mid_begin, g.mid_end, true, ctx_.threads(), built);
    plans.push_back({static_cast<size_t>(i), std::move(next)});
  }
  // commit (no throw below)
  int64_t freed = 0;
  for (Plan& p : plans) {
    std::unique_ptr<LayerState>& layer = layers_[p.layer];
    stats_.tokens_stored -= layer->store().size() - p.next->store().size();
    stats_.index_bytes -= layer->index_bytes();
    freed += layer->store().bytes() - p.next->store().bytes();
    layer.swap(p.next);  // the old state goes with the plan
    // state about positions that moved: recomputed (KVCrush's signatures, at the next select) or dropped
    if (!crush_.empty()) crush_[p.layer] = KvCrushLayer{};
    ImportanceInputs& in = importance_[p.layer];
    in.window = {};  // the queries' positions moved: the keys' rule again
    in.w = 0;
    in.observed_at = 0;
    in.sums.erase(keep, count);  // the other tokens keep their sums
    if (p.layer < reuse_.size()) {
      reuse_[p.layer].clear();
      stats_.cluster_reuse_bytes += reuse_[p.layer].bytes_change();
    }
    if (p.layer < prefetched_.size()) prefetched_[p.layer].clear();
  }
  if (!plans.empty()) ctx_.backend().drop_cached(this, -1, keep);  // blocks past `keep` moved
  stats_.index_bytes += built.index_bytes.load();
  stats_.index_builds += built.index_builds.load();
  stats_.index_build_ns += built.index_build_ns.load();
  stats_.host_bytes -= freed;
  ctx_.release_host_bytes(freed);
}

void Sequence::truncate(int64_t length) {
  require(length >= 0, KVRET_ERR_INVALID_ARGUMENT, "length must be >= 0, got " + std::to_string(length));
  wait_loaded();
  drain();  // no build runs while the layers change (a failed one keeps its status for the next wait)
  // Everything that may throw first: the indexes that cannot be cut are rebuilt aside from the tokens that stay.
  struct Plan {
    LayerState* layer;
    int64_t indexed_end;
    std::unique_ptr<Retriever> rebuilt;
  };
  std::vector<Plan> plans;
  const auto start = std::chrono::steady_clock::now();
  int64_t rebuilds = 0;
  const TokenGroups after = groups_at(length);
  for (int32_t i = 0; i < ctx_.config().n_layers; ++i) {
    LayerState& l = *layers_[static_cast<size_t>(i)];
    if (l.store().size() <= length) continue;
    Plan p{&l, std::min(l.indexed_end(), after.mid_end), nullptr};
    if (!l.index().can_cut(p.indexed_end)) {
      p.rebuilt = ctx_.kind().make(ctx_.config(), i);
      p.rebuilt->extend(l.store(), after.mid_begin, after.mid_end, true, ctx_.threads());
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
    LayerState& l = *p.layer;
    if (p.rebuilt) {
      l.replace_index(std::move(p.rebuilt), stats_);
    } else {
      l.cut_index(p.indexed_end, stats_);
    }
    HostKvStore& store = l.store();
    stats_.tokens_stored -= store.size() - length;
    store.truncate(length);
    const int64_t freed = store.release_unused_pages();
    stats_.host_bytes -= freed;
    ctx_.release_host_bytes(freed);
  }
  for (KvCrushLayer& k : crush_) k.truncate(length);
  for (ImportanceInputs& in : importance_) {
    in.sums.truncate(length);
    if (length == 0) in.steps = 0;  // nothing left that a step attended
    if (length < in.observed_at) {  // the window's tokens are gone
      in.window = {};
      in.w = 0;
      in.observed_at = 0;
    }
  }
  if (!plans.empty()) ctx_.backend().drop_cached(this, -1, length);  // blocks past `length` change at the next append
  for (size_t i = 0; i < reuse_.size(); ++i)  // a shortened layer's resident rows may not be its tokens any more
    if (std::any_of(plans.begin(), plans.end(), [&](const Plan& p) { return p.layer == layers_[i].get(); })) {
      reuse_[i].clear();
      stats_.cluster_reuse_bytes += reuse_[i].bytes_change();
    }
}

std::unique_ptr<Sequence> Sequence::fork() {
  wait_loaded();
  drain();  // no build changes a layer while it is copied (a failed one keeps its status here)
  auto child = std::make_unique<Sequence>(ctx_, ForkTag{});
  child->layers_.reserve(layers_.size());
  child->crush_ = crush_;
  child->importance_ = importance_;
  int64_t host_bytes = 0;
  for (const auto& l : layers_) {
    child->layers_.push_back(l->fork());
    host_bytes += l->store().bytes();
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

int64_t Sequence::check_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                               const TensorView* scores) const {
  const kvret_config& c = ctx_.config();
  check_layer(layer);
  q.expect_dim(0, c.n_q_heads, "n_q_heads");
  q.expect_dim(1, c.head_dim, "head_dim");
  out.expect_dim(0, c.n_kv_heads, "n_kv_heads");
  require(length(layer) > 0, KVRET_ERR_STATE, "select on " + layer_name(layer) + ", which holds no tokens");
  int64_t count = resolve_budget(layer, budget);
  if (!ctx_.kind().selects()) count = 0;
  out.expect_dim_at_least(1, count, "selected positions per head");
  if (scores != nullptr) {
    scores->expect_dim(0, c.n_kv_heads, "n_kv_heads");
    scores->expect_dim_at_least(1, count, "scores per head");
  }
  return count;
}

void Sequence::prepare_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                              const TensorView* scores, PreparedSelect& p) {
  const kvret_config& c = ctx_.config();
  const int64_t count = check_select(layer, q, budget, out, scores);
  Backend& backend = ctx_.backend();
  {
    std::vector<std::byte> q_copy;
    p.q = load_query(backend.host_readable(q, q_copy), c.check_finite != 0);
  }
  p.out = out;
  p.out_host = backend.host_writable(out, p.out_copy);
  p.has_scores = scores != nullptr;
  if (p.has_scores) {
    p.scores = *scores;
    p.scores_host = backend.host_writable(*scores, p.scores_copy);
  }
  LayerState& l = *layers_[static_cast<size_t>(layer)];
  l.wait();
  const TokenGroups g = groups(layer);
  l.index_to(g.mid_begin, g.mid_end, true, ctx_.threads(), stats_);  // no-op unless a failed build left a gap
  p.rows.resize(static_cast<size_t>(c.n_kv_heads));
  for (int h = 0; h < c.n_kv_heads; ++h)
    p.rows[static_cast<size_t>(h)] = reinterpret_cast<int32_t*>(p.out_host.at({h}));
  if (p.has_scores) {
    p.score_rows.resize(static_cast<size_t>(c.n_kv_heads));
    for (int h = 0; h < c.n_kv_heads; ++h)
      p.score_rows[static_cast<size_t>(h)] = reinterpret_cast<float*>(p.scores_host.at({h}));
  }
  stats_.selections += 1;
  SelectJob& job = p.job;
  job = SelectJob{};
  p.representatives = 0;
  p.layer = layer;
  if (count == 0) return;
  int64_t important = count;
  if (!crush_.empty()) {  // KVCrush: the retriever selects the important part, finish_select adds the rest
    const BudgetSplit split = split_budget(count, c.hamming_fraction, c.hamming_buckets);
    important = split.important;
    p.representatives = split.representatives;
    if (p.representatives > 0) refresh_crush(layer, crush_[static_cast<size_t>(layer)]);
  }
  job.retriever = &l.index();
  job.store = &l.store();
  job.out_rows = p.rows.data();
  job.out_scores = p.has_scores ? p.score_rows.data() : nullptr;
  SelectRequest& r = job.request;
  r.q = p.q.data();
  r.n_q_heads = c.n_q_heads;
  r.group = c.n_q_heads / c.n_kv_heads;
  r.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  r.mid_begin = g.mid_begin;
  r.mid_end = g.mid_end;
  r.budget = important;
  r.fold = static_cast<kvret_gqa_fold>(c.gqa_fold);
  r.n_threads = ctx_.threads();
}

bool Sequence::prepare_device_select(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                                     const TensorView* scores, DeviceSelectPlan& plan) {
  const kvret_config& c = ctx_.config();
  check_layer(layer);
  LayerState& l = *layers_[static_cast<size_t>(layer)];
  // asked first (the kinds of the tensors only), so that a select the host runs is checked once, by prepare_select
  if (!ctx_.backend().selects_on_device(l.index(), q, out, scores)) return false;
  const int64_t n = check_select(layer, q, budget, out, scores);
  if (n == 0) return false;
  l.wait();
  const TokenGroups g = groups(layer);
  l.index_to(g.mid_begin, g.mid_end, true, ctx_.threads(), stats_);  // no-op unless a failed build left a gap
  DeviceSelectJob& job = plan.job;
  job = DeviceSelectJob{};
  plan.crush = DeviceCrush{};  // KVCrush: the device adds the representatives to the important part
  int64_t important = n, selected = n;
  if (!crush_.empty()) {
    const BudgetSplit split = split_budget(n, c.hamming_fraction, c.hamming_buckets);
    if (split.representatives > 0 && c.hamming_granularity > 1) return false;  // the device adds single tokens only
    important = split.important;
    if (split.representatives > 0) {
      DeviceCrush& crush = plan.crush;
      crush.representatives = split.representatives;
      crush.prepare = [this, layer, mid_end = g.mid_end](DeviceCrush& d) {  // after the backend's checks of q
        KvCrushLayer& k = crush_[static_cast<size_t>(layer)];
        refresh_crush(layer, k);
        if (k.tokens() < mid_end) return false;  // the host's rule for signatures short of the middle
        d.bits = k.bits().data();
        d.tokens = k.tokens();
        d.heads = k.signature_heads();
        d.words = signature_words(k.signature_heads());
        d.epoch = k.epoch();
        return true;
      };
      job.crush = &crush;
      selected = cuda::math::kvcrush_selected_count(important, split.representatives, g.mid_end - g.mid_begin);
    }
  }
  plan.q = q;
  plan.out = out;
  if (scores != nullptr) plan.scores = *scores;
  job.retriever = &l.index();
  job.request.n_q_heads = c.n_q_heads;
  job.request.group = c.n_q_heads / c.n_kv_heads;
  job.request.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  job.request.mid_begin = g.mid_begin;
  job.request.mid_end = g.mid_end;
  job.request.budget = important;
  job.request.fold = static_cast<kvret_gqa_fold>(c.gqa_fold);
  job.request.n_threads = ctx_.threads();
  job.q = &plan.q;
  job.out = &plan.out;
  job.scores = scores != nullptr ? &plan.scores : nullptr;
  job.check_finite = c.check_finite != 0;
  job.sequence = this;
  job.layer = layer;
  job.store = &l.store();
  plan.selected = selected;
  return true;
}

void Sequence::finish_device_select(const DeviceSelectPlan&) {
  stats_.selections += 1;
  note_cache_use();  // the device's copy of the index counts in device_bytes
}

bool Sequence::select_on_device(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                                const TensorView* scores, int64_t* count, kvret_stream stream, bool in_stream_order) {
  DeviceSelectPlan plan;
  if (!prepare_device_select(layer, q, budget, out, scores, plan)) return false;
  Backend& backend = ctx_.backend();
  if (!backend.select_on_device(plan.job, stream)) return false;
  if (!in_stream_order) backend.synchronize(stream);  // the outputs are written when the call returns
  finish_device_select(plan);
  *count = plan.selected;
  return true;
}

int64_t Sequence::select_checked(int32_t layer, const TensorView& q, int32_t budget, const TensorView& out,
                                 const TensorView* scores) {
  if (int64_t n = 0; select_on_device(layer, q, budget, out, scores, &n)) return n;
  PreparedSelect p;
  prepare_select(layer, q, budget, out, scores, p);
  if (p.job.retriever != nullptr) ctx_.kind().select_batch(&p.job, 1, nullptr);
  finish_select(p);
  return p.job.count;
}

void Sequence::finish_select(PreparedSelect& p) {
  if (p.job.count == 0) return;  // nothing written
  if (p.representatives > 0) {
    const KvCrushLayer& crush = crush_[static_cast<size_t>(p.layer)];
    const SelectRequest& r = p.job.request;
    int64_t count = p.job.count;
    if (const int32_t g = ctx_.config().hamming_granularity; g > 1) {  // representatives as whole units of g
      const KvCrushLayer::UnitOrder units = crush.unit_order(r.mid_begin, r.mid_end, g);
      for (int h = 0; h < ctx_.config().n_kv_heads; ++h) {
        const auto i = static_cast<size_t>(h);
        count = crush.add_unit_representatives(units, p.rows[i], p.has_scores ? p.score_rows[i] : nullptr, p.job.count,
                                               p.representatives);  // the same for every head
      }
    } else {
      const KvCrushLayer::MiddleOrder order = crush.middle_order(r.mid_begin, r.mid_end, p.representatives);
      // the heads in turn: a few microseconds each, less than starting threads
      for (int h = 0; h < ctx_.config().n_kv_heads; ++h) {
        const auto i = static_cast<size_t>(h);
        count = crush.add_representatives(h, order, p.rows[i], p.has_scores ? p.score_rows[i] : nullptr, p.job.count,
                                          p.representatives);  // the same for every head
      }
    }
    p.job.count = count;
  }
  Backend& backend = ctx_.backend();
  backend.write_back(p.out_host, p.out);
  if (p.has_scores) backend.write_back(p.scores_host, p.scores);
}

int64_t Sequence::select(int32_t layer, const kvret_tensor* q, int32_t budget, const kvret_tensor* out,
                         const kvret_tensor* scores) {
  const TensorView qv = ctx_.view(q, "q", kFloatTypes, {2});
  const TensorView ov = ctx_.view(out, "out_positions", {DType::I32}, {2});
  if (scores == nullptr) return select_checked(layer, qv, budget, ov);
  const TensorView sv = ctx_.view(scores, "out_scores", {DType::F32}, {2});
  return select_checked(layer, qv, budget, ov, &sv);
}

int64_t Sequence::working_set_capacity(int32_t layer, int32_t budget) const {
  const TokenGroups g = groups(layer);
  int64_t count = budget == 0 ? 0 : resolve_budget(layer, budget);  // 0: what kvret_seq_budget may answer
  if (!ctx_.kind().selects()) count = 0;
  return g.mid_begin + count + (g.length - g.mid_end);
}

void Sequence::check_fetch(int32_t layer, int32_t count, const kvret_working_set* out, const FetchNames& names,
                           PreparedFetch& p) const {
  const kvret_config& c = ctx_.config();
  const HostKvStore& store = layer_at(layer).store();
  require(out != nullptr, KVRET_ERR_INVALID_ARGUMENT, "working set (out) is NULL");
  require(count >= 0, KVRET_ERR_INVALID_ARGUMENT, names.count + " must be >= 0, got " + std::to_string(count));
  const TokenGroups g = groups(layer);
  require(count <= g.middle(), KVRET_ERR_BUDGET,
          names.count + " " + std::to_string(count) + " exceeds the " + std::to_string(g.middle()) +
              " middle tokens of " + layer_name(layer));
  const DType store_type = store.dtype();
  const DTypeSet out_types{store_type, DType::F32};
  WorkingSetViews ws{ctx_.view(&out->k, names.k.c_str(), out_types, {3}),
                     ctx_.view(&out->v, names.v.c_str(), out_types, {3}),
                     ctx_.view(&out->positions, names.out_positions.c_str(), {DType::I32}, {2})};
  const int64_t rows = g.mid_begin + count + (g.length - g.mid_end);
  for (const TensorView* t : {&ws.k, &ws.v}) {
    t->expect_dim(0, c.n_kv_heads, "n_kv_heads");
    t->expect_dim_at_least(1, rows, "working-set rows");
    t->expect_dim(2, c.head_dim, "head_dim");
  }
  ws.positions.expect_dim(0, c.n_kv_heads, "n_kv_heads");
  ws.positions.expect_dim_at_least(1, rows, "working-set rows");
  p.layer = layer;
  p.count = count;
  p.g = g;
  p.rows = rows;
  p.ws = std::move(ws);
  p.selected.assign(static_cast<size_t>(c.n_kv_heads), {});
  p.rows_ptr.assign(static_cast<size_t>(c.n_kv_heads), nullptr);
}

void Sequence::check_fetch_positions(const TensorView& pv, const FetchNames& names, PreparedFetch& p) const {
  const kvret_config& c = ctx_.config();
  const TokenGroups& g = p.g;
  const int64_t count = p.count;
  pv.expect_dim(0, c.n_kv_heads, "n_kv_heads");
  pv.expect_dim_at_least(1, count, "selected positions per head");
  for (int h = 0; h < c.n_kv_heads; ++h) {
    const auto* row = reinterpret_cast<const int32_t*>(pv.at({h}));
    auto& s = p.selected[static_cast<size_t>(h)];
    s.assign(row, row + count);
    std::sort(s.begin(), s.end());
    for (int64_t i = 0; i < count; ++i) {
      KVRET_REQUIRE(s[static_cast<size_t>(i)] >= g.mid_begin && s[static_cast<size_t>(i)] < g.mid_end,
                    KVRET_ERR_OUT_OF_RANGE,
                    names.positions + ": " + std::to_string(s[static_cast<size_t>(i)]) + " (head " + std::to_string(h) +
                        ") is not a middle position of " + layer_name(p.layer) + " [" + std::to_string(g.mid_begin) +
                        ", " + std::to_string(g.mid_end) + ")");
      KVRET_REQUIRE(i == 0 || s[static_cast<size_t>(i)] != s[static_cast<size_t>(i - 1)], KVRET_ERR_INVALID_ARGUMENT,
                    names.positions + ": " + std::to_string(s[static_cast<size_t>(i)]) + " appears twice for head " +
                        std::to_string(h));
    }
    p.rows_ptr[static_cast<size_t>(h)] = s.data();
  }
}

void Sequence::begin_fetch(PreparedFetch& p) {
  const kvret_config& c = ctx_.config();
  const auto sources = ctx_.row_sources();
  // ClusterKV's reuse between steps: the layer's resident clusters serve first (docs/cluster.md)
  if (c.index_kind == KVRET_INDEX_CLUSTER) {
    LayerState& l = layer_at(p.layer);
    if (c.cluster_reuse_steps > 0 && p.count > 0) l.drain();  // the index must not change while it is read
    p.clusters = dynamic_cast<const ClusterRetriever*>(l.index().selects_as());
    if (p.clusters != nullptr && c.cluster_reuse_steps > 0 && p.count > 0) {
      if (reuse_.empty()) reuse_.resize(static_cast<size_t>(c.n_layers));
      p.reuse = &reuse_[static_cast<size_t>(p.layer)];
    }
  }
  try {
    if (p.reuse != nullptr) {
      p.reuse->sync(*p.clusters, c.n_kv_heads);
      p.chain.push_back(p.reuse->begin_fetch(p.g.mid_begin, p.count, c.cluster_reuse_steps));
    }
    if (sources) p.chain.insert(p.chain.end(), sources->begin(), sources->end());
  } catch (...) {
    abort_fetch(p);
    throw;
  }
  p.job = GatherJob{&layer_at(p.layer).store(),
                    p.g.mid_begin,
                    p.g.mid_end,
                    p.rows_ptr.data(),
                    p.count,
                    &p.ws,
                    &p.chain,
                    this,
                    p.layer,
                    0,
                    0};
}

void Sequence::abort_fetch(PreparedFetch& p) noexcept {
  if (p.reuse == nullptr) return;
  p.reuse->clear();  // a copy that may have been updated for some heads only: start again without one
  stats_.cluster_reuse_bytes += p.reuse->bytes_change();
}

void Sequence::finish_fetch(PreparedFetch& p) noexcept {
  const kvret_config& c = ctx_.config();
  const int64_t count = p.count;
  const int64_t rows = p.rows;
  const int64_t from_sources = p.job.served_by_sources;
  if (p.reuse != nullptr) {
    stats_.cluster_reuse_hits += p.reuse->last_hits();
    stats_.cluster_reuse_bytes += p.reuse->bytes_change();
  }
  if (p.clusters != nullptr) stats_.cluster_reuse_rows += count * c.n_kv_heads;
  if (!prefetched_.empty() && !prefetched_[static_cast<size_t>(p.layer)].empty()) {
    // the rows of this fetch that the layer's last prefetch had selected (both ascending)
    auto& guessed = prefetched_[static_cast<size_t>(p.layer)];
    int64_t hits = 0;
    for (int h = 0; h < c.n_kv_heads && count > 0; ++h) {
      const auto& guess = guessed[static_cast<size_t>(h)];
      const int32_t* s = p.rows_ptr[static_cast<size_t>(h)];
      for (size_t i = 0, j = 0; i < static_cast<size_t>(count) && j < guess.size();) {
        if (s[i] == guess[j]) {
          ++hits;
          ++i;
          ++j;
        } else if (s[i] < guess[j]) {
          ++i;
        } else {
          ++j;
        }
      }
    }
    stats_.prefetch_hits += hits;
    guessed.clear();
  }
  stats_.fetches += 1;
  stats_.fetched_rows += rows * c.n_kv_heads;
  stats_.cache_hits += from_sources;  // rows a source before the host store served
  stats_.cache_misses += rows * c.n_kv_heads - from_sources;
  stats_.bytes_h2d += ctx_.backend().bytes_to_device(rows * c.n_kv_heads - from_sources, p.job.store->row_bytes());
  if (ctx_.backend().counts_fetches_on_device()) device_counted_ = true;  // the cache's rows: fold_device_counts
  note_cache_use();
}

int64_t Sequence::fetch(int32_t layer, const kvret_tensor* positions, int32_t count, const kvret_working_set* out,
                        kvret_stream stream) {
  static const FetchNames names{"positions", "out.k", "out.v", "out.positions", "count"};
  PreparedFetch p;
  check_fetch(layer, count, out, names, p);
  if (count > 0) {
    TensorView pv = ctx_.view(positions, "positions", {DType::I32}, {2});
    pv.expect_dim(0, ctx_.config().n_kv_heads, "n_kv_heads");
    pv.expect_dim_at_least(1, count, "selected positions per head");
    std::vector<std::byte> positions_copy;
    pv = ctx_.backend().host_readable(pv, positions_copy);
    check_fetch_positions(pv, names, p);
  }
  begin_fetch(p);
  try {
    GatherJob& j = p.job;
    j.rows = ctx_.backend().gather(*j.store, j.mid_begin, j.mid_end, j.selected, j.count, *j.out, ctx_.threads(),
                                   *j.sources, j.sequence, j.layer, &j.served_by_sources, stream);
  } catch (...) {
    abort_fetch(p);
    throw;
  }
  finish_fetch(p);
  return p.rows;
}

void Sequence::read(int32_t layer, int64_t begin, int64_t end, const kvret_tensor* k, const kvret_tensor* v) const {
  const kvret_config& c = ctx_.config();
  const HostKvStore& store = layer_at(layer).store();
  require(begin >= 0 && begin <= end && end <= store.size(), KVRET_ERR_OUT_OF_RANGE,
          "range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is outside the " +
              std::to_string(store.size()) + " tokens of " + layer_name(layer));
  const DTypeSet types{store.dtype(), DType::F32};
  const TensorView k_out = ctx_.view(k, "k", types, {3});
  const TensorView v_out = ctx_.view(v, "v", types, {3});
  for (const TensorView* t : {&k_out, &v_out}) {
    t->expect_dim(0, end - begin, "tokens");
    t->expect_dim(1, c.n_kv_heads, "n_kv_heads");
    t->expect_dim(2, c.head_dim, "head_dim");
  }
  Backend& backend = ctx_.backend();
  std::vector<std::byte> k_copy, v_copy;
  const TensorView kv = backend.host_writable(k_out, k_copy);
  const TensorView vv = backend.host_writable(v_out, v_copy);
  for (int64_t p = begin; p < end; ++p)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      convert_row(store.key_row(h, p), store.dtype(), kv.at({p - begin, h}), kv.dtype(),
                  static_cast<size_t>(c.head_dim));
      convert_row(store.value_row(h, p), store.dtype(), vv.at({p - begin, h}), vv.dtype(),
                  static_cast<size_t>(c.head_dim));
    }
  backend.write_back(kv, k_out);
  backend.write_back(vv, v_out);
}

const Retriever& Sequence::index(int32_t layer) {
  LayerState& l = layer_at(layer);
  l.wait();
  return l.index();
}

}  // namespace kvret
