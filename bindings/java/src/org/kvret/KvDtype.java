package org.kvret;

/** The storage type of the KV cache. */
public enum KvDtype {
  F16(KvretNativeConstants.KVRET_KV_F16, DType.F16),
  BF16(KvretNativeConstants.KVRET_KV_BF16, DType.BF16),
  F32(KvretNativeConstants.KVRET_KV_F32, DType.F32);

  final int code;
  final DType dtype;

  KvDtype(int code, DType dtype) {
    this.code = code;
    this.dtype = dtype;
  }

  /** The element type of tensors holding this KV dtype. */
  public DType dtype() {
    return dtype;
  }

  static KvDtype fromCode(int code) {
    for (KvDtype value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown KV dtype " + code);
  }
}
