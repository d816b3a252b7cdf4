package org.kvret;

/** kvret_status: what a failed call reports. The tests check every constant against kvret_status_string. */
public enum Status {
  OK(0),
  INVALID_ARGUMENT(1),
  INVALID_HANDLE(2),
  SHAPE(3),
  DTYPE(4),
  STRIDE(5),
  DEVICE(6),
  OUT_OF_RANGE(7),
  BUDGET(8),
  CAPACITY(9),
  OUT_OF_MEMORY(10),
  NONFINITE(11),
  STATE(12),
  UNSUPPORTED(13),
  IO(14),
  CORRUPT(15),
  CUDA(16),
  VERSION(17),
  INTERNAL(18),
  NOT_FOUND(19),
  BUSY(20),
  /** A status this version of the binding does not know. */
  UNKNOWN(-1);

  private final int code;

  Status(int code) {
    this.code = code;
  }

  /** The numeric kvret_status. */
  public int code() {
    return code;
  }

  /** The library's name of this status ("KVRET_ERR_SHAPE", ...). */
  public String libraryName() {
    return KvretNative.kvret_status_string(code);
  }

  public static Status fromCode(int code) {
    for (Status status : values()) {
      if (status.code == code) {
        return status;
      }
    }
    return UNKNOWN;
  }
}
