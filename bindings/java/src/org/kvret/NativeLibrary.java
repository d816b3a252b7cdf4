package org.kvret;

import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/**
 * Loads the JNI library libkvret_jni once, trying in order:
 *
 * <ol>
 *   <li>the full path in the system property {@code org.kvret.jni}, when it is set (and nothing else);
 *   <li>{@code System.loadLibrary("kvret_jni")}, i.e. a directory of {@code java.library.path} (an installed kvret
 *       puts it in {@code <prefix>/<libdir>/jni}, whose run path finds libkvret in {@code <prefix>/<libdir>});
 *   <li>the copy inside this jar (with the libkvret it was built with), under {@code org/kvret/native/<os>-<arch>/},
 *       extracted to a fresh directory under {@code java.io.tmpdir} and deleted once loaded; the system property
 *       {@code org.kvret.jni.embedded=false} turns this step off.
 * </ol>
 *
 * <p>If none loads, an {@link UnsatisfiedLinkError} names every place tried and why each failed.
 */
final class NativeLibrary {
  /** The jar's directory of native libraries for this platform. */
  static final String RESOURCE_DIR = "/org/kvret/native/" + platform() + "/";
  /** A resource in {@link #RESOURCE_DIR} naming the libraries to load, one a line, libkvret_jni last. */
  static final String INDEX = "libraries";

  private static boolean loaded;

  private NativeLibrary() {}

  static synchronized void load() {
    if (loaded) {
      return;
    }
    String path = System.getProperty("org.kvret.jni");
    if (path != null && !path.isEmpty()) {
      try {
        System.load(path);
      } catch (UnsatisfiedLinkError e) {
        throw failure("-Dorg.kvret.jni=" + path + ": " + e.getMessage(), e);
      }
      loaded = true;
      return;
    }
    List<String> tried = new ArrayList<>();
    UnsatisfiedLinkError first;
    try {
      System.loadLibrary("kvret_jni");
      loaded = true;
      return;
    } catch (UnsatisfiedLinkError e) {
      first = e;
      tried.add("System.loadLibrary(\"kvret_jni\") with java.library.path="
          + System.getProperty("java.library.path") + ": " + e.getMessage());
    }
    if ("false".equalsIgnoreCase(System.getProperty("org.kvret.jni.embedded", "true"))) {
      tried.add("the copy in the jar: not tried (-Dorg.kvret.jni.embedded=false)");
    } else {
      try {
        loadEmbedded();
        loaded = true;
        return;
      } catch (UnsatisfiedLinkError | IOException e) {
        tried.add("the copy in the jar (" + RESOURCE_DIR + "): " + e.getMessage());
      }
    }
    throw failure(String.join("; ", tried), first);
  }

  private static UnsatisfiedLinkError failure(String tried, Throwable cause) {
    UnsatisfiedLinkError error = new UnsatisfiedLinkError(
        "kvret: cannot load the JNI library libkvret_jni. Tried: " + tried + ". Put the directory of "
            + "libkvret_jni.so on java.library.path (an installed kvret has it in <prefix>/<libdir>/jni), set "
            + "-Dorg.kvret.jni=/full/path/libkvret_jni.so, or use a kvret.jar that embeds the library for "
            + platform());
    error.initCause(cause);
    return error;
  }

  /** The platform directory of the jar's native libraries: os.name and os.arch, e.g. "linux-amd64". */
  static String platform() {
    String os = System.getProperty("os.name", "unknown").toLowerCase(Locale.ROOT).replaceAll("[^a-z0-9]", "");
    String arch = System.getProperty("os.arch", "unknown").toLowerCase(Locale.ROOT);
    return os + "-" + arch;
  }

  /** Extracts the jar's libraries to a new temporary directory, loads them in order, then deletes them. */
  private static void loadEmbedded() throws IOException {
    List<String> names = new ArrayList<>();
    try (InputStream index = NativeLibrary.class.getResourceAsStream(RESOURCE_DIR + INDEX)) {
      if (index == null) {
        throw new UnsatisfiedLinkError("this jar holds no native library for " + platform());
      }
      for (String line : new String(index.readAllBytes(), StandardCharsets.UTF_8).split("\n")) {
        if (!line.isBlank()) {
          names.add(line.strip());
        }
      }
    }
    if (names.isEmpty()) {
      throw new UnsatisfiedLinkError(RESOURCE_DIR + INDEX + " names no library");
    }
    Path dir = Files.createTempDirectory("kvret-jni-");
    List<Path> files = new ArrayList<>();
    try {
      for (String name : names) {
        Path file = dir.resolve(name);
        try (InputStream in = NativeLibrary.class.getResourceAsStream(RESOURCE_DIR + name)) {
          if (in == null) {
            throw new UnsatisfiedLinkError(RESOURCE_DIR + INDEX + " names " + name + ", which the jar lacks");
          }
          Files.copy(in, file, StandardCopyOption.REPLACE_EXISTING);
        }
        files.add(file);
      }
      // In order: libkvret first, so that libkvret_jni binds to this copy (its run path is $ORIGIN as well).
      for (Path file : files) {
        try {
          System.load(file.toString());
        } catch (UnsatisfiedLinkError e) {
          throw new UnsatisfiedLinkError("extracted to " + file + ": " + e.getMessage());
        }
      }
    } finally {
      // A loaded library stays mapped once its file is gone: leave nothing in the temporary directory.
      for (Path file : files) {
        Files.deleteIfExists(file);
      }
      Files.deleteIfExists(dir);
    }
  }
}
