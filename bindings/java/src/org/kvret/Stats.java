package org.kvret;

/** Statistics of a sequence or a context (kvret_stats). */
public record Stats(long sequences, long tokensStored, long hostBytes, long deviceBytes, long diskBytes,
    long indexBytes, long indexBuilds, double indexBuildMs, long selections, long fetches, long fetchedRows,
    long cacheHits, long cacheMisses, long prefetchHits, long bytesH2d, long diskReads, long diskWrites,
    long clusterReuseRows, long clusterReuseHits, long clusterReuseBytes, long sessionSaves, long sessionHitsDram,
    long sessionHitsDisk, long sessionMisses, long sessionEvictions, long sessionExpired, long sessionCorrupt,
    long sessionDramBytes, long sessionDramCount, long sessionDiskCount, long sessionHitsShared,
    long sessionSharedWrites, long sessionWriteFailures) {
  static Stats of(NativeStats s) {
    return new Stats(s.getSequences(), s.getTokens_stored(), s.getHost_bytes(), s.getDevice_bytes(), s.getDisk_bytes(),
        s.getIndex_bytes(), s.getIndex_builds(), s.getIndex_build_ms(), s.getSelections(), s.getFetches(),
        s.getFetched_rows(), s.getCache_hits(), s.getCache_misses(), s.getPrefetch_hits(), s.getBytes_h2d(),
        s.getDisk_reads(), s.getDisk_writes(), s.getCluster_reuse_rows(), s.getCluster_reuse_hits(),
        s.getCluster_reuse_bytes(), s.getSession_saves(), s.getSession_hits_dram(), s.getSession_hits_disk(),
        s.getSession_misses(), s.getSession_evictions(), s.getSession_expired(), s.getSession_corrupt(),
        s.getSession_dram_bytes(), s.getSession_dram_count(), s.getSession_disk_count(), s.getSession_hits_shared(),
        s.getSession_shared_writes(), s.getSession_write_failures());
  }

  /** Runs {@code fill} on a fresh native stats struct and copies it out. */
  static Stats read(java.util.function.Consumer<NativeStats> fill) {
    NativeStats stats = new NativeStats();
    try {
      KvretNative.kvret_stats_init(stats);
      fill.accept(stats);
      return of(stats);
    } finally {
      stats.delete();
    }
  }
}
