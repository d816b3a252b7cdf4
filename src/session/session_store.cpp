#include "session/session_store.hpp"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <unordered_set>

#include "core/error.hpp"
#include "core/serial.hpp"
#include "core/tensor_view.hpp"
#include "session/redis_tier.hpp"
#include "session/session_layout.hpp"

namespace kvret::session {

std::atomic<LayerLoadHook> g_layer_load_hook{nullptr};
std::atomic<SharedTierFactory> g_shared_tier_factory{nullptr};
std::atomic<DiskWriteHook> g_disk_write_hook{nullptr};

using namespace session_detail;  // NOLINT: the layout's helpers (session_layout.hpp)

SessionStore::SessionStore(Context& ctx) : ctx_(ctx), placement_(placement_config(ctx)) {
  if (!ctx.shared_url().empty()) {  // parsed here; the first call that uses it connects
    if (const SharedTierFactory factory = g_shared_tier_factory.load()) {
      shared_ = factory();
    } else {
      try {
        shared_ = open_shared_tier(ctx.shared_url().c_str());
      } catch (const Error& e) {
        const std::string what = e.what();  // the tier's messages name session_shared_url (never its password)
        throw Error(e.status(),
                    what.rfind("session_shared_url", 0) == 0 ? "config." + what : "config.session_shared_url: " + what);
      }
    }
  }
  if (!ctx.disk_path().empty()) {
    disk_ = std::make_unique<DiskTier>(ctx.disk_path());
    scan_disk();
  }
}

SessionStore::~SessionStore() {
  // The loaders first: each ends by taking the lock (to release its pin), so none may be running below.
  std::vector<std::weak_ptr<LayerLoad>> loads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    loads.swap(loads_);
  }
  for (const std::weak_ptr<LayerLoad>& w : loads)
    if (const std::shared_ptr<LayerLoad> load = w.lock()) load->stop();
  // The writer finishes what is queued (its commits take the lock), then ends.
  {
    std::lock_guard<std::mutex> lock(wmu_);
    wstop_ = true;
  }
  wcv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

std::string SessionStore::check_id(const char* id, const char* what) {
  require(id != nullptr, KVRET_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  const size_t n = std::strlen(id);
  require(n > 0, KVRET_ERR_INVALID_ARGUMENT, std::string(what) + " is empty");
  require(n <= kMaxSessionIdBytes, KVRET_ERR_INVALID_ARGUMENT,
          std::string(what) + " has " + std::to_string(n) + " bytes; at most " + std::to_string(kMaxSessionIdBytes));
  return std::string(id, n);
}

void SessionStore::set_shared_tier(std::unique_ptr<BlobTier> tier) {
  wait_writer();
  std::lock_guard<std::mutex> lock(mu_);
  shared_ = std::move(tier);
}

SessionId SessionStore::id_of(const std::string& id) {
  if (const auto it = ids_.find(id); it != ids_.end()) return it->second;
  const SessionId sid = next_id_++;
  ids_.emplace(id, sid);
  return sid;
}

void SessionStore::forget_if_unused(SessionId sid) {
  if (meta_.count(sid) != 0 || std::find(queue_.begin(), queue_.end(), sid) != queue_.end()) return;
  for (auto it = ids_.begin(); it != ids_.end(); ++it)
    if (it->second == sid) {
      ids_.erase(it);
      return;
    }
}

void SessionStore::keep_failure(const std::exception_ptr& e, const char* what) noexcept {
  if (deferred_status_ != KVRET_OK) return;
  try {
    std::rethrow_exception(e);
  } catch (...) {
    std::string message;
    deferred_status_ = current_exception_status(message);
    try {
      deferred_message_ = std::string(what) + ": " + message;
    } catch (...) {
    }
  }
}

void SessionStore::remove_blobs(const DiskRecord& rec, int32_t layers, bool manifest) {
  // The manifest first: a crash between the two leaves unnamed layer blobs (removed when the store next opens the
  // directory), never a manifest naming missing layers.
  if (manifest) {
    try {
      disk_->remove(manifest_key(rec.stem));
    } catch (...) {
      keep_failure(std::current_exception());
    }
  }
  const auto pin = std::make_pair(rec.stem, rec.generation);
  const bool pinned = readers_.count(pin) != 0;  // a loader reads these layers: removed when it ends
  for (int32_t l = 0; l < layers; ++l) {
    try {
      if (pinned)
        deferred_removals_.emplace_back(pin, layer_key(rec.stem, rec.generation, l));
      else
        disk_->remove(layer_key(rec.stem, rec.generation, l));
    } catch (...) {
      keep_failure(std::current_exception());
    }
  }
}

void SessionStore::cancel_eviction(SessionId sid) {
  const auto e = evicting_.find(sid);
  if (e == evicting_.end()) return;
  e->second->cancelled = true;
  evicting_.erase(e);
}

void SessionStore::drop_session(SessionId sid) {
  placement_.drop(sid);
  dram_.erase(sid);
  cancel_eviction(sid);
  if (const auto it = meta_.find(sid); it != meta_.end()) {
    if (it->second.disk) remove_blobs(*it->second.disk, ctx_.config().n_layers, true);
    meta_.erase(it);
  }
  forget_if_unused(sid);
}

void SessionStore::expire_now() {
  if (meta_.empty()) return;
  const int64_t now = now_ms();
  std::vector<SessionId> expired;
  for (const auto& [sid, m] : meta_)
    if (m.expires_ms != 0 && now >= m.expires_ms) expired.push_back(sid);
  for (const SessionId sid : expired) {
    drop_session(sid);
    ++counters_.expired;
  }
}

uint64_t SessionStore::session_bytes(const Sequence& seq) const {
  uint64_t bytes = 0;
  for (const auto& l : seq.layers_) {
    const HostKvStore& s = l->store();
    bytes += static_cast<uint64_t>(s.size()) * static_cast<uint64_t>(s.n_kv_heads()) * s.row_bytes() * 2;
    bytes += static_cast<uint64_t>(std::max<int64_t>(0, l->index().bytes()));
  }
  return std::max<uint64_t>(bytes, 1);
}

std::vector<std::byte> SessionStore::manifest_bytes(const Meta& meta, const DiskRecord& rec,
                                                    const std::vector<uint64_t>& layer_sizes) const {
  ByteWriter w;
  write_header(w, kManifestTag, kLayoutVersion);
  w.array(std::vector<char>(meta.id.begin(), meta.id.end()));
  w.value<uint64_t>(rec.generation);
  w.value<int64_t>(meta.expires_ms);
  w.value<uint64_t>(meta.bytes);
  w.array(fingerprint(ctx_.config()));
  w.array(layer_sizes);
  return std::move(w.bytes());
}

std::vector<std::byte> SessionStore::layer_blob(const Sequence& seq, int32_t l, uint64_t generation) const {
  const LayerState& layer = *seq.layers_[static_cast<size_t>(l)];
  const HostKvStore& s = layer.store();
  const std::vector<std::byte> index = layer.index().save();
  ByteWriter w;
  write_header(w, kLayerTag, kLayoutVersion);
  w.value<uint64_t>(generation);
  w.value<int32_t>(l);
  w.value<int64_t>(s.size());
  w.value<uint64_t>(s.row_bytes());
  std::vector<std::byte>& out = w.bytes();
  const size_t rows = static_cast<size_t>(s.size()) * static_cast<size_t>(s.n_kv_heads());
  const size_t start = out.size();
  out.resize(start + 2 * rows * s.row_bytes());
  std::byte* p = out.data() + start;
  for (int kv = 0; kv < 2; ++kv)
    for (int64_t t = 0; t < s.size(); ++t)
      for (int h = 0; h < s.n_kv_heads(); ++h) {
        // keys as appended: before RoPE when the store rotates them (restore rotates them again)
        const std::byte* row = kv == 1 ? s.value_row(h, t) : (s.rope() ? s.pre_rope_key_row(h, t) : s.key_row(h, t));
        std::memcpy(p, row, s.row_bytes());
        p += s.row_bytes();
      }
  w.array(index);
  return std::move(w.bytes());
}

SessionStore::DiskRecord SessionStore::next_record(SessionId sid, const std::vector<std::string>& also_used) const {
  const Meta& meta = meta_.at(sid);
  DiskRecord rec;
  if (meta.disk) {
    // The next generation of its stem, past the writes of it still in flight (cancelled ones included: their
    // layer files may be on their way).
    rec.stem = meta.disk->stem;
    uint64_t generation = meta.disk->generation;
    const auto past = [&](const std::shared_ptr<DiskWrite>& job) {
      if (job && job->rec.stem == rec.stem) generation = std::max(generation, job->rec.generation);
    };
    for (const auto& [other, job] : evicting_) past(job);
    {
      std::lock_guard<std::mutex> wlock(wmu_);
      past(disk_writing_);
      for (const auto& job : disk_writes_) past(job);
    }
    rec.generation = generation + 1;
    return rec;
  }
  // A stem no other session uses (the hash of the id, with a suffix on a collision).
  std::unordered_set<std::string> used(also_used.begin(), also_used.end());
  for (const auto& [other, m] : meta_)
    if (m.disk) used.insert(m.disk->stem);
  for (const auto& [pin, count] : readers_) used.insert(pin.first);  // a loader may still read a dropped save
  for (const auto& [other, job] : evicting_) used.insert(job->rec.stem);
  {
    std::lock_guard<std::mutex> wlock(wmu_);
    if (disk_writing_) used.insert(disk_writing_->rec.stem);  // cancelled, but its files may be on their way
    for (const auto& job : disk_writes_) used.insert(job->rec.stem);
  }
  const std::string base = hex64(fnv1a(meta.id));
  rec.stem = base;
  for (int i = 1; used.count(rec.stem) != 0; ++i) rec.stem = base + "-" + std::to_string(i);
  rec.generation = 1;
  return rec;
}

void SessionStore::remove_layers(const DiskRecord& rec, int32_t count, std::exception_ptr* cleanup) {
  for (int32_t l = 0; l < count; ++l) {
    try {
      disk_->remove(layer_key(rec.stem, rec.generation, l));
    } catch (...) {
      if (cleanup == nullptr)
        keep_failure(std::current_exception());
      else if (!*cleanup)
        *cleanup = std::current_exception();
    }
  }
}

std::vector<uint64_t> SessionStore::write_layers(const Sequence& seq, const DiskRecord& rec,
                                                 std::exception_ptr* cleanup) {
  const int32_t n_layers = ctx_.config().n_layers;
  // Only the layer sizes are kept for the manifest: each layer's bytes go to disk and are freed before the next.
  std::vector<uint64_t> sizes;
  int32_t written = 0;
  try {
    for (int32_t l = 0; l < n_layers; ++l) {
      const std::vector<std::byte> out = layer_blob(seq, l, rec.generation);
      disk_->put(layer_key(rec.stem, rec.generation, l), out.data(), out.size(), 0);
      ++written;
      sizes.push_back(out.size());
    }
  } catch (...) {
    remove_layers(rec, written, cleanup);
    throw;
  }
  return sizes;
}

void SessionStore::write_blobs(const Sequence& seq, const Meta& meta, const DiskRecord& rec,
                               std::exception_ptr* cleanup) {
  const std::vector<uint64_t> sizes = write_layers(seq, rec, cleanup);
  try {
    const std::vector<std::byte> manifest = manifest_bytes(meta, rec, sizes);
    disk_->put(manifest_key(rec.stem), manifest.data(), manifest.size(), 0);
  } catch (...) {
    remove_layers(rec, ctx_.config().n_layers, cleanup);
    throw;
  }
}

SessionStore::DiskRecord SessionStore::write_session(SessionId sid, const Sequence& seq,
                                                     const std::vector<std::string>& also_used) {
  const DiskRecord rec = next_record(sid, also_used);
  write_blobs(seq, meta_.at(sid), rec, nullptr);
  return rec;
}

std::unique_ptr<LayerState> SessionStore::make_layer(Sequence& seq, int32_t l, const DiskRecord& rec,
                                                     const std::vector<std::byte>& blob,
                                                     const std::shared_ptr<const rope::Rope>& rope) {
  const kvret_config& c = ctx_.config();
  ByteReader r(blob.data(), blob.size());
  read_header(r, kLayerTag, kLayoutVersion);
  require_intact(r.value<uint64_t>() == rec.generation, "a layer blob of another save");
  require_intact(r.value<int32_t>() == l, "a layer blob of another layer");
  const auto tokens = r.value<int64_t>();
  const auto row_bytes = r.value<uint64_t>();
  HostKvStore store(c.n_kv_heads, c.head_dim, kv_dtype_to_dtype(c.kv_dtype), ctx_.backend().pages(), rope);
  require_intact(row_bytes == store.row_bytes(), "a layer blob of another head size or KV dtype");
  require_intact(
      tokens >= 0 && static_cast<uint64_t>(tokens) <= r.left() / (2 * static_cast<uint64_t>(c.n_kv_heads) * row_bytes),
      "a layer blob shorter than its tokens");
  const size_t half = static_cast<size_t>(tokens) * static_cast<size_t>(c.n_kv_heads) * row_bytes;
  const std::byte* rows = blob.data() + (blob.size() - r.left());
  if (tokens > 0) {
    const int64_t shape[3] = {tokens, c.n_kv_heads, c.head_dim};
    kvret_tensor kt{
        const_cast<std::byte*>(rows), kvret_device{KVRET_DEVICE_CPU, 0}, 3, dtype_of(store.dtype()), shape, nullptr, 0};
    kvret_tensor vt = kt;
    vt.data = const_cast<std::byte*>(rows + half);
    const TensorView k = TensorView::from(&kt, "saved keys", kFloatTypes, {3});
    const TensorView v = TensorView::from(&vt, "saved values", kFloatTypes, {3});
    store.append(k, v, tokens, true);
  }
  ByteReader rest(rows + 2 * half, r.left() - 2 * half);
  const std::vector<std::byte> state = rest.array<std::byte>();
  require_intact(rest.left() == 0, "trailing bytes after a layer blob");
  std::unique_ptr<Retriever> index = ctx_.kind().make(c, l);
  index->restore(store, state.data(), state.size());
  // Each design checked its state's own sizes; whatever the design, the range it covers must be one the sequence
  // can extend to its middle (it starts where the middle starts and ends inside it), or every select of the layer
  // would fail on every open of the session: a forged or foreign state is corrupt, and the session dropped.
  {
    const TokenGroups g = seq.groups_at(tokens);
    const int64_t begin = index->indexed_begin(), end = index->indexed_end();
    require_intact(end <= begin || (begin == g.mid_begin && end <= g.mid_end),
                   "an index over [" + std::to_string(begin) + ", " + std::to_string(end) +
                       "), which is not a start of the layer's middle [" + std::to_string(g.mid_begin) + ", " +
                       std::to_string(g.mid_end) + ")");
  }
  auto layer = std::make_unique<LayerState>(l, std::move(store), ctx_.kind().make(c, l));
  layer->replace_index(std::move(index), seq.stats_);
  return layer;
}

void SessionStore::restore_layer(Sequence& seq, int32_t l, const DiskRecord& rec, const std::vector<std::byte>& blob,
                                 const std::shared_ptr<const rope::Rope>& rope) {
  std::unique_ptr<LayerState> layer = make_layer(seq, l, rec, blob, rope);
  seq.layers_.push_back(std::move(layer));  // may throw bad_alloc: seq is discarded then
}

std::vector<uint64_t> SessionStore::read_manifest(SessionId sid) {
  const Meta& meta = meta_.at(sid);
  const DiskRecord rec = *meta.disk;
  const kvret_config& c = ctx_.config();
  auto manifest = disk_->get(manifest_key(rec.stem));
  require(manifest.has_value(), KVRET_ERR_CORRUPT,
          "session store: the manifest of session '" + meta.id + "' is missing from " + disk_->dir());
  ByteReader r(manifest->data(), manifest->size());
  read_header(r, kManifestTag, kLayoutVersion);
  const auto id = r.array<char>();
  require_intact(std::string(id.begin(), id.end()) == meta.id, "a manifest of another session");
  require_intact(r.value<uint64_t>() == rec.generation, "a manifest of another save");
  (void)r.value<int64_t>();
  (void)r.value<uint64_t>();
  require_intact(r.array<int32_t>() == fingerprint(c), "a session of another model configuration");
  return r.array<uint64_t>(c.n_layers);
}

std::unique_ptr<Sequence> SessionStore::read_session(SessionId sid) {
  const Meta& meta = meta_.at(sid);
  const DiskRecord rec = *meta.disk;
  const kvret_config& c = ctx_.config();
  const std::vector<uint64_t> sizes = read_manifest(sid);
  auto seq = std::make_unique<Sequence>(ctx_, Sequence::ForkTag{});
  seq->layers_.resize(static_cast<size_t>(c.n_layers));
  load_layers(*seq, meta.id, rec, sizes, 0, c.n_layers, nullptr);
  return seq;
}

void SessionStore::load_layers(Sequence& seq, const std::string& id, const DiskRecord& rec,
                               const std::vector<uint64_t>& sizes, int32_t from, int32_t to, LayerLoad* load) {
  const std::shared_ptr<const rope::Rope> rope = rope_of(ctx_.config());  // one for every layer, as a new sequence has
  for (int32_t l = from; l < to; ++l) {
    if (load != nullptr) {
      if (load->cancelled()) return;
      if (const LayerLoadHook hook = g_layer_load_hook.load()) hook(id.c_str(), l);
    }
    auto blob = disk_->get(layer_key(rec.stem, rec.generation, l));
    require(blob.has_value(), KVRET_ERR_CORRUPT,
            "session store: layer " + std::to_string(l) + " of session '" + id + "' is missing");
    require_intact(blob->size() == sizes[static_cast<size_t>(l)], "a layer blob of another size than its manifest's");
    std::unique_ptr<LayerState> layer = make_layer(seq, l, rec, *blob, rope);
    blob.reset();
    const int64_t bytes = layer->store().bytes();
    const int64_t tokens = layer->store().size();
    ctx_.reserve_host_bytes(bytes);
    // no throw below
    seq.layers_[static_cast<size_t>(l)] = std::move(layer);
    seq.stats_.host_bytes += bytes;
    seq.stats_.tokens_stored += tokens;
    if (load != nullptr) load->set_ready(l + 1);
  }
}

std::unique_ptr<Sequence> SessionStore::open_disk(SessionId sid) {
  const Meta& meta = meta_.at(sid);
  const DiskRecord rec = *meta.disk;
  const std::string id = meta.id;
  const int32_t n_layers = ctx_.config().n_layers;
  const std::vector<uint64_t> sizes = read_manifest(sid);
  auto seq = std::make_unique<Sequence>(ctx_, Sequence::ForkTag{});
  seq->layers_.resize(static_cast<size_t>(n_layers));
  // Layer 0 now: a session whose first layer is damaged is refused by the open itself.
  load_layers(*seq, id, rec, sizes, 0, 1, nullptr);
  if (n_layers == 1) return seq;
  auto load = std::make_shared<LayerLoad>(n_layers, 1);
  const auto pin = std::make_pair(rec.stem, rec.generation);
  loads_.erase(std::remove_if(loads_.begin(), loads_.end(), [](const auto& w) { return w.expired(); }), loads_.end());
  loads_.push_back(load);
  ++readers_[pin];
  Sequence* target = seq.get();
  try {
    load->start([this, target, load_ptr = load.get(), id, rec, sizes, n_layers] {
      kvret_status status = KVRET_OK;
      std::string message;
      try {
        load_layers(*target, id, rec, sizes, 1, n_layers, load_ptr);
      } catch (...) {
        status = current_exception_status(message);
      }
      end_load(id, rec, status);  // a corrupt session is dropped before any call hears of it
      if (status != KVRET_OK) {
        try {
          message = "session store: loading layer " + std::to_string(load_ptr->ready()) + " of the session '" + id +
                    "' from disk: " + message;
        } catch (...) {
        }
        load_ptr->fail(status, message);
      }
    });
  } catch (const std::system_error&) {
    // No thread: every layer now, on the caller's thread.
    loads_.pop_back();
    unpin(rec);
    load_layers(*seq, id, rec, sizes, 1, n_layers, nullptr);
    return seq;
  } catch (...) {
    loads_.pop_back();
    unpin(rec);
    throw;
  }
  seq->load_ = std::move(load);
  return seq;
}

void SessionStore::unpin(const DiskRecord& rec) noexcept {
  const auto pin = std::make_pair(rec.stem, rec.generation);
  const auto it = readers_.find(pin);
  if (it == readers_.end() || --it->second > 0) return;
  readers_.erase(it);
  for (auto d = deferred_removals_.begin(); d != deferred_removals_.end();) {
    if (d->first != pin) {
      ++d;
      continue;
    }
    try {
      disk_->remove(d->second);
    } catch (...) {
      keep_failure(std::current_exception());
    }
    d = deferred_removals_.erase(d);
  }
}

void SessionStore::end_load(const std::string& id, const DiskRecord& rec, kvret_status status) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (status == KVRET_ERR_CORRUPT) {
    // A layer failed its checks after the open returned: the session is dropped (when the store still holds this
    // save of it), as an open that finds it so drops it.
    const auto it = ids_.find(id);
    if (it != ids_.end()) {
      const auto m = meta_.find(it->second);
      if (m != meta_.end() && m->second.disk && m->second.disk->stem == rec.stem &&
          m->second.disk->generation == rec.generation) {
        try {
          drop_session(it->second);
        } catch (...) {
        }
        ++counters_.corrupt;
      }
    }
  }
  unpin(rec);
}

void SessionStore::apply(Placement next, std::optional<SessionId> saved, std::unique_ptr<Sequence> copy) {
  std::vector<SessionId> to_write, to_load, dropped;
  for (const Tier from : {Tier::dram, Tier::disk})
    for (const SessionId s : placement_.sessions(from)) {
      if (saved && s == *saved) continue;
      const Tier to = next.where(s);
      if (from == Tier::dram && to == Tier::disk) to_write.push_back(s);
      if (from == Tier::disk && to == Tier::dram) to_load.push_back(s);
      if (to == Tier::miss) dropped.push_back(s);
    }
  // Reads, then writes (the saved session's last: it may replace a manifest, which cannot be undone).
  std::unordered_map<SessionId, std::unique_ptr<Sequence>> loaded;
  for (const SessionId s : to_load) {
    try {
      if (const auto e = evicting_.find(s); e != evicting_.end())
        loaded[s] = e->second->copy->fork();  // its files are not written (yet): its DRAM copy
      else
        loaded[s] = read_session(s);
    } catch (const Error& e) {
      if (e.status() == KVRET_ERR_CORRUPT) {
        drop_session(s);
        ++counters_.corrupt;
      }
      throw;
    }
  }
  // Evictions DRAM -> disk go to the background writer: their DRAM copies serve them until their files are
  // written. So does the saved session when it goes to disk itself and is not larger than the DRAM tier (its copy
  // then counts in the writer's bound as an eviction's does); a larger one, or any when the writer cannot start,
  // is written in the call.
  const bool saved_to_disk = saved && next.where(*saved) == Tier::disk;
  const uint64_t dram_bytes = static_cast<uint64_t>(std::max<int64_t>(0, ctx_.config().session_dram_bytes));
  bool saved_by_writer = saved_to_disk && copy && dram_bytes > 0 && next.bytes_of(*saved) <= dram_bytes;
  std::vector<std::shared_ptr<DiskWrite>> evictions;
  std::shared_ptr<DiskWrite> saved_job;
  std::vector<std::string> eviction_stems;
  if (!to_write.empty() || saved_by_writer) {
    bool writer = false;
    {
      std::lock_guard<std::mutex> wlock(wmu_);
      writer = start_writer();
    }
    if (writer) {
      for (const SessionId s : to_write) {
        auto job = std::make_shared<DiskWrite>();
        job->sid = s;
        job->meta = meta_.at(s);
        job->rec = next_record(s, eviction_stems);
        job->bytes = placement_.bytes_of(s);
        eviction_stems.push_back(job->rec.stem);
        evictions.push_back(std::move(job));
      }
      to_write.clear();
      if (saved_by_writer) {
        saved_job = std::make_shared<DiskWrite>();
        saved_job->sid = *saved;
        saved_job->meta = meta_.at(*saved);
        saved_job->rec = next_record(*saved, eviction_stems);
        saved_job->bytes = next.bytes_of(*saved);
      }
    } else {
      saved_by_writer = false;
    }
  }
  std::vector<std::pair<SessionId, DiskRecord>> written;
  try {
    for (const SessionId s : to_write) written.emplace_back(s, write_session(s, *dram_.at(s)));
    if (saved_to_disk && !saved_by_writer) written.emplace_back(*saved, write_session(*saved, *copy, eviction_stems));
  } catch (...) {
    for (const auto& [s, rec] : written) remove_blobs(rec, ctx_.config().n_layers, true);
    throw;
  }
  // Commit. Nothing below throws but bad_alloc of the maps (then DRAM copies are still held, as the old state).
  const int32_t n_layers = ctx_.config().n_layers;
  placement_ = std::move(next);
  if (saved) cancel_eviction(*saved);  // an eviction of its older save still in flight
  for (auto& [s, rec] : written) {
    Meta& m = meta_.at(s);
    if (m.disk) remove_blobs(*m.disk, n_layers, false);  // the old generation's layers (its manifest is replaced)
    m.disk = rec;
    dram_.erase(s);
    if (!saved || s != *saved) ++counters_.evictions;
  }
  for (auto& [s, seq] : loaded) {
    Meta& m = meta_.at(s);
    cancel_eviction(s);
    if (m.disk) remove_blobs(*m.disk, n_layers, true);
    m.disk.reset();
    dram_[s] = std::move(seq);
  }
  for (const std::shared_ptr<DiskWrite>& job : evictions) {
    job->copy = std::move(dram_.at(job->sid));
    dram_.erase(job->sid);
    evicting_[job->sid] = job;
    ++counters_.evictions;
  }
  if (saved_job) {  // its copy serves it until its files are written; an older disk copy stays until then
    saved_job->copy = std::move(copy);
    dram_.erase(*saved);
    evicting_[*saved] = saved_job;
    evictions.push_back(saved_job);
  }
  if (!evictions.empty()) {
    {
      std::lock_guard<std::mutex> wlock(wmu_);
      for (const std::shared_ptr<DiskWrite>& job : evictions) {
        disk_writes_.push_back(job);
        pending_bytes_ += job->bytes;
      }
    }
    wcv_.notify_all();
  }
  for (const SessionId s : dropped) {
    ++counters_.evictions;
    drop_session(s);
  }
  if (saved && placement_.where(*saved) == Tier::dram) {
    Meta& m = meta_.at(*saved);
    if (m.disk) {
      remove_blobs(*m.disk, n_layers, true);
      m.disk.reset();
    }
    dram_[*saved] = std::move(copy);
  }
}

void SessionStore::save(Sequence& seq, const std::string& id) {
  const kvret_config& c = ctx_.config();
  require(c.hamming_fraction == 0.0f, KVRET_ERR_UNSUPPORTED,
          "kvret_session_save: a sequence with KVCrush's signatures (config.hamming_fraction > 0) cannot be saved");
  require(!seq.holds_importance_inputs(), KVRET_ERR_UNSUPPORTED,
          "kvret_session_save: a sequence with KVCrush's importance inputs (a query window given to kvret_seq_observe "
          "or attention accumulated under config.hamming_importance) cannot be saved");
  seq.wait_loaded();  // not under the lock: a loader that fails takes it (to drop its session) before reporting
  if ((shared_ || disk_) && c.session_dram_bytes > 0) {
    // The writer's copies hold at most session_dram_bytes (plus what one save adds): wait for room.
    std::unique_lock<std::mutex> wlock(wmu_);
    wcv_.wait(wlock, [&] { return pending_bytes_ < static_cast<uint64_t>(c.session_dram_bytes) || wstop_; });
  }
  std::unique_lock<std::mutex> lock(mu_);
  expire_now();
  std::unique_ptr<Sequence> copy = seq.fork();  // waits for the builds; shares the pages
  const uint64_t bytes = session_bytes(*copy);
  const bool known = ids_.count(id) != 0;
  const SessionId sid = id_of(id);
  try {
    Placement next = placement_;
    const Tier tier = next.save(sid, bytes, queue_);
    if (tier == Tier::miss) {
      std::string m = "kvret_session_save: the session of " + std::to_string(bytes) +
                      " bytes fits no tier (config.session_dram_bytes = " + std::to_string(c.session_dram_bytes);
      m += disk_ ? ", config.session_disk_bytes = " + std::to_string(c.session_disk_bytes) + ")" : ", no disk tier)";
      throw Error(KVRET_ERR_CAPACITY, m);
    }
    const bool had_meta = meta_.count(sid) != 0;
    Meta old;
    if (had_meta) old = meta_.at(sid);
    Meta& m = meta_[sid];
    m.id = id;
    m.bytes = bytes;
    m.expires_ms = c.session_ttl_ms > 0 ? now_ms() + c.session_ttl_ms : 0;
    try {
      apply(std::move(next), sid, std::move(copy));
    } catch (...) {
      if (had_meta)
        meta_[sid] = old;
      else
        meta_.erase(sid);
      throw;
    }
  } catch (...) {
    if (!known) forget_if_unused(sid);
    throw;
  }
  ++counters_.saves;
  retry_failed_writes();
  if (shared_) {
    // Write-through, now that the local tiers hold the session: by the background writer, on a fork of the
    // sequence; now, when the fork or the writer cannot be had. A failure leaves the local tiers so and is kept
    // for flush.
    Meta& m = meta_.at(sid);
    m.save_serial = ++save_serial_;
    std::unique_ptr<Sequence> wcopy;
    bool queued = false;
    try {
      wcopy = seq.fork();
      queued = queue_write(m, wcopy, bytes);
    } catch (...) {
    }
    m.shared = kSharedBehind;  // until the write-through is done, the local copy is the newer
    if (queued) return;
    // Done here, without the store's lock (other threads' session calls do not wait for the round trips).
    const Meta saved = m;
    lock.unlock();
    SharedWrite job;  // not queued: nothing marks it dropped; its cleanup failure is kept below
    uint64_t generation = 0;
    std::exception_ptr failure;
    try {
      generation = write_shared(seq, saved, &job);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (job.cleanup) keep_failure(job.cleanup, "session store cleanup (shared tier)");
    if (failure) {
      ++counters_.write_failures;
      keep_failure(failure, "kvret_session_save: the write-through to the shared tier");
      return;
    }
    ++counters_.shared_writes;
    if (const auto i = ids_.find(id); i != ids_.end())
      if (const auto s = meta_.find(i->second); s != meta_.end() && s->second.save_serial == saved.save_serial)
        s->second.shared = generation;  // the shared tier names this very save
  }
}

std::unique_ptr<Sequence> SessionStore::open(const std::string& id) {
  // The shared tier's round trips run without the store's lock; the local state is looked at again after them.
  std::unique_lock<std::mutex> lock(mu_);
  SessionId sid = 0;
  for (int pass = 0;; ++pass) {
    expire_now();
    const auto it = ids_.find(id);
    if (it == ids_.end() || placement_.where(it->second) == Tier::miss) {
      if (shared_) {
        lock.unlock();
        try {
          std::unique_ptr<Sequence> seq = read_shared(id);
          lock.lock();
          ++counters_.hits_shared;
          return seq;
        } catch (const Error& e) {
          if (e.status() == KVRET_ERR_NOT_FOUND) {
            lock.lock();
            ++counters_.misses;
          }
          throw;
        }
      }
      ++counters_.misses;
      throw Error(KVRET_ERR_NOT_FOUND, "kvret_session_open: no saved session '" + id + "'");
    }
    sid = it->second;
    if (!shared_ || meta_.at(sid).shared == kSharedBehind || pass == 2) break;
    // Another node may have saved a later turn: the local copy serves only when the shared tier names the same
    // save (or has none, or cannot be asked).
    const uint64_t local_generation = meta_.at(sid).shared;
    const uint64_t serial = meta_.at(sid).save_serial;
    lock.unlock();
    std::optional<SharedManifest> current;
    try {
      current = shared_manifest(id);
    } catch (const Error&) {
    }
    std::unique_ptr<Sequence> newer;
    if (current && current->same_config && current->generation != local_generation) {
      try {
        newer = read_shared(id);
      } catch (const Error& e) {
        if (e.status() != KVRET_ERR_NOT_FOUND) throw;  // gone meanwhile: the local copy serves
      }
    }
    lock.lock();
    expire_now();
    const auto again = ids_.find(id);
    const auto meta = again == ids_.end() ? meta_.end() : meta_.find(again->second);
    const bool same = meta != meta_.end() && again->second == sid && meta->second.save_serial == serial &&
                      placement_.where(sid) != Tier::miss;  // the local copy asked about is still there
    if (newer) {
      if (same && meta->second.shared != kSharedUnknown) drop_session(sid);  // a copy of an older save
      ++counters_.hits_shared;
      return newer;
    }
    if (same) break;
    // saved, dropped or evicted meanwhile: look again (the last pass serves the local copy without asking)
  }
  if (placement_.where(sid) == Tier::dram) {
    std::unique_ptr<Sequence> seq = dram_.at(sid)->fork();
    placement_.access(sid);
    ++counters_.hits_dram;
    return seq;
  }
  if (const auto e = evicting_.find(sid); e != evicting_.end()) {
    // On disk for placement, its files not written yet (or their write failed): its DRAM copy serves.
    std::unique_ptr<Sequence> seq = e->second->copy->fork();
    placement_.access(sid);
    ++counters_.hits_dram;
    return seq;
  }
  std::unique_ptr<Sequence> seq;
  try {
    seq = open_disk(sid);
  } catch (const Error& e) {
    if (e.status() == KVRET_ERR_CORRUPT) {
      drop_session(sid);
      ++counters_.corrupt;
    }
    throw;
  }
  placement_.access(sid);
  ++counters_.hits_disk;
  return seq;
}

void SessionStore::drop(const std::string& id) {
  std::unique_lock<std::mutex> lock(mu_);
  expire_now();
  const auto it = ids_.find(id);
  const bool local = it != ids_.end() && placement_.where(it->second) != Tier::miss;
  std::vector<std::shared_ptr<SharedWrite>> cancelled;  // freed after the lock
  if (shared_) {
    // The writer's jobs of this id: the queued ones go, the running one writes no manifest (or has written it,
    // and remove_shared below removes it).
    std::lock_guard<std::mutex> wlock(wmu_);
    for (auto w = writes_.begin(); w != writes_.end();) {
      if ((*w)->id == id) {
        pending_bytes_ -= (*w)->bytes;
        cancelled.push_back(std::move(*w));
        w = writes_.erase(w);
      } else {
        ++w;
      }
    }
    if (writing_ && writing_->id == id) writing_->dropped = true;
  }
  if (!cancelled.empty()) wcv_.notify_all();
  if (local) drop_session(it->second);
  if (!shared_) {
    require(local, KVRET_ERR_NOT_FOUND, "kvret_session_drop: no saved session '" + id + "'");
    return;
  }
  // The local copy is gone; the shared tier's copy goes without the store's lock (its round trips).
  lock.unlock();
  bool shared = false;
  try {
    shared = remove_shared(id);
  } catch (...) {
    if (!local) throw;  // the shared tier was all there was to drop
    lock.lock();
    keep_failure(std::current_exception(), "kvret_session_drop: the shared tier");
    return;
  }
  require(local || shared, KVRET_ERR_NOT_FOUND, "kvret_session_drop: no saved session '" + id + "'");
}

void SessionStore::schedule(const std::vector<std::string>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_now();
  std::vector<SessionId> queue;
  queue.reserve(ids.size());
  std::vector<std::string> added;
  try {
    for (const std::string& id : ids) {
      if (ids_.count(id) == 0) added.push_back(id);
      queue.push_back(id_of(id));
    }
    if (placement_.config().policy == Policy::scheduler_aware) {
      Placement next = placement_;
      next.prefetch(queue);
      apply(std::move(next), std::nullopt, nullptr);
    }
    retry_failed_writes();
  } catch (...) {
    for (const std::string& id : added) {
      const auto it = ids_.find(id);
      if (it != ids_.end() && meta_.count(it->second) == 0 &&
          std::find(queue_.begin(), queue_.end(), it->second) == queue_.end())
        ids_.erase(it);
    }
    throw;
  }
  queue_ = std::move(queue);
  // Names neither stored nor queued are forgotten.
  const std::unordered_set<SessionId> queued(queue_.begin(), queue_.end());
  for (auto it = ids_.begin(); it != ids_.end();)
    if (meta_.count(it->second) == 0 && queued.count(it->second) == 0)
      it = ids_.erase(it);
    else
      ++it;
}

kvret_session_tier SessionStore::where(const std::string& id) {
  std::unique_lock<std::mutex> lock(mu_);
  expire_now();
  const auto it = ids_.find(id);
  if (it != ids_.end()) {
    const Tier tier = placement_.where(it->second);
    if (tier == Tier::dram) return KVRET_TIER_DRAM;
    // On disk for placement, but its files are not complete (the writer has not written them, or failed to): its
    // DRAM copy is what serves it.
    if (tier == Tier::disk) return evicting_.count(it->second) != 0 ? KVRET_TIER_DRAM : KVRET_TIER_DISK;
  }
  if (shared_) {
    lock.unlock();  // the round trip runs without the store's lock
    try {
      const std::optional<SharedManifest> m = shared_manifest(id);
      if (m && m->same_config) return KVRET_TIER_SHARED;
    } catch (const Error& e) {
      if (e.status() != KVRET_ERR_CORRUPT) throw;  // a damaged manifest: opening it reports (and drops) it
    }
  }
  return KVRET_TIER_NONE;
}

void SessionStore::account_restored(Sequence& seq) {
  int64_t host_bytes = 0, tokens = 0;
  for (const auto& l : seq.layers_) {
    host_bytes += l->store().bytes();
    tokens += l->store().size();
  }
  ctx_.reserve_host_bytes(host_bytes);
  // no throw below
  seq.stats_.host_bytes = host_bytes;
  seq.stats_.tokens_stored = tokens;
}

void SessionStore::add_stats(kvret_stats* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t dram_bytes = 0, dram_sessions = 0, disk_sessions = 0;
  for (const SessionId s : placement_.sessions(Tier::dram)) {
    dram_bytes += static_cast<int64_t>(placement_.bytes_of(s));
    ++dram_sessions;
  }
  disk_sessions = static_cast<int64_t>(placement_.sessions(Tier::disk).size());
#define KVRET_SET(field, value) \
  if (out->struct_size >= offsetof(kvret_stats, field) + sizeof out->field) out->field += (value)
  if (disk_) {
    KVRET_SET(disk_bytes, disk_->bytes());
    KVRET_SET(disk_reads, disk_->reads());
    KVRET_SET(disk_writes, disk_->writes());
  }
  KVRET_SET(session_saves, counters_.saves);
  KVRET_SET(session_hits_dram, counters_.hits_dram);
  KVRET_SET(session_hits_disk, counters_.hits_disk);
  KVRET_SET(session_misses, counters_.misses);
  KVRET_SET(session_evictions, counters_.evictions);
  KVRET_SET(session_expired, counters_.expired);
  KVRET_SET(session_corrupt, counters_.corrupt);
  KVRET_SET(session_dram_bytes, dram_bytes);
  KVRET_SET(session_dram_count, dram_sessions);
  KVRET_SET(session_disk_count, disk_sessions);
  KVRET_SET(session_hits_shared, counters_.hits_shared);
  KVRET_SET(session_shared_writes, counters_.shared_writes);
  KVRET_SET(session_write_failures, counters_.write_failures);
#undef KVRET_SET
}

}  // namespace kvret::session
