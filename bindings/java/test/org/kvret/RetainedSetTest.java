package org.kvret;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.util.Arrays;
import java.util.Random;
import org.junit.Test;

/** Sequence.retainedSet: KVCrush's eviction-only mode (kvret_seq_retained_set). */
public class RetainedSetTest {
  private final Random random = new Random(15);

  @Test
  public void snapKvBasePlusRepresentatives() {
    Tensor k = Fixtures.kv(random);
    Tensor v = Fixtures.kv(random);
    try (Context plain = Context.create(Fixtures.config().indexKind(IndexKind.STREAMING).build());
        Context crushed =
            Context.create(Fixtures.config().indexKind(IndexKind.STREAMING).hammingFraction(0.25f).build());
        Sequence a = plain.openSequence();
        Sequence b = crushed.openSequence()) {
      a.appendPrefill(0, k, v);
      b.appendPrefill(0, k, v);
      Selection kept = b.retainedSet(0, 40);
      assertEquals(40, kept.count());
      Selection base = a.retainedSet(0, 30); // floor(0.25 * 40) = 10 representatives
      for (int h = 0; h < Fixtures.KV_HEADS; ++h) {
        int[] row = kept.positions(h);
        for (int i = 0; i < row.length; ++i) {
          assertTrue("middle position", row[i] >= Fixtures.SINK && row[i] < Fixtures.TOKENS - Fixtures.LOCAL);
          assertTrue("distinct and ascending", i == 0 || row[i] > row[i - 1]);
        }
        for (int p : base.positions(h)) {
          assertTrue("the important part is SnapKV's set", Arrays.binarySearch(row, p) >= 0);
        }
      }
      // the call changes nothing: the same answer again
      assertArrayEquals(kept.positions(1), b.retainedSet(0, 40).positions(1));
    }
  }

  @Test
  public void refusalsNameTheProblem() {
    try (Context ctx = Context.create(Fixtures.config().hammingFraction(0.25f).build());
        Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      KvretException e = assertThrows(KvretException.class, () -> seq.retainedSet(1, 8));
      assertEquals(Status.STATE, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("observation window"));
      e = assertThrows(KvretException.class, () -> seq.retainedSet(0, 0));
      assertEquals(Status.BUDGET, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("budget"));
      Tensor floats = Tensor.allocate(DType.F32, Fixtures.KV_HEADS, 8);
      e = assertThrows(KvretException.class, () -> seq.retainedSetInto(0, 8, floats));
      assertEquals(Status.DTYPE, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("out_positions"));
    }
  }
}
