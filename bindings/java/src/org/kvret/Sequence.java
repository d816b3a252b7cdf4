package org.kvret;

import java.lang.ref.Cleaner;

/**
 * One request or conversation whose keys and values kvret stores, indexes and retrieves. Calls on one sequence are
 * serialized; distinct sequences run in parallel from different threads.
 */
public final class Sequence implements AutoCloseable {
  /**
   * The native sequence and what its release needs. It holds no reference to the Sequence (the cleaner of an
   * unreachable Sequence runs it) but holds its context's state, whose release closes this sequence first. Its
   * monitor serializes the calls on the sequence and its release.
   */
  static final class State implements Runnable {
    private final Context.State context;
    long handle; // guarded by this

    State(Context.State context, long handle) {
      this.context = context;
      this.handle = handle;
      NativeHandles.sequencesOpened.incrementAndGet();
    }

    synchronized boolean released() {
      return handle == 0;
    }

    /** Waits for the sequence's background work and frees it; a no-op once done. Run by close() or a cleaner. */
    @Override
    public synchronized void run() {
      if (handle == 0) {
        return;
      }
      long closing = handle;
      handle = 0;
      context.forget(this);
      NativeHandles.sequencesReleased.incrementAndGet();
      try {
        KvretNative.kvret_seq_close(closing);
      } catch (RuntimeException e) {
        NativeHandles.failedReleases.incrementAndGet();
        throw e;
      }
    }
  }

  private final Context context;
  private final State state;
  private final Cleaner.Cleanable cleanable;

  Sequence(Context context, State state) {
    this.context = context;
    this.state = state;
    this.cleanable = NativeHandles.CLEANER.register(this, state);
  }

  public Context context() {
    return context;
  }

  public boolean isClosed() {
    return state.released();
  }

  /**
   * Waits for the sequence's background work and frees it. Closing twice is a no-op, and so is closing a sequence
   * whose context is closed. A sequence never closed is closed the same way by a cleaner once it is unreachable;
   * close it anyway: when that happens is up to the garbage collector.
   */
  @Override
  public void close() {
    cleanable.clean();
  }

  State state() {
    return state;
  }

  long handle() {
    synchronized (state) {
      return state.handle;
    }
  }

  // ---- appending ----

  /**
   * Appends prefill tokens to {@code layer}: k and v are [T, n_kv_heads, head_dim] (F16, BF16 or F32). Schedules
   * the layer's index build (in the background by default).
   */
  public void appendPrefill(int layer, Tensor k, Tensor v) {
    synchronized (state) {
      KvretNative.kvret_append_prefill(state.handle, layer, k, v);
    }
  }

  /** Appends one decode token ([n_kv_heads, head_dim] or [1, n_kv_heads, head_dim]) to {@code layer}. */
  public void appendDecode(int layer, Tensor k, Tensor v) {
    synchronized (state) {
      KvretNative.kvret_append_decode(state.handle, layer, k, v);
    }
  }

  /** Waits until the index of {@code layer} (every layer when -1) is built. */
  public void waitIndex(int layer) {
    synchronized (state) {
      KvretNative.kvret_wait_index(state.handle, layer);
    }
  }

  /**
   * A new sequence of the same context holding what this one holds (every layer's tokens and index), for beam
   * search, parallel sampling or several continuations of one prompt. The two share their KV pages copy on write
   * and are independent from then on (see kvret_seq_fork). Close it like any sequence.
   */
  public Sequence fork() {
    // The context's lock before the sequence's, as Context.close takes them (not the other way round).
    return context.forkSequence(state);
  }

  /**
   * Rolls the sequence back to its first {@code length} tokens in every layer (speculative decoding: drop the
   * rejected draft tokens; regeneration). The sequence is then as if the dropped tokens had never been appended;
   * on failure nothing changes (see kvret_seq_truncate).
   *
   * @throws IllegalArgumentException if length is negative
   */
  public void truncate(long length) {
    if (length < 0) throw new IllegalArgumentException("length must be >= 0, got " + length);
    synchronized (state) {
      KvretNative.kvret_seq_truncate(state.handle, length);
    }
  }

  /**
   * Context-window truncation: drops {@code count} tokens of every layer after its first {@code keep} tokens (keep
   * 0: the earliest tokens; keep = n_sink keeps the attention sinks, as StreamingLLM does). The later tokens move
   * {@code count} positions earlier: with {@link Config#ropeKeys()} their keys are rotated at their new positions
   * (exactly as in a sequence given only the remaining tokens), without it they stay as given. Each shortened
   * layer's index is rebuilt, on the calling thread, so the sequence selects as one given the remaining tokens. A
   * layer holding at most {@code keep} tokens is unchanged; one holding fewer than keep + count keeps its first
   * {@code keep}. Count 0 changes nothing; on failure nothing changes (see kvret_seq_drop_front).
   *
   * @throws IllegalArgumentException if keep or count is negative
   */
  public void dropFront(long keep, long count) {
    if (keep < 0) throw new IllegalArgumentException("keep must be >= 0, got " + keep);
    if (count < 0) throw new IllegalArgumentException("count must be >= 0, got " + count);
    synchronized (state) {
      KvretNative.kvret_seq_drop_front(state.handle, keep, count);
    }
  }

  // ---- sessions ----

  /**
   * Saves what this sequence holds now under {@code sessionId} (1 to 255 bytes of UTF-8 without a NUL character)
   * in the context's session store, replacing an older save of that id once the new one is whole. The sequence
   * stays open and unchanged: go on appending to it, or close it; a later turn reopens it with {@link
   * Context#openSession}.
   *
   * @throws NullPointerException if sessionId is null
   * @throws KvretException (and nothing changes) status INVALID_ARGUMENT for a bad id, CAPACITY when the session
   *     fits no tier, IO when a disk write it needs fails (a full disk), UNSUPPORTED for a sequence of a context
   *     with hammingFraction > 0 (KVCrush's state is not saved), INVALID_HANDLE once the sequence is closed
   */
  public void saveSession(String sessionId) {
    byte[] id = NativeStrings.utf8(sessionId, "session_id");
    synchronized (state) {
      KvretNative.kvret_session_save(state.handle, id);
    }
  }

  // ---- queries ----

  /** Tokens stored for {@code layer}. */
  public long length(int layer) {
    synchronized (state) {
      long[] out = new long[1];
      KvretNative.kvret_seq_length(state.handle, layer, out);
      return out[0];
    }
  }

  /** The budget select uses by default for {@code layer} at its current length. */
  public int budget(int layer) {
    synchronized (state) {
      int[] out = new int[1];
      KvretNative.kvret_seq_budget(state.handle, layer, out);
      return out[0];
    }
  }

  /** Upper bound of the working-set rows for {@code layer} at {@code budget} ({@link Kvret#BUDGET_DEFAULT} ok). */
  public long workingSetCapacity(int layer, int budget) {
    synchronized (state) {
      long[] out = new long[1];
      KvretNative.kvret_working_set_capacity(state.handle, layer, budget, out);
      return out[0];
    }
  }

  public Stats stats() {
    synchronized (state) {
      return Stats.read(s -> KvretNative.kvret_seq_stats(state.handle, s));
    }
  }

  // ---- retrieval ----

  /** Selects with the default budget. */
  public Selection select(int layer, Tensor q) {
    return select(layer, q, Kvret.BUDGET_DEFAULT);
  }

  /**
   * Scores the middle tokens of {@code layer} for q ([n_q_heads, head_dim]) and selects the top {@code budget}
   * per KV head (ascending positions).
   */
  public Selection select(int layer, Tensor q, int budget) {
    synchronized (state) {
      int width = width(layer, budget);
      Tensor positions = Tensor.allocate(DType.I32, context.config().nKvHeads(), Math.max(width, 1));
      return new Selection(positions, selectInto(layer, q, budget, positions));
    }
  }

  /**
   * {@link #select(int, Tensor, int)} with the score of each position: the folded score the index ranked it by
   * (see kvret_select_scored), read with {@link Selection#scores(int)}.
   */
  public Selection selectScored(int layer, Tensor q, int budget) {
    synchronized (state) {
      int width = Math.max(width(layer, budget), 1);
      int kvHeads = context.config().nKvHeads();
      Tensor positions = Tensor.allocate(DType.I32, kvHeads, width);
      Tensor scores = Tensor.allocate(DType.F32, kvHeads, width);
      int[] count = new int[1];
      KvretNative.kvret_select_scored(state.handle, layer, q, budget, positions, scores, count);
      return new Selection(positions, scores, count[0]);
    }
  }

  /**
   * Columns of the positions buffer a select of {@code budget} needs: never more than the layer holds, so that an
   * absurd budget is refused by the library (KvretException, status BUDGET) before anything large is allocated.
   */
  int width(int layer, int budget) {
    synchronized (state) {
      if (budget == Kvret.BUDGET_DEFAULT) return budget(layer);
      return (int) Math.min(budget, Math.max(length(layer), 1));
    }
  }

  /** Selects into {@code positions} (I32 [n_kv_heads, >= budget]); returns the count per head. */
  public int selectInto(int layer, Tensor q, int budget, Tensor positions) {
    synchronized (state) {
      Context.requireWritable(positions, "positions");
      int[] count = new int[1];
      KvretNative.kvret_select(state.handle, layer, q, budget, positions, count);
      return count[0];
    }
  }

  /**
   * KVCrush's eviction-only mode (kvret_seq_retained_set): the middle positions to keep per KV head of {@code
   * layer} after its prefill, for an engine that drops KV instead of offloading it. No query: SnapKV's top tokens by
   * importance from the queries given to {@link #observe} (else a window of the layer's last 32 keys; under {@link
   * Importance#ACCUMULATED}, the accumulated attention once a step was observed), plus floor(hamming_fraction * count) bucket
   * representatives of the other middle tokens (the context's {@code hammingFraction}; 0 gives SnapKV's set
   * exactly). Sink and local tokens are kept besides and not counted in {@code budget} ({@link
   * Kvret#BUDGET_DEFAULT} for the default). The selection holds min(budget, middle tokens) ascending positions per
   * head. Changes nothing in the sequence.
   *
   * @throws KvretException status STATE when the layer holds no tokens (no observation window), BUDGET for a budget
   *     of 0 or above the layer's length, OUT_OF_RANGE for a bad layer
   */
  public Selection retainedSet(int layer, int budget) {
    synchronized (state) {
      int width = width(layer, budget);
      Tensor positions = Tensor.allocate(DType.I32, context.config().nKvHeads(), Math.max(width, 1));
      return new Selection(positions, retainedSetInto(layer, budget, positions));
    }
  }

  /** {@link #retainedSet} into {@code positions} (I32 [n_kv_heads, >= budget]); returns the count per head. */
  public int retainedSetInto(int layer, int budget, Tensor positions) {
    synchronized (state) {
      Context.requireWritable(positions, "positions");
      int[] count = new int[1];
      KvretNative.kvret_seq_retained_set(state.handle, layer, budget, positions, count);
      return count[0];
    }
  }

  /**
   * Gives KVCrush the prompt's observation window of {@code layer} (kvret_seq_observe): the queries of its last w
   * prompt tokens, [w, n_q_heads, head_dim] (F16, BF16 or F32; 1 &lt;= w &lt;= the layer's length), after the layer's
   * prefill. From then on the importance behind the layer's KVCrush signatures (one bit per query head),
   * representatives and {@link #retainedSet} comes from these queries instead of the layer's last 32 keys. A second
   * call replaces the window.
   *
   * @throws KvretException status STATE when the layer holds no tokens, SHAPE for a wrong shape, OUT_OF_RANGE for
   *     a bad layer; nothing changes then
   */
  public void observe(int layer, Tensor qWindow) {
    synchronized (state) {
      KvretNative.kvret_seq_observe(state.handle, layer, qWindow);
    }
  }

  /**
   * Adds one decode step's attention probabilities of {@code layer} ([n_q_heads, n], F16, BF16 or F32; 1 &lt;= n
   * &lt;= the layer's length; finite and &gt;= 0) to its accumulated attention (H2O;
   * kvret_seq_observe_attention), on a context with {@link Importance#ACCUMULATED}. Once a layer has a step, its
   * KVCrush signatures, representatives and {@link #retainedSet} come from the sums.
   *
   * @throws KvretException status STATE on a context without accumulated importance or a layer holding no tokens,
   *     SHAPE for a wrong shape, INVALID_ARGUMENT for a negative or non-finite value; nothing changes then
   */
  public void observeAttention(int layer, Tensor probs) {
    synchronized (state) {
      KvretNative.kvret_seq_observe_attention(state.handle, layer, probs);
    }
  }

  /**
   * Attention of q ([n_q_heads, head_dim]) over this step's working set of {@code layer}, in one call: select,
   * fetch and attention inside kvret (see kvret_seq_attend), into a new F32 [n_q_heads, head_dim] tensor. Pass
   * {@link Kvret#BUDGET_DEFAULT} for the default budget.
   */
  public Tensor attend(int layer, Tensor q, int budget) {
    synchronized (state) {
      Tensor out = Tensor.allocate(DType.F32, context.config().nQHeads(), context.config().headDim());
      KvretNative.kvret_seq_attend(state.handle, layer, q, budget, 0f, out, 0);
      return out;
    }
  }

  /** Fetches the working set of a selection into new buffers of the KV dtype (F32 for BF16). */
  public WorkingSet fetch(int layer, Selection selection) {
    KvDtype kv = context.config().kvDtype();
    return fetch(layer, selection, kv == KvDtype.BF16 ? DType.F32 : kv.dtype());
  }

  /** Fetches the working set of a selection into new buffers of {@code dtype} (the KV dtype or F32). */
  public WorkingSet fetch(int layer, Selection selection, DType dtype) {
    synchronized (state) {
      long capacity = selection.count() > 0 ? workingSetCapacity(layer, selection.count()) : length(layer);
      Config config = context.config();
      WorkingSet workingSet = WorkingSet.allocate(dtype, config.nKvHeads(), capacity, config.headDim());
      fetchInto(layer, selection.tensor(), selection.count(), workingSet, 0);
      return workingSet;
    }
  }

  /**
   * Writes the working set of {@code layer} for {@code count} selected positions per head (I32 [n_kv_heads,
   * >= count]) into {@code out}; returns the rows written per head. On a CUDA context the copy is enqueued on
   * {@code stream}.
   */
  public long fetchInto(int layer, Tensor positions, int count, WorkingSet out, long stream) {
    synchronized (state) {
      long[] rows = new long[1];
      KvretNative.kvret_fetch_async(state.handle, layer, positions, count, out, rows, stream);
      out.setRows(rows[0]);
      return rows[0];
    }
  }

  /**
   * Experimental: selects with a guessed next query; the layer's next fetch counts the rows it takes from that
   * selection as prefetch hits (the speculative hit rate). Nothing is loaded ahead yet.
   */
  public void prefetch(int layer, Tensor qGuess, int budget, long stream) {
    synchronized (state) {
      KvretNative.kvret_prefetch_async(state.handle, layer, qGuess, budget, stream);
    }
  }

  /** Experimental: copies the stored keys and values of positions [begin, end) into k and v. */
  public void read(int layer, long begin, long end, Tensor k, Tensor v) {
    synchronized (state) {
      Context.requireWritable(k, "k");
      Context.requireWritable(v, "v");
      KvretNative.kvret_seq_read(state.handle, layer, begin, end, k, v);
    }
  }
}
