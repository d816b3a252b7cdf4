package org.kvret;

/** Which saved session a full tier of the session store evicts. */
public enum SessionPolicy {
  SCHEDULER_AWARE(KvretNativeConstants.KVRET_SESSION_SCHEDULER_AWARE),
  LRU(KvretNativeConstants.KVRET_SESSION_LRU),
  FIFO(KvretNativeConstants.KVRET_SESSION_FIFO);

  final int code;

  SessionPolicy(int code) {
    this.code = code;
  }

  static SessionPolicy fromCode(int code) {
    for (SessionPolicy value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown session policy " + code);
  }
}
