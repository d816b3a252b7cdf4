package org.kvret;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertSame;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import org.junit.Test;

/**
 * Each design's parameters in one object (Config.builder().pq(PqParams.builder().m(8).build())): the values reach the
 * context, and bad ones (out of range, a flat field set next to its object) are refused with a status and a message
 * naming the field, and no context.
 */
public class ParamsTest {
  private static void refused(Config config, String prefix, String part) {
    KvretException e = assertThrows(KvretException.class, () -> Context.create(config).close());
    assertEquals(e.toString(), Status.INVALID_ARGUMENT, e.status());
    assertTrue(e.getMessage(), e.getMessage().startsWith(prefix));
    assertTrue(e.getMessage(), e.getMessage().contains(part));
  }

  @Test
  public void defaultsAreTheFlatDefaults() {
    Config flat = Config.defaults();
    PqParams pq = PqParams.defaults();
    assertEquals(flat.pqM(), pq.m());
    assertEquals(flat.pqBits(), pq.bits());
    assertEquals(flat.pqExactFraction(), pq.exactFraction(), 0.0f);
    assertEquals(flat.clusterTokens(), ClusterParams.defaults().tokens());
    assertEquals(flat.quantRerank(), QuantParams.defaults().rerank());
    assertEquals(flat.hammingImportance(), CrushParams.defaults().importance());
    assertEquals(flat.sessionPolicy(), SessionParams.defaults().policy());
    // a builder starts from the object's values and does not change it
    PqParams eight = pq.toBuilder().m(8).build();
    assertEquals(8, eight.m());
    assertEquals(flat.pqM(), pq.m());
  }

  @Test
  public void groupedValuesTakeEffect() {
    PqParams pq = PqParams.builder().m(8).bits(4).exactFraction(0.125f).build();
    Config config = Fixtures.config()
                        .indexKind(IndexKind.PQ)
                        .pq(pq)
                        .cluster(ClusterParams.builder().tokens(48).reuseSteps(3).build())
                        .quant(QuantParams.builder().bits(1).groupSize(32).build())
                        .crush(CrushParams.builder().fraction(0.25f).importance(Importance.ACCUMULATED).build())
                        .session(SessionParams.builder().ttlMs(1234).policy(SessionPolicy.FIFO).build())
                        .build();
    assertSame(pq, config.pq());
    try (Context ctx = Context.create(config)) {
      Config got = ctx.config();
      assertEquals(8, got.pqM());
      assertEquals(4, got.pqBits());
      assertEquals(0.125f, got.pqExactFraction(), 0.0f);
      assertEquals(0, got.pqIters());
      assertEquals(48, got.clusterTokens());
      assertEquals(3, got.clusterReuseSteps());
      assertEquals(1, got.quantBits());
      assertEquals(32, got.quantGroupSize());
      assertEquals(64, got.quantResidual());
      assertEquals(0.25f, got.hammingFraction(), 0.0f);
      assertEquals(Importance.ACCUMULATED, got.hammingImportance());
      assertEquals(1234, got.sessionTtlMs());
      assertEquals(SessionPolicy.FIFO, got.sessionPolicy());
      assertNull("the effective config reports the flat fields", got.pq());
    }
    // the flat setters, kept for one release, still work
    try (Context ctx = Context.create(Fixtures.config().pqM(16).build())) {
      assertEquals(16, ctx.config().pqM());
    }
  }

  @Test
  public void outOfRangeNamesTheStructField() {
    refused(Fixtures.config().pq(PqParams.builder().m(3).build()).build(), "config.pq.m: ",
        "does not divide head_dim 64");
    refused(Fixtures.config().pq(PqParams.builder().exactFraction(0.75f).build()).build(),
        "config.pq.exact_fraction: ", "[0, 0.5]");
    refused(Fixtures.config().cluster(ClusterParams.builder().reuseSteps(2000).build()).build(),
        "config.cluster.reuse_steps: ", "0..1024");
    refused(Fixtures.config().quant(QuantParams.builder().bits(3).build()).build(), "config.quant.bits: ", "1 or 2");
    refused(Fixtures.config().crush(CrushParams.builder().fraction(1.0f).build()).build(), "config.crush.fraction: ",
        "[0, 1)");
    refused(Fixtures.config().session(SessionParams.builder().ttlMs(-1).build()).build(), "config.session.ttl_ms: ",
        ">= 0");
  }

  @Test
  public void aFlatFieldNextToItsStructIsRefused() {
    refused(Fixtures.config().pqM(8).pq(PqParams.builder().bits(4).build()).build(),
        "config.pq_m is changed from its default and config.pq is given too", "set pq.m only");
    refused(Fixtures.config().hammingImportance(Importance.ACCUMULATED).crush(CrushParams.defaults()).build(),
        "config.hamming_importance is changed", "crush.importance");
    refused(Fixtures.config().sessionPolicy(SessionPolicy.LRU).session(SessionParams.defaults()).build(),
        "config.session_policy is changed", "session.policy");
    // a flat field at its default is no conflict; removing the object again leaves the flat fields
    try (Context ctx = Context.create(Fixtures.config().pqBits(6).pq(PqParams.builder().m(2).build()).build())) {
      assertEquals(2, ctx.config().pqM());
    }
    Config back = Fixtures.config().pqM(8).pq(PqParams.defaults()).pq(null).build();
    try (Context ctx = Context.create(back)) {
      assertEquals(8, ctx.config().pqM());
    }
  }
}
