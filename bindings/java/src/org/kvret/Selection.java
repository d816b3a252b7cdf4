package org.kvret;

/** The result of {@link Sequence#select}: {@code count} ascending middle positions per KV head. */
public final class Selection {
  private final Tensor positions;
  private final int count;

  Selection(Tensor positions, int count) {
    this.positions = positions;
    this.count = count;
  }

  /** I32 [n_kv_heads, width >= count]; the first {@code count} entries of each row are the selection. */
  public Tensor tensor() {
    return positions;
  }

  /** Positions selected per KV head. */
  public int count() {
    return count;
  }

  public int kvHeads() {
    return (int) positions.shape(0);
  }

  /** A copy of the positions selected for one KV head. */
  public int[] positions(int head) {
    int[] values = new int[count];
    for (int i = 0; i < count; ++i) {
      values[i] = positions.getInt(head, i);
    }
    return values;
  }
}
