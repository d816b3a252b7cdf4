package org.kvret;

/** A kvret call failed: {@link #status()} says what kind of failure, {@link #getMessage()} is the library's message. */
public class KvretException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final Status status;
  private final int code;

  /** Called from the JNI layer with the failed call's status and kvret_last_error(). */
  public KvretException(int code, String message) {
    super(message);
    this.code = code;
    this.status = Status.fromCode(code);
  }

  public Status status() {
    return status;
  }

  /** The numeric kvret_status (also for statuses this binding does not know). */
  public int code() {
    return code;
  }

  @Override
  public String toString() {
    return getClass().getName() + ": [" + (status == Status.UNKNOWN ? String.valueOf(code) : status.name()) + "] "
        + getMessage();
  }
}
