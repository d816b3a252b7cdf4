#include "engine/stats.hpp"

#include <cstddef>

namespace kvret {

void StatCounters::add_to(kvret_stats* out) const noexcept {
  kvret_stats s{};
  s.tokens_stored = tokens_stored.load();
  s.host_bytes = host_bytes.load();
  s.index_bytes = index_bytes.load();
  s.index_builds = index_builds.load();
  s.index_build_ms = static_cast<double>(index_build_ns.load()) * 1e-6;
  s.selections = selections.load();
  s.fetches = fetches.load();
  s.fetched_rows = fetched_rows.load();
  s.cache_hits = cache_hits.load();
  s.cache_misses = cache_misses.load();
  s.bytes_h2d = bytes_h2d.load();
  s.prefetch_hits = prefetch_hits.load();
  s.device_bytes = device_bytes.load();
  s.cluster_reuse_rows = cluster_reuse_rows.load();
  s.cluster_reuse_hits = cluster_reuse_hits.load();
  s.cluster_reuse_bytes = cluster_reuse_bytes.load();
  // Only the fields the caller's struct has.
#define KVRET_ADD(field) \
  if (out->struct_size >= offsetof(kvret_stats, field) + sizeof out->field) out->field += s.field
  KVRET_ADD(tokens_stored);
  KVRET_ADD(host_bytes);
  KVRET_ADD(index_bytes);
  KVRET_ADD(index_builds);
  KVRET_ADD(index_build_ms);
  KVRET_ADD(selections);
  KVRET_ADD(fetches);
  KVRET_ADD(fetched_rows);
  KVRET_ADD(cache_hits);
  KVRET_ADD(cache_misses);
  KVRET_ADD(bytes_h2d);
  KVRET_ADD(prefetch_hits);
  KVRET_ADD(device_bytes);
  KVRET_ADD(cluster_reuse_rows);
  KVRET_ADD(cluster_reuse_hits);
  KVRET_ADD(cluster_reuse_bytes);
#undef KVRET_ADD
}

void StatCounters::add_into(StatCounters& o) const noexcept {
  // tokens and bytes describe live storage: a closed sequence no longer holds any.
  o.index_builds += index_builds.load();
  o.index_build_ns += index_build_ns.load();
  o.selections += selections.load();
  o.fetches += fetches.load();
  o.fetched_rows += fetched_rows.load();
  o.cache_hits += cache_hits.load();
  o.cache_misses += cache_misses.load();
  o.bytes_h2d += bytes_h2d.load();
  o.prefetch_hits += prefetch_hits.load();
  o.cluster_reuse_rows += cluster_reuse_rows.load();
  o.cluster_reuse_hits += cluster_reuse_hits.load();
}

}  // namespace kvret
