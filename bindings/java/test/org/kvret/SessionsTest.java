package org.kvret;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertSame;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Optional;
import java.util.Random;
import java.util.function.Consumer;
import org.junit.Test;
import org.junit.function.ThrowingRunnable;

/** Sessions across conversation turns and context-window truncation (dropFront). */
public class SessionsTest {
  private static final long SESSION_KV_BYTES =
      2L * Fixtures.LAYERS * Fixtures.TOKENS * Fixtures.KV_HEADS * Fixtures.HEAD_DIM * 4;

  private final Random random = new Random(7);

  private static KvretException expect(Status status, String word, ThrowingRunnable call) {
    KvretException e = assertThrows(KvretException.class, call);
    assertEquals(e.toString(), status, e.status());
    assertTrue(e.toString(), e.getMessage().contains(word));
    return e;
  }

  private Sequence filled(Context ctx, int tokens) {
    Sequence seq = ctx.openSequence();
    for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
      seq.appendPrefill(layer, kv(tokens), kv(tokens));
    }
    return seq;
  }

  private Tensor kv(int tokens) {
    return Tensor.ofFloats(Fixtures.gaussian(random, tokens * Fixtures.KV_HEADS * Fixtures.HEAD_DIM), tokens,
        Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
  }

  /** [keys, values] of positions [0, length) of a layer, as floats. */
  private static float[][] read(Sequence seq, int layer) {
    long length = seq.length(layer);
    Tensor k = Tensor.allocate(DType.F32, length, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
    Tensor v = Tensor.allocate(DType.F32, length, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
    seq.read(layer, 0, length, k, v);
    return new float[][] {k.toFloatArray(), v.toFloatArray()};
  }

  private void assertSameSequence(Sequence a, Sequence b) {
    for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
      assertEquals(a.length(layer), b.length(layer));
      float[][] ra = read(a, layer);
      float[][] rb = read(b, layer);
      assertArrayEquals(ra[0], rb[0], 0f);
      assertArrayEquals(ra[1], rb[1], 0f);
      Tensor q = Fixtures.query(random);
      Selection sa = a.select(layer, q);
      Selection sb = b.select(layer, q);
      assertEquals(sa.count(), sb.count());
      for (int head = 0; head < Fixtures.KV_HEADS; ++head) {
        assertArrayEquals(sa.positions(head), sb.positions(head));
      }
      assertArrayEquals(a.attend(layer, q, Kvret.BUDGET_DEFAULT).toFloatArray(),
          b.attend(layer, q, Kvret.BUDGET_DEFAULT).toFloatArray(), 0f);
    }
  }

  @Test
  public void saveThenOpenGivesTheSameSequence() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = filled(ctx, Fixtures.TOKENS)) {
      seq.saveSession("conversation-1");
      assertEquals(SessionTier.DRAM, ctx.sessionTier("conversation-1"));
      Optional<Sequence> opened = ctx.openSession("conversation-1");
      assertTrue(opened.isPresent());
      try (Sequence reopened = opened.get()) {
        assertSame(ctx, reopened.context());
        assertSameSequence(seq, reopened);
        reopened.appendDecode(0, kv(1), kv(1)); // independent of the saved sequence
        assertEquals(Fixtures.TOKENS + 1, reopened.length(0));
        assertEquals(Fixtures.TOKENS, seq.length(0));
      }
      Stats stats = ctx.stats();
      assertEquals(1, stats.sessionSaves());
      assertEquals(1, stats.sessionHitsDram());
      assertEquals(0, stats.sessionMisses());
      assertEquals(1, stats.sessionDramCount());
      assertTrue(stats.sessionDramBytes() >= SESSION_KV_BYTES);
    }
  }

  @Test
  public void aMissIsEmptyAndDropSaysWhetherThereWasASession() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = filled(ctx, 40)) {
      assertFalse(ctx.openSession("never-saved").isPresent());
      assertEquals(SessionTier.NONE, ctx.sessionTier("never-saved"));
      assertFalse(ctx.dropSession("never-saved"));
      seq.saveSession("a");
      assertTrue(ctx.dropSession("a"));
      assertEquals(SessionTier.NONE, ctx.sessionTier("a"));
      assertFalse(ctx.openSession("a").isPresent());
      assertFalse(ctx.dropSession("a"));
      assertEquals(2, ctx.stats().sessionMisses());
      assertEquals(1, ctx.stats().sequences()); // a miss opens no sequence
    }
  }

  @Test
  public void idsAreTheirUtf8Bytes() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = filled(ctx, 40)) {
      seq.saveSession("café-\uD83D\uDE42"); // an emoji: a surrogate pair in Java, 4 bytes of UTF-8
      assertEquals(SessionTier.DRAM, ctx.sessionTier("café-\uD83D\uDE42"));
      assertEquals(SessionTier.NONE, ctx.sessionTier("cafe-\uD83D\uDE42"));
      String longest = "x".repeat(255);
      seq.saveSession(longest);
      assertEquals(SessionTier.DRAM, ctx.sessionTier(longest));
      expect(Status.INVALID_ARGUMENT, "256", () -> seq.saveSession("é".repeat(128))); // 256 bytes
    }
  }

  @Test
  public void sessionsMoveToTheDiskTierAndOpenFromIt() throws Exception {
    Path dir = Files.createTempDirectory("kvret-sessions");
    Config config = Fixtures.config()
        .diskPath(dir.toString())
        .sessionDramBytes(SESSION_KV_BYTES * 3 / 2)
        .sessionPolicy(SessionPolicy.LRU)
        .build();
    try (Context ctx = Context.create(config); Sequence first = filled(ctx, Fixtures.TOKENS);
         Sequence second = filled(ctx, Fixtures.TOKENS)) {
      assertEquals(dir.toString(), ctx.config().diskPath());
      assertEquals(SessionPolicy.LRU, ctx.config().sessionPolicy());
      first.saveSession("first");
      second.saveSession("second"); // DRAM holds one of them: the first moves to disk
      ctx.flushSessions();
      assertEquals(SessionTier.DISK, ctx.sessionTier("first"));
      assertEquals(SessionTier.DRAM, ctx.sessionTier("second"));
      assertTrue(ctx.stats().sessionEvictions() >= 1);
      assertTrue(ctx.stats().diskBytes() > 0);
      try (Sequence reopened = ctx.openSession("first").orElseThrow()) {
        assertSameSequence(first, reopened);
      }
      assertEquals(1, ctx.stats().sessionHitsDisk());
      ctx.scheduleSessions(List.of("second", "first", "second"));
      ctx.scheduleSessions(List.of());
      ctx.flushSessions();
      assertTrue(ctx.dropSession("first"));
    } finally {
      try (var files = Files.walk(dir)) {
        files.sorted((a, b) -> b.compareTo(a)).forEach(p -> p.toFile().delete());
      }
    }
  }

  @Test
  public void aNewContextOnTheSameDirectorySeesTheSavedSessions() throws Exception {
    Path dir = Files.createTempDirectory("kvret-sessions");
    Config config = Fixtures.config().diskPath(dir.toString()).build();
    float[][] expected;
    try (Context ctx = Context.create(config.toBuilder().sessionDramBytes(1).build());
         Sequence seq = filled(ctx, Fixtures.TOKENS)) {
      seq.saveSession("persisted"); // fits no DRAM: straight to disk
      assertEquals(SessionTier.DISK, ctx.sessionTier("persisted"));
      expected = read(seq, 0);
    }
    try {
      try (Context ctx = Context.create(config)) {
        assertEquals(SessionTier.DISK, ctx.sessionTier("persisted"));
        try (Sequence reopened = ctx.openSession("persisted").orElseThrow()) {
          float[][] now = read(reopened, 0);
          assertArrayEquals(expected[0], now[0], 0f);
          assertArrayEquals(expected[1], now[1], 0f);
        }
        assertTrue(ctx.dropSession("persisted"));
      }
      try (Context ctx = Context.create(config)) {
        assertEquals(SessionTier.NONE, ctx.sessionTier("persisted"));
      }
    } finally {
      try (var files = Files.walk(dir)) {
        files.sorted((a, b) -> b.compareTo(a)).forEach(p -> p.toFile().delete());
      }
    }
  }

  @Test
  public void dropFrontKeepsTheFirstTokensAndMovesTheRest() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      Tensor k0 = kv(Fixtures.TOKENS);
      Tensor v0 = kv(Fixtures.TOKENS);
      seq.appendPrefill(0, k0, v0);
      seq.appendPrefill(1, kv(10), kv(10));
      seq.dropFront(Fixtures.SINK, 100);
      assertEquals(Fixtures.TOKENS - 100, seq.length(0));
      assertEquals(Fixtures.SINK, seq.length(1)); // fewer than keep + count tokens: the rest is dropped
      float[][] now = read(seq, 0);
      assertArrayEquals(withoutTokens(k0, Fixtures.SINK, 100), now[0], 0f);
      assertArrayEquals(withoutTokens(v0, Fixtures.SINK, 100), now[1], 0f);
      assertTrue(seq.select(0, Fixtures.query(random)).count() > 0);
      seq.dropFront(0, 0);
      seq.dropFront(Long.MAX_VALUE, Long.MAX_VALUE);
      assertEquals(Fixtures.TOKENS - 100, seq.length(0));
      seq.dropFront(0, Long.MAX_VALUE);
      assertEquals(0, seq.length(0));
      assertEquals(0, seq.length(1));
    }
  }

  /** The floats of a [tokens, KV_HEADS, HEAD_DIM] tensor without its tokens [keep, keep + count). */
  private static float[] withoutTokens(Tensor tensor, int keep, int count) {
    int row = Fixtures.KV_HEADS * Fixtures.HEAD_DIM;
    float[] all = tensor.toFloatArray();
    float[] kept = new float[all.length - count * row];
    System.arraycopy(all, 0, kept, 0, keep * row);
    System.arraycopy(all, (keep + count) * row, kept, keep * row, kept.length - keep * row);
    return kept;
  }

  /**
   * With pre-RoPE keys a token is rotated at the position it has now, so after dropFront the sequence holds what a
   * sequence given only the remaining tokens holds, whether or not kvret applies RoPE.
   */
  @Test
  public void dropFrontEqualsASequenceOfTheTokensLeft() {
    for (boolean ropeKeys : new boolean[] {false, true}) {
      try (Context ctx = Context.create(Fixtures.config().ropeKeys(ropeKeys).build());
           Sequence a = ctx.openSequence(); Sequence b = ctx.openSequence()) {
        assertEquals(ropeKeys, ctx.config().ropeKeys());
        Tensor k = kv(Fixtures.TOKENS);
        Tensor v = kv(Fixtures.TOKENS);
        long left = Fixtures.TOKENS - 50;
        Tensor leftK = Tensor.ofFloats(withoutTokens(k, Fixtures.SINK, 50), left, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
        Tensor leftV = Tensor.ofFloats(withoutTokens(v, Fixtures.SINK, 50), left, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
        for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
          a.appendPrefill(layer, k, v);
          b.appendPrefill(layer, leftK, leftV);
        }
        a.dropFront(Fixtures.SINK, 50);
        assertSameSequence(a, b);
      }
    }
  }

  @Test
  public void preRopeSessionsRoundTripThroughDiskAfterDropFront() throws Exception {
    Path dir = Files.createTempDirectory("kvret-sessions");
    Config config = Fixtures.config().ropeKeys(true).diskPath(dir.toString()).sessionDramBytes(1).build();
    try (Context ctx = Context.create(config); Sequence seq = filled(ctx, Fixtures.TOKENS)) {
      seq.dropFront(Fixtures.SINK, 30);
      seq.saveSession("rope");
      assertEquals(SessionTier.DISK, ctx.sessionTier("rope"));
      try (Sequence reopened = ctx.openSession("rope").orElseThrow()) {
        assertSameSequence(seq, reopened);
        Tensor k = kv(1);
        Tensor v = kv(1);
        seq.appendDecode(0, k, v);
        reopened.appendDecode(0, k, v); // rotated at the same position in both
        assertSameSequence(seq, reopened);
      }
    } finally {
      try (var files = Files.walk(dir)) {
        files.sorted((a, b) -> b.compareTo(a)).forEach(p -> p.toFile().delete());
      }
    }
  }

  @Test
  public void badIdsAreRefusedAndChangeNothing() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = filled(ctx, 40)) {
      seq.saveSession("kept");
      Stats before = ctx.stats();
      List<Consumer<String>> calls = new ArrayList<>();
      calls.add(seq::saveSession);
      calls.add(ctx::openSession);
      calls.add(ctx::dropSession);
      calls.add(ctx::sessionTier);
      calls.add(id -> ctx.scheduleSessions(Arrays.asList("kept", id)));
      String[] bad = {"", "x".repeat(256), "a\0b", "\0", "\uD800"};
      String[] words = {"empty", "256", "NUL", "NUL", "UTF-8"};
      for (Consumer<String> call : calls) {
        for (int i = 0; i < bad.length; ++i) {
          String id = bad[i];
          KvretException e = expect(Status.INVALID_ARGUMENT, words[i], () -> call.accept(id));
          assertTrue(e.getMessage(), e.getMessage().contains("session_id"));
        }
        NullPointerException e = assertThrows(NullPointerException.class, () -> call.accept(null));
        assertTrue(e.getMessage(), e.getMessage().contains("session_id"));
      }
      assertThrows(NullPointerException.class, () -> ctx.scheduleSessions(null));
      KvretException e = expect(Status.INVALID_ARGUMENT, "empty", () -> ctx.scheduleSessions(List.of("a", "b", "")));
      assertTrue(e.getMessage(), e.getMessage().contains("session_ids[2]"));
      assertEquals(before, ctx.stats());
      assertEquals(SessionTier.DRAM, ctx.sessionTier("kept"));
      assertEquals(40, seq.length(0));
    }
  }

  @Test
  public void closedSequencesAndContextsAreRefused() {
    Context ctx = Context.create(Fixtures.config().build());
    Sequence seq = filled(ctx, 40);
    seq.saveSession("a");
    seq.close();
    expect(Status.INVALID_HANDLE, "", () -> seq.saveSession("b"));
    expect(Status.INVALID_HANDLE, "", () -> seq.dropFront(0, 1));
    assertEquals(SessionTier.NONE, ctx.sessionTier("b"));
    ctx.close();
    expect(Status.INVALID_HANDLE, "", () -> ctx.openSession("a"));
    expect(Status.INVALID_HANDLE, "", () -> ctx.dropSession("a"));
    expect(Status.INVALID_HANDLE, "", () -> ctx.sessionTier("a"));
    expect(Status.INVALID_HANDLE, "", () -> ctx.scheduleSessions(List.of("a")));
    expect(Status.INVALID_HANDLE, "", ctx::flushSessions);
  }

  @Test
  public void dropFrontRefusesNegativeCounts() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = filled(ctx, 40)) {
      float[][] before = read(seq, 0);
      assertThrows(IllegalArgumentException.class, () -> seq.dropFront(-1, 1));
      assertThrows(IllegalArgumentException.class, () -> seq.dropFront(0, -1));
      assertThrows(IllegalArgumentException.class, () -> seq.dropFront(Long.MIN_VALUE, 0));
      float[][] after = read(seq, 0);
      assertArrayEquals(before[0], after[0], 0f);
      assertArrayEquals(before[1], after[1], 0f);
    }
  }

  @Test
  public void invalidSessionAndRopeConfigValues() {
    Config.Builder[] bad = {
      Fixtures.config().sessionDramBytes(-1),
      Fixtures.config().sessionDiskBytes(-1),
      Fixtures.config().sessionTtlMs(-1),
      Fixtures.config().ropeDims(3),
      Fixtures.config().ropeDims(-2),
      Fixtures.config().ropeDims(Fixtures.HEAD_DIM + 2),
      Fixtures.config().ropeTheta(0f),
      Fixtures.config().ropeTheta(Float.NaN),
      Fixtures.config().ropeTheta(Float.POSITIVE_INFINITY),
      Fixtures.config().ropeScaleFactor(0.5f),
      Fixtures.config().ropeScaleFactor(-1f),
      Fixtures.config().ropeLowFreqFactor(0f),
      Fixtures.config().ropeHighFreqFactor(1f),
      Fixtures.config().ropeHighFreqFactor(Float.NaN),
      Fixtures.config().ropeOriginalMaxPositions(0),
      Fixtures.config().ropeOriginalMaxPositions(-5)
    };
    String[] fields = {
      "session_dram_bytes", "session_disk_bytes", "session_ttl_ms", "rope_dims", "rope_dims", "rope_dims",
      "rope_theta", "rope_theta", "rope_theta", "rope_scale_factor", "rope_scale_factor", "rope_low_freq_factor",
      "rope_high_freq_factor", "rope_high_freq_factor", "rope_original_max_positions", "rope_original_max_positions"
    };
    for (int i = 0; i < bad.length; ++i) {
      Config config = bad[i].build();
      expect(Status.INVALID_ARGUMENT, fields[i], () -> Context.create(config));
    }
    // The strings: a NUL is refused before the call, by name.
    for (Config.Builder builder : new Config.Builder[] {
           Fixtures.config().sessionSharedUrl("redis://local\0host"), Fixtures.config().diskPath("/tmp/a\0b")}) {
      Config config = builder.build();
      KvretException e = assertThrows(KvretException.class, () -> Context.create(config));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("NUL"));
    }
  }

  @Test
  public void diskPathsAreUtf8BothWays() throws Exception {
    Path parent = Files.createTempDirectory("kvret-sessions");
    Path dir = parent.resolve("café-\uD83D\uDE42");
    try {
      try (Context ctx = Context.create(Fixtures.config().diskPath(dir.toString()).sessionDramBytes(1).build());
           Sequence seq = filled(ctx, 40)) {
        assertEquals(dir.toString(), ctx.config().diskPath());
        assertEquals(dir.toString(), ctx.config().toBuilder().build().diskPath());
        seq.saveSession("s");
        assertEquals(SessionTier.DISK, ctx.sessionTier("s"));
        assertTrue(Files.isDirectory(dir));
      }
    } finally {
      try (var files = Files.walk(parent)) {
        files.sorted((a, b) -> b.compareTo(a)).forEach(p -> p.toFile().delete());
      }
    }
  }

  /**
   * Whether this build serves the shared tier or not, the URL crosses: the context has it, or the library refused it
   * by name (no server listens on port 1).
   */
  @Test
  public void theSharedUrlReachesTheLibrary() {
    String url = "redis://127.0.0.1:1/0?prefix=kvret-java&timeout_ms=200";
    Config config = Fixtures.config().sessionSharedUrl(url).build();
    assertEquals(url, config.sessionSharedUrl());
    assertEquals(url, config.toBuilder().build().sessionSharedUrl());
    Context ctx;
    try {
      ctx = Context.create(config);
    } catch (KvretException e) {
      assertTrue(e.getMessage(), e.getMessage().contains("session_shared_url"));
      return;
    }
    try (Context created = ctx) {
      assertEquals(url, created.config().sessionSharedUrl());
    }
  }

  @Test
  public void sessionAndRopeFieldsRoundTrip() {
    Config config = Fixtures.config()
        .sessionPolicy(SessionPolicy.FIFO)
        .ropeLayout(RopeLayout.GPTJ)
        .sessionTtlMs(60_000)
        .sessionDramBytes(1L << 40)
        .build();
    try (Context ctx = Context.create(config)) {
      Config effective = ctx.config();
      assertEquals(SessionPolicy.FIFO, effective.sessionPolicy());
      assertEquals(RopeLayout.GPTJ, effective.ropeLayout());
      assertEquals(60_000, effective.sessionTtlMs());
      assertEquals(1L << 40, effective.sessionDramBytes());
      assertNull(effective.sessionSharedUrl());
      assertNull(effective.diskPath());
      assertEquals(Config.defaults().ropeTheta(), effective.ropeTheta(), 0f);
    }
    assertEquals(4, SessionTier.values().length);
    assertEquals(SessionTier.NONE, SessionTier.valueOf("NONE"));
  }
}
