package org.kvret;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.util.HashSet;
import java.util.List;
import java.util.Random;
import java.util.Set;
import org.junit.Test;

/** prefill -> select -> fetch -> attend through direct ByteBuffers. */
public class RoundTripTest {
  private final Random random = new Random(1234);

  @Test
  public void roundTrip() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
        seq.appendPrefill(layer, Fixtures.kv(random), Fixtures.kv(random));
      }
      seq.waitIndex(-1);
      for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
        assertEquals(Fixtures.TOKENS, seq.length(layer));
        Tensor q = Fixtures.query(random);
        Selection selection = seq.select(layer, q);
        assertEquals(Fixtures.BUDGET, selection.count());
        for (int head = 0; head < Fixtures.KV_HEADS; ++head) {
          int[] positions = selection.positions(head);
          for (int i = 0; i < positions.length; ++i) {
            assertTrue(positions[i] >= Fixtures.SINK && positions[i] < Fixtures.TOKENS - Fixtures.LOCAL);
            assertTrue(i == 0 || positions[i] > positions[i - 1]);
          }
        }
        WorkingSet ws = seq.fetch(layer, selection);
        assertEquals(Fixtures.SINK + Fixtures.BUDGET + Fixtures.LOCAL, ws.rows());
        int[] rowPositions = ws.positions(0);
        assertEquals(0, rowPositions[0]);
        assertEquals(Fixtures.TOKENS - 1, rowPositions[rowPositions.length - 1]);

        Tensor out = ctx.attend(q, ws);
        double[][] expected = Fixtures.attention(q, ws);
        for (int h = 0; h < Fixtures.Q_HEADS; ++h) {
          for (int d = 0; d < Fixtures.HEAD_DIM; ++d) {
            assertEquals(expected[h][d], out.getFloat(h, d), 1e-4);
          }
        }
      }
    }
  }

  @Test
  public void fetchedRowsEqualStoredRows() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      Tensor k = Fixtures.kv(random);
      Tensor v = Fixtures.kv(random);
      seq.appendPrefill(0, k, v);
      WorkingSet ws = seq.fetch(0, seq.select(0, Fixtures.query(random)));
      for (int head = 0; head < Fixtures.KV_HEADS; ++head) {
        int[] positions = ws.positions(head);
        for (int row = 0; row < positions.length; ++row) {
          float[] expectedK = new float[Fixtures.HEAD_DIM];
          float[] expectedV = new float[Fixtures.HEAD_DIM];
          for (int d = 0; d < Fixtures.HEAD_DIM; ++d) {
            expectedK[d] = k.getFloat(positions[row], head, d);
            expectedV[d] = v.getFloat(positions[row], head, d);
          }
          assertArrayEquals(expectedK, ws.key(head, row), 0f);
          assertArrayEquals(expectedV, ws.value(head, row), 0f);
        }
      }
      Tensor readK = Tensor.allocate(DType.F32, 10, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
      Tensor readV = Tensor.allocate(DType.F32, 10, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
      seq.read(0, 5, 15, readK, readV);
      assertEquals(k.getFloat(5, 1, 3), readK.getFloat(0, 1, 3), 0f);
      assertEquals(v.getFloat(14, 0, 63), readV.getFloat(9, 0, 63), 0f);
    }
  }

  @Test
  public void stridedHeadsFirstMemoryIsAcceptedWithoutCopy() {
    // [KV_HEADS, TOKENS, HEAD_DIM] memory seen as [TOKENS, KV_HEADS, HEAD_DIM].
    long[] strides = {Fixtures.HEAD_DIM, (long) Fixtures.TOKENS * Fixtures.HEAD_DIM, 1};
    Tensor headsFirst =
        Tensor.ofFloats(Fixtures.gaussian(random, Fixtures.TOKENS * Fixtures.KV_HEADS * Fixtures.HEAD_DIM),
            Fixtures.KV_HEADS, Fixtures.TOKENS, Fixtures.HEAD_DIM);
    Tensor view = Tensor.wrap(headsFirst.buffer(), DType.F32, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM)
                      .withStrides(strides);
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, view, view);
      Tensor readK = Tensor.allocate(DType.F32, 1, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
      seq.read(0, 7, 8, readK, Tensor.allocate(DType.F32, 1, Fixtures.KV_HEADS, Fixtures.HEAD_DIM));
      assertEquals(headsFirst.getFloat(1, 7, 5), readK.getFloat(0, 1, 5), 0f);
    }
  }

  @Test
  public void reusedWorkingSetAndSelectBatch() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence a = ctx.openSequence();
         Sequence b = ctx.openSequence()) {
      a.appendPrefill(1, Fixtures.kv(random), Fixtures.kv(random));
      b.appendPrefill(1, Fixtures.kv(random), Fixtures.kv(random));
      float[] qs = Fixtures.gaussian(random, 2 * Fixtures.Q_HEADS * Fixtures.HEAD_DIM);
      Tensor q = Tensor.ofFloats(qs, 2, Fixtures.Q_HEADS, Fixtures.HEAD_DIM);
      List<Selection> batch = ctx.selectBatch(List.of(a, b), 1, q, Kvret.BUDGET_DEFAULT);
      float[] qb = java.util.Arrays.copyOfRange(qs, Fixtures.Q_HEADS * Fixtures.HEAD_DIM, qs.length);
      Selection single = b.select(1, Tensor.ofFloats(qb, Fixtures.Q_HEADS, Fixtures.HEAD_DIM));
      assertArrayEquals(single.positions(1), batch.get(1).positions(1));

      WorkingSet ws = WorkingSet.allocate(
          DType.F32, Fixtures.KV_HEADS, a.workingSetCapacity(1, Kvret.BUDGET_DEFAULT), Fixtures.HEAD_DIM);
      for (int step = 0; step < 3; ++step) {
        Selection selection = a.select(1, Fixtures.query(random));
        long rows = a.fetchInto(1, selection.tensor(), selection.count(), ws, 0);
        assertEquals(rows, ws.rows());
      }
      assertEquals(3, a.stats().fetches());
      assertTrue(ctx.stats().selections() >= 4);
    }
  }

  private Tensor kvOf(int tokens) {
    return Tensor.ofFloats(Fixtures.gaussian(random, tokens * Fixtures.KV_HEADS * Fixtures.HEAD_DIM), tokens,
        Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
  }

  @Test
  public void fetchBatchEqualsOneFetchPerSequence() {
    try (Context ctx = Context.create(Fixtures.config().build())) {
      int[] lengths = {200, 400, 650};
      List<Sequence> batched = new java.util.ArrayList<>();
      List<Sequence> single = new java.util.ArrayList<>();
      for (int tokens : lengths) {
        Tensor k = kvOf(tokens);
        Tensor v = kvOf(tokens);
        for (List<Sequence> group : List.of(batched, single)) {
          Sequence seq = ctx.openSequence();
          seq.appendPrefill(1, k, v);
          group.add(seq);
        }
      }
      Tensor q = Tensor.ofFloats(
          Fixtures.gaussian(random, 3 * Fixtures.Q_HEADS * Fixtures.HEAD_DIM), 3, Fixtures.Q_HEADS, Fixtures.HEAD_DIM);
      List<Selection> selections = ctx.selectBatch(batched, 1, q, Kvret.BUDGET_DEFAULT);
      List<WorkingSet> sets = ctx.fetchBatch(batched, 1, selections);
      for (int i = 0; i < lengths.length; ++i) {
        WorkingSet expected = single.get(i).fetch(1, selections.get(i));
        assertEquals(expected.rows(), sets.get(i).rows());
        assertEquals(Fixtures.SINK + Fixtures.BUDGET + Fixtures.LOCAL, sets.get(i).rows());
        assertArrayEquals(expected.k().toFloatArray(), sets.get(i).k().toFloatArray(), 0.0f);
        assertArrayEquals(expected.v().toFloatArray(), sets.get(i).v().toFloatArray(), 0.0f);
        assertArrayEquals(expected.positions().toIntArray(), sets.get(i).positions().toIntArray());
        Stats a = batched.get(i).stats();
        Stats b = single.get(i).stats();
        assertEquals(1, a.fetches());
        assertEquals(b.fetchedRows(), a.fetchedRows());
        assertEquals(b.cacheMisses(), a.cacheMisses());
        assertEquals(b.cacheHits(), a.cacheHits());
      }
      assertEquals(0, ctx.fetchBatch(List.of(), 1, List.of()).size());
      for (Sequence seq : batched) seq.close();
      for (Sequence seq : single) seq.close();
    }
  }

  @Test
  public void fetchBatchRefusesABadEntryAndWritesNothing() {
    try (Context ctx = Context.create(Fixtures.config().build())) {
      List<Sequence> batch = new java.util.ArrayList<>();
      for (int i = 0; i < 3; ++i) {
        Sequence seq = ctx.openSequence();
        seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
        batch.add(seq);
      }
      Tensor q = Tensor.ofFloats(
          Fixtures.gaussian(random, 3 * Fixtures.Q_HEADS * Fixtures.HEAD_DIM), 3, Fixtures.Q_HEADS, Fixtures.HEAD_DIM);
      int width = Fixtures.BUDGET;
      Tensor positions = Tensor.allocate(DType.I32, 3, Fixtures.KV_HEADS, width);
      int[] counts = new int[3];
      // select_batch's own outputs, through the raw form
      List<Selection> selections = ctx.selectBatch(batch, 0, q, Kvret.BUDGET_DEFAULT);
      java.nio.IntBuffer all = positions.asIntBuffer();
      for (int i = 0; i < 3; ++i) {
        counts[i] = selections.get(i).count();
        for (int h = 0; h < Fixtures.KV_HEADS; ++h) {
          all.position((i * Fixtures.KV_HEADS + h) * width);
          all.put(selections.get(i).positions(h));
        }
      }
      all.put(Fixtures.KV_HEADS * width + 5, Fixtures.TOKENS - 1); // entry 1, head 0: a local position
      List<WorkingSet> outs = new java.util.ArrayList<>();
      for (int i = 0; i < 3; ++i) {
        outs.add(WorkingSet.allocate(
            DType.F32, Fixtures.KV_HEADS, Fixtures.SINK + Fixtures.BUDGET + Fixtures.LOCAL, Fixtures.HEAD_DIM));
      }
      KvretException e = assertThrows(
          KvretException.class, () -> ctx.fetchBatchInto(batch, 0, positions, counts, outs, 0));
      assertEquals(Status.OUT_OF_RANGE, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("positions[1]"));
      for (WorkingSet ws : outs) {
        for (int p : ws.positions().toIntArray()) assertEquals(0, p);
        for (float x : ws.k().toFloatArray()) assertEquals(0.0f, x, 0.0f);
      }
      for (Sequence seq : batch) assertEquals(0, seq.stats().fetches());
      // a count above the middle of entry 2
      all.put(Fixtures.KV_HEADS * width + 5, selections.get(1).positions(0)[5]);
      counts[2] = Fixtures.TOKENS;
      e = assertThrows(KvretException.class, () -> ctx.fetchBatchInto(batch, 0, positions, counts, outs, 0));
      assertEquals(Status.BUDGET, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("counts[2]"));
      counts[2] = selections.get(2).count();
      long[] rows = ctx.fetchBatchInto(batch, 0, positions, counts, outs, 0);
      for (int i = 0; i < 3; ++i) {
        assertEquals(Fixtures.SINK + Fixtures.BUDGET + Fixtures.LOCAL, rows[i]);
        assertEquals(rows[i], outs.get(i).rows());
        assertEquals(1, batch.get(i).stats().fetches());
      }
      // a null working set or positions: refused before anything is converted or written
      List<WorkingSet> withNull = new java.util.ArrayList<>(outs);
      withNull.set(1, null);
      NullPointerException npe = assertThrows(
          NullPointerException.class, () -> ctx.fetchBatchInto(batch, 0, positions, counts, withNull, 0));
      assertTrue(npe.getMessage(), npe.getMessage().contains("outs[1]"));
      npe = assertThrows(NullPointerException.class, () -> ctx.fetchBatchInto(batch, 0, null, counts, outs, 0));
      assertTrue(npe.getMessage(), npe.getMessage().contains("positions"));
      npe = assertThrows(NullPointerException.class, () -> ctx.selectBatch(batch, 0, null, Kvret.BUDGET_DEFAULT));
      assertTrue(npe.getMessage(), npe.getMessage().contains("q"));
      for (Sequence seq : batch) assertEquals(1, seq.stats().fetches());
      // the same sequence twice
      e = assertThrows(KvretException.class,
          () -> ctx.fetchBatch(List.of(batch.get(0), batch.get(0)), 0, selections.subList(0, 2)));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("seqs[1] appears twice"));
      for (Sequence seq : batch) seq.close();
    }
  }

  @Test
  public void clusterReuseHitsShowInTheStats() {
    try (Context ctx = Context.create(Fixtures.config().indexKind(IndexKind.CLUSTER).build());
         Sequence a = ctx.openSequence()) {
      a.appendPrefill(1, Fixtures.kv(random), Fixtures.kv(random));
      Tensor q = Fixtures.query(random);
      WorkingSet ws = WorkingSet.allocate(
          DType.F32, Fixtures.KV_HEADS, a.workingSetCapacity(1, Kvret.BUDGET_DEFAULT), Fixtures.HEAD_DIM);
      for (int step = 0; step < 2; ++step) {  // the same query twice: the second fetch takes every row from reuse
        Selection selection = a.select(1, q);
        a.fetchInto(1, selection.tensor(), selection.count(), ws, 0);
      }
      Stats stats = a.stats();
      assertTrue(stats.clusterReuseRows() > 0);
      assertEquals(stats.clusterReuseRows() / 2, stats.clusterReuseHits());
      assertTrue(stats.clusterReuseBytes() > 0);
    }
  }

  @Test
  public void selectScoredRanksTheSelection() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor q = Fixtures.query(random);
      int middle = Fixtures.TOKENS - Fixtures.SINK - Fixtures.LOCAL;
      Selection all = seq.selectScored(0, q, middle);
      Selection top = seq.selectScored(0, q, 20);
      Selection plain = seq.select(0, q, 20);
      assertFalse(plain.hasScores());
      assertThrows(IllegalStateException.class, () -> plain.scores(0));
      assertTrue(top.hasScores());
      int group = Fixtures.Q_HEADS / Fixtures.KV_HEADS;
      for (int head = 0; head < Fixtures.KV_HEADS; ++head) {
        assertArrayEquals(plain.positions(head), top.positions(head));
        float[] every = all.scores(head);
        double sum = 0;
        for (float score : every) {
          sum += score;
        }
        assertEquals(group, sum, 1e-3); // one softmax per query head of the group
        int[] positions = top.positions(head);
        float[] scores = top.scores(head);
        float lowest = Float.POSITIVE_INFINITY;
        Set<Integer> taken = new HashSet<>();
        for (int i = 0; i < positions.length; ++i) {
          assertEquals(every[positions[i] - Fixtures.SINK], scores[i], 0.0f); // independent of the budget
          lowest = Math.min(lowest, scores[i]);
          taken.add(positions[i]);
        }
        for (int t = 0; t < middle; ++t) {
          if (!taken.contains(t + Fixtures.SINK)) assertTrue(every[t] <= lowest);
        }
      }
    }
  }

  @Test
  public void versionMatchesHeader() {
    assertEquals(Kvret.headerVersionNumber() / 100, Kvret.versionNumber() / 100);
    assertTrue(Kvret.version().startsWith("0."));
  }

  @Test
  public void truncateRollsBackDecodeSteps() {
    try (Context ctx = Context.create(Fixtures.config().build());
        Sequence a = ctx.openSequence();
        Sequence b = ctx.openSequence()) {
      Tensor k = Fixtures.kv(random);
      Tensor v = Fixtures.kv(random);
      a.appendPrefill(0, k, v);
      b.appendPrefill(0, k, v);
      for (int step = 0; step < 5; ++step) { // draft tokens, then rejected
        Tensor dk = Tensor.ofFloats(Fixtures.gaussian(random, Fixtures.KV_HEADS * Fixtures.HEAD_DIM),
            Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
        a.appendDecode(0, dk, dk);
      }
      assertEquals(Fixtures.TOKENS + 5, a.length(0));
      a.truncate(Fixtures.TOKENS);
      assertEquals(Fixtures.TOKENS, a.length(0));
      Tensor q = Fixtures.query(random);
      Selection got = a.select(0, q);
      Selection want = b.select(0, q);
      for (int head = 0; head < Fixtures.KV_HEADS; ++head) {
        assertArrayEquals(want.positions(head), got.positions(head));
      }
      try {
        a.truncate(-1);
        org.junit.Assert.fail("a negative length was accepted");
      } catch (IllegalArgumentException expected) {
        assertTrue(expected.getMessage().contains("length"));
      }
      a.truncate(Long.MAX_VALUE);
      assertEquals(Fixtures.TOKENS, a.length(0));
    }
  }

  @Test
  public void forkBranchesIndependently() {
    try (Context ctx = Context.create(Fixtures.config().build());
        Sequence parent = ctx.openSequence();
        Sequence direct = ctx.openSequence()) {
      Tensor k = Fixtures.kv(random);
      Tensor v = Fixtures.kv(random);
      parent.appendPrefill(0, k, v);
      direct.appendPrefill(0, k, v);
      try (Sequence child = parent.fork()) {
        assertEquals(Fixtures.TOKENS, child.length(0));
        Tensor step = Tensor.ofFloats(Fixtures.gaussian(random, Fixtures.KV_HEADS * Fixtures.HEAD_DIM),
            Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
        child.appendDecode(0, step, step);
        direct.appendDecode(0, step, step);
        assertEquals(Fixtures.TOKENS, parent.length(0));
        Tensor q = Fixtures.query(random);
        Selection got = child.select(0, q);
        Selection want = direct.select(0, q);
        for (int head = 0; head < Fixtures.KV_HEADS; ++head) {
          assertArrayEquals(want.positions(head), got.positions(head));
        }
      }
      assertEquals(Fixtures.TOKENS, parent.length(0));
    }
  }

  @Test
  public void sequenceAttendEqualsSelectFetchAttend() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor q = Fixtures.query(random);
      Tensor got = seq.attend(0, q, Kvret.BUDGET_DEFAULT);
      Tensor want = ctx.attend(q, seq.fetch(0, seq.select(0, q)));
      for (int h = 0; h < Fixtures.Q_HEADS; ++h) {
        for (int d = 0; d < Fixtures.HEAD_DIM; ++d) {
          assertEquals(want.getFloat(h, d), got.getFloat(h, d), 0f);
        }
      }
    }
  }
}
