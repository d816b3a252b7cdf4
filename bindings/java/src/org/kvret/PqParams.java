// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.
package org.kvret;

import java.lang.ref.Cleaner;

/**
 * The parameters of PQCache, the pq index (KVRET_INDEX_PQ; docs/pq.md). Fill with
 * kvret_pq_params_init; reached from config.pq. An immutable kvret_pq_params: build one with {@link
 * #builder()} and give it to {@link Config.Builder#pq}. Its values are checked when the context is
 * made (KvretException, Status.INVALID_ARGUMENT, naming the field, e.g. config.pq.m).
 */
public final class PqParams {
  private static final Cleaner CLEANER = NativeHandles.CLEANER;

  private final NativePqParams fields;

  private PqParams(NativePqParams fields) {
    this.fields = fields;
    CLEANER.register(this, fields::delete);
  }

  /** The library's defaults. */
  public static PqParams defaults() {
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

  NativePqParams fields() {
    return fields;
  }

  private static void copy(NativePqParams from, NativePqParams to) {
    to.setM(from.getM());
    to.setBits(from.getBits());
    to.setIters(from.getIters());
    to.setTol(from.getTol());
    to.setTrain_sample(from.getTrain_sample());
    to.setExact_fraction(from.getExact_fraction());
  }

  /** kvret_pq_params.m: sub-spaces; head_dim % m == 0; default 4 */
  public int m() {
    return fields.getM();
  }

  /** kvret_pq_params.bits: bits per code (2^bits centroids), 1..8; default 6 */
  public int bits() {
    return fields.getBits();
  }

  /**
   * kvret_pq_params.iters: k-means iterations; 0 = adaptive (stop when the objective improves <
   * tol, at most 25); default 0
   */
  public int iters() {
    return fields.getIters();
  }

  /** kvret_pq_params.tol: relative objective improvement that ends adaptive k-means; default 1e-3 */
  public float tol() {
    return fields.getTol();
  }

  /**
   * kvret_pq_params.train_sample: max tokens sampled per (layer, KV head) for training; 0 = all;
   * default 8192
   */
  public int trainSample() {
    return fields.getTrain_sample();
  }

  /**
   * kvret_pq_params.exact_fraction: share of each (layer, KV head)'s indexed tokens whose keys
   * quantize worst (largest squared reconstruction error ||k - k_hat||^2) that PQ keeps exact: a
   * copy of the key in the index (in kv_dtype), scored with the exact q.k instead of the codes. A
   * rare, sharp key (the one a retrieval head copies from) is the one PQ reconstructs worst.
   * ceil(fraction * n) tokens per head at each training, ties to the earlier position; a token
   * encoded later with the same codebook becomes exact when its error exceeds the smallest error in
   * the exact set, while the set holds less than twice its share. Costs fraction * n * head_dim *
   * (2 or 4) bytes per head. 0 = off; valid range [0, 0.5]; default 0.05
   */
  public float exactFraction() {
    return fields.getExact_fraction();
  }

  public static final class Builder {
    private final NativePqParams fields = new NativePqParams();

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_pq_params_init(fields);
    }

    public PqParams build() {
      NativePqParams copy = new NativePqParams();
      KvretNative.kvret_pq_params_init(copy);
      copy(fields, copy);
      return new PqParams(copy);
    }

    /** kvret_pq_params.m: sub-spaces; head_dim % m == 0; default 4 */
    public Builder m(int value) {
      fields.setM(value);
      return this;
    }

    /** kvret_pq_params.bits: bits per code (2^bits centroids), 1..8; default 6 */
    public Builder bits(int value) {
      fields.setBits(value);
      return this;
    }

    /**
     * kvret_pq_params.iters: k-means iterations; 0 = adaptive (stop when the objective improves <
     * tol, at most 25); default 0
     */
    public Builder iters(int value) {
      fields.setIters(value);
      return this;
    }

    /** kvret_pq_params.tol: relative objective improvement that ends adaptive k-means; default 1e-3 */
    public Builder tol(float value) {
      fields.setTol(value);
      return this;
    }

    /**
     * kvret_pq_params.train_sample: max tokens sampled per (layer, KV head) for training; 0 = all;
     * default 8192
     */
    public Builder trainSample(int value) {
      fields.setTrain_sample(value);
      return this;
    }

    /**
     * kvret_pq_params.exact_fraction: share of each (layer, KV head)'s indexed tokens whose keys
     * quantize worst (largest squared reconstruction error ||k - k_hat||^2) that PQ keeps exact: a
     * copy of the key in the index (in kv_dtype), scored with the exact q.k instead of the codes. A
     * rare, sharp key (the one a retrieval head copies from) is the one PQ reconstructs worst.
     * ceil(fraction * n) tokens per head at each training, ties to the earlier position; a token
     * encoded later with the same codebook becomes exact when its error exceeds the smallest error
     * in the exact set, while the set holds less than twice its share. Costs fraction * n *
     * head_dim * (2 or 4) bytes per head. 0 = off; valid range [0, 0.5]; default 0.05
     */
    public Builder exactFraction(float value) {
      fields.setExact_fraction(value);
      return this;
    }
  }
}
