package org.kvret;

/** Library-wide queries. */
public final class Kvret {
  /** Pass as a budget to use the sequence's default budget. */
  public static final int BUDGET_DEFAULT = KvretNativeConstants.KVRET_BUDGET_DEFAULT;

  private Kvret() {}

  /** The version of the loaded libkvret, "MAJOR.MINOR.PATCH". */
  public static String version() {
    return KvretNative.kvret_version_string();
  }

  /** The version of the loaded libkvret as MAJOR * 10000 + MINOR * 100 + PATCH. */
  public static long versionNumber() {
    return KvretNative.kvret_version_number();
  }

  /** The version of kvret.h these classes were generated from. */
  public static int headerVersionNumber() {
    return KvretNativeConstants.KVRET_VERSION_NUMBER;
  }
}
