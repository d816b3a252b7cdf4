import java.util.Random;
import org.kvret.Config;
import org.kvret.Context;
import org.kvret.IndexKind;
import org.kvret.KvDtype;
import org.kvret.Kvret;
import org.kvret.KvretException;
import org.kvret.Selection;
import org.kvret.Sequence;
import org.kvret.Tensor;
import org.kvret.WorkingSet;

/** kvret from Java: prefill -> select -> fetch -> attend, then compare with attention over every token. */
public final class Quickstart {
  private Quickstart() {}

  public static void main(String[] args) {
    final int layers = 2;
    final int qHeads = 8;
    final int kvHeads = 2;
    final int headDim = 64;
    final int tokens = 2048;
    Random random = new Random(0);

    Config config = Config.builder()
                        .nLayers(layers)
                        .nQHeads(qHeads)
                        .nKvHeads(kvHeads)
                        .headDim(headDim)
                        .kvDtype(KvDtype.F32)
                        .indexKind(IndexKind.PQ)
                        .nSink(16)
                        .nLocal(64)
                        .budget(128)
                        .build();
    try (Context ctx = Context.create(config); Sequence seq = ctx.openSequence()) {
      // Prefill: keys and values of every layer, [tokens, kvHeads, headDim] in direct native-order buffers.
      Tensor[] keys = new Tensor[layers];
      Tensor[] values = new Tensor[layers];
      for (int layer = 0; layer < layers; ++layer) {
        keys[layer] = Tensor.ofFloats(gaussian(random, tokens * kvHeads * headDim), tokens, kvHeads, headDim);
        values[layer] = Tensor.ofFloats(gaussian(random, tokens * kvHeads * headDim), tokens, kvHeads, headDim);
        seq.appendPrefill(layer, keys[layer], values[layer]);
      }

      // One decode step on the last layer, with a query whose heads each look for one far-back "needle" token.
      int layer = layers - 1;
      int group = qHeads / kvHeads;
      float[] query = gaussian(random, qHeads * headDim);
      int[] needles = new int[qHeads];
      for (int h = 0; h < qHeads; ++h) {
        needles[h] = 16 + random.nextInt(tokens - 16 - 64);
        double norm = 0;
        for (int d = 0; d < headDim; ++d) {
          float x = keys[layer].getFloat(needles[h], h / group, d);
          norm += x * x;
        }
        for (int d = 0; d < headDim; ++d) {
          float x = keys[layer].getFloat(needles[h], h / group, d);
          query[h * headDim + d] =
              (float) (1.2 * Math.sqrt(headDim) * x / Math.sqrt(norm) + 0.5 * query[h * headDim + d]);
        }
      }
      Tensor q = Tensor.ofFloats(query, qHeads, headDim);
      Selection selection = seq.select(layer, q);
      WorkingSet ws = seq.fetch(layer, selection);
      Tensor out = ctx.attend(q, ws);

      // The same attention over every token, for comparison.
      Tensor allK = Tensor.allocate(org.kvret.DType.F32, kvHeads, tokens, headDim);
      Tensor allV = Tensor.allocate(org.kvret.DType.F32, kvHeads, tokens, headDim);
      seq.read(layer, 0, tokens,
          Tensor.wrap(allK.buffer(), org.kvret.DType.F32, tokens, kvHeads, headDim)
              .withStrides(headDim, (long) tokens * headDim, 1),
          Tensor.wrap(allV.buffer(), org.kvret.DType.F32, tokens, kvHeads, headDim)
              .withStrides(headDim, (long) tokens * headDim, 1));
      Tensor full = Tensor.allocate(org.kvret.DType.F32, qHeads, headDim);
      ctx.attend(q, allK, allV, tokens, 0f, full, 0);

      double error = 0;
      double norm = 0;
      for (int h = 0; h < qHeads; ++h) {
        for (int d = 0; d < headDim; ++d) {
          double diff = out.getFloat(h, d) - full.getFloat(h, d);
          error += diff * diff;
          norm += full.getFloat(h, d) * (double) full.getFloat(h, d);
        }
      }
      int found = 0;
      for (int h = 0; h < qHeads; ++h) {
        final int needle = needles[h];
        found += java.util.Arrays.stream(selection.positions(h / group)).anyMatch(p -> p == needle) ? 1 : 0;
      }
      System.out.printf(
          "kvret %s: %d tokens per layer, PQ index, budget %d%n", Kvret.version(), tokens, selection.count());
      System.out.printf("working set: %d rows per KV head; needles retrieved: %d/%d%n", ws.rows(), found, qHeads);
      System.out.printf("output error vs full attention: %.3f%n", Math.sqrt(error / norm));

      try {
        seq.select(layers, q);
      } catch (KvretException e) {
        System.out.println("a bad call throws: " + e);
      }
    }
  }

  private static float[] gaussian(Random random, int count) {
    float[] values = new float[count];
    for (int i = 0; i < count; ++i) {
      values[i] = (float) random.nextGaussian();
    }
    return values;
  }
}
