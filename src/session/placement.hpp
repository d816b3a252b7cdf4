// Where the saved KV of a conversation's session lives between turns: a model of AttentionStore's two fast tiers
// (host DRAM and disk) and of three placement policies. Sizes and decisions only: no bytes are stored here.
//
// The model (docs/sessions.md):
// - Two tiers with capacities in bytes, DRAM above disk. A session is in at most one tier, whole: all or nothing.
//   A session larger than a tier's capacity never goes into that tier.
// - `save` writes a session at the end of its turn: DRAM first. Room is made by evicting the sessions the policy
//   prefers to evict over the one being saved; a session evicted from DRAM moves down to disk (by the same rule),
//   one evicted from disk is dropped. When the policy prefers to evict the saved session itself (or it is larger
//   than DRAM), it is written to disk instead, and dropped when it does not get a place there either.
// - `access` is the start of a job: it says where the session's KV is (DRAM, disk, or a miss: its prefill is
//   recomputed). It moves nothing; the `save` at the end of the turn writes the grown KV back.
// - `prefetch` (scheduler-aware only) moves the sessions of the look-ahead window from disk to DRAM.
//
// The policies, in the order in which each ranks eviction candidates (the first is evicted first):
// - SchedulerAware (AttentionStore): the session whose next use in the job queue is furthest in the future; a
//   session not in the queue at all is needed "never" and goes before every queued one (among those, the least
//   recently used first). So a session inside the window (the next W sessions of the queue) is evicted only when
//   no candidate outside it is left. Prefetch window W = floor(C_mem / S_kv) distinct sessions, S_kv the mean size
//   of the sessions the two tiers hold (or a fixed `mean_session_bytes`): as many sessions as DRAM holds.
// - Lru: the least recently used (accessed or saved) session.
// - Fifo: the session that entered the tier earliest; re-saving a session that stays in the tier keeps its place.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvret::session {

using SessionId = std::uint64_t;

enum class Tier { dram, disk, miss };
enum class Policy { scheduler_aware, lru, fifo };

std::string_view to_string(Tier tier);
std::string_view to_string(Policy policy);

struct PlacementConfig {
  Policy policy = Policy::scheduler_aware;
  std::uint64_t dram_bytes = 0;  // C_mem
  std::uint64_t disk_bytes = 0;  // C_disk
  // S_kv of the window rule; 0: the mean size of the sessions the tiers hold now.
  std::uint64_t mean_session_bytes = 0;
};

struct PlacementStats {
  std::uint64_t accesses = 0;
  std::uint64_t dram_hits = 0;
  std::uint64_t disk_hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t saves = 0;
  std::uint64_t saved_to_dram = 0;
  std::uint64_t saved_to_disk = 0;
  std::uint64_t not_saved = 0;         // a save that found a place in neither tier
  std::uint64_t demoted_bytes = 0;     // DRAM -> disk by eviction
  std::uint64_t prefetched_bytes = 0;  // disk -> DRAM by prefetch
  std::uint64_t dropped = 0;           // sessions evicted from disk or not placed on demotion
};

class Placement {
 public:
  explicit Placement(PlacementConfig config);

  // The job of `session` starts: where its saved KV is (Tier::miss when nowhere). Counts as a use for LRU.
  Tier access(SessionId session);

  // The turn of `session` ended with `bytes` of KV: store it (replacing an older copy), DRAM first. `queue` is the
  // sessions of the jobs that will run next, in order (SchedulerAware reads it; the others ignore it). Returns the
  // tier it went to, Tier::miss when neither tier took it.
  Tier save(SessionId session, std::uint64_t bytes, std::span<const SessionId> queue);

  // A session found on disk (a store reopening its directory): placed on disk only, as a save that skips DRAM.
  // Returns Tier::disk, or Tier::miss when the disk has no room for it.
  Tier save_to_disk(SessionId session, std::uint64_t bytes, std::span<const SessionId> queue);

  // SchedulerAware: bring the sessions of the window (the first window_sessions() distinct sessions of `queue`)
  // that are on disk into DRAM, in queue order, each only by evicting sessions needed later than it, and stopping
  // at the first one that would take the bytes moved past `max_bytes` (what the disk can read in the time there
  // is). Returns the bytes moved. Lru and Fifo do not prefetch (returns 0).
  std::uint64_t prefetch(std::span<const SessionId> queue,
                         std::uint64_t max_bytes = std::numeric_limits<std::uint64_t>::max());

  // Forget a session in every tier; false when it was in none.
  bool drop(SessionId session);

  Tier where(SessionId session) const;
  std::uint64_t bytes_of(SessionId session) const;  // 0 when not held
  std::uint64_t used(Tier tier) const;
  std::uint64_t capacity(Tier tier) const;
  std::vector<SessionId> sessions(Tier tier) const;  // ascending ids
  // W = floor(C_mem / S_kv); 0 while S_kv is unknown (no session held and no fixed mean).
  std::size_t window_sessions() const;

  const PlacementStats& stats() const { return stats_; }
  const PlacementConfig& config() const { return config_; }

 private:
  struct Entry {
    std::uint64_t bytes = 0;
    std::uint64_t entered = 0;   // clock when it entered this tier (FIFO)
    std::uint64_t last_use = 0;  // clock of its last access or save (LRU, and SchedulerAware's tie break)
  };
  struct TierState {
    std::unordered_map<SessionId, Entry> entries;
    std::uint64_t used = 0;
    std::uint64_t capacity = 0;
  };
  using NextUse = std::unordered_map<SessionId, std::uint64_t>;  // first position in the queue

  TierState& state(Tier tier) { return tier == Tier::dram ? dram_ : disk_; }
  const TierState& state(Tier tier) const { return tier == Tier::dram ? dram_ : disk_; }
  // Sessions to evict from `tier` so that `incoming` (not in the tier) fits, best victim first; false when the
  // policy would rather evict `incoming` itself before enough room is made (nothing is changed either way).
  bool choose_victims(const TierState& tier, SessionId incoming, const Entry& entry, const NextUse& next,
                      std::vector<SessionId>& victims) const;
  // Whether `a` goes before `b` in the eviction order of `tier`.
  bool evict_before(SessionId a, const Entry& ea, SessionId b, const Entry& eb, const NextUse& next) const;
  bool place_dram(SessionId session, Entry entry, const NextUse& next);
  bool place_disk(SessionId session, Entry entry, const NextUse& next);
  void insert(TierState& tier, SessionId session, Entry entry);
  void erase(TierState& tier, SessionId session);

  PlacementConfig config_;
  PlacementStats stats_;
  TierState dram_;
  TierState disk_;
  std::uint64_t clock_ = 0;
};

// The next-use map of a queue: each session's first position.
std::unordered_map<SessionId, std::uint64_t> next_uses(std::span<const SessionId> queue);

}  // namespace kvret::session
