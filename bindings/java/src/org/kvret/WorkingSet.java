package org.kvret;

/**
 * The buffers of a working set: sink + selected + local tokens of every KV head, in position order. k and v are
 * [n_kv_heads, capacity, head_dim], positions is I32 [n_kv_heads, capacity]; after a fetch the first
 * {@link #rows()} rows of each head are valid. One working set can be reused for every step.
 */
public final class WorkingSet {
  // Read by the JNI layer (kvret_java.i).
  final Tensor k;
  final Tensor v;
  final Tensor positions;

  private volatile long rows;

  public WorkingSet(Tensor k, Tensor v, Tensor positions) {
    if (!k.writable() || !v.writable() || !positions.writable()) {
      throw new IllegalArgumentException("kvret: a working set needs writable buffers");
    }
    this.k = k;
    this.v = v;
    this.positions = positions;
  }

  /** New zeroed buffers for {@code capacity} rows per head. */
  public static WorkingSet allocate(DType dtype, int kvHeads, long capacity, int headDim) {
    return new WorkingSet(Tensor.allocate(dtype, kvHeads, capacity, headDim),
        Tensor.allocate(dtype, kvHeads, capacity, headDim), Tensor.allocate(DType.I32, kvHeads, capacity));
  }

  public Tensor k() {
    return k;
  }

  public Tensor v() {
    return v;
  }

  public Tensor positions() {
    return positions;
  }

  /** Rows per head written by the last fetch. */
  public long rows() {
    return rows;
  }

  public long capacity() {
    return k.shape(1);
  }

  void setRows(long rows) {
    this.rows = rows;
  }

  /** A copy of the token positions of one head's rows. */
  public int[] positions(int head) {
    int[] values = new int[Math.toIntExact(rows)];
    for (int i = 0; i < values.length; ++i) {
      values[i] = positions.getInt(head, i);
    }
    return values;
  }

  /** A copy of one row's key (F32 working sets). */
  public float[] key(int head, int row) {
    return row(k, head, row);
  }

  /** A copy of one row's value (F32 working sets). */
  public float[] value(int head, int row) {
    return row(v, head, row);
  }

  private float[] row(Tensor tensor, int head, int row) {
    if (row < 0 || row >= rows) {
      throw new IndexOutOfBoundsException("kvret: row " + row + " of " + rows);
    }
    float[] values = new float[(int) tensor.shape(2)];
    for (int d = 0; d < values.length; ++d) {
      values[d] = tensor.getFloat(head, row, d);
    }
    return values;
  }
}
