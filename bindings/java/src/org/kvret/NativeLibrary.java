package org.kvret;

/** Loads the JNI library once: from the path in the system property {@code org.kvret.jni}, else by name. */
final class NativeLibrary {
  private static boolean loaded;

  private NativeLibrary() {}

  static synchronized void load() {
    if (loaded) {
      return;
    }
    String path = System.getProperty("org.kvret.jni");
    if (path != null && !path.isEmpty()) {
      System.load(path);
    } else {
      System.loadLibrary("kvret_jni");
    }
    loaded = true;
  }
}
