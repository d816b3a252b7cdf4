package org.kvret;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.lang.ref.WeakReference;
import java.util.ArrayList;
import java.util.List;
import java.util.Random;
import java.util.function.BooleanSupplier;
import org.junit.Test;

/**
 * The cleaners under close(): contexts and sequences never closed release their native handles once unreachable,
 * a sequence's release comes before its context's, and a close() followed by a collection releases nothing twice.
 * NativeHandles counts the handles opened and released and the releases the library refused (a second release of
 * a handle, or a sequence released after its context, is refused with INVALID_HANDLE: handles are never reused).
 */
public class CleanerTest {
  private static final long WAIT_NANOS = 30_000_000_000L;

  /** Collects until {@code done} holds; fails after 30 s. */
  private static void collectUntil(BooleanSupplier done, String what) throws InterruptedException {
    long deadline = System.nanoTime() + WAIT_NANOS;
    while (!done.getAsBoolean()) {
      if (System.nanoTime() - deadline > 0) {
        fail(what + " after 30 s of System.gc()");
      }
      System.gc();
      Thread.sleep(20);
    }
  }

  /** Lets what earlier tests left unreachable be released first, so that the live counts below are ours. */
  private static void settle() throws InterruptedException {
    long last = -1;
    for (int round = 0; round < 100; ++round) {
      System.gc();
      Thread.sleep(20);
      long released = NativeHandles.contextsReleased.get() + NativeHandles.sequencesReleased.get();
      if (round >= 3 && released == last) {
        return;
      }
      last = released;
    }
  }

  /** Opens sequences (some holding tokens, some forks) and drops them unclosed; returns how many. */
  private static int openAndDrop(Context ctx, int count, Random random) {
    for (int i = 0; i < count; ++i) {
      Sequence seq = ctx.openSequence();
      if (i % 8 == 0) {
        seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
        seq.fork().length(0);
      }
    }
    return count + (count + 7) / 8;
  }

  @Test
  public void unclosedSequencesOfALiveContextAreReleased() throws InterruptedException {
    long failed = NativeHandles.failedReleases.get();
    try (Context ctx = Context.create(Fixtures.config().build())) {
      int opened = openAndDrop(ctx, 200, new Random(1));
      assertTrue(ctx.openSequences() <= opened);
      collectUntil(() -> ctx.openSequences() == 0, "unclosed sequences are still open");
      // The context is untouched: it opens, fills and selects as before.
      try (Sequence seq = ctx.openSequence()) {
        Random random = new Random(2);
        seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
        assertEquals(Fixtures.TOKENS, seq.length(0));
        assertTrue(seq.select(0, Fixtures.query(random)).count() > 0);
      }
    }
    assertEquals(failed, NativeHandles.failedReleases.get());
  }

  /**
   * Creates contexts with open sequences and drops them all unclosed; returns their native states (which hold no
   * reference to the Context and Sequence objects, so that holding them does not keep those reachable).
   */
  private static List<Object> createAndDropContexts(int count) {
    Random random = new Random(3);
    List<Object> states = new ArrayList<>();
    for (int i = 0; i < count; ++i) {
      Context ctx = Context.create(Fixtures.config().build());
      states.add(ctx.state());
      for (int j = 0; j < 3; ++j) {
        Sequence seq = ctx.openSequence();
        states.add(seq.state());
        if (j == 0) {
          seq.appendPrefill(1, Fixtures.kv(random), Fixtures.kv(random));
          states.add(seq.fork().state());
        }
      }
    }
    return states;
  }

  private static boolean released(Object state) {
    return state instanceof Context.State ? ((Context.State) state).released() : ((Sequence.State) state).released();
  }

  @Test
  public void unclosedContextsAndTheirSequencesAreReleased() throws InterruptedException {
    long failed = NativeHandles.failedReleases.get();
    List<Object> states = createAndDropContexts(30);
    assertEquals(30 * 5, states.size());
    collectUntil(() -> states.stream().allMatch(CleanerTest::released),
        "unclosed contexts or sequences are still open");
    // Every sequence was released before its context was destroyed (else kvret_seq_close would have refused it).
    assertEquals(failed, NativeHandles.failedReleases.get());
  }

  /** A sequence, its context dropped: the context must stay open while the sequence is reachable. */
  private static Sequence sequenceOfADroppedContext() {
    Context ctx = Context.create(Fixtures.config().build());
    Sequence seq = ctx.openSequence();
    Random random = new Random(4);
    seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
    return seq;
  }

  @Test
  public void aSequenceKeepsItsContextOpen() throws InterruptedException {
    long failed = NativeHandles.failedReleases.get();
    Sequence seq = sequenceOfADroppedContext();
    for (int round = 0; round < 5; ++round) {
      System.gc();
      Thread.sleep(20);
    }
    assertFalse(seq.isClosed());
    assertFalse(seq.context().isClosed());
    assertEquals(Fixtures.TOKENS, seq.length(0));
    assertTrue(seq.select(0, Fixtures.query(new Random(5))).count() > 0);
    Context.State context = seq.context().state();
    Sequence.State sequence = seq.state();
    seq = null;
    collectUntil(() -> context.released() && sequence.released(), "the context or the sequence is still open");
    assertEquals(failed, NativeHandles.failedReleases.get());
  }

  /** Creates and closes contexts and sequences in every order; returns weak references to them. */
  private static List<WeakReference<Object>> createAndClose(int count) {
    List<WeakReference<Object>> dropped = new ArrayList<>();
    for (int i = 0; i < count; ++i) {
      Context ctx = Context.create(Fixtures.config().build());
      Sequence closedFirst = ctx.openSequence();
      Sequence closedByContext = ctx.openSequence();
      Sequence closedAfter = ctx.openSequence();
      Sequence fork = closedFirst.fork();
      closedFirst.close();
      closedFirst.close();
      fork.close();
      ctx.close();
      closedAfter.close();
      ctx.close();
      assertTrue(closedByContext.isClosed());
      for (Object object : new Object[] {ctx, closedFirst, closedByContext, closedAfter, fork}) {
        dropped.add(new WeakReference<>(object));
      }
    }
    return dropped;
  }

  @Test
  public void closeThenCollectReleasesNothingTwice() throws InterruptedException {
    settle();
    long contextsOpened = NativeHandles.contextsOpened.get();
    long contextsReleased = NativeHandles.contextsReleased.get();
    long sequencesOpened = NativeHandles.sequencesOpened.get();
    long sequencesReleased = NativeHandles.sequencesReleased.get();
    long failed = NativeHandles.failedReleases.get();
    List<WeakReference<Object>> dropped = createAndClose(20);
    // Each handle was released exactly once, by close().
    assertEquals(20, NativeHandles.contextsOpened.get() - contextsOpened);
    assertEquals(20, NativeHandles.contextsReleased.get() - contextsReleased);
    assertEquals(80, NativeHandles.sequencesOpened.get() - sequencesOpened);
    assertEquals(80, NativeHandles.sequencesReleased.get() - sequencesReleased);
    collectUntil(() -> dropped.stream().allMatch(reference -> reference.get() == null),
        "closed contexts and sequences are still reachable");
    // Give the cleaner thread time to run anything the collections queued: nothing may be released again.
    for (int round = 0; round < 10; ++round) {
      System.gc();
      Thread.sleep(20);
    }
    assertEquals(20, NativeHandles.contextsReleased.get() - contextsReleased);
    assertEquals(80, NativeHandles.sequencesReleased.get() - sequencesReleased);
    assertEquals(failed, NativeHandles.failedReleases.get());
  }
}
