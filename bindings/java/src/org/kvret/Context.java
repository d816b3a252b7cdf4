package org.kvret;

import java.util.ArrayList;
import java.util.Collections;
import java.util.IdentityHashMap;
import java.util.List;
import java.util.Set;
import java.util.concurrent.locks.ReadWriteLock;
import java.util.concurrent.locks.ReentrantReadWriteLock;

/**
 * A kvret context: the model geometry, index settings and stores shared by its sequences. Its calls are
 * thread-safe; {@link #close()} closes the sequences still open, then frees the context.
 *
 * <pre>{@code
 * try (Context ctx = Context.create(config); Sequence seq = ctx.openSequence()) {
 *   seq.appendPrefill(0, k, v);
 *   Selection selection = seq.select(0, q);
 *   WorkingSet ws = seq.fetch(0, selection);
 *   Tensor out = ctx.attend(q, ws);
 * }
 * }</pre>
 */
public final class Context implements AutoCloseable {
  private final ReadWriteLock lifetime = new ReentrantReadWriteLock();
  private final Set<Sequence> sequences = Collections.newSetFromMap(new IdentityHashMap<>());
  private final Config config;
  private long handle;

  private Context(long handle) {
    this.handle = handle;
    NativeConfig effective = new NativeConfig();
    try {
      KvretNative.kvret_config_init(effective);
      KvretNative.kvret_get_config(handle, effective);
    } catch (RuntimeException e) {
      effective.delete();
      KvretNative.kvret_destroy(handle);
      throw e;
    }
    this.config = Config.adopt(effective);
  }

  /** Creates a context; throws {@link KvretException} if the config is invalid. */
  public static Context create(Config config) {
    long[] out = new long[1];
    KvretNative.kvret_swig_create(config.fields(), config.diskPath(), out);
    return new Context(out[0]);
  }

  /** A context with the library's default config. */
  public static Context create() {
    return create(Config.defaults());
  }

  /** The effective config. */
  public Config config() {
    return config;
  }

  public boolean isClosed() {
    lifetime.readLock().lock();
    try {
      return handle == 0;
    } finally {
      lifetime.readLock().unlock();
    }
  }

  /** Opens an empty sequence. */
  public Sequence openSequence() {
    lifetime.readLock().lock();
    try {
      long[] out = new long[1];
      KvretNative.kvret_seq_open(handle, out);
      return track(out[0]);
    } finally {
      lifetime.readLock().unlock();
    }
  }

  /** The fork of an open sequence of this context (Sequence.fork). */
  Sequence forkSequence(long source) {
    lifetime.readLock().lock();
    try {
      long[] out = new long[1];
      KvretNative.kvret_seq_fork(source, out);
      return track(out[0]);
    } finally {
      lifetime.readLock().unlock();
    }
  }

  /** A Sequence for a handle just opened, closed with this context. */
  private Sequence track(long sequenceHandle) {
    Sequence sequence = new Sequence(this, sequenceHandle);
    synchronized (sequences) {
      sequences.add(sequence);
    }
    return sequence;
  }

  /**
   * Reference attention: out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)] over the first {@code rows} rows.
   * q: [n_q_heads, head_dim]; k, v: [n_kv_heads, >= rows, head_dim]; out: F32 [n_q_heads, head_dim]. A scale
   * {@code <= 0} means 1/sqrt(head_dim); stream 0 is the library's default.
   */
  public void attend(Tensor q, Tensor k, Tensor v, long rows, float scale, Tensor out, long stream) {
    requireWritable(out, "out");
    lifetime.readLock().lock();
    try {
      KvretNative.kvret_attend(handle, q, k, v, rows, scale, out, stream);
    } finally {
      lifetime.readLock().unlock();
    }
  }

  /** Attention of q over a fetched working set, into a new F32 [n_q_heads, head_dim] tensor. */
  public Tensor attend(Tensor q, WorkingSet workingSet) {
    Tensor out = Tensor.allocate(DType.F32, config.nQHeads(), config.headDim());
    attend(q, workingSet.k(), workingSet.v(), workingSet.rows(), 0f, out, 0);
    return out;
  }

  /**
   * {@link Sequence#select} for several distinct sequences of this context at once; q is [n, n_q_heads,
   * head_dim]. Pass {@link Kvret#BUDGET_DEFAULT} for each sequence's default budget.
   */
  public List<Selection> selectBatch(List<Sequence> batch, int layer, Tensor q, int budget) {
    List<Sequence> ordered = new ArrayList<>(batch);
    ordered.sort((a, b) -> Integer.compare(System.identityHashCode(a), System.identityHashCode(b)));
    lifetime.readLock().lock();
    try {
      return selectLocked(batch, ordered, 0, layer, q, budget);
    } finally {
      lifetime.readLock().unlock();
    }
  }

  // Holds every sequence's monitor (in a fixed order) around the batched call.
  private List<Selection> selectLocked(
      List<Sequence> batch, List<Sequence> ordered, int next, int layer, Tensor q, int budget) {
    if (next < ordered.size()) {
      synchronized (ordered.get(next)) {
        return selectLocked(batch, ordered, next + 1, layer, q, budget);
      }
    }
    int width = 1;
    long[] handles = new long[batch.size()];
    for (int i = 0; i < handles.length; ++i) {
      handles[i] = batch.get(i).handle();
      width = Math.max(width, batch.get(i).width(layer, budget));
    }
    Tensor positions = Tensor.allocate(DType.I32, handles.length, config.nKvHeads(), width);
    int[] counts = new int[handles.length];
    KvretNative.kvret_select_batch(handle, handles, layer, q, budget, positions, counts);
    List<Selection> selections = new ArrayList<>(handles.length);
    long rowBytes = (long) config.nKvHeads() * width * DType.I32.bytes();
    for (int i = 0; i < handles.length; ++i) {
      java.nio.ByteBuffer slice =
          positions.buffer().position((int) (i * rowBytes)).slice().order(java.nio.ByteOrder.nativeOrder());
      selections.add(new Selection(Tensor.wrap(slice, DType.I32, config.nKvHeads(), width), counts[i]));
    }
    return selections;
  }

  /** Waits for the work kvret enqueued on {@code stream} (a no-op on the CPU backend). */
  public void synchronize(long stream) {
    lifetime.readLock().lock();
    try {
      KvretNative.kvret_synchronize(handle, stream);
    } finally {
      lifetime.readLock().unlock();
    }
  }

  /** Statistics over the context's sequences, open and closed. */
  public Stats stats() {
    lifetime.readLock().lock();
    try {
      return Stats.read(s -> KvretNative.kvret_context_stats(handle, s));
    } finally {
      lifetime.readLock().unlock();
    }
  }

  /** Closes the open sequences, waits for background work and frees the context. Closing twice is a no-op. */
  @Override
  public void close() {
    lifetime.writeLock().lock();
    try {
      if (handle == 0) {
        return;
      }
      List<Sequence> open;
      synchronized (sequences) {
        open = new ArrayList<>(sequences);
      }
      try {
        for (Sequence sequence : open) {
          sequence.close();
        }
      } finally {
        long closing = handle;
        handle = 0;
        KvretNative.kvret_destroy(closing);
      }
    } finally {
      lifetime.writeLock().unlock();
    }
  }

  void forget(Sequence sequence) {
    synchronized (sequences) {
      sequences.remove(sequence);
    }
  }

  static void requireWritable(Tensor tensor, String name) {
    if (tensor != null && !tensor.writable()) {
      throw new IllegalArgumentException("kvret: output " + name + " is read-only");
    }
  }
}
