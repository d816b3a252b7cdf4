package org.kvret;

/** Replacement policy of the GPU block cache. */
public enum CachePolicy {
  LRU(KvretNativeConstants.KVRET_CACHE_LRU),
  LFU(KvretNativeConstants.KVRET_CACHE_LFU);

  final int code;

  CachePolicy(int code) {
    this.code = code;
  }

  static CachePolicy fromCode(int code) {
    for (CachePolicy value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown cache policy " + code);
  }
}
