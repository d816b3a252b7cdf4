package org.kvret;

/**
 * The result of {@link Sequence#select}: {@code count} ascending middle positions per KV head, and after {@link
 * Sequence#selectScored} the score each was ranked by.
 */
public final class Selection {
  private final Tensor positions;
  private final Tensor scores;
  private final int count;

  Selection(Tensor positions, int count) {
    this(positions, null, count);
  }

  Selection(Tensor positions, Tensor scores, int count) {
    this.positions = positions;
    this.scores = scores;
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

  /** Whether the selection carries scores ({@link Sequence#selectScored}). */
  public boolean hasScores() {
    return scores != null;
  }

  /**
   * A copy of the scores of one KV head's positions, aligned with {@link #positions(int)}: the folded score the
   * index ranked each by (see kvret_select_scored).
   *
   * @throws IllegalStateException if the selection was made without scores
   */
  public float[] scores(int head) {
    if (scores == null) {
      throw new IllegalStateException("kvret: this selection has no scores (use Sequence.selectScored)");
    }
    float[] values = new float[count];
    for (int i = 0; i < count; ++i) {
      values[i] = scores.getFloat(head, i);
    }
    return values;
  }
}
