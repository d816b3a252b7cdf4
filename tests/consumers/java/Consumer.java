import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Arrays;
import java.util.Random;
import java.util.TreeSet;
import org.kvret.Config;
import org.kvret.Context;
import org.kvret.IndexKind;
import org.kvret.KvDtype;
import org.kvret.Kvret;
import org.kvret.Selection;
import org.kvret.Sequence;
import org.kvret.Tensor;
import org.kvret.WorkingSet;

/**
 * A program of a kvret user, built against an installed kvret.jar alone: prefill, select, fetch and attend, with a
 * planted "needle" key that an exact index must select and fetch back unchanged. Prints one line starting with
 * "kvret java consumer: OK" on success, then the files libkvret and libkvret_jni were loaded from (one "loaded:"
 * line each, from /proc/self/maps); exits with status 1 otherwise.
 */
public final class Consumer {
  private Consumer() {}

  private static void check(boolean condition, String what) {
    if (!condition) {
      System.out.println("kvret java consumer: FAILED: " + what);
      System.exit(1);
    }
  }

  public static void main(String[] args) {
    final int qHeads = 4;
    final int kvHeads = 2;
    final int headDim = 64;
    final int tokens = 512;
    final int needle = 200;
    Random random = new Random(7);

    float[] keys = new float[tokens * kvHeads * headDim];
    float[] values = new float[keys.length];
    for (int i = 0; i < keys.length; ++i) {
      keys[i] = (float) random.nextGaussian();
      values[i] = (float) random.nextGaussian();
    }
    // Every query head points at the needle's key of its KV head, far stronger than any other token's.
    float[] query = new float[qHeads * headDim];
    int group = qHeads / kvHeads;
    for (int h = 0; h < qHeads; ++h) {
      for (int d = 0; d < headDim; ++d) {
        query[h * headDim + d] = 4f * keys[(needle * kvHeads + h / group) * headDim + d];
      }
    }

    Config config = Config.builder().nLayers(1).nQHeads(qHeads).nKvHeads(kvHeads).headDim(headDim)
                        .kvDtype(KvDtype.F32).indexKind(IndexKind.EXACT).nSink(4).nLocal(16).budget(8).build();
    try (Context ctx = Context.create(config); Sequence seq = ctx.openSequence()) {
      seq.appendPrefill(0, Tensor.ofFloats(keys, tokens, kvHeads, headDim),
          Tensor.ofFloats(values, tokens, kvHeads, headDim));
      seq.waitIndex(0);
      check(seq.length(0) == tokens, "length " + seq.length(0));

      Tensor q = Tensor.ofFloats(query, qHeads, headDim);
      Selection selection = seq.select(0, q);
      check(selection.count() == 8, "selected " + selection.count() + " per head, not 8");
      WorkingSet ws = seq.fetch(0, selection);
      for (int head = 0; head < kvHeads; ++head) {
        int[] positions = ws.positions(head);
        int row = Arrays.binarySearch(positions, needle);
        check(row >= 0, "head " + head + " did not fetch the needle: " + Arrays.toString(positions));
        float[] expected = Arrays.copyOfRange(keys, (needle * kvHeads + head) * headDim,
            (needle * kvHeads + head + 1) * headDim);
        check(Arrays.equals(expected, ws.key(head, row)), "head " + head + ": the needle's key differs");
      }
      Tensor out = ctx.attend(q, ws);
      for (int h = 0; h < qHeads; ++h) {
        for (int d = 0; d < headDim; ++d) {
          check(Float.isFinite(out.getFloat(h, d)), "attention output is not finite");
        }
      }
      System.out.println("kvret java consumer: OK (kvret " + Kvret.version() + ", " + tokens + " tokens, needle "
          + needle + " selected and fetched, " + ws.rows() + " rows per KV head)");
    }
    TreeSet<String> loaded = new TreeSet<>();
    try {
      for (String line : Files.readAllLines(Path.of("/proc/self/maps"))) {
        int slash = line.indexOf('/');
        if (slash >= 0 && line.matches(".*/libkvret(_jni)?\\.so[^/]*$")) {
          loaded.add(line.substring(slash));
        }
      }
    } catch (IOException e) {
      loaded.add("unknown (" + e.getMessage() + ")");
    }
    for (String file : loaded) {
      System.out.println("loaded: " + file);
    }
  }
}
