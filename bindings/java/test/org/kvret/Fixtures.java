package org.kvret;

import java.util.Random;

/** Shared geometry and random data of the tests. */
final class Fixtures {
  static final int LAYERS = 2;
  static final int Q_HEADS = 8;
  static final int KV_HEADS = 2;
  static final int HEAD_DIM = 64;
  static final int SINK = 4;
  static final int LOCAL = 16;
  static final int BUDGET = 32;
  static final int TOKENS = 400;

  private Fixtures() {}

  static Config.Builder config() {
    return Config.builder()
        .nLayers(LAYERS)
        .nQHeads(Q_HEADS)
        .nKvHeads(KV_HEADS)
        .headDim(HEAD_DIM)
        .kvDtype(KvDtype.F32)
        .indexKind(IndexKind.EXACT)
        .nSink(SINK)
        .nLocal(LOCAL)
        .budget(BUDGET);
  }

  static float[] gaussian(Random random, int count) {
    float[] values = new float[count];
    for (int i = 0; i < count; ++i) {
      values[i] = (float) random.nextGaussian();
    }
    return values;
  }

  /** [TOKENS, KV_HEADS, HEAD_DIM] random keys or values. */
  static Tensor kv(Random random) {
    return Tensor.ofFloats(gaussian(random, TOKENS * KV_HEADS * HEAD_DIM), TOKENS, KV_HEADS, HEAD_DIM);
  }

  static Tensor query(Random random) {
    return Tensor.ofFloats(gaussian(random, Q_HEADS * HEAD_DIM), Q_HEADS, HEAD_DIM);
  }

  /** Reference attention over the first rows of a working set, in double precision. */
  static double[][] attention(Tensor q, WorkingSet ws) {
    int group = Q_HEADS / KV_HEADS;
    double scale = 1.0 / Math.sqrt(HEAD_DIM);
    double[][] out = new double[Q_HEADS][HEAD_DIM];
    int rows = (int) ws.rows();
    for (int h = 0; h < Q_HEADS; ++h) {
      int g = h / group;
      double[] logits = new double[rows];
      double max = Double.NEGATIVE_INFINITY;
      for (int r = 0; r < rows; ++r) {
        double dot = 0;
        for (int d = 0; d < HEAD_DIM; ++d) {
          dot += q.getFloat(h, d) * ws.k().getFloat(g, r, d);
        }
        logits[r] = scale * dot;
        max = Math.max(max, logits[r]);
      }
      double sum = 0;
      for (int r = 0; r < rows; ++r) {
        logits[r] = Math.exp(logits[r] - max);
        sum += logits[r];
      }
      for (int r = 0; r < rows; ++r) {
        for (int d = 0; d < HEAD_DIM; ++d) {
          out[h][d] += logits[r] / sum * ws.v().getFloat(g, r, d);
        }
      }
    }
    return out;
  }
}
