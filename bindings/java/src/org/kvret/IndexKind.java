package org.kvret;

/** Which index selects the middle tokens. */
public enum IndexKind {
  /** Exact q.k over every middle token: the quality oracle. */
  EXACT(KvretNativeConstants.KVRET_INDEX_EXACT),
  /** Product quantization of keys (PQCache). */
  PQ(KvretNativeConstants.KVRET_INDEX_PQ),
  /** No retrieval: sink + local only. */
  STREAMING(KvretNativeConstants.KVRET_INDEX_STREAMING),
  PAGE(KvretNativeConstants.KVRET_INDEX_PAGE),
  CLUSTER(KvretNativeConstants.KVRET_INDEX_CLUSTER),
  QUANT(KvretNativeConstants.KVRET_INDEX_QUANT);

  final int code;

  IndexKind(int code) {
    this.code = code;
  }

  static IndexKind fromCode(int code) {
    for (IndexKind value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown index kind " + code);
  }
}
