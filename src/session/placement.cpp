#include "session/placement.hpp"

#include <algorithm>
#include <limits>
#include <unordered_set>

namespace kvret::session {

namespace {
constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
}  // namespace

std::string_view to_string(Tier tier) {
  switch (tier) {
    case Tier::dram:
      return "dram";
    case Tier::disk:
      return "disk";
    case Tier::miss:
      return "miss";
  }
  return "?";
}

std::string_view to_string(Policy policy) {
  switch (policy) {
    case Policy::scheduler_aware:
      return "scheduler-aware";
    case Policy::lru:
      return "lru";
    case Policy::fifo:
      return "fifo";
  }
  return "?";
}

std::unordered_map<SessionId, std::uint64_t> next_uses(std::span<const SessionId> queue) {
  std::unordered_map<SessionId, std::uint64_t> next;
  next.reserve(queue.size());
  for (std::size_t i = 0; i < queue.size(); ++i) next.try_emplace(queue[i], i);
  return next;
}

Placement::Placement(PlacementConfig config) : config_(config) {
  dram_.capacity = config.dram_bytes;
  disk_.capacity = config.disk_bytes;
}

Tier Placement::where(SessionId session) const {
  if (dram_.entries.contains(session)) return Tier::dram;
  if (disk_.entries.contains(session)) return Tier::disk;
  return Tier::miss;
}

std::uint64_t Placement::bytes_of(SessionId session) const {
  const Tier tier = where(session);
  return tier == Tier::miss ? 0 : state(tier).entries.at(session).bytes;
}

std::uint64_t Placement::used(Tier tier) const { return tier == Tier::miss ? 0 : state(tier).used; }

std::uint64_t Placement::capacity(Tier tier) const { return tier == Tier::miss ? 0 : state(tier).capacity; }

std::vector<SessionId> Placement::sessions(Tier tier) const {
  std::vector<SessionId> ids;
  if (tier == Tier::miss) return ids;
  for (const auto& [id, entry] : state(tier).entries) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::size_t Placement::window_sessions() const {
  std::uint64_t mean = config_.mean_session_bytes;
  if (mean == 0) {
    const std::size_t held = dram_.entries.size() + disk_.entries.size();
    if (held == 0) return 0;
    mean = std::max<std::uint64_t>(1, (dram_.used + disk_.used) / held);
  }
  return static_cast<std::size_t>(dram_.capacity / mean);
}

void Placement::insert(TierState& tier, SessionId session, Entry entry) {
  tier.used += entry.bytes;
  tier.entries.emplace(session, entry);
}

void Placement::erase(TierState& tier, SessionId session) {
  const auto it = tier.entries.find(session);
  if (it == tier.entries.end()) return;
  tier.used -= it->second.bytes;
  tier.entries.erase(it);
}

bool Placement::evict_before(SessionId a, const Entry& ea, SessionId b, const Entry& eb, const NextUse& next) const {
  switch (config_.policy) {
    case Policy::scheduler_aware: {
      const auto na = next.find(a);
      const auto nb = next.find(b);
      const std::uint64_t ua = na == next.end() ? kNever : na->second;
      const std::uint64_t ub = nb == next.end() ? kNever : nb->second;
      if (ua != ub) return ua > ub;  // needed later goes first
      if (ea.last_use != eb.last_use) return ea.last_use < eb.last_use;
      return a < b;
    }
    case Policy::lru:
      if (ea.last_use != eb.last_use) return ea.last_use < eb.last_use;
      return a < b;
    case Policy::fifo:
      if (ea.entered != eb.entered) return ea.entered < eb.entered;
      return a < b;
  }
  return a < b;
}

bool Placement::choose_victims(const TierState& tier, SessionId incoming, const Entry& entry, const NextUse& next,
                               std::vector<SessionId>& victims) const {
  victims.clear();
  if (entry.bytes > tier.capacity) return false;
  std::uint64_t free = tier.capacity - tier.used;
  if (entry.bytes <= free) return true;
  // Candidates that go before the incoming session in the eviction order, best first.
  std::vector<std::pair<SessionId, const Entry*>> candidates;
  for (const auto& [id, e] : tier.entries) {
    if (id != incoming && evict_before(id, e, incoming, entry, next)) candidates.emplace_back(id, &e);
  }
  std::sort(candidates.begin(), candidates.end(),
            [&](const auto& x, const auto& y) { return evict_before(x.first, *x.second, y.first, *y.second, next); });
  for (const auto& [id, e] : candidates) {
    victims.push_back(id);
    free += e->bytes;
    if (entry.bytes <= free) return true;
  }
  victims.clear();
  return false;
}

bool Placement::place_disk(SessionId session, Entry entry, const NextUse& next) {
  std::vector<SessionId> victims;
  entry.entered = clock_;
  if (!choose_victims(disk_, session, entry, next, victims)) return false;
  for (const SessionId victim : victims) {
    erase(disk_, victim);
    ++stats_.dropped;
  }
  insert(disk_, session, entry);
  return true;
}

bool Placement::place_dram(SessionId session, Entry entry, const NextUse& next) {
  std::vector<SessionId> victims;
  if (!choose_victims(dram_, session, entry, next, victims)) return false;
  std::vector<std::pair<SessionId, Entry>> demoted;
  for (const SessionId victim : victims) {
    demoted.emplace_back(victim, dram_.entries.at(victim));
    erase(dram_, victim);
  }
  insert(dram_, session, entry);
  for (const auto& [victim, demoted_entry] : demoted) {
    if (place_disk(victim, demoted_entry, next)) {
      stats_.demoted_bytes += demoted_entry.bytes;
    } else {
      ++stats_.dropped;
    }
  }
  return true;
}

Tier Placement::access(SessionId session) {
  ++clock_;
  ++stats_.accesses;
  const Tier tier = where(session);
  switch (tier) {
    case Tier::dram:
      ++stats_.dram_hits;
      dram_.entries.at(session).last_use = clock_;
      break;
    case Tier::disk:
      ++stats_.disk_hits;
      disk_.entries.at(session).last_use = clock_;
      break;
    case Tier::miss:
      ++stats_.misses;
      break;
  }
  return tier;
}

Tier Placement::save(SessionId session, std::uint64_t bytes, std::span<const SessionId> queue) {
  ++clock_;
  ++stats_.saves;
  const NextUse next = next_uses(queue);
  Entry entry{bytes, clock_, clock_};
  // FIFO keeps the place of a session that stays in DRAM; the older copy is replaced in any case.
  if (const auto it = dram_.entries.find(session); it != dram_.entries.end()) entry.entered = it->second.entered;
  erase(dram_, session);
  erase(disk_, session);
  if (place_dram(session, entry, next)) {
    ++stats_.saved_to_dram;
    return Tier::dram;
  }
  if (place_disk(session, entry, next)) {
    ++stats_.saved_to_disk;
    return Tier::disk;
  }
  ++stats_.not_saved;
  return Tier::miss;
}

Tier Placement::save_to_disk(SessionId session, std::uint64_t bytes, std::span<const SessionId> queue) {
  ++clock_;
  const NextUse next = next_uses(queue);
  erase(dram_, session);
  erase(disk_, session);
  if (place_disk(session, Entry{bytes, clock_, clock_}, next)) return Tier::disk;
  return Tier::miss;
}

std::uint64_t Placement::prefetch(std::span<const SessionId> queue, std::uint64_t max_bytes) {
  if (config_.policy != Policy::scheduler_aware) return 0;
  const std::size_t window = window_sessions();
  if (window == 0) return 0;
  const NextUse next = next_uses(queue);
  std::unordered_set<SessionId> seen;
  std::uint64_t moved = 0;
  std::vector<SessionId> victims;
  for (const SessionId session : queue) {
    if (seen.size() >= window) break;
    if (!seen.insert(session).second) continue;
    const auto it = disk_.entries.find(session);
    if (it == disk_.entries.end()) continue;
    const Entry entry = it->second;
    if (entry.bytes > max_bytes - moved) break;                           // the disk has no time left for it
    if (!choose_victims(dram_, session, entry, next, victims)) continue;  // only sessions needed later make room
    ++clock_;
    erase(disk_, session);
    Entry promoted = entry;
    promoted.entered = clock_;
    place_dram(session, promoted, next);  // the same victims: DRAM has not changed since choose_victims
    moved += entry.bytes;
  }
  stats_.prefetched_bytes += moved;
  return moved;
}

bool Placement::drop(SessionId session) {
  const bool held = where(session) != Tier::miss;
  erase(dram_, session);
  erase(disk_, session);
  return held;
}

}  // namespace kvret::session
