#pragma once
// The session store of a context (AttentionStore; docs/sessions.md): saved sequences under string ids, in a host
// DRAM tier (a saved session is a fork of the sequence: its KV pages shared copy on write, its index copied) and a
// disk tier (DiskTier under config.disk_path: one blob per layer, then a manifest blob naming them). Placement (the
// policy model) decides which session goes where; the store carries its decisions out on the bytes.
//
// Opening a session from disk checks its manifest and loads layer 0, then returns a sequence whose other layers a
// loader thread (a LayerLoad) brings in, in layer order; the sequence's calls on a layer wait for it. The layer
// blobs a loader reads are pinned: removing them (a re-save, an eviction, a drop) is deferred until it ends.
//
// Every public call takes the store's lock and has the strong guarantee; no call holds it across a round trip to
// the shared tier (open, where, drop and a save's write-through in the call release it and look at the local state
// again after), so a slow Redis server never holds up the calls on local sessions. The files of a session a decision
// puts on disk (one it evicts from DRAM, or the saved one when it is not larger than the DRAM tier) are written by the
// background writer from a DRAM copy, which serves the session until its manifest is written (under the lock, so a
// drop or a re-save meanwhile never races it); where() reports DRAM until then. A failed write leaves the session
// on that copy and is queued again by the next save or schedule, kEvictionTries writes in all. A saved session
// larger than the DRAM tier (or any, when the writer cannot start) is written in the call, and a failure there is
// undone. flush waits for the writer and reports its failures and the cleanups'.
//
// The shared tier (config.session_shared_url: a RedisTier; docs/redis.md) is outside placement: a save writes the
// session through to it once the local tiers hold it (by the background writer, or in the call when the writer cannot
// be had; a failure is kept for flush, the local save stands), and open, where and drop look there on a local miss. Its
// keys depend on the session id only (the hex of its bytes), so every node finds them; each save writes its layers
// under a random generation and then the manifest naming it.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/context.hpp"
#include "engine/layer_load.hpp"
#include "engine/sequence.hpp"
#include "kvret.h"
#include "session/blob_tier.hpp"
#include "session/disk_tier.hpp"
#include "session/placement.hpp"

namespace kvret::session {

/// The most bytes of a session id.
constexpr size_t kMaxSessionIdBytes = 255;

/// For tests: when set, the background loader of a session opened from disk calls it (with the session id and the
/// layer) before it reads each layer, on the loader's thread. Null: none.
using LayerLoadHook = void (*)(const char* id, int32_t layer);
extern std::atomic<LayerLoadHook> g_layer_load_hook;

/// For tests: when set, the background writer calls it (with the session id) before it writes the files of a
/// session evicted from DRAM, on the writer's thread. Null: none.
using DiskWriteHook = void (*)(const char* id);
extern std::atomic<DiskWriteHook> g_disk_write_hook;

/// For tests: when set, a store whose context names a shared tier (config.session_shared_url) takes the tier this
/// returns instead of connecting to the URL. Null: none.
using SharedTierFactory = std::unique_ptr<BlobTier> (*)();
extern std::atomic<SharedTierFactory> g_shared_tier_factory;

struct SessionCounters {
  int64_t saves = 0;
  int64_t hits_dram = 0;
  int64_t hits_disk = 0;
  int64_t misses = 0;
  int64_t evictions = 0;  ///< sessions moved out of DRAM to disk, or dropped from a tier, to make room
  int64_t expired = 0;
  int64_t corrupt = 0;         ///< sessions dropped because their bytes failed a check
  int64_t hits_shared = 0;     ///< opens served from the shared tier
  int64_t shared_writes = 0;   ///< saves written through to the shared tier
  int64_t write_failures = 0;  ///< writes below DRAM that failed (evictions to disk, write-throughs)
};

class SessionStore {
 public:
  /// Opens the disk tier at ctx.disk_path() (when set) and registers the sessions a previous store left there.
  explicit SessionStore(Context& ctx);
  ~SessionStore();
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  /// Throws KVRET_ERR_INVALID_ARGUMENT unless `id` is a valid session id (`what` names it in the message).
  static std::string check_id(const char* id, const char* what);

  void save(Sequence& seq, const std::string& id);
  /// A new sequence (not adopted by the context) holding the session. KVRET_ERR_NOT_FOUND when there is none.
  std::unique_ptr<Sequence> open(const std::string& id);
  void drop(const std::string& id);
  void schedule(const std::vector<std::string>& ids);
  kvret_session_tier where(const std::string& id);
  /// Waits for the background writer's queue, then reports (and clears) the first failure of a write-through or a
  /// cleanup since the last flush.
  void flush();

  /// Replaces the shared tier (the constructor opens the one config.session_shared_url names); nullptr: none.
  void set_shared_tier(std::unique_ptr<BlobTier> tier);

  /// Adds the session counters and the disk tier's figures to a context's stats (fields within struct_size).
  void add_stats(kvret_stats* out) const;

 private:
  /// Where a session's disk copy is: its key stem and the generation of its layer blobs.
  struct DiskRecord {
    std::string stem;
    uint64_t generation = 0;
  };
  /// Meta::shared: the local copy's relation to the shared tier's.
  static constexpr uint64_t kSharedUnknown = 0;          ///< not known (found on disk by a new store)
  static constexpr uint64_t kSharedBehind = UINT64_MAX;  ///< the write-through failed: the local copy is newer
  struct Meta {
    std::string id;
    uint64_t bytes = 0;
    int64_t expires_ms = 0;  ///< system-clock ms; 0 = never
    std::optional<DiskRecord> disk;
    uint64_t shared = kSharedUnknown;  ///< else the generation of the shared tier's copy of this same save
    uint64_t save_serial = 0;          ///< which save of the store this is (the writer's job names it)
  };
  /// An eviction to disk the background writer does: the session's DRAM copy (which serves it meanwhile) and
  /// where its files go.
  struct DiskWrite {
    SessionId sid = 0;
    Meta meta;
    DiskRecord rec;
    std::unique_ptr<Sequence> copy;
    uint64_t bytes = 0;
    std::atomic<bool> cancelled{false};  ///< dropped, saved again or moved back to DRAM meanwhile
    bool failed = false;                 ///< its last write failed and it is not queued again (guarded by mu_)
    int tries = 0;                       ///< the writes of it that failed (guarded by mu_)
  };
  /// How many times the writer tries to write a session's files before it leaves it in DRAM for good (until it is
  /// dropped, saved again, moved back or expires).
  static constexpr int kEvictionTries = 3;
  /// A write-through the background writer does: a fork of the saved sequence and the save's Meta.
  struct SharedWrite {
    uint64_t serial = 0;
    std::string id;
    Meta meta;
    std::unique_ptr<Sequence> copy;
    uint64_t bytes = 0;
    bool dropped = false;        ///< dropped meanwhile: no manifest is written (guarded by wmu_)
    std::exception_ptr cleanup;  ///< the first failure removing the replaced save's layers
  };
  /// What a manifest of the shared tier says.
  struct SharedManifest {
    std::string id;
    uint64_t generation = 0;
    int64_t expires_ms = 0;
    bool same_config = false;  ///< saved by a context of this configuration (the fingerprint matches)
    std::vector<uint64_t> sizes;
  };

  SessionId id_of(const std::string& id);
  void forget_if_unused(SessionId sid);
  void expire_now();
  /// Removes a session from every tier (disk failures kept for flush).
  void drop_session(SessionId sid);
  void remove_blobs(const DiskRecord& rec, int32_t layers, bool manifest);
  /// Writes `seq` to disk as `sid` (generation after `meta.disk`'s); returns its record. On failure, nothing of
  /// it is left and the old copy stays. `also_used`: stems taken besides those the store knows.
  DiskRecord write_session(SessionId sid, const Sequence& seq, const std::vector<std::string>& also_used = {});
  /// Where `sid`'s next disk copy goes: the next generation of its stem, or a stem no other record uses.
  DiskRecord next_record(SessionId sid, const std::vector<std::string>& also_used) const;
  /// Writes the layer blobs of `seq`, then the manifest, as `rec`; on failure removes the layers it wrote.
  /// `cleanup` null: a removal failure is kept for flush (the lock held); else it is stored there.
  void write_blobs(const Sequence& seq, const Meta& meta, const DiskRecord& rec, std::exception_ptr* cleanup);
  /// The layer blobs of write_blobs alone; returns their sizes (for the manifest).
  std::vector<uint64_t> write_layers(const Sequence& seq, const DiskRecord& rec, std::exception_ptr* cleanup);
  /// Removes layers [0, count) of `rec` now (not deferred: no loader reads a save without its manifest).
  void remove_layers(const DiskRecord& rec, int32_t count, std::exception_ptr* cleanup);
  std::unique_ptr<Sequence> read_session(SessionId sid);
  /// The layer sizes the disk manifest of `sid` names, after checking it (KVRET_ERR_CORRUPT).
  std::vector<uint64_t> read_manifest(SessionId sid);
  /// Opens `sid` from disk: layer 0 now, the others by a loader thread (all now when it cannot start).
  std::unique_ptr<Sequence> open_disk(SessionId sid);
  /// Reads layers [from, to) of a disk session into `seq` (its layers_ sized already), accounting their bytes;
  /// with `load`, stops when it is cancelled and marks each layer ready. Throws the first failure.
  void load_layers(Sequence& seq, const std::string& id, const DiskRecord& rec, const std::vector<uint64_t>& sizes,
                   int32_t from, int32_t to, LayerLoad* load);
  /// The loader thread's end: a corrupt session dropped (when the store still holds that save), the pin released.
  void end_load(const std::string& id, const DiskRecord& rec, kvret_status status) noexcept;
  /// Removes a pinned save's deferred blobs once no loader reads it.
  void unpin(const DiskRecord& rec) noexcept;
  /// The state of layer `l` from its blob, its index restored (and counted in `seq`'s stats).
  std::unique_ptr<LayerState> make_layer(Sequence& seq, int32_t l, const DiskRecord& rec,
                                         const std::vector<std::byte>& blob,
                                         const std::shared_ptr<const rope::Rope>& rope);
  /// Adds layer `l` from its blob to `seq` (made with Sequence::ForkTag).
  void restore_layer(Sequence& seq, int32_t l, const DiskRecord& rec, const std::vector<std::byte>& blob,
                     const std::shared_ptr<const rope::Rope>& rope);
  /// Carries out the move from placement_ to `next` (the saved session `saved` with its copy, if any).
  void apply(Placement next, std::optional<SessionId> saved, std::unique_ptr<Sequence> copy);
  uint64_t session_bytes(const Sequence& seq) const;
  std::vector<std::byte> manifest_bytes(const Meta& meta, const DiskRecord& rec,
                                        const std::vector<uint64_t>& layer_sizes) const;
  void scan_disk();
  void keep_failure(const std::exception_ptr& e, const char* what = "session store cleanup") noexcept;

  /// The bytes of layer `l` of `seq` as a blob of save `generation`.
  std::vector<std::byte> layer_blob(const Sequence& seq, int32_t l, uint64_t generation) const;
  /// The shared tier's manifest of `id`; std::nullopt when it has none (or only an expired one).
  std::optional<SharedManifest> shared_manifest(const std::string& id);
  /// Writes `seq` (saved as `meta`) to the shared tier: layers under a new generation, then the manifest; then
  /// removes the replaced save's layers. Returns the generation. On failure the shared tier's old copy stays.
  /// The store's lock is not held. No manifest stays when `job` was dropped meanwhile (returns 0); a cleanup
  /// failure goes to job->cleanup.
  uint64_t write_shared(const Sequence& seq, const Meta& meta, SharedWrite* job);
  /// Queues the write-through of `copy` as the save `meta` (the lock held); false when the writer cannot start.
  bool queue_write(const Meta& meta, std::unique_ptr<Sequence>& copy, uint64_t bytes);
  /// The writer thread: runs the queued evictions and write-throughs in order until stopped with nothing queued.
  void writer_loop();
  /// Starts the writer thread if it is not running (wmu_ held); false when it cannot start or is stopping.
  bool start_writer();
  /// The end of a disk write the writer ran (the lock held; its manifest written when it succeeded): the session's
  /// record (its older save's layers removed), or, failed, the session left on its DRAM copy for a retry.
  void commit_disk_write(const std::shared_ptr<DiskWrite>& job, const std::exception_ptr& failure);
  /// Queues again the writes that failed fewer than kEvictionTries times (the lock held).
  void retry_failed_writes();
  /// Forgets an eviction of `sid` still in flight (its files are removed when the writer is done with it).
  void cancel_eviction(SessionId sid);
  /// Waits until the writer has nothing queued or running (the lock not held).
  void wait_writer();
  /// The session from the shared tier (a miss: KVRET_ERR_NOT_FOUND). A corrupt one is counted and removed from it.
  std::unique_ptr<Sequence> read_shared(const std::string& id);
  /// Removes `id`'s manifest and then its layers from the shared tier; false when it had none.
  bool remove_shared(const std::string& id);
  /// Sets the host bytes and tokens of a sequence restored layer by layer, accounting its bytes (may throw).
  void account_restored(Sequence& seq);

  Context& ctx_;
  mutable std::mutex mu_;
  Placement placement_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<BlobTier> shared_;
  std::unordered_map<std::string, SessionId> ids_;
  std::unordered_map<SessionId, Meta> meta_;
  std::unordered_map<SessionId, std::unique_ptr<Sequence>> dram_;
  std::vector<SessionId> queue_;
  SessionId next_id_ = 1;
  SessionCounters counters_;
  kvret_status deferred_status_ = KVRET_OK;
  std::string deferred_message_;
  /// The disk saves (stem, generation) background loaders are reading, with their count of loaders.
  std::map<std::pair<std::string, uint64_t>, int> readers_;
  /// Blob keys whose removal waits for the loaders of their save (the key of readers_, the blob key).
  std::vector<std::pair<std::pair<std::string, uint64_t>, std::string>> deferred_removals_;
  /// The loads started (stopped and joined by the destructor).
  std::vector<std::weak_ptr<LayerLoad>> loads_;
  uint64_t save_serial_ = 0;
  /// Sessions evicted to disk whose files the writer has not finished (or failed to write): their DRAM copies.
  std::unordered_map<SessionId, std::shared_ptr<DiskWrite>> evicting_;

  // The background writer of the write-through (docs/redis.md). Lock order: mu_, then wmu_; the writer never
  // holds wmu_ while it takes mu_.
  mutable std::mutex wmu_;
  std::condition_variable wcv_;
  std::deque<std::shared_ptr<SharedWrite>> writes_;     ///< queued, oldest first
  std::deque<std::shared_ptr<DiskWrite>> disk_writes_;  ///< evictions queued, oldest first
  std::shared_ptr<DiskWrite> disk_writing_;             ///< the one the writer runs
  std::shared_ptr<SharedWrite> writing_;                ///< the one the writer runs
  uint64_t pending_bytes_ = 0;                          ///< the sessions queued or running
  bool wstop_ = false;
  std::thread writer_;
};

}  // namespace kvret::session
