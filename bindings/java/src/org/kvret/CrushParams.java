// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.
package org.kvret;

import java.lang.ref.Cleaner;

/**
 * The parameters of KVCrush's hamming grouping of the tokens left out (docs/kvcrush.md). Fill with
 * kvret_crush_params_init; reached from config.crush. An immutable kvret_crush_params: build one
 * with {@link #builder()} and give it to {@link Config.Builder#crush}. Its values are checked when
 * the context is made (KvretException, Status.INVALID_ARGUMENT, naming the field, e.g.
 * config.crush.fraction).
 */
public final class CrushParams {
  private static final Cleaner CLEANER = NativeHandles.CLEANER;

  private final NativeCrushParams fields;

  private CrushParams(NativeCrushParams fields) {
    this.fields = fields;
    CLEANER.register(this, fields::delete);
  }

  /** The library's defaults. */
  public static CrushParams defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder();
  }

  /** A builder starting from this struct's values. */
  public Builder toBuilder() {
    Builder builder = new Builder();
    copy(fields, builder.fields);
    return builder;
  }

  NativeCrushParams fields() {
    return fields;
  }

  private static void copy(NativeCrushParams from, NativeCrushParams to) {
    to.setFraction(from.getFraction());
    to.setBuckets(from.getBuckets());
    to.setImportance(from.getImportance());
    to.setGranularity(from.getGranularity());
  }

  /**
   * kvret_crush_params.fraction: share of each select's budget spent on bucket representatives of
   * the tokens left out, in [0, 1): floor(fraction * budget) of them; default 0 (off)
   */
  public float fraction() {
    return fields.getFraction();
  }

  /**
   * kvret_crush_params.buckets: most representatives (buckets) per KV head and select; default 0 =
   * no cap
   */
  public int buckets() {
    return fields.getBuckets();
  }

  /**
   * kvret_crush_params.importance: a kvret_importance: where the importance behind KVCrush's
   * signatures, its representatives and kvret_seq_retained_set comes from; default
   * KVRET_IMPORTANCE_WINDOW
   */
  public Importance importance() {
    return Importance.fromCode(fields.getImportance());
  }

  /**
   * kvret_crush_params.granularity: tokens per KVCrush representative unit: 0 or 1 = single tokens
   * (default 0); a power of two 2..4096 = aligned runs of that many positions (chunks of 8, or the
   * engine's KV page), each representative unit sending all its tokens the index did not select;
   * the count a select returns does not change
   */
  public int granularity() {
    return fields.getGranularity();
  }

  public static final class Builder {
    private final NativeCrushParams fields = new NativeCrushParams();

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_crush_params_init(fields);
    }

    public CrushParams build() {
      NativeCrushParams copy = new NativeCrushParams();
      KvretNative.kvret_crush_params_init(copy);
      copy(fields, copy);
      return new CrushParams(copy);
    }

    /**
     * kvret_crush_params.fraction: share of each select's budget spent on bucket representatives of
     * the tokens left out, in [0, 1): floor(fraction * budget) of them; default 0 (off)
     */
    public Builder fraction(float value) {
      fields.setFraction(value);
      return this;
    }

    /**
     * kvret_crush_params.buckets: most representatives (buckets) per KV head and select; default 0
     * = no cap
     */
    public Builder buckets(int value) {
      fields.setBuckets(value);
      return this;
    }

    /**
     * kvret_crush_params.importance: a kvret_importance: where the importance behind KVCrush's
     * signatures, its representatives and kvret_seq_retained_set comes from; default
     * KVRET_IMPORTANCE_WINDOW
     */
    public Builder importance(Importance value) {
      fields.setImportance(value.code);
      return this;
    }

    /**
     * kvret_crush_params.granularity: tokens per KVCrush representative unit: 0 or 1 = single
     * tokens (default 0); a power of two 2..4096 = aligned runs of that many positions (chunks of
     * 8, or the engine's KV page), each representative unit sending all its tokens the index did
     * not select; the count a select returns does not change
     */
    public Builder granularity(int value) {
      fields.setGranularity(value);
      return this;
    }
  }
}
