package org.kvret;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Random;
import org.junit.Test;
import org.junit.function.ThrowingRunnable;

/** Failures throw KvretException carrying the status and the library's message. */
public class ErrorsTest {
  private final Random random = new Random(99);

  private static KvretException expect(Status status, ThrowingRunnable call) {
    KvretException e = assertThrows(KvretException.class, call);
    assertEquals(e.toString(), status, e.status());
    assertEquals(status.code(), e.code());
    assertFalse("the library's message", e.getMessage().isEmpty());
    return e;
  }

  @Test
  public void wrongShapeLeavesTheSequenceAsItWas() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor bad = Tensor.allocate(DType.F32, 10, Fixtures.KV_HEADS + 1, Fixtures.HEAD_DIM);
      expect(Status.SHAPE, () -> seq.appendPrefill(0, bad, bad));
      assertEquals(Fixtures.TOKENS, seq.length(0));
      expect(Status.SHAPE, () -> seq.select(0, Tensor.allocate(DType.F32, Fixtures.Q_HEADS, 3)));
    }
  }

  @Test
  public void layerOutOfRange() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      KvretException e = expect(
          Status.OUT_OF_RANGE, () -> seq.appendPrefill(Fixtures.LAYERS, Fixtures.kv(random), Fixtures.kv(random)));
      assertTrue(e.getMessage(), e.getMessage().contains(String.valueOf(Fixtures.LAYERS)));
    }
  }

  @Test
  public void budgetZero() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      expect(Status.BUDGET, () -> seq.select(0, Fixtures.query(random), 0));
    }
  }

  @Test
  public void wrongDtype() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor floats = Tensor.allocate(DType.F32, Fixtures.KV_HEADS, Fixtures.BUDGET);
      expect(Status.DTYPE, () -> seq.selectInto(0, Fixtures.query(random), Fixtures.BUDGET, floats));
    }
  }

  @Test
  public void invalidConfig() {
    expect(Status.INVALID_ARGUMENT, () -> Context.create(Fixtures.config().nQHeads(6).nKvHeads(4).build()));
    for (float fraction : new float[] {-0.1f, 0.75f, Float.NaN}) {
      KvretException e =
          expect(Status.INVALID_ARGUMENT, () -> Context.create(Fixtures.config().pqExactFraction(fraction).build()));
      assertTrue(e.getMessage(), e.getMessage().contains("pq_exact_fraction"));
    }
    Config.Builder[] bad = {
      Fixtures.config().indexKind(IndexKind.QUANT).quantGroupSize(48),
      Fixtures.config().indexKind(IndexKind.QUANT).quantResidual(-1),
      Fixtures.config().indexKind(IndexKind.QUANT).quantAttention(2),
      Fixtures.config().indexKind(IndexKind.PQ).quantAttention(1),
      Fixtures.config().clusterSegmentTokens(-1),
      Fixtures.config().indexKind(IndexKind.CLUSTER).clusterReuseSteps(-1),
      Fixtures.config().indexKind(IndexKind.CLUSTER).clusterReuseSteps(1025),
      Fixtures.config().deviceBytesLimit(-1),
      Fixtures.config().indexKind(IndexKind.CLUSTER).clusterExactFraction(-0.1f),
      Fixtures.config().indexKind(IndexKind.CLUSTER).clusterExactFraction(0.6f),
      Fixtures.config().indexKind(IndexKind.CLUSTER).clusterExactFraction(Float.NaN),
      Fixtures.config().indexKind(IndexKind.QUANT).quantRerank(0),
      Fixtures.config().indexKind(IndexKind.QUANT).quantRerank(65),
      Fixtures.config().hammingFraction(0.25f).hammingGranularity(3),
      Fixtures.config().hammingFraction(0.25f).hammingGranularity(-1),
      Fixtures.config().hammingFraction(0.25f).hammingGranularity(8192)
    };
    String[] fields = {
      "quant_group_size", "quant_residual", "quant_attention", "quant_attention", "cluster_segment_tokens",
      "cluster_reuse_steps", "cluster_reuse_steps", "device_bytes_limit", "cluster_exact_fraction",
      "cluster_exact_fraction", "cluster_exact_fraction", "quant_rerank", "quant_rerank", "hamming_granularity",
      "hamming_granularity", "hamming_granularity"
    };
    for (int i = 0; i < bad.length; ++i) {
      Config config = bad[i].build();
      KvretException e = expect(Status.INVALID_ARGUMENT, () -> Context.create(config));
      assertTrue(e.getMessage(), e.getMessage().contains(fields[i]));
    }
  }

  @Test
  public void unusableBuffersAreRejectedBeforeTheNativeCall() {
    assertThrows(IllegalArgumentException.class, () -> Tensor.wrap(ByteBuffer.allocate(64), DType.F32, 16));
    assertThrows(IllegalArgumentException.class,
        () -> Tensor.wrap(ByteBuffer.allocateDirect(64).order(ByteOrder.nativeOrder()), DType.F32, 17));
    ByteOrder other =
        ByteOrder.nativeOrder() == ByteOrder.LITTLE_ENDIAN ? ByteOrder.BIG_ENDIAN : ByteOrder.LITTLE_ENDIAN;
    assertThrows(
        IllegalArgumentException.class, () -> Tensor.wrap(ByteBuffer.allocateDirect(64).order(other), DType.F32, 16));
    assertThrows(IllegalArgumentException.class, () -> Tensor.allocate(DType.F32, 4, 4).withStrides(8, 1));
  }

  @Test
  public void statusesMatchTheLibrary() {
    for (Status status : Status.values()) {
      if (status == Status.UNKNOWN) {
        continue;
      }
      String expected = status == Status.OK ? "KVRET_OK" : "KVRET_ERR_" + status.name();
      assertEquals(expected, status.libraryName());
    }
  }

  @Test
  public void absurdBudgetsAreRefusedBeforeAnyAllocation() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor q = Fixtures.query(random);
      for (int budget : new int[] {Integer.MAX_VALUE, 1_000_000_000, Fixtures.TOKENS + 1}) {
        try {
          seq.select(0, q, budget);
          org.junit.Assert.fail("budget " + budget + " was accepted");
        } catch (KvretException e) {
          assertEquals(Status.BUDGET, e.status());
        }
        try {
          ctx.selectBatch(java.util.List.of(seq), 0, Tensor.ofFloats(Fixtures.gaussian(random,
              Fixtures.Q_HEADS * Fixtures.HEAD_DIM), 1, Fixtures.Q_HEADS, Fixtures.HEAD_DIM), budget);
          org.junit.Assert.fail("budget " + budget + " was accepted in a batch");
        } catch (KvretException e) {
          assertEquals(Status.BUDGET, e.status());
        }
      }
    }
  }

  @Test
  public void sequenceEditsAndAttendRefuseBadValues() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor narrow = Tensor.ofFloats(new float[Fixtures.Q_HEADS * 8], Fixtures.Q_HEADS, 8);
      KvretException e = assertThrows(KvretException.class, () -> seq.attend(0, narrow, Kvret.BUDGET_DEFAULT));
      assertEquals(Status.SHAPE, e.status());
      e = assertThrows(KvretException.class, () -> seq.attend(0, Fixtures.query(random), Fixtures.TOKENS + 1));
      assertEquals(Status.BUDGET, e.status());
      assertThrows(IllegalArgumentException.class, () -> seq.truncate(-1));
      assertEquals(Fixtures.TOKENS, seq.length(0));
      Sequence closed = ctx.openSequence();
      closed.close();
      e = assertThrows(KvretException.class, closed::fork);
      assertEquals(Status.INVALID_HANDLE, e.status());
    }
  }

  @Test
  public void theCasesOfTheBadInputTable() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      Tensor ints = Tensor.allocate(DType.I32, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
      expect(Status.DTYPE, () -> seq.appendPrefill(0, ints, ints)); // integer keys are refused, not converted
      assertEquals(0, seq.length(0));
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor q = Fixtures.query(random);
      // a device address on the CPU backend
      Tensor device = Tensor.ofAddress(4096, DType.F32, DeviceType.CUDA, 0, Fixtures.Q_HEADS, Fixtures.HEAD_DIM);
      expect(Status.DEVICE, () -> seq.select(0, device, Fixtures.BUDGET));
      // a read-only output is refused before the call
      Tensor readOnly = Tensor.wrap(
          ByteBuffer.allocateDirect(Fixtures.KV_HEADS * Fixtures.BUDGET * 4)
              .asReadOnlyBuffer()
              .order(ByteOrder.nativeOrder()),
          DType.I32, Fixtures.KV_HEADS, Fixtures.BUDGET);
      assertThrows(IllegalArgumentException.class, () -> seq.selectInto(0, q, Fixtures.BUDGET, readOnly));
      // selectScored refuses what select refuses, and changes nothing
      expect(Status.BUDGET, () -> seq.selectScored(0, q, 0));
      expect(Status.SHAPE, () -> seq.selectScored(0, Tensor.allocate(DType.F32, Fixtures.Q_HEADS, 3), 8));
      expect(Status.DEVICE, () -> seq.selectScored(0, device, 8));
      // a batch of no sequences selects nothing
      Tensor none = Tensor.allocate(DType.F32, 0, Fixtures.Q_HEADS, Fixtures.HEAD_DIM);
      assertEquals(0, ctx.selectBatch(java.util.List.of(), 0, none, Fixtures.BUDGET).size());
      assertEquals(Fixtures.TOKENS, seq.length(0));
    }
  }

  @Test
  public void kvCrushImportanceInputsAreRefusedByName() {
    try (Context ctx = Context.create(Fixtures.config().build()); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      Tensor good = Tensor.allocate(DType.F32, 4, Fixtures.Q_HEADS, Fixtures.HEAD_DIM);
      expect(Status.STATE, () -> seq.observe(1, good)); // layer 1 holds no tokens
      expect(Status.OUT_OF_RANGE, () -> seq.observe(Fixtures.LAYERS, good));
      expect(Status.SHAPE, () -> seq.observe(0, Tensor.allocate(DType.F32, Fixtures.TOKENS + 1, Fixtures.Q_HEADS,
          Fixtures.HEAD_DIM)));
      expect(Status.SHAPE, () -> seq.observe(0, Tensor.allocate(DType.F32, 4, Fixtures.KV_HEADS, Fixtures.HEAD_DIM)));
      expect(Status.DTYPE, () -> seq.observe(0, Tensor.allocate(DType.I32, 4, Fixtures.Q_HEADS, Fixtures.HEAD_DIM)));
      Tensor probs = Tensor.allocate(DType.F32, Fixtures.Q_HEADS, Fixtures.TOKENS);
      KvretException e = expect(Status.STATE, () -> seq.observeAttention(0, probs)); // window importance
      assertTrue(e.getMessage(), e.getMessage().contains("hamming_importance"));
    }
    try (Context ctx = Context.create(Fixtures.config().hammingImportance(Importance.ACCUMULATED).build());
        Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Fixtures.kv(random), Fixtures.kv(random));
      float[] values = new float[Fixtures.Q_HEADS * Fixtures.TOKENS];
      values[2 * Fixtures.TOKENS + 7] = -1.0f;
      KvretException e = expect(Status.INVALID_ARGUMENT,
          () -> seq.observeAttention(0, Tensor.ofFloats(values, Fixtures.Q_HEADS, Fixtures.TOKENS)));
      assertTrue(e.getMessage(), e.getMessage().contains("query head 2, position 7"));
      expect(Status.SHAPE,
          () -> seq.observeAttention(0, Tensor.allocate(DType.F32, Fixtures.Q_HEADS, Fixtures.TOKENS + 1)));
    }
  }
}
