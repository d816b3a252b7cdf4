// The extern "C" boundary: handle checks, exception -> status translation, the thread-local last error.
// Every entry point runs its body inside guarded(), so no exception ever crosses into C.
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "c_api/handles.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/tensor_view.hpp"
#include "core/vec_math.hpp"
#include "engine/context.hpp"
#include "engine/retained_set.hpp"
#include "engine/sequence.hpp"
#include "kvret.h"
#include "session/session_store.hpp"

// The opaque C handles are the C++ objects themselves.
struct kvret_context : kvret::Context {
  using kvret::Context::Context;
};

namespace {

using kvret::Error;
using kvret::require;

thread_local std::string g_last_error;

/// Live handles. A handle is a number drawn once from a counter, never an object's address and never reused, so a
/// closed sequence's or destroyed context's handle stays invalid when the allocator gives its memory to a new one.
/// A handle that is not here is NULL, closed or foreign: it is reported, never dereferenced.
template <class T>
class HandleRegistry {
 public:
  /// Registers object and returns its new handle (strong guarantee).
  const void* add(T* object) {
    std::unique_lock lock(mu_);
    const uintptr_t id = next_;
    objects_.emplace(id, object);
    try {
      ids_.emplace(object, id);
    } catch (...) {
      objects_.erase(id);
      throw;
    }
    next_ += kStep;
    return reinterpret_cast<const void*>(id);
  }
  void remove(const T* object) noexcept {
    std::unique_lock lock(mu_);
    const auto it = ids_.find(object);
    if (it == ids_.end()) return;
    objects_.erase(it->second);
    ids_.erase(it);
  }
  /// The object of a live handle, else nullptr.
  T* find(const void* handle) const {
    std::shared_lock lock(mu_);
    const auto it = objects_.find(reinterpret_cast<uintptr_t>(handle));
    return it == objects_.end() ? nullptr : it->second;
  }
  /// The object of a live handle marked in a call (T::try_enter), under the lock, so that no close removes it in
  /// between; nullptr when the handle is not live, or, with *busy set, when another call holds the object.
  T* enter(const void* handle, bool* busy) const {
    std::shared_lock lock(mu_);
    *busy = false;
    const auto it = objects_.find(reinterpret_cast<uintptr_t>(handle));
    if (it == objects_.end()) return nullptr;
    if (!it->second->try_enter()) {
      *busy = true;
      return nullptr;
    }
    return it->second;
  }
  /// Removes a live handle and returns its object, the caller's from then on; nullptr, with nothing removed, when
  /// the handle is not live, or, with *busy set, when another call holds the object.
  T* remove_idle(const void* handle, bool* busy) {
    std::unique_lock lock(mu_);
    *busy = false;
    const auto it = objects_.find(reinterpret_cast<uintptr_t>(handle));
    if (it == objects_.end()) return nullptr;
    T* object = it->second;
    if (!object->try_enter()) {
      *busy = true;
      return nullptr;
    }
    ids_.erase(object);
    objects_.erase(it);
    return object;
  }

 private:
  static constexpr uintptr_t kStep = 16;  // handles look like aligned pointers to code that prints them
  mutable std::shared_mutex mu_;
  uintptr_t next_ = 0x10000;
  std::unordered_map<uintptr_t, T*> objects_;
  std::unordered_map<const T*, uintptr_t> ids_;
};

HandleRegistry<kvret_context>& contexts() {
  static HandleRegistry<kvret_context> r;
  return r;
}
HandleRegistry<kvret::Sequence>& sequences() {
  static HandleRegistry<kvret::Sequence> r;
  return r;
}

template <class F>
kvret_status guarded(F&& body) noexcept {
  try {
    body();
    return KVRET_OK;
  } catch (...) {
    return kvret::current_exception_status(g_last_error);  // the message goes straight to the last error
  }
}

kvret_context& context_of(const kvret_context* ctx) {
  require(ctx != nullptr, KVRET_ERR_INVALID_HANDLE, "context handle is NULL");
  kvret_context* c = contexts().find(ctx);
  require(c != nullptr, KVRET_ERR_INVALID_HANDLE, "context handle is not a live kvret context (destroyed or foreign)");
  return *c;
}

void require_idle(bool busy, const std::string& name) {
  require(!busy, KVRET_ERR_BUSY,
          name + " is in a call on another thread (a sequence takes one call at a time); nothing was done");
}

/// The sequence of a handle, marked in this call (Sequence::try_enter): KVRET_ERR_BUSY while another thread's call
/// holds it. Every call that takes a kvret_seq* enters it, the read-only ones too: they read what a concurrent
/// append or fetch changes.
kvret::Sequence& enter_sequence(const kvret_seq* seq, const std::string& name) {
  require(seq != nullptr, KVRET_ERR_INVALID_HANDLE, name + " is NULL");
  bool busy = false;
  kvret::Sequence* s = sequences().enter(seq, &busy);
  if (s != nullptr) return *s;  // entered: nothing may throw (allocate a message) until the caller holds it
  require_idle(busy, name);
  throw kvret::Error(KVRET_ERR_INVALID_HANDLE, name + " is not a live kvret sequence (closed or foreign)");
}

/// One call's hold on a sequence: entered when made, left when the call returns or throws.
class SequenceCall {
 public:
  explicit SequenceCall(const kvret_seq* seq) : s_(enter_sequence(seq, "sequence handle")) {}
  ~SequenceCall() { s_.leave(); }
  SequenceCall(const SequenceCall&) = delete;
  SequenceCall& operator=(const SequenceCall&) = delete;
  kvret::Sequence& operator*() const noexcept { return s_; }
  kvret::Sequence* operator->() const noexcept { return &s_; }

 private:
  kvret::Sequence& s_;
};

/// A batch call's hold on its sequences: each entered in turn, all left when the call returns or throws (so a
/// batch that fails part way releases those it took).
class SequenceCalls {
 public:
  SequenceCalls() = default;
  SequenceCalls(const SequenceCalls&) = delete;
  SequenceCalls& operator=(const SequenceCalls&) = delete;
  ~SequenceCalls() {
    for (kvret::Sequence* s : held_) s->leave();
  }
  kvret::Sequence& enter(const kvret_seq* seq, const std::string& name) {
    held_.reserve(held_.size() + 1);  // may throw before the sequence is entered, never after
    kvret::Sequence& s = enter_sequence(seq, name);
    held_.push_back(&s);
    return s;
  }

 private:
  std::vector<kvret::Sequence*> held_;
};

/// Each context's session store: made with the context, destroyed before it.
class StoreRegistry {
 public:
  void add(const kvret::Context* ctx, std::shared_ptr<kvret::session::SessionStore> store) {
    std::lock_guard<std::mutex> lock(mu_);
    stores_[ctx] = std::move(store);
  }
  std::shared_ptr<kvret::session::SessionStore> take(const kvret::Context* ctx) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = stores_.find(ctx);
    if (it == stores_.end()) return nullptr;
    auto store = std::move(it->second);
    stores_.erase(it);
    return store;
  }
  std::shared_ptr<kvret::session::SessionStore> find(const kvret::Context* ctx) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = stores_.find(ctx);
    return it == stores_.end() ? nullptr : it->second;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<const kvret::Context*, std::shared_ptr<kvret::session::SessionStore>> stores_;
};

StoreRegistry& stores() {
  static StoreRegistry r;
  return r;
}

kvret::session::SessionStore& store_of(const kvret::Context& ctx) {
  const auto store = stores().find(&ctx);
  require(store != nullptr, KVRET_ERR_INTERNAL, "the context has no session store");
  return *store;  // the registry keeps it until kvret_destroy
}

template <class T>
void require_out(T* p, const char* name) {
  require(p != nullptr, KVRET_ERR_INVALID_ARGUMENT, std::string(name) + " is NULL");
}

}  // namespace

namespace kvret {
Sequence* sequence_from_handle(const kvret_seq* seq) { return sequences().find(seq); }
Context* context_from_handle(const kvret_context* ctx) { return contexts().find(ctx); }
}  // namespace kvret

extern "C" {

unsigned kvret_version_number(void) { return KVRET_VERSION_NUMBER; }
const char* kvret_version_string(void) { return KVRET_VERSION_STRING; }

const char* kvret_status_string(kvret_status status) {
  switch (status) {
    case KVRET_OK:
      return "KVRET_OK";
    case KVRET_ERR_INVALID_ARGUMENT:
      return "KVRET_ERR_INVALID_ARGUMENT";
    case KVRET_ERR_INVALID_HANDLE:
      return "KVRET_ERR_INVALID_HANDLE";
    case KVRET_ERR_SHAPE:
      return "KVRET_ERR_SHAPE";
    case KVRET_ERR_DTYPE:
      return "KVRET_ERR_DTYPE";
    case KVRET_ERR_STRIDE:
      return "KVRET_ERR_STRIDE";
    case KVRET_ERR_DEVICE:
      return "KVRET_ERR_DEVICE";
    case KVRET_ERR_OUT_OF_RANGE:
      return "KVRET_ERR_OUT_OF_RANGE";
    case KVRET_ERR_BUDGET:
      return "KVRET_ERR_BUDGET";
    case KVRET_ERR_CAPACITY:
      return "KVRET_ERR_CAPACITY";
    case KVRET_ERR_OUT_OF_MEMORY:
      return "KVRET_ERR_OUT_OF_MEMORY";
    case KVRET_ERR_NONFINITE:
      return "KVRET_ERR_NONFINITE";
    case KVRET_ERR_STATE:
      return "KVRET_ERR_STATE";
    case KVRET_ERR_UNSUPPORTED:
      return "KVRET_ERR_UNSUPPORTED";
    case KVRET_ERR_IO:
      return "KVRET_ERR_IO";
    case KVRET_ERR_CORRUPT:
      return "KVRET_ERR_CORRUPT";
    case KVRET_ERR_CUDA:
      return "KVRET_ERR_CUDA";
    case KVRET_ERR_VERSION:
      return "KVRET_ERR_VERSION";
    case KVRET_ERR_INTERNAL:
      return "KVRET_ERR_INTERNAL";
    case KVRET_ERR_NOT_FOUND:
      return "KVRET_ERR_NOT_FOUND";
    case KVRET_ERR_BUSY:
      return "KVRET_ERR_BUSY";
  }
  return "KVRET_ERR_UNKNOWN";
}

const char* kvret_last_error(void) { return g_last_error.c_str(); }
void kvret_clear_error(void) { g_last_error.clear(); }

kvret_status kvret_config_init(kvret_config* config) {
  return guarded([&] {
    require_out(config, "config");
    kvret::config_defaults(config);
  });
}

kvret_status kvret_pq_params_init(kvret_pq_params* params) {
  return guarded([&] {
    require_out(params, "params");
    kvret::pq_params_defaults(params);
  });
}

kvret_status kvret_cluster_params_init(kvret_cluster_params* params) {
  return guarded([&] {
    require_out(params, "params");
    kvret::cluster_params_defaults(params);
  });
}

kvret_status kvret_quant_params_init(kvret_quant_params* params) {
  return guarded([&] {
    require_out(params, "params");
    kvret::quant_params_defaults(params);
  });
}

kvret_status kvret_crush_params_init(kvret_crush_params* params) {
  return guarded([&] {
    require_out(params, "params");
    kvret::crush_params_defaults(params);
  });
}

kvret_status kvret_session_params_init(kvret_session_params* params) {
  return guarded([&] {
    require_out(params, "params");
    kvret::session_params_defaults(params);
  });
}

kvret_status kvret_create(const kvret_config* config, kvret_context** out) {
  return guarded([&] {
    require_out(out, "out");
    *out = nullptr;
    std::string disk_path, shared_url;
    const kvret_config c = kvret::read_config(config, &disk_path, &shared_url);
    // the session store opens the shared tier (config.session_shared_url) and refuses a bad URL before registering
    auto* ctx = new kvret_context(c, std::move(disk_path), nullptr, std::move(shared_url));
    try {
      stores().add(ctx, std::make_shared<kvret::session::SessionStore>(*ctx));
      *out = static_cast<kvret_context*>(const_cast<void*>(contexts().add(ctx)));
    } catch (...) {
      stores().take(ctx);
      delete ctx;
      throw;
    }
  });
}

kvret_status kvret_destroy(kvret_context* ctx) {
  if (ctx == nullptr) return KVRET_OK;
  return guarded([&] {
    kvret_context& c = context_of(ctx);
    contexts().remove(&c);
    for (kvret::Sequence* s : c.sequences()) sequences().remove(s);
    stores().take(&c).reset();  // the saved sessions go before the context they belong to
    delete &c;
  });
}

kvret_status kvret_get_config(const kvret_context* ctx, kvret_config* out) {
  return guarded([&] {
    const kvret::Context& c = context_of(ctx);
    require_out(out, "out");
    require(out->struct_size >= offsetof(kvret_config, n_layers), KVRET_ERR_VERSION,
            "out->struct_size is not set; call kvret_config_init first");
    const size_t n = out->struct_size < sizeof(kvret_config) ? out->struct_size : sizeof(kvret_config);
    const size_t caller_size = out->struct_size;
    std::memcpy(out, &c.config(), n);
    out->struct_size = caller_size;
  });
}

kvret_status kvret_seq_open(kvret_context* ctx, kvret_seq** out) {
  if (out != nullptr) *out = nullptr;  // before anything may fail
  return guarded([&] {
    kvret::Context& c = context_of(ctx);
    require_out(out, "out");
    kvret::Sequence* s = c.open_sequence();
    try {
      *out = static_cast<kvret_seq*>(const_cast<void*>(sequences().add(s)));
    } catch (...) {
      c.close_sequence(s);
      throw;
    }
  });
}

kvret_status kvret_seq_close(kvret_seq* seq) {
  if (seq == nullptr) return KVRET_OK;
  return guarded([&] {
    bool busy = false;
    kvret::Sequence* s = sequences().remove_idle(seq, &busy);
    if (s == nullptr) {  // (once removed, nothing may throw before the close: the message is made only here)
      require_idle(busy, "sequence handle");
      throw kvret::Error(KVRET_ERR_INVALID_HANDLE, "sequence handle is not a live kvret sequence (closed or foreign)");
    }
    s->context().close_sequence(s);
  });
}

kvret_status kvret_seq_length(const kvret_seq* seq, int32_t layer, int64_t* out_tokens) {
  return guarded([&] {
    const SequenceCall call(seq);
    const kvret::Sequence& s = *call;
    require_out(out_tokens, "out_tokens");
    *out_tokens = s.length(layer);
  });
}

kvret_status kvret_seq_fork(kvret_seq* seq, kvret_seq** out) {
  if (out != nullptr) *out = nullptr;  // before anything may fail
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    require_out(out, "out");
    kvret::Sequence* child = s.context().adopt_sequence(s.fork());
    try {
      *out = static_cast<kvret_seq*>(const_cast<void*>(sequences().add(child)));
    } catch (...) {
      s.context().close_sequence(child);
      throw;
    }
  });
}

kvret_status kvret_seq_truncate(kvret_seq* seq, int64_t length) {
  return guarded([&] { SequenceCall(seq)->truncate(length); });
}

kvret_status kvret_seq_drop_front(kvret_seq* seq, int64_t keep, int64_t count) {
  return guarded([&] { SequenceCall(seq)->drop_front(keep, count); });
}

// ---- sessions (docs/sessions.md) ----

kvret_status kvret_session_save(kvret_seq* seq, const char* session_id) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    const std::string id = kvret::session::SessionStore::check_id(session_id, "session_id");
    store_of(s.context()).save(s, id);
  });
}

kvret_status kvret_session_open(kvret_context* ctx, const char* session_id, kvret_seq** out) {
  if (out != nullptr) *out = nullptr;  // before anything may fail
  return guarded([&] {
    kvret_context& c = context_of(ctx);
    const std::string id = kvret::session::SessionStore::check_id(session_id, "session_id");
    require_out(out, "out");
    kvret::Sequence* seq = c.adopt_sequence(store_of(c).open(id));
    try {
      *out = static_cast<kvret_seq*>(const_cast<void*>(sequences().add(seq)));
    } catch (...) {
      c.close_sequence(seq);
      throw;
    }
  });
}

kvret_status kvret_session_drop(kvret_context* ctx, const char* session_id) {
  return guarded([&] {
    kvret_context& c = context_of(ctx);
    store_of(c).drop(kvret::session::SessionStore::check_id(session_id, "session_id"));
  });
}

kvret_status kvret_session_schedule(kvret_context* ctx, const char* const* session_ids, int32_t n) {
  return guarded([&] {
    kvret_context& c = context_of(ctx);
    require(n >= 0, KVRET_ERR_INVALID_ARGUMENT, "n must be >= 0, got " + std::to_string(n));
    require(n == 0 || session_ids != nullptr, KVRET_ERR_INVALID_ARGUMENT,
            "session_ids is NULL with n = " + std::to_string(n));
    std::vector<std::string> ids;
    ids.reserve(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      const std::string what = "session_ids[" + std::to_string(i) + "]";
      ids.push_back(kvret::session::SessionStore::check_id(session_ids[i], what.c_str()));
    }
    store_of(c).schedule(ids);
  });
}

kvret_status kvret_session_where(kvret_context* ctx, const char* session_id, int32_t* out_tier) {
  return guarded([&] {
    kvret_context& c = context_of(ctx);
    const std::string id = kvret::session::SessionStore::check_id(session_id, "session_id");
    require_out(out_tier, "out_tier");
    *out_tier = store_of(c).where(id);
  });
}

kvret_status kvret_session_flush(kvret_context* ctx) {
  return guarded([&] { store_of(context_of(ctx)).flush(); });
}

kvret_status kvret_seq_budget(const kvret_seq* seq, int32_t layer, int32_t* out_budget) {
  return guarded([&] {
    const SequenceCall call(seq);
    const kvret::Sequence& s = *call;
    require_out(out_budget, "out_budget");
    *out_budget = static_cast<int32_t>(s.resolve_budget(layer, KVRET_BUDGET_DEFAULT));
  });
}

kvret_status kvret_append_prefill(kvret_seq* seq, int32_t layer, const kvret_tensor* k, const kvret_tensor* v) {
  return guarded([&] { SequenceCall(seq)->append_prefill(layer, k, v); });
}

kvret_status kvret_append_decode(kvret_seq* seq, int32_t layer, const kvret_tensor* k, const kvret_tensor* v) {
  return guarded([&] { SequenceCall(seq)->append_decode(layer, k, v); });
}

kvret_status kvret_wait_index(kvret_seq* seq, int32_t layer) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    require(layer >= -1, KVRET_ERR_OUT_OF_RANGE, "layer must be >= 0, or -1 for every layer");
    s.wait_index(layer);
  });
}

kvret_status kvret_select(kvret_seq* seq, int32_t layer, const kvret_tensor* q, int32_t budget,
                          const kvret_tensor* out_positions, int32_t* out_count) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    require_out(out_count, "out_count");
    *out_count = static_cast<int32_t>(s.select(layer, q, budget, out_positions));
  });
}

kvret_status kvret_select_scored(kvret_seq* seq, int32_t layer, const kvret_tensor* q, int32_t budget,
                                 const kvret_tensor* out_positions, const kvret_tensor* out_scores,
                                 int32_t* out_count) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    require_out(out_count, "out_count");
    require(out_scores != nullptr, KVRET_ERR_INVALID_ARGUMENT,
            "out_scores is NULL (kvret_select selects without scores)");
    *out_count = static_cast<int32_t>(s.select(layer, q, budget, out_positions, out_scores));
  });
}

kvret_status kvret_select_batch(kvret_context* ctx, int32_t n, kvret_seq* const* seqs, int32_t layer,
                                const kvret_tensor* q, int32_t budget, const kvret_tensor* out_positions,
                                int32_t* out_counts) {
  return guarded([&] {
    kvret::Context& c = context_of(ctx);
    require(n >= 0, KVRET_ERR_INVALID_ARGUMENT, "n must be >= 0");
    if (n == 0) return;
    require_out(seqs, "seqs");
    require_out(out_counts, "out_counts");
    const auto qv = c.view(q, "q", kvret::kFloatTypes, {3});
    const auto ov = c.view(out_positions, "out_positions", {kvret::DType::I32}, {3});
    qv.expect_dim(0, n, "batch");
    ov.expect_dim(0, n, "batch");
    std::vector<kvret::Sequence*> batch;
    std::unordered_set<const void*> seen;
    SequenceCalls held;
    for (int32_t i = 0; i < n; ++i) {
      const std::string name = "seqs[" + std::to_string(i) + "]";
      require(seen.insert(seqs[i]).second, KVRET_ERR_INVALID_ARGUMENT, name + " appears twice in the batch");
      kvret::Sequence& s = held.enter(seqs[i], name);
      require(c.owns(&s), KVRET_ERR_INVALID_HANDLE, name + " belongs to another context");
      (void)s.check_select(layer, qv.slice(i), budget, ov.slice(i));
      batch.push_back(&s);
    }
    kvret::Sequence::select_batch(c, batch.data(), n, layer, qv, budget, ov, out_counts);
  });
}

kvret_status kvret_working_set_capacity(const kvret_seq* seq, int32_t layer, int32_t budget, int64_t* out_rows) {
  return guarded([&] {
    const SequenceCall call(seq);
    const kvret::Sequence& s = *call;
    require_out(out_rows, "out_rows");
    *out_rows = s.working_set_capacity(layer, budget);
  });
}

kvret_status kvret_fetch_async(kvret_seq* seq, int32_t layer, const kvret_tensor* positions, int32_t count,
                               const kvret_working_set* out, int64_t* out_rows, kvret_stream stream) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    require_out(out_rows, "out_rows");
    s.context().backend().check_stream(stream);
    *out_rows = s.fetch(layer, positions, count, out, stream);
  });
}

kvret_status kvret_fetch_batch_async(kvret_context* ctx, int32_t n, kvret_seq* const* seqs, int32_t layer,
                                     const kvret_tensor* positions, const int32_t* counts,
                                     const kvret_working_set* outs, int64_t* out_row_counts, kvret_stream stream) {
  return guarded([&] {
    kvret::Context& c = context_of(ctx);
    require(n >= 0, KVRET_ERR_INVALID_ARGUMENT, "n must be >= 0");
    if (n == 0) return;
    require_out(seqs, "seqs");
    require_out(counts, "counts");
    require_out(outs, "outs");
    require_out(out_row_counts, "out_row_counts");
    c.backend().check_stream(stream);
    std::vector<kvret::Sequence*> batch;
    batch.reserve(static_cast<size_t>(n));
    std::unordered_set<const void*> seen;
    SequenceCalls held;
    for (int32_t i = 0; i < n; ++i) {
      const std::string name = "seqs[" + std::to_string(i) + "]";
      require(seen.insert(seqs[i]).second, KVRET_ERR_INVALID_ARGUMENT, name + " appears twice in the batch");
      kvret::Sequence* s = &held.enter(seqs[i], name);
      require(c.owns(s), KVRET_ERR_INVALID_HANDLE, name + " belongs to another context");
      batch.push_back(s);
    }
    kvret::Sequence::fetch_batch(c, batch.data(), n, layer, positions, counts, outs, out_row_counts, stream);
  });
}

kvret_status kvret_attend(kvret_context* ctx, const kvret_tensor* q, const kvret_tensor* k, const kvret_tensor* v,
                          int64_t rows, float scale, const kvret_tensor* out, kvret_stream stream) {
  return guarded([&] {
    const kvret::Context& c = context_of(ctx);
    c.backend().check_stream(stream);
    const auto qv = c.view(q, "q", kvret::kFloatTypes, {2});
    const auto kv = c.view(k, "k", kvret::kFloatTypes, {3});
    const auto vv = c.view(v, "v", kvret::kFloatTypes, {3});
    const auto ov = c.view(out, "out", kvret::kFloatTypes, {2});
    c.backend().attend(c.config(), qv, kv, vv, rows, scale, ov, c.threads(), stream);
  });
}

kvret_status kvret_seq_attend(kvret_seq* seq, int32_t layer, const kvret_tensor* q, int32_t budget, float scale,
                              const kvret_tensor* out, kvret_stream stream) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    s.context().backend().check_stream(stream);
    s.attend(layer, q, budget, scale, out, stream);
  });
}

kvret_status kvret_seq_retained_set(kvret_seq* seq, int32_t layer, int32_t budget, const kvret_tensor* out_positions,
                                    int32_t* out_count) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    require_out(out_count, "out_count");
    *out_count = static_cast<int32_t>(kvret::retained_set(s, layer, budget, out_positions));
  });
}

kvret_status kvret_seq_observe(kvret_seq* seq, int32_t layer, const kvret_tensor* q_window) {
  return guarded([&] { SequenceCall(seq)->observe(layer, q_window); });
}

kvret_status kvret_seq_observe_attention(kvret_seq* seq, int32_t layer, const kvret_tensor* probs) {
  return guarded([&] { SequenceCall(seq)->observe_attention(layer, probs); });
}

kvret_status kvret_synchronize(kvret_context* ctx, kvret_stream stream) {
  return guarded([&] {
    const kvret::Context& c = context_of(ctx);
    c.backend().check_stream(stream);
    c.backend().synchronize(stream);
  });
}

kvret_status kvret_stats_init(kvret_stats* stats) {
  return guarded([&] {
    require_out(stats, "stats");
    std::memset(stats, 0, sizeof *stats);
    stats->struct_size = sizeof *stats;
  });
}

namespace {
void reset_stats(kvret_stats* out) {
  require_out(out, "out");
  require(out->struct_size >= offsetof(kvret_stats, sequences) + sizeof(int64_t), KVRET_ERR_VERSION,
          "out->struct_size is not set; call kvret_stats_init first");
  const size_t size = out->struct_size;
  std::memset(out, 0, size < sizeof *out ? size : sizeof *out);
  out->struct_size = size;
}
}  // namespace

kvret_status kvret_seq_stats(const kvret_seq* seq, kvret_stats* out) {
  return guarded([&] {
    const SequenceCall call(seq);
    const kvret::Sequence& s = *call;
    reset_stats(out);
    out->sequences = 1;
    s.stats().add_to(out);
  });
}

kvret_status kvret_context_stats(const kvret_context* ctx, kvret_stats* out) {
  return guarded([&] {
    const kvret::Context& c = context_of(ctx);
    reset_stats(out);
    c.stats(out);
    store_of(c).add_stats(out);
  });
}

kvret_status kvret_prefetch_async(kvret_seq* seq, int32_t layer, const kvret_tensor* q_guess, int32_t budget,
                                  kvret_stream stream) {
  return guarded([&] {
    const SequenceCall call(seq);
    kvret::Sequence& s = *call;
    s.context().backend().check_stream(stream);
    s.prefetch(layer, q_guess, budget, stream);
  });
}

kvret_status kvret_seq_read(const kvret_seq* seq, int32_t layer, int64_t begin, int64_t end, const kvret_tensor* k,
                            const kvret_tensor* v) {
  return guarded([&] { SequenceCall(seq)->read(layer, begin, end, k, v); });
}

}  // extern "C"
