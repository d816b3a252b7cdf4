package org.kvret;

/** Where a tensor's memory, or a context's index and working set, lives. */
public enum DeviceType {
  CPU(KvretNativeConstants.KVRET_DEVICE_CPU),
  CUDA(KvretNativeConstants.KVRET_DEVICE_CUDA),
  /** Pinned host memory (readable by the CPU backend). */
  CUDA_HOST(KvretNativeConstants.KVRET_DEVICE_CUDA_HOST);

  final int code;

  DeviceType(int code) {
    this.code = code;
  }

  static DeviceType fromCode(int code) {
    for (DeviceType type : values()) {
      if (type.code == code) {
        return type;
      }
    }
    throw new IllegalArgumentException("kvret: unknown device type " + code);
  }
}
