package org.kvret;

/** Where a saved session is ({@link Context#sessionTier}). */
public enum SessionTier {
  /** Not stored: {@link Context#openSession} gives an empty Optional. */
  NONE(KvretNativeConstants.KVRET_TIER_NONE),
  /** Host memory. */
  DRAM(KvretNativeConstants.KVRET_TIER_DRAM),
  /** The disk tier (the config's disk path). */
  DISK(KvretNativeConstants.KVRET_TIER_DISK),
  /** Only in the shared tier (the config's session shared URL). */
  SHARED(KvretNativeConstants.KVRET_TIER_SHARED);

  final int code;

  SessionTier(int code) {
    this.code = code;
  }

  static SessionTier fromCode(int code) {
    for (SessionTier value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new KvretException(Status.INTERNAL.code(), "kvret_session_where gave an unknown tier " + code);
  }
}
