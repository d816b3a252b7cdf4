package org.kvret;

import java.lang.ref.Cleaner;
import java.util.ArrayList;
import java.util.Collections;
import java.util.IdentityHashMap;
import java.util.List;
import java.util.Optional;
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
  /**
   * The native context and what its release needs. It holds no reference to the Context (the cleaner of an
   * unreachable Context runs it); the state of each open sequence holds this one, and this one the open sequences'
   * states, so that releasing a context closes its sequences first, whichever becomes unreachable first.
   */
  static final class State implements Runnable {
    final ReadWriteLock lifetime = new ReentrantReadWriteLock();
    private final Set<Sequence.State> sequences = Collections.newSetFromMap(new IdentityHashMap<>());
    long handle; // guarded by lifetime

    State(long handle) {
      this.handle = handle;
      NativeHandles.contextsOpened.incrementAndGet();
    }

    void track(Sequence.State sequence) {
      synchronized (sequences) {
        sequences.add(sequence);
      }
    }

    void forget(Sequence.State sequence) {
      synchronized (sequences) {
        sequences.remove(sequence);
      }
    }

    int openSequences() {
      synchronized (sequences) {
        return sequences.size();
      }
    }

    boolean released() {
      lifetime.readLock().lock();
      try {
        return handle == 0;
      } finally {
        lifetime.readLock().unlock();
      }
    }

    /** Closes the open sequences, then frees the context; a no-op once done. Run by close() or the cleaner. */
    @Override
    public void run() {
      lifetime.writeLock().lock();
      try {
        if (handle == 0) {
          return;
        }
        List<Sequence.State> open;
        synchronized (sequences) {
          open = new ArrayList<>(sequences);
        }
        RuntimeException failure = null;
        for (Sequence.State sequence : open) {
          try {
            sequence.run();
          } catch (RuntimeException e) {
            if (failure == null) {
              failure = e;
            } else {
              failure.addSuppressed(e);
            }
          }
        }
        long closing = handle;
        handle = 0;
        NativeHandles.contextsReleased.incrementAndGet();
        try {
          KvretNative.kvret_destroy(closing);
        } catch (RuntimeException e) {
          NativeHandles.failedReleases.incrementAndGet();
          if (failure == null) {
            failure = e;
          } else {
            failure.addSuppressed(e);
          }
        }
        if (failure != null) {
          throw failure;
        }
      } finally {
        lifetime.writeLock().unlock();
      }
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;
  private final Config config;

  private Context(long handle) {
    State created = new State(handle);
    NativeConfig effective = new NativeConfig();
    try {
      KvretNative.kvret_config_init(effective);
      KvretNative.kvret_get_config(handle, effective);
    } catch (RuntimeException e) {
      effective.delete();
      created.run();
      throw e;
    }
    this.config = Config.adopt(effective);
    this.state = created;
    this.cleanable = NativeHandles.CLEANER.register(this, created);
  }

  /** Creates a context; throws {@link KvretException} if the config is invalid. */
  public static Context create(Config config) {
    long[] out = new long[1];
    KvretNative.kvret_swig_create(config.fields(), NativeStrings.utf8OrNull(config.diskPath(), "disk_path"),
        NativeStrings.utf8OrNull(config.sessionSharedUrl(), "session_shared_url"), out);
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
    return state.released();
  }

  /** Opens an empty sequence. */
  public Sequence openSequence() {
    state.lifetime.readLock().lock();
    try {
      long[] out = new long[1];
      KvretNative.kvret_seq_open(state.handle, out);
      return track(out[0]);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  // ---- sessions across conversation turns ----

  /**
   * A new sequence holding what {@link Sequence#saveSession} saved under {@code sessionId} (the same tokens, index
   * and selections), or an empty Optional when no session has that id (never saved, dropped, expired or evicted).
   * The session stays stored. Close the sequence like any other. A session id is 1 to 255 bytes of UTF-8 without a
   * NUL character.
   *
   * @throws NullPointerException if sessionId is null
   * @throws KvretException status INVALID_ARGUMENT for a bad id, CORRUPT for a stored session whose files fail
   *     their checks (it is dropped: the next open is empty), INVALID_HANDLE once the context is closed
   */
  public Optional<Sequence> openSession(String sessionId) {
    byte[] id = NativeStrings.utf8(sessionId, "session_id");
    state.lifetime.readLock().lock();
    try {
      long[] out = new long[1];
      try {
        KvretNative.kvret_session_open(state.handle, id, out);
      } catch (KvretException e) {
        if (e.status() == Status.NOT_FOUND) {
          return Optional.empty();
        }
        throw e;
      }
      return Optional.of(track(out[0]));
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /** Removes a saved session from every tier; true if there was one, false if not. */
  public boolean dropSession(String sessionId) {
    byte[] id = NativeStrings.utf8(sessionId, "session_id");
    state.lifetime.readLock().lock();
    try {
      KvretNative.kvret_session_drop(state.handle, id);
      return true;
    } catch (KvretException e) {
      if (e.status() == Status.NOT_FOUND) {
        return false;
      }
      throw e;
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /**
   * The scheduler's job queue: the ids of the sessions it will run next, in order (ids may repeat; an empty list
   * clears it; an id need not be stored yet). It replaces the previous queue. With {@link
   * SessionPolicy#SCHEDULER_AWARE}, eviction keeps the sessions needed soonest, and those of the look-ahead window
   * that are on disk are read into DRAM.
   *
   * @throws NullPointerException if the list or one of its ids is null
   */
  public void scheduleSessions(List<String> sessionIds) {
    java.util.Objects.requireNonNull(sessionIds, "kvret: session_ids is null");
    byte[][] ids = new byte[sessionIds.size()][];
    int i = 0;
    for (String sessionId : sessionIds) {
      ids[i] = NativeStrings.utf8(sessionId, "session_ids[" + i + "]");
      ++i;
    }
    state.lifetime.readLock().lock();
    try {
      KvretNative.kvret_session_schedule(state.handle, ids);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /** Where a saved session is now ({@link SessionTier#NONE} when there is none). */
  public SessionTier sessionTier(String sessionId) {
    byte[] id = NativeStrings.utf8(sessionId, "session_id");
    state.lifetime.readLock().lock();
    try {
      int[] tier = new int[1];
      KvretNative.kvret_session_where(state.handle, id, tier);
      return SessionTier.fromCode(tier[0]);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /**
   * Waits until the session store's background writer has written every earlier save through to the shared tier,
   * then throws the first failure, since the last flush, of the work the store does after a call has returned (a
   * write-through to the shared tier; removing the files of a dropped, replaced or expired session), which no call
   * reports itself.
   */
  public void flushSessions() {
    state.lifetime.readLock().lock();
    try {
      KvretNative.kvret_session_flush(state.handle);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /** The fork of an open sequence of this context (Sequence.fork): the context's lock, then the sequence's. */
  Sequence forkSequence(Sequence.State source) {
    state.lifetime.readLock().lock();
    try {
      long[] out = new long[1];
      synchronized (source) {
        KvretNative.kvret_seq_fork(source.handle, out);
      }
      return track(out[0]);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /** A Sequence for a handle just opened, closed with this context (or by its cleaner). */
  private Sequence track(long sequenceHandle) {
    Sequence.State sequence = new Sequence.State(state, sequenceHandle);
    state.track(sequence);
    return new Sequence(this, sequence);
  }

  /** Sequences of this context not closed yet (for the tests). */
  int openSequences() {
    return state.openSequences();
  }

  State state() {
    return state;
  }

  /**
   * Reference attention: out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)] over the first {@code rows} rows.
   * q: [n_q_heads, head_dim]; k, v: [n_kv_heads, >= rows, head_dim]; out: F32 [n_q_heads, head_dim]. A scale
   * {@code <= 0} means 1/sqrt(head_dim); stream 0 is the library's default.
   */
  public void attend(Tensor q, Tensor k, Tensor v, long rows, float scale, Tensor out, long stream) {
    requireWritable(out, "out");
    state.lifetime.readLock().lock();
    try {
      KvretNative.kvret_attend(state.handle, q, k, v, rows, scale, out, stream);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /** Attention of q over a fetched working set, into a new F32 [n_q_heads, head_dim] tensor. */
  public Tensor attend(Tensor q, WorkingSet workingSet) {
    Tensor out = Tensor.allocate(DType.F32, config.nQHeads(), config.headDim());
    attend(q, workingSet.k(), workingSet.v(), workingSet.rows(), 0f, out, 0);
    return out;
  }

  /** The states of a batch's sequences in the order their locks are taken (the same for every batched call). */
  private static List<Sequence.State> lockOrder(List<Sequence> batch) {
    List<Sequence.State> ordered = new ArrayList<>(batch.size());
    for (Sequence sequence : batch) {
      ordered.add(sequence.state());
    }
    ordered.sort((a, b) -> Integer.compare(System.identityHashCode(a), System.identityHashCode(b)));
    return ordered;
  }

  /**
   * {@link Sequence#select} for several distinct sequences of this context at once; q is [n, n_q_heads,
   * head_dim]. Pass {@link Kvret#BUDGET_DEFAULT} for each sequence's default budget.
   */
  public List<Selection> selectBatch(List<Sequence> batch, int layer, Tensor q, int budget) {
    java.util.Objects.requireNonNull(q, "kvret: q is null"); // before the native call converts any argument
    List<Sequence.State> ordered = lockOrder(batch);
    state.lifetime.readLock().lock();
    try {
      return selectLocked(batch, ordered, 0, layer, q, budget);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  // Holds every sequence's lock (in a fixed order) around the batched call.
  private List<Selection> selectLocked(
      List<Sequence> batch, List<Sequence.State> ordered, int next, int layer, Tensor q, int budget) {
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
    KvretNative.kvret_select_batch(state.handle, handles, layer, q, budget, positions, counts);
    List<Selection> selections = new ArrayList<>(handles.length);
    long rowBytes = (long) config.nKvHeads() * width * DType.I32.bytes();
    for (int i = 0; i < handles.length; ++i) {
      java.nio.ByteBuffer slice =
          positions.buffer().position((int) (i * rowBytes)).slice().order(java.nio.ByteOrder.nativeOrder());
      selections.add(new Selection(Tensor.wrap(slice, DType.I32, config.nKvHeads(), width), counts[i]));
    }
    return selections;
  }

  /**
   * {@link Sequence#fetch} for several distinct sequences of this context in one call: the working set of each
   * sequence for its selection (as {@link #selectBatch} returns them), into new buffers of the KV dtype (F32 for
   * BF16). The same bytes, row counts and stats as one fetch per sequence. Every argument of every sequence is
   * checked before anything is written: a bad one throws {@link KvretException} naming its index.
   */
  public List<WorkingSet> fetchBatch(List<Sequence> batch, int layer, List<Selection> selections) {
    if (selections.size() != batch.size()) {
      throw new IllegalArgumentException(
          "kvret: " + selections.size() + " selections for " + batch.size() + " sequences");
    }
    int kvHeads = config.nKvHeads();
    int width = 1;
    int[] counts = new int[batch.size()];
    for (int i = 0; i < counts.length; ++i) {
      Selection selection = selections.get(i);
      if (selection.kvHeads() != kvHeads) {
        throw new KvretException(Status.SHAPE.code(), "selections[" + i + "] has " + selection.kvHeads()
            + " KV heads, the context " + kvHeads);
      }
      counts[i] = selection.count();
      width = Math.max(width, counts[i]);
    }
    // one I32 [n, n_kv_heads, width] tensor, as kvret_select_batch writes it
    Tensor positions = Tensor.allocate(DType.I32, counts.length, kvHeads, width);
    java.nio.IntBuffer all = positions.asIntBuffer();
    for (int i = 0; i < counts.length; ++i) {
      for (int h = 0; h < kvHeads; ++h) {
        all.position((i * kvHeads + h) * width);
        all.put(selections.get(i).positions(h));
      }
    }
    KvDtype kv = config.kvDtype();
    DType dtype = kv == KvDtype.BF16 ? DType.F32 : kv.dtype();
    List<WorkingSet> outs = new ArrayList<>(counts.length);
    for (int i = 0; i < counts.length; ++i) {
      Sequence sequence = batch.get(i);
      long length = sequence.length(layer);
      // a count above the length is the library's to refuse, naming the entry
      long capacity = counts[i] > 0 ? sequence.workingSetCapacity(layer, (int) Math.min(counts[i], length)) : length;
      outs.add(WorkingSet.allocate(dtype, kvHeads, capacity, config.headDim()));
    }
    fetchBatchInto(batch, layer, positions, counts, outs, 0);
    return outs;
  }

  /**
   * kvret_fetch_batch_async: writes the working set of each sequence for {@code counts[i]} selected positions per
   * head (positions: I32 [n, n_kv_heads, >= max count], as {@link #selectBatch} fills it) into {@code outs.get(i)};
   * returns the rows written per head of each. On a CUDA context the copies are enqueued on {@code stream}.
   */
  public long[] fetchBatchInto(
      List<Sequence> batch, int layer, Tensor positions, int[] counts, List<WorkingSet> outs, long stream) {
    if (counts.length != batch.size() || outs.size() != batch.size()) {
      throw new IllegalArgumentException("kvret: " + batch.size() + " sequences, " + counts.length + " counts and "
          + outs.size() + " working sets");
    }
    // refused here, before the native call converts any argument
    java.util.Objects.requireNonNull(positions, "kvret: positions is null");
    for (int i = 0; i < outs.size(); ++i) {
      java.util.Objects.requireNonNull(outs.get(i), "kvret: outs[" + i + "] is null");
    }
    List<Sequence.State> ordered = lockOrder(batch);
    state.lifetime.readLock().lock();
    try {
      return fetchLocked(batch, ordered, 0, layer, positions, counts, outs, stream);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  // Holds every sequence's lock (in a fixed order) around the batched call.
  private long[] fetchLocked(List<Sequence> batch, List<Sequence.State> ordered, int next, int layer,
      Tensor positions, int[] counts, List<WorkingSet> outs, long stream) {
    if (next < ordered.size()) {
      synchronized (ordered.get(next)) {
        return fetchLocked(batch, ordered, next + 1, layer, positions, counts, outs, stream);
      }
    }
    long[] handles = new long[batch.size()];
    for (int i = 0; i < handles.length; ++i) {
      handles[i] = batch.get(i).handle();
    }
    long[] rows = new long[handles.length];
    WorkingSet[] sets = outs.toArray(new WorkingSet[0]);
    KvretNative.kvret_fetch_batch_async(state.handle, handles, layer, positions, counts, sets, rows, stream);
    for (int i = 0; i < sets.length; ++i) {
      sets[i].setRows(rows[i]);
    }
    return rows;
  }

  /** Waits for the work kvret enqueued on {@code stream} (a no-op on the CPU backend). */
  public void synchronize(long stream) {
    state.lifetime.readLock().lock();
    try {
      KvretNative.kvret_synchronize(state.handle, stream);
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /** Statistics over the context's sequences, open and closed. */
  public Stats stats() {
    state.lifetime.readLock().lock();
    try {
      return Stats.read(s -> KvretNative.kvret_context_stats(state.handle, s));
    } finally {
      state.lifetime.readLock().unlock();
    }
  }

  /**
   * Closes the open sequences, waits for background work and frees the context. Closing twice is a no-op. A
   * context never closed is closed the same way by a cleaner once it (and every sequence of it) is unreachable;
   * close it anyway: when that happens is up to the garbage collector.
   */
  @Override
  public void close() {
    cleanable.clean();
  }

  static void requireWritable(Tensor tensor, String name) {
    if (tensor != null && !tensor.writable()) {
      throw new IllegalArgumentException("kvret: output " + name + " is read-only");
    }
  }
}
