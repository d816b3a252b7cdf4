package org.kvret;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.lang.reflect.Method;
import java.util.ArrayList;
import java.util.List;
import java.util.Random;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import org.junit.Test;

/** close(), try-with-resources, use after close, threads, and the config builder. */
public class LifetimeTest {
  @Test
  public void closeIsIdempotentAndUseAfterCloseThrows() {
    Context ctx = Context.create(Fixtures.config().build());
    Sequence seq = ctx.openSequence();
    seq.close();
    seq.close();
    assertTrue(seq.isClosed());
    KvretException e = assertThrows(KvretException.class, () -> seq.length(0));
    assertEquals(Status.INVALID_HANDLE, e.status());
    ctx.close();
    ctx.close();
    assertEquals(Status.INVALID_HANDLE, assertThrows(KvretException.class, ctx::openSequence).status());
  }

  @Test
  public void closingTheContextClosesItsSequences() {
    Sequence seq;
    try (Context ctx = Context.create(Fixtures.config().build())) {
      seq = ctx.openSequence();
      assertFalse(seq.isClosed());
    }
    assertTrue(seq.isClosed());
  }

  private static List<int[]> run(Context ctx, long seed) {
    Random random = new Random(seed);
    List<int[]> results = new ArrayList<>();
    try (Sequence seq = ctx.openSequence()) {
      for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
        seq.appendPrefill(layer, Fixtures.kv(random), Fixtures.kv(random));
      }
      for (int step = 0; step < 4; ++step) {
        WorkingSet ws = seq.fetch(step % 2, seq.select(step % 2, Fixtures.query(random)));
        results.add(ws.positions(1));
      }
    }
    return results;
  }

  @Test
  public void distinctSequencesOnManyThreads() throws Exception {
    try (Context ctx = Context.create(Fixtures.config().build())) {
      int n = 6;
      List<List<int[]>> expected = new ArrayList<>();
      for (int i = 0; i < n; ++i) {
        expected.add(run(ctx, i));
      }
      ExecutorService pool = Executors.newFixedThreadPool(n);
      try {
        List<Future<List<int[]>>> futures = new ArrayList<>();
        for (int i = 0; i < n; ++i) {
          final long seed = i;
          futures.add(pool.submit(() -> run(ctx, seed)));
        }
        for (int i = 0; i < n; ++i) {
          List<int[]> got = futures.get(i).get();
          for (int step = 0; step < got.size(); ++step) {
            org.junit.Assert.assertArrayEquals(expected.get(i).get(step), got.get(step));
          }
        }
      } finally {
        pool.shutdown();
      }
    }
  }

  @Test
  public void configBuilderAndEffectiveConfig() {
    Config defaults = Config.defaults();
    assertEquals(IndexKind.PQ, defaults.indexKind());
    assertEquals(DeviceType.CPU, defaults.deviceType());
    Config config = Fixtures.config().seed(-1L).diskPath(null).build();
    try (Context ctx = Context.create(config)) {
      Config effective = ctx.config();
      assertEquals(Fixtures.KV_HEADS, effective.nKvHeads());
      assertEquals(KvDtype.F32, effective.kvDtype());
      assertEquals(IndexKind.EXACT, effective.indexKind());
      assertEquals(-1L, effective.seed());
      assertEquals(null, effective.diskPath());
      assertEquals(Fixtures.BUDGET, effective.toBuilder().build().budget());
    }
  }

  private static String camel(String snake) {
    StringBuilder out = new StringBuilder();
    boolean upper = false;
    for (char c : snake.toCharArray()) {
      if (c == '_') {
        upper = true;
      } else {
        out.append(upper ? Character.toUpperCase(c) : c);
        upper = false;
      }
    }
    return out.toString();
  }

  /** Every kvret_config field (from the SWIG proxy, i.e. from kvret.h) has a Config getter and a Builder setter. */
  @Test
  public void configCoversEveryField() throws Exception {
    for (Method method : NativeConfig.class.getDeclaredMethods()) {
      String name = method.getName();
      if (!name.startsWith("get") || name.equals("getStruct_size") || name.equals("getCPtr")) {
        continue;
      }
      String field = name.substring(3);
      String getter = camel(Character.toLowerCase(field.charAt(0)) + field.substring(1));
      Config.class.getMethod(getter);
      if (!field.startsWith("Device_")) {
        boolean found = false;
        for (Method setter : Config.Builder.class.getMethods()) {
          found |= setter.getName().equals(getter);
        }
        assertTrue("Config.Builder." + getter, found);
      }
    }
  }
}
