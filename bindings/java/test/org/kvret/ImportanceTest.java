package org.kvret;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;

import java.util.Random;
import org.junit.Test;

/** Sequence.observe and Sequence.observeAttention: where KVCrush's importance comes from. */
public class ImportanceTest {
  private final Random random = new Random(31);

  @Test
  public void theKeysAsAQueryWindowGiveTheKeysRule() {
    float[] keys = Fixtures.gaussian(random, Fixtures.TOKENS * Fixtures.KV_HEADS * Fixtures.HEAD_DIM);
    Tensor k = Tensor.ofFloats(keys, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
    Tensor v = Fixtures.kv(random);
    int row = Fixtures.KV_HEADS * Fixtures.HEAD_DIM;
    float[] last = new float[32 * row];
    System.arraycopy(keys, (Fixtures.TOKENS - 32) * row, last, 0, last.length);
    Tensor window = Tensor.ofFloats(last, 32, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
    try (Context ctx = Context.create(Fixtures.config().nQHeads(Fixtures.KV_HEADS).hammingFraction(0.25f).build());
        Sequence a = ctx.openSequence();
        Sequence b = ctx.openSequence()) {
      a.appendPrefill(0, k, v);
      b.appendPrefill(0, k, v);
      b.observe(0, window);
      for (int h = 0; h < Fixtures.KV_HEADS; ++h) {
        assertArrayEquals(a.retainedSet(0, 40).positions(h), b.retainedSet(0, 40).positions(h));
      }
    }
  }

  @Test
  public void accumulatedAttentionDrivesTheRetainedSet() {
    try (Context ctx = Context.create(Fixtures.config().hammingImportance(Importance.ACCUMULATED).build());
        Sequence seq = ctx.openSequence()) {
      assertEquals(Importance.ACCUMULATED, ctx.config().hammingImportance());
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      int[] favourites = {50, 120, 121, 300, 301, 302};
      float[] probs = new float[Fixtures.Q_HEADS * Fixtures.TOKENS];
      for (int i = 0; i < Fixtures.Q_HEADS; ++i) {
        for (int p : favourites) {
          probs[i * Fixtures.TOKENS + p] = 1.0f / favourites.length;
        }
      }
      seq.observeAttention(0, Tensor.ofFloats(probs, Fixtures.Q_HEADS, Fixtures.TOKENS));
      Selection kept = seq.retainedSet(0, favourites.length);
      for (int h = 0; h < Fixtures.KV_HEADS; ++h) {
        assertArrayEquals(favourites, kept.positions(h));
      }
    }
  }
}
