package org.kvret;

import java.lang.ref.Cleaner;
import java.util.concurrent.atomic.AtomicLong;

/**
 * The safety net under close(): every object that owns native memory registers its release with {@link #CLEANER},
 * so that one never closed releases it once it is unreachable. close() runs the same action through its
 * {@link Cleaner.Cleanable}, at most once. The counters (read by the tests) count the context and sequence handles
 * opened and released, and the releases the library refused (a handle released twice, or out of order).
 */
final class NativeHandles {
  static final Cleaner CLEANER = Cleaner.create();

  static final AtomicLong contextsOpened = new AtomicLong();
  static final AtomicLong contextsReleased = new AtomicLong();
  static final AtomicLong sequencesOpened = new AtomicLong();
  static final AtomicLong sequencesReleased = new AtomicLong();
  static final AtomicLong failedReleases = new AtomicLong();

  private NativeHandles() {}

  static long liveContexts() {
    return contextsOpened.get() - contextsReleased.get();
  }

  static long liveSequences() {
    return sequencesOpened.get() - sequencesReleased.get();
  }
}
