package org.kvret;

/** Element types of tensors. */
public enum DType {
  F16(KvretNativeConstants.KVRET_DTYPE_FLOAT, 16),
  BF16(KvretNativeConstants.KVRET_DTYPE_BFLOAT, 16),
  F32(KvretNativeConstants.KVRET_DTYPE_FLOAT, 32),
  I32(KvretNativeConstants.KVRET_DTYPE_INT, 32);

  final int code;
  final int bits;

  DType(int code, int bits) {
    this.code = code;
    this.bits = bits;
  }

  /** Bytes per element. */
  public int bytes() {
    return bits / 8;
  }
}
