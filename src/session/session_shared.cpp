// The session store's shared tier (a BlobTier such as Redis, docs/redis.md): manifests and layers keyed the same on
// every node (session_store.hpp).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/serial.hpp"
#include "session/session_layout.hpp"
#include "session/session_store.hpp"

namespace kvret::session {

using namespace session_detail;  // NOLINT: the layout's helpers (session_layout.hpp)

std::optional<SessionStore::SharedManifest> SessionStore::shared_manifest(const std::string& id) {
  const std::optional<std::vector<std::byte>> bytes = shared_->get(manifest_key(shared_stem(id)));
  if (!bytes) return std::nullopt;
  SharedManifest m;
  ByteReader r(bytes->data(), bytes->size());
  read_header(r, kManifestTag, kLayoutVersion);
  const auto id_chars = r.array<char>();
  m.id.assign(id_chars.begin(), id_chars.end());
  m.generation = r.value<uint64_t>();
  m.expires_ms = r.value<int64_t>();
  (void)r.value<uint64_t>();
  m.same_config = r.array<int32_t>() == fingerprint(ctx_.config());
  m.sizes = r.array<uint64_t>();
  require_intact(r.left() == 0, "trailing bytes after a shared manifest");
  require_intact(m.id == id, "a shared manifest of another session");
  if (m.expires_ms != 0 && now_ms() >= m.expires_ms) return std::nullopt;
  return m;
}

uint64_t SessionStore::write_shared(const Sequence& seq, const Meta& meta, SharedWrite* job) {
  const int32_t n_layers = ctx_.config().n_layers;
  const std::string stem = shared_stem(meta.id);
  // The save this one replaces (its layers go once the new manifest is in); a damaged manifest is simply replaced.
  std::optional<SharedManifest> old;
  try {
    old = shared_manifest(meta.id);
  } catch (const Error& e) {
    if (e.status() != KVRET_ERR_CORRUPT) throw;
  }
  const uint64_t generation = new_generation();
  // every blob expires when the session does (expires_ms was set at the start of the save)
  const auto ttl = [&] { return meta.expires_ms == 0 ? int64_t{0} : std::max<int64_t>(1, meta.expires_ms - now_ms()); };
  std::vector<uint64_t> sizes;
  int32_t written = 0;
  const auto remove_written = [&] {  // no manifest names them; a tier that stopped answering keeps them
    for (int32_t l = 0; l < written; ++l) {
      try {
        shared_->remove(shared_layer_key(stem, generation, l));
      } catch (...) {
        break;
      }
    }
  };
  bool dropped = false;
  try {
    for (int32_t l = 0; l < n_layers; ++l) {
      const std::vector<std::byte> blob = layer_blob(seq, l, generation);
      shared_->put(shared_layer_key(stem, generation, l), blob.data(), blob.size(), ttl());
      ++written;
      sizes.push_back(blob.size());
    }
    const std::vector<std::byte> manifest = manifest_bytes(meta, DiskRecord{stem, generation}, sizes);
    const auto was_dropped = [&] {  // a drop of this id marks the job under wmu_ before it removes the manifest
      std::lock_guard<std::mutex> wlock(wmu_);
      return job->dropped;
    };
    dropped = was_dropped();
    if (!dropped) {
      shared_->put(manifest_key(stem), manifest.data(), manifest.size(), ttl());
      // A drop that came during the put may have read the manifest before it was in: this save takes it back.
      if (was_dropped()) {
        dropped = true;
        try {
          const std::optional<SharedManifest> now = shared_manifest(meta.id);
          if (now && now->generation == generation) shared_->remove(manifest_key(stem));
        } catch (...) {
          job->cleanup = std::current_exception();
        }
      }
    }
  } catch (...) {
    remove_written();
    {
      std::lock_guard<std::mutex> wlock(wmu_);
      if (job->dropped) return 0;  // not a failure: the session was dropped meanwhile
    }
    throw;
  }
  if (dropped) {
    remove_written();
    return 0;
  }
  if (old && old->generation != generation)
    for (size_t l = 0; l < old->sizes.size(); ++l) {
      try {
        shared_->remove(shared_layer_key(stem, old->generation, static_cast<int32_t>(l)));
      } catch (...) {
        if (!job->cleanup) job->cleanup = std::current_exception();
      }
    }
  return generation;
}

std::unique_ptr<Sequence> SessionStore::read_shared(const std::string& id) {
  const kvret_config& c = ctx_.config();
  const std::string stem = shared_stem(id);
  std::optional<uint64_t> incomplete;  // the generation a read found a layer of missing
  for (int attempt = 0; attempt < 4; ++attempt) {
    try {
      const std::optional<SharedManifest> m = shared_manifest(id);
      if (!m || !m->same_config)
        throw Error(KVRET_ERR_NOT_FOUND,
                    m ? "kvret_session_open: the session '" + id +
                            "' in the shared tier was saved by a context of another "
                            "configuration (model shapes, index kind, sink, local, RoPE)"
                      : "kvret_session_open: no saved session '" + id + "' (nor in the shared tier)");
      if (incomplete && *incomplete == m->generation) break;  // the same save still lacks a layer: gone for good
      require_intact(m->sizes.size() == static_cast<size_t>(c.n_layers), "a shared manifest of another layer count");
      auto seq = std::make_unique<Sequence>(ctx_, Sequence::ForkTag{});
      seq->layers_.reserve(static_cast<size_t>(c.n_layers));
      const std::shared_ptr<const rope::Rope> rope = rope_of(c);
      const DiskRecord rec{stem, m->generation};
      bool complete = true;
      for (int32_t l = 0; l < c.n_layers && complete; ++l) {
        auto blob = shared_->get(shared_layer_key(stem, m->generation, l));
        complete = blob.has_value();  // replaced by a later save or expired meanwhile: the manifest again
        if (!complete) break;
        require_intact(blob->size() == m->sizes[static_cast<size_t>(l)],
                       "a shared layer blob of another size than its manifest's");
        restore_layer(*seq, l, rec, *blob, rope);
      }
      if (!complete) {
        incomplete = m->generation;
        continue;
      }
      account_restored(*seq);
      return seq;
    } catch (const Error& e) {
      if (e.status() == KVRET_ERR_CORRUPT) {  // dropped, as a local one is: the next open is a miss
        std::exception_ptr cleanup;
        try {
          remove_shared(id);
        } catch (...) {
          cleanup = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(mu_);
        ++counters_.corrupt;
        if (cleanup) keep_failure(cleanup, "session store cleanup (shared tier)");
      }
      throw;
    }
  }
  throw Error(KVRET_ERR_NOT_FOUND,
              "kvret_session_open: the session '" + id + "' lost a layer in the shared tier (expired or evicted)");
}

bool SessionStore::remove_shared(const std::string& id) {
  const std::string stem = shared_stem(id);
  std::optional<SharedManifest> m;
  try {
    m = shared_manifest(id);
  } catch (const Error& e) {
    if (e.status() != KVRET_ERR_CORRUPT) throw;
  }
  // the manifest first: a reader then misses the session instead of finding a layer gone
  const bool had = shared_->remove(manifest_key(stem));
  if (m)
    for (size_t l = 0; l < m->sizes.size(); ++l) {
      try {
        shared_->remove(shared_layer_key(stem, m->generation, static_cast<int32_t>(l)));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        keep_failure(std::current_exception(), "session store cleanup (shared tier)");
      }
    }
  return had;
}

}  // namespace kvret::session
