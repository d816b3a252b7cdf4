package org.kvret;

/** Where KVCrush's token importance comes from (config hammingImportance; docs/kvcrush.md). */
public enum Importance {
  /** SnapKV's observation window: the queries given to Sequence.observe, else the layer's last 32 keys. */
  WINDOW(KvretNativeConstants.KVRET_IMPORTANCE_WINDOW),
  /** H2O's accumulated attention of decode steps (Sequence.attend, Sequence.observeAttention). */
  ACCUMULATED(KvretNativeConstants.KVRET_IMPORTANCE_ACCUMULATED);

  final int code;

  Importance(int code) {
    this.code = code;
  }

  static Importance fromCode(int code) {
    for (Importance value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown importance source " + code);
  }
}
