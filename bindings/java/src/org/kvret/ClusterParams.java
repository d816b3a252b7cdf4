// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.
package org.kvret;

import java.lang.ref.Cleaner;

/**
 * The parameters of ClusterKV, the cluster index (KVRET_INDEX_CLUSTER; docs/cluster.md). Fill with
 * kvret_cluster_params_init; reached from config.cluster. An immutable kvret_cluster_params: build
 * one with {@link #builder()} and give it to {@link Config.Builder#cluster}. Its values are checked
 * when the context is made (KvretException, Status.INVALID_ARGUMENT, naming the field, e.g.
 * config.cluster.tokens).
 */
public final class ClusterParams {
  private static final Cleaner CLEANER = NativeHandles.CLEANER;

  private final NativeClusterParams fields;

  private ClusterParams(NativeClusterParams fields) {
    this.fields = fields;
    CLEANER.register(this, fields::delete);
  }

  /** The library's defaults. */
  public static ClusterParams defaults() {
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

  NativeClusterParams fields() {
    return fields;
  }

  private static void copy(NativeClusterParams from, NativeClusterParams to) {
    to.setTokens(from.getTokens());
    to.setDecode_interval(from.getDecode_interval());
    to.setDecode_k(from.getDecode_k());
    to.setSegment_tokens(from.getSegment_tokens());
    to.setReuse_steps(from.getReuse_steps());
    to.setExact_fraction(from.getExact_fraction());
  }

  /**
   * kvret_cluster_params.tokens: tokens per cluster at prefill (ceil(n / this) clusters); default
   * 32 (ClusterKV's own setting is 80: docs/cluster.md compares them)
   */
  public int tokens() {
    return fields.getTokens();
  }

  /**
   * kvret_cluster_params.decode_interval: decode tokens clustered at a time (scored exactly until
   * then); default 320
   */
  public int decodeInterval() {
    return fields.getDecode_interval();
  }

  /** kvret_cluster_params.decode_k: clusters made from each decoded interval; default 4 */
  public int decodeK() {
    return fields.getDecode_k();
  }

  /**
   * kvret_cluster_params.segment_tokens: most middle tokens one k-means of the cluster index
   * clusters: a longer prefill is cut into ceil(n / this) segments of equal length, clustered
   * apart, so the build is linear in the prefill length; 0 = the whole prefill in one k-means
   * (quadratic in its length); default 4096
   */
  public int segmentTokens() {
    return fields.getSegment_tokens();
  }

  /**
   * kvret_cluster_params.reuse_steps: R: on a KVRET_INDEX_CLUSTER context, the clusters a layer's
   * fetches took in its last R fetches (steps) stay resident in the sequence: a copy of the rows
   * fetched from them (in kv_dtype), from which the next fetch serves the selected rows it holds
   * instead of the host store (the same bytes). A cluster fetched again stays resident with every
   * row it holds; one not fetched in R steps is dropped. Hits count in stats.cluster_reuse_hits
   * (and cache_hits), so cluster_reuse_hits / cluster_reuse_rows is the hit rate. Truncating a
   * layer drops its copy; a fork starts without one. 0 = off; 0..1024; default 1. Ignored by the
   * other index kinds
   */
  public int reuseSteps() {
    return fields.getReuse_steps();
  }

  /**
   * kvret_cluster_params.exact_fraction: share of each clustered segment's tokens (per KV head)
   * that the cluster index keeps out of the clusters: the ceil(fraction * n) keys of lowest cosine
   * to their k-means direction (ties to the earlier position; at most n minus the segment's
   * clusters), each a group of its own, scored by its exact q.k. A rare, sharp key (the one a
   * retrieval head copies from) is the one its cluster's mean hides. Costs fraction * n * head_dim
   * * 4 bytes per head. 0 = off (ClusterKV's own index); [0, 0.5]; default 0.05
   */
  public float exactFraction() {
    return fields.getExact_fraction();
  }

  public static final class Builder {
    private final NativeClusterParams fields = new NativeClusterParams();

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_cluster_params_init(fields);
    }

    public ClusterParams build() {
      NativeClusterParams copy = new NativeClusterParams();
      KvretNative.kvret_cluster_params_init(copy);
      copy(fields, copy);
      return new ClusterParams(copy);
    }

    /**
     * kvret_cluster_params.tokens: tokens per cluster at prefill (ceil(n / this) clusters); default
     * 32 (ClusterKV's own setting is 80: docs/cluster.md compares them)
     */
    public Builder tokens(int value) {
      fields.setTokens(value);
      return this;
    }

    /**
     * kvret_cluster_params.decode_interval: decode tokens clustered at a time (scored exactly until
     * then); default 320
     */
    public Builder decodeInterval(int value) {
      fields.setDecode_interval(value);
      return this;
    }

    /** kvret_cluster_params.decode_k: clusters made from each decoded interval; default 4 */
    public Builder decodeK(int value) {
      fields.setDecode_k(value);
      return this;
    }

    /**
     * kvret_cluster_params.segment_tokens: most middle tokens one k-means of the cluster index
     * clusters: a longer prefill is cut into ceil(n / this) segments of equal length, clustered
     * apart, so the build is linear in the prefill length; 0 = the whole prefill in one k-means
     * (quadratic in its length); default 4096
     */
    public Builder segmentTokens(int value) {
      fields.setSegment_tokens(value);
      return this;
    }

    /**
     * kvret_cluster_params.reuse_steps: R: on a KVRET_INDEX_CLUSTER context, the clusters a layer's
     * fetches took in its last R fetches (steps) stay resident in the sequence: a copy of the rows
     * fetched from them (in kv_dtype), from which the next fetch serves the selected rows it holds
     * instead of the host store (the same bytes). A cluster fetched again stays resident with every
     * row it holds; one not fetched in R steps is dropped. Hits count in stats.cluster_reuse_hits
     * (and cache_hits), so cluster_reuse_hits / cluster_reuse_rows is the hit rate. Truncating a
     * layer drops its copy; a fork starts without one. 0 = off; 0..1024; default 1. Ignored by the
     * other index kinds
     */
    public Builder reuseSteps(int value) {
      fields.setReuse_steps(value);
      return this;
    }

    /**
     * kvret_cluster_params.exact_fraction: share of each clustered segment's tokens (per KV head)
     * that the cluster index keeps out of the clusters: the ceil(fraction * n) keys of lowest
     * cosine to their k-means direction (ties to the earlier position; at most n minus the
     * segment's clusters), each a group of its own, scored by its exact q.k. A rare, sharp key (the
     * one a retrieval head copies from) is the one its cluster's mean hides. Costs fraction * n *
     * head_dim * 4 bytes per head. 0 = off (ClusterKV's own index); [0, 0.5]; default 0.05
     */
    public Builder exactFraction(float value) {
      fields.setExact_fraction(value);
      return this;
    }
  }
}
