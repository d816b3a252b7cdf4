package org.kvret;

import java.lang.ref.Cleaner;

/**
 * An immutable context configuration: every field of kvret_config, with the library's defaults for those a
 * {@link Builder} does not set.
 *
 * <pre>{@code
 * Config config = Config.builder().nLayers(2).nQHeads(8).nKvHeads(2).headDim(64)
 *     .kvDtype(KvDtype.F32).indexKind(IndexKind.EXACT).budget(32).build();
 * }</pre>
 */
public final class Config {
  private static final Cleaner CLEANER = NativeHandles.CLEANER;

  private final NativeConfig fields;
  private final String diskPath;
  private final String sessionSharedUrl;

  private Config(NativeConfig fields, String diskPath, String sessionSharedUrl) {
    this.fields = fields;
    this.diskPath = diskPath;
    this.sessionSharedUrl = sessionSharedUrl;
    CLEANER.register(this, fields::delete);
  }

  /** The library's defaults. */
  public static Config defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder();
  }

  /** Adopts a native config filled by the library (kvret_get_config). */
  static Config adopt(NativeConfig fields) {
    return new Config(fields, NativeStrings.fromUtf8(KvretNative.kvret_swig_config_disk_path(fields)),
        NativeStrings.fromUtf8(KvretNative.kvret_swig_config_session_shared_url(fields)));
  }

  /** A builder that starts from this config. */
  public Builder toBuilder() {
    Builder builder = new Builder();
    KvretNative.kvret_swig_config_copy(builder.fields, fields);
    builder.diskPath = diskPath;
    builder.sessionSharedUrl = sessionSharedUrl;
    return builder;
  }

  NativeConfig fields() {
    return fields;
  }

  /** Where the index and working set live (kvret_config.device_type). */
  public DeviceType deviceType() {
    return DeviceType.fromCode(fields.getDevice_type());
  }

  /** The CUDA device ordinal (kvret_config.device_id). */
  public int deviceId() {
    return fields.getDevice_id();
  }

  /** The directory of the session store's disk tier, or null for none (kvret_config.disk_path). */
  public String diskPath() {
    return diskPath;
  }

  /** The Redis URL of the shared session tier, or null for none (kvret_config.session_shared_url). */
  public String sessionSharedUrl() {
    return sessionSharedUrl;
  }

  // The accessors of every other field, from include/kvret.h (bindings/gen_config.py; do not edit by hand).
  // <generated getters>
  /** kvret_config.n_layers: 1..4096; default 32 */
  public int nLayers() {
    return fields.getN_layers();
  }

  /** kvret_config.n_q_heads: 1..4096; default 32 */
  public int nQHeads() {
    return fields.getN_q_heads();
  }

  /** kvret_config.n_kv_heads: default 8; n_q_heads % n_kv_heads == 0 */
  public int nKvHeads() {
    return fields.getN_kv_heads();
  }

  /** kvret_config.head_dim: 64, 128 or 256; default 128 */
  public int headDim() {
    return fields.getHead_dim();
  }

  /** kvret_config.kv_dtype: a kvret_kv_dtype; default KVRET_KV_F16 */
  public KvDtype kvDtype() {
    return KvDtype.fromCode(fields.getKv_dtype());
  }

  /** kvret_config.n_sink: first tokens always attended; default 16 */
  public int nSink() {
    return fields.getN_sink();
  }

  /** kvret_config.n_local: most recent tokens always attended; default 64 */
  public int nLocal() {
    return fields.getN_local();
  }

  /** kvret_config.budget: middle tokens selected per KV head; 0 = use budget_ratio (default 0) */
  public int budget() {
    return fields.getBudget();
  }

  /**
   * kvret_config.budget_ratio: budget as a fraction of the context length when budget == 0; default
   * 0.1
   */
  public float budgetRatio() {
    return fields.getBudget_ratio();
  }

  /** kvret_config.gqa_fold: a kvret_gqa_fold; default KVRET_FOLD_SUM_PROB */
  public GqaFold gqaFold() {
    return GqaFold.fromCode(fields.getGqa_fold());
  }

  /** kvret_config.index_kind: a kvret_index_kind; default KVRET_INDEX_PQ */
  public IndexKind indexKind() {
    return IndexKind.fromCode(fields.getIndex_kind());
  }

  /** kvret_config.pq_m: sub-spaces; head_dim % pq_m == 0; default 4 */
  public int pqM() {
    return fields.getPq_m();
  }

  /** kvret_config.pq_bits: bits per code (2^bits centroids), 1..8; default 6 */
  public int pqBits() {
    return fields.getPq_bits();
  }

  /**
   * kvret_config.pq_iters: k-means iterations; 0 = adaptive (stop when the objective improves <
   * pq_tol, at most 25); default 0
   */
  public int pqIters() {
    return fields.getPq_iters();
  }

  /** kvret_config.pq_tol: relative objective improvement that ends adaptive k-means; default 1e-3 */
  public float pqTol() {
    return fields.getPq_tol();
  }

  /**
   * kvret_config.pq_train_sample: max tokens sampled per (layer, KV head) for training; 0 = all;
   * default 8192
   */
  public int pqTrainSample() {
    return fields.getPq_train_sample();
  }

  /**
   * kvret_config.cluster_tokens: tokens per cluster at prefill (ceil(n / this) clusters); default
   * 32 (ClusterKV's own setting is 80: docs/cluster.md compares them)
   */
  public int clusterTokens() {
    return fields.getCluster_tokens();
  }

  /**
   * kvret_config.cluster_decode_interval: decode tokens clustered at a time (scored exactly until
   * then); default 320
   */
  public int clusterDecodeInterval() {
    return fields.getCluster_decode_interval();
  }

  /** kvret_config.cluster_decode_k: clusters made from each decoded interval; default 4 */
  public int clusterDecodeK() {
    return fields.getCluster_decode_k();
  }

  /** kvret_config.page_size: tokens per page; default 16 */
  public int pageSize() {
    return fields.getPage_size();
  }

  /** kvret_config.quant_bits: bits per quantized key and value element: 1 or 2; default 2 */
  public int quantBits() {
    return fields.getQuant_bits();
  }

  /**
   * kvret_config.hamming_fraction: share of each select's budget spent on bucket representatives of
   * the tokens left out, in [0, 1): floor(fraction * budget) of them; default 0 (off)
   */
  public float hammingFraction() {
    return fields.getHamming_fraction();
  }

  /**
   * kvret_config.hamming_buckets: most representatives (buckets) per KV head and select; default 0
   * = no cap
   */
  public int hammingBuckets() {
    return fields.getHamming_buckets();
  }

  /**
   * kvret_config.max_seq_tokens: token capacity of one sequence (per layer); 0 = unlimited; default
   * 0
   */
  public long maxSeqTokens() {
    return fields.getMax_seq_tokens();
  }

  /**
   * kvret_config.host_bytes_limit: capacity of the host KV store over all sequences; 0 = unlimited;
   * default 0. When set, at least one 256-token page of K and V per layer (n_layers x 256 x 2 x
   * n_kv_heads x head_dim x element size): less is KVRET_ERR_INVALID_ARGUMENT
   */
  public long hostBytesLimit() {
    return fields.getHost_bytes_limit();
  }

  /**
   * kvret_config.block_tokens: tokens per cache block (positions [b * block_tokens, (b+1) *
   * block_tokens)); default 128; >= 1
   */
  public int blockTokens() {
    return fields.getBlock_tokens();
  }

  /**
   * kvret_config.cache_policy: a kvret_cache_policy: which cached block a newly admitted one
   * replaces; default KVRET_CACHE_LRU
   */
  public CachePolicy cachePolicy() {
    return CachePolicy.fromCode(fields.getCache_policy());
  }

  /**
   * kvret_config.cache_capacity_tokens: block cache capacity per (sequence, layer, KV head) on the
   * CUDA backend: cache_capacity_tokens / block_tokens slots (at most 2048; 0 slots = no cache) of
   * keys and values in device memory, made at the layer's first fetch or prefetch, counted in
   * stats.device_bytes and under device_bytes_limit (a layer whose cache does not fit runs without
   * one). Fetches serve rows of cached blocks from it (stats.cache_hits) and admit the complete
   * blocks holding the most selected rows; the still-growing last block is never cached. With it
   * come the device windows: the first n_sink and the last n_local rows (each at most 4096) in
   * device memory, loaded as the layer grows, from which fetches serve their sink and local rows.
   * Results are the same with and without it. Ignored by the CPU backend, whose KV is already in
   * host memory; default 4096; >= 0
   */
  public long cacheCapacityTokens() {
    return fields.getCache_capacity_tokens();
  }

  /** kvret_config.n_threads: CPU threads for scoring and builds; 0 = all cores; default 0 */
  public int nThreads() {
    return fields.getN_threads();
  }

  /**
   * kvret_config.background_build: 1: index builds run in the background after append_prefill
   * (default)
   */
  public boolean backgroundBuild() {
    return fields.getBackground_build() != 0;
  }

  /** kvret_config.check_finite: 1: reject NaN/Inf in appended keys/values and queries; default 0 */
  public boolean checkFinite() {
    return fields.getCheck_finite() != 0;
  }

  /** kvret_config.seed: seed of every randomized step (k-means init, sampling); default 42 */
  public long seed() {
    return fields.getSeed();
  }

  /**
   * kvret_config.pq_exact_fraction: share of each (layer, KV head)'s indexed tokens whose keys
   * quantize worst (largest squared reconstruction error ||k - k_hat||^2) that PQ keeps exact: a
   * copy of the key in the index (in kv_dtype), scored with the exact q.k instead of the codes. A
   * rare, sharp key (the one a retrieval head copies from) is the one PQ reconstructs worst.
   * ceil(fraction * n) tokens per head at each training, ties to the earlier position; a token
   * encoded later with the same codebook becomes exact when its error exceeds the smallest error in
   * the exact set, while the set holds less than twice its share. Costs fraction * n * head_dim *
   * (2 or 4) bytes per head. 0 = off; valid range [0, 0.5]; default 0.05
   */
  public float pqExactFraction() {
    return fields.getPq_exact_fraction();
  }

  /**
   * kvret_config.quant_group_size: elements per quantization group of the quant index (keys: tokens
   * of one channel, values: channels of one token), each with its own f16 min and max: 32 or 64;
   * default 64
   */
  public int quantGroupSize() {
    return fields.getQuant_group_size();
  }

  /**
   * kvret_config.quant_residual: most recent middle tokens the quant index keeps in f16 (KIVI's
   * residual window; up to quant_group_size - 1 more wait for a full key group): 0..65536; default
   * 64
   */
  public int quantResidual() {
    return fields.getQuant_residual();
  }

  /**
   * kvret_config.cluster_segment_tokens: most middle tokens one k-means of the cluster index
   * clusters: a longer prefill is cut into ceil(n / this) segments of equal length, clustered
   * apart, so the build is linear in the prefill length; 0 = the whole prefill in one k-means
   * (quadratic in its length); default 4096
   */
  public int clusterSegmentTokens() {
    return fields.getCluster_segment_tokens();
  }

  /**
   * kvret_config.quant_attention: 1: on a KVRET_INDEX_QUANT context, kvret_seq_attend attends over
   * every token of the layer, the sink, local and selected tokens exact, select's quant_rerank x
   * budget candidates with their exact keys (their values low-bit unless selected) and every other
   * middle token as the low-bit copy has it (computed on the host); 0 (default): over the working
   * set, as for every other index. 1 needs index_kind = KVRET_INDEX_QUANT
   */
  public int quantAttention() {
    return fields.getQuant_attention();
  }

  /**
   * kvret_config.cluster_reuse_steps: R: on a KVRET_INDEX_CLUSTER context, the clusters a layer's
   * fetches took in its last R fetches (steps) stay resident in the sequence: a copy of the rows
   * fetched from them (in kv_dtype), from which the next fetch serves the selected rows it holds
   * instead of the host store (the same bytes). A cluster fetched again stays resident with every
   * row it holds; one not fetched in R steps is dropped. Hits count in stats.cluster_reuse_hits
   * (and cache_hits), so cluster_reuse_hits / cluster_reuse_rows is the hit rate. Truncating a
   * layer drops its copy; a fork starts without one. 0 = off; 0..1024; default 1. Ignored by the
   * other index kinds
   */
  public int clusterReuseSteps() {
    return fields.getCluster_reuse_steps();
  }

  /**
   * kvret_config.device_bytes_limit: most bytes of device memory the context's sequences keep
   * between calls (the working sets of kvret_seq_attend and the block caches; stats.device_bytes).
   * A working set that would pass it is KVRET_ERR_CAPACITY, naming this field, before the call
   * changes anything; a block cache that would pass it is not made (that layer's fetches read every
   * row from host memory and succeed; a later fetch tries again), and a cache's block table that
   * cannot grow stops admitting blocks past it. The temporaries of a call (gather lists, attention
   * weights, the cache's bookkeeping), freed before it returns, are not counted. 0 = unlimited
   * (default); >= 0. Ignored by the CPU backend, which uses no device memory
   */
  public long deviceBytesLimit() {
    return fields.getDevice_bytes_limit();
  }

  /**
   * kvret_config.session_dram_bytes: capacity of the session store's host DRAM tier in bytes; 0 =
   * unlimited; default 0; >= 0
   */
  public long sessionDramBytes() {
    return fields.getSession_dram_bytes();
  }

  /**
   * kvret_config.session_disk_bytes: capacity of the disk tier (config.disk_path) in bytes; 0 =
   * unlimited; default 0; >= 0
   */
  public long sessionDiskBytes() {
    return fields.getSession_disk_bytes();
  }

  /**
   * kvret_config.session_ttl_ms: a saved session expires this many milliseconds after its save
   * (then it is a miss, and its bytes are freed); 0 = never; default 0; >= 0
   */
  public long sessionTtlMs() {
    return fields.getSession_ttl_ms();
  }

  /** kvret_config.session_policy: a kvret_session_policy; default KVRET_SESSION_SCHEDULER_AWARE */
  public SessionPolicy sessionPolicy() {
    return SessionPolicy.fromCode(fields.getSession_policy());
  }

  /**
   * kvret_config.rope_keys: 1: the keys appended are before RoPE; kvret rotates them at the
   * position each token has now (its index in the sequence) wherever keys are read: index builds,
   * select, fetch, attention and kvret_seq_read. Queries stay rotated as before. 0 (default): keys
   * are given rotated
   */
  public boolean ropeKeys() {
    return fields.getRope_keys() != 0;
  }

  /**
   * kvret_config.rope_dims: rotated dimensions of each head (even, <= head_dim; the rest pass
   * unrotated); 0 = head_dim (default)
   */
  public int ropeDims() {
    return fields.getRope_dims();
  }

  /** kvret_config.rope_layout: a kvret_rope_layout; default KVRET_ROPE_NEOX */
  public RopeLayout ropeLayout() {
    return RopeLayout.fromCode(fields.getRope_layout());
  }

  /** kvret_config.rope_theta: the base of the rotary frequencies; > 0; default 10000 */
  public float ropeTheta() {
    return fields.getRope_theta();
  }

  /**
   * kvret_config.rope_scale_factor: Llama-3 frequency scaling: the factor; 0 = none (default); else
   * >= 1
   */
  public float ropeScaleFactor() {
    return fields.getRope_scale_factor();
  }

  /** kvret_config.rope_low_freq_factor: Llama-3 scaling: low-frequency factor; > 0; default 1 */
  public float ropeLowFreqFactor() {
    return fields.getRope_low_freq_factor();
  }

  /**
   * kvret_config.rope_high_freq_factor: Llama-3 scaling: high-frequency factor; >
   * rope_low_freq_factor; default 4
   */
  public float ropeHighFreqFactor() {
    return fields.getRope_high_freq_factor();
  }

  /**
   * kvret_config.rope_original_max_positions: Llama-3 scaling: the original context length; >= 1;
   * default 8192
   */
  public int ropeOriginalMaxPositions() {
    return fields.getRope_original_max_positions();
  }

  /**
   * kvret_config.cluster_exact_fraction: share of each clustered segment's tokens (per KV head)
   * that the cluster index keeps out of the clusters: the ceil(fraction * n) keys of lowest cosine
   * to their k-means direction (ties to the earlier position; at most n minus the segment's
   * clusters), each a group of its own, scored by its exact q.k. A rare, sharp key (the one a
   * retrieval head copies from) is the one its cluster's mean hides. Costs fraction * n * head_dim
   * * 4 bytes per head. 0 = off (ClusterKV's own index); [0, 0.5]; default 0.05
   */
  public float clusterExactFraction() {
    return fields.getCluster_exact_fraction();
  }

  /**
   * kvret_config.quant_rerank: on a KVRET_INDEX_QUANT context, select takes the quant_rerank x
   * budget middle tokens the low-bit keys score highest (at most the middle) as candidates, scores
   * them again with their exact keys from the KV store and keeps the top budget of those: a key the
   * 1-bit copy ranks just below the cut (a needle) is recovered for candidates x head_dim
   * multiply-adds more and a read of the candidates' keys. 1 = off (the low-bit ranking alone,
   * SpeCache's); 1..64; default 4. Ignored by the other index kinds. Under quant_attention = 1 the
   * candidates also enter that attention with their exact keys
   */
  public int quantRerank() {
    return fields.getQuant_rerank();
  }

  /**
   * kvret_config.hamming_importance: a kvret_importance: where the importance behind KVCrush's
   * signatures, its representatives and kvret_seq_retained_set comes from; default
   * KVRET_IMPORTANCE_WINDOW
   */
  public Importance hammingImportance() {
    return Importance.fromCode(fields.getHamming_importance());
  }

  /**
   * kvret_config.hamming_granularity: tokens per KVCrush representative unit: 0 or 1 = single
   * tokens (default 0); a power of two 2..4096 = aligned runs of that many positions (chunks of 8,
   * or the engine's KV page), each representative unit sending all its tokens the index did not
   * select; the count a select returns does not change
   */
  public int hammingGranularity() {
    return fields.getHamming_granularity();
  }
  // </generated getters>

  /** Sets kvret_config fields; {@link #build()} makes an independent Config (the builder stays usable). */
  public static final class Builder {
    private final NativeConfig fields = new NativeConfig();
    private String diskPath;
    private String sessionSharedUrl;

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_config_init(fields);
    }

    public Config build() {
      NativeConfig copy = new NativeConfig();
      KvretNative.kvret_swig_config_copy(copy, fields);
      return new Config(copy, diskPath, sessionSharedUrl);
    }

    /** Where the index and working set live: CPU (default) or CUDA with a device ordinal. */
    public Builder device(DeviceType type, int deviceId) {
      fields.setDevice_type(type.code);
      fields.setDevice_id(deviceId);
      return this;
    }

    /**
     * The directory of the session store's disk tier, created if missing; null or "" for none. A NUL character is
     * refused by {@link Context#create} (KvretException, INVALID_ARGUMENT).
     */
    public Builder diskPath(String value) {
      diskPath = value;
      return this;
    }

    /**
     * The shared session tier: a Redis server every node of a serving stack reads saved sessions from,
     * {@code redis://[:password@]host[:port][/db][?prefix=P&timeout_ms=N]} or {@code rediss://} for TLS; null or ""
     * for none (default). A library built without the Redis client refuses it (KvretException, UNSUPPORTED).
     */
    public Builder sessionSharedUrl(String value) {
      sessionSharedUrl = value;
      return this;
    }

    // The setters of every other field, from include/kvret.h (bindings/gen_config.py; do not edit by hand).
    // <generated setters>
    /** kvret_config.n_layers: 1..4096; default 32 */
    public Builder nLayers(int value) {
      fields.setN_layers(value);
      return this;
    }

    /** kvret_config.n_q_heads: 1..4096; default 32 */
    public Builder nQHeads(int value) {
      fields.setN_q_heads(value);
      return this;
    }

    /** kvret_config.n_kv_heads: default 8; n_q_heads % n_kv_heads == 0 */
    public Builder nKvHeads(int value) {
      fields.setN_kv_heads(value);
      return this;
    }

    /** kvret_config.head_dim: 64, 128 or 256; default 128 */
    public Builder headDim(int value) {
      fields.setHead_dim(value);
      return this;
    }

    /** kvret_config.kv_dtype: a kvret_kv_dtype; default KVRET_KV_F16 */
    public Builder kvDtype(KvDtype value) {
      fields.setKv_dtype(value.code);
      return this;
    }

    /** kvret_config.n_sink: first tokens always attended; default 16 */
    public Builder nSink(int value) {
      fields.setN_sink(value);
      return this;
    }

    /** kvret_config.n_local: most recent tokens always attended; default 64 */
    public Builder nLocal(int value) {
      fields.setN_local(value);
      return this;
    }

    /** kvret_config.budget: middle tokens selected per KV head; 0 = use budget_ratio (default 0) */
    public Builder budget(int value) {
      fields.setBudget(value);
      return this;
    }

    /**
     * kvret_config.budget_ratio: budget as a fraction of the context length when budget == 0;
     * default 0.1
     */
    public Builder budgetRatio(float value) {
      fields.setBudget_ratio(value);
      return this;
    }

    /** kvret_config.gqa_fold: a kvret_gqa_fold; default KVRET_FOLD_SUM_PROB */
    public Builder gqaFold(GqaFold value) {
      fields.setGqa_fold(value.code);
      return this;
    }

    /** kvret_config.index_kind: a kvret_index_kind; default KVRET_INDEX_PQ */
    public Builder indexKind(IndexKind value) {
      fields.setIndex_kind(value.code);
      return this;
    }

    /** kvret_config.pq_m: sub-spaces; head_dim % pq_m == 0; default 4 */
    public Builder pqM(int value) {
      fields.setPq_m(value);
      return this;
    }

    /** kvret_config.pq_bits: bits per code (2^bits centroids), 1..8; default 6 */
    public Builder pqBits(int value) {
      fields.setPq_bits(value);
      return this;
    }

    /**
     * kvret_config.pq_iters: k-means iterations; 0 = adaptive (stop when the objective improves <
     * pq_tol, at most 25); default 0
     */
    public Builder pqIters(int value) {
      fields.setPq_iters(value);
      return this;
    }

    /** kvret_config.pq_tol: relative objective improvement that ends adaptive k-means; default 1e-3 */
    public Builder pqTol(float value) {
      fields.setPq_tol(value);
      return this;
    }

    /**
     * kvret_config.pq_train_sample: max tokens sampled per (layer, KV head) for training; 0 = all;
     * default 8192
     */
    public Builder pqTrainSample(int value) {
      fields.setPq_train_sample(value);
      return this;
    }

    /**
     * kvret_config.cluster_tokens: tokens per cluster at prefill (ceil(n / this) clusters); default
     * 32 (ClusterKV's own setting is 80: docs/cluster.md compares them)
     */
    public Builder clusterTokens(int value) {
      fields.setCluster_tokens(value);
      return this;
    }

    /**
     * kvret_config.cluster_decode_interval: decode tokens clustered at a time (scored exactly until
     * then); default 320
     */
    public Builder clusterDecodeInterval(int value) {
      fields.setCluster_decode_interval(value);
      return this;
    }

    /** kvret_config.cluster_decode_k: clusters made from each decoded interval; default 4 */
    public Builder clusterDecodeK(int value) {
      fields.setCluster_decode_k(value);
      return this;
    }

    /** kvret_config.page_size: tokens per page; default 16 */
    public Builder pageSize(int value) {
      fields.setPage_size(value);
      return this;
    }

    /** kvret_config.quant_bits: bits per quantized key and value element: 1 or 2; default 2 */
    public Builder quantBits(int value) {
      fields.setQuant_bits(value);
      return this;
    }

    /**
     * kvret_config.hamming_fraction: share of each select's budget spent on bucket representatives
     * of the tokens left out, in [0, 1): floor(fraction * budget) of them; default 0 (off)
     */
    public Builder hammingFraction(float value) {
      fields.setHamming_fraction(value);
      return this;
    }

    /**
     * kvret_config.hamming_buckets: most representatives (buckets) per KV head and select; default
     * 0 = no cap
     */
    public Builder hammingBuckets(int value) {
      fields.setHamming_buckets(value);
      return this;
    }

    /**
     * kvret_config.max_seq_tokens: token capacity of one sequence (per layer); 0 = unlimited;
     * default 0
     */
    public Builder maxSeqTokens(long value) {
      fields.setMax_seq_tokens(value);
      return this;
    }

    /**
     * kvret_config.host_bytes_limit: capacity of the host KV store over all sequences; 0 =
     * unlimited; default 0. When set, at least one 256-token page of K and V per layer (n_layers x
     * 256 x 2 x n_kv_heads x head_dim x element size): less is KVRET_ERR_INVALID_ARGUMENT
     */
    public Builder hostBytesLimit(long value) {
      fields.setHost_bytes_limit(value);
      return this;
    }

    /**
     * kvret_config.block_tokens: tokens per cache block (positions [b * block_tokens, (b+1) *
     * block_tokens)); default 128; >= 1
     */
    public Builder blockTokens(int value) {
      fields.setBlock_tokens(value);
      return this;
    }

    /**
     * kvret_config.cache_policy: a kvret_cache_policy: which cached block a newly admitted one
     * replaces; default KVRET_CACHE_LRU
     */
    public Builder cachePolicy(CachePolicy value) {
      fields.setCache_policy(value.code);
      return this;
    }

    /**
     * kvret_config.cache_capacity_tokens: block cache capacity per (sequence, layer, KV head) on
     * the CUDA backend: cache_capacity_tokens / block_tokens slots (at most 2048; 0 slots = no
     * cache) of keys and values in device memory, made at the layer's first fetch or prefetch,
     * counted in stats.device_bytes and under device_bytes_limit (a layer whose cache does not fit
     * runs without one). Fetches serve rows of cached blocks from it (stats.cache_hits) and admit
     * the complete blocks holding the most selected rows; the still-growing last block is never
     * cached. With it come the device windows: the first n_sink and the last n_local rows (each at
     * most 4096) in device memory, loaded as the layer grows, from which fetches serve their sink
     * and local rows. Results are the same with and without it. Ignored by the CPU backend, whose
     * KV is already in host memory; default 4096; >= 0
     */
    public Builder cacheCapacityTokens(long value) {
      fields.setCache_capacity_tokens(value);
      return this;
    }

    /** kvret_config.n_threads: CPU threads for scoring and builds; 0 = all cores; default 0 */
    public Builder nThreads(int value) {
      fields.setN_threads(value);
      return this;
    }

    /**
     * kvret_config.background_build: 1: index builds run in the background after append_prefill
     * (default)
     */
    public Builder backgroundBuild(boolean value) {
      fields.setBackground_build(value ? 1 : 0);
      return this;
    }

    /** kvret_config.check_finite: 1: reject NaN/Inf in appended keys/values and queries; default 0 */
    public Builder checkFinite(boolean value) {
      fields.setCheck_finite(value ? 1 : 0);
      return this;
    }

    /** kvret_config.seed: seed of every randomized step (k-means init, sampling); default 42 */
    public Builder seed(long value) {
      fields.setSeed(value);
      return this;
    }

    /**
     * kvret_config.pq_exact_fraction: share of each (layer, KV head)'s indexed tokens whose keys
     * quantize worst (largest squared reconstruction error ||k - k_hat||^2) that PQ keeps exact: a
     * copy of the key in the index (in kv_dtype), scored with the exact q.k instead of the codes. A
     * rare, sharp key (the one a retrieval head copies from) is the one PQ reconstructs worst.
     * ceil(fraction * n) tokens per head at each training, ties to the earlier position; a token
     * encoded later with the same codebook becomes exact when its error exceeds the smallest error
     * in the exact set, while the set holds less than twice its share. Costs fraction * n *
     * head_dim * (2 or 4) bytes per head. 0 = off; valid range [0, 0.5]; default 0.05
     */
    public Builder pqExactFraction(float value) {
      fields.setPq_exact_fraction(value);
      return this;
    }

    /**
     * kvret_config.quant_group_size: elements per quantization group of the quant index (keys:
     * tokens of one channel, values: channels of one token), each with its own f16 min and max: 32
     * or 64; default 64
     */
    public Builder quantGroupSize(int value) {
      fields.setQuant_group_size(value);
      return this;
    }

    /**
     * kvret_config.quant_residual: most recent middle tokens the quant index keeps in f16 (KIVI's
     * residual window; up to quant_group_size - 1 more wait for a full key group): 0..65536;
     * default 64
     */
    public Builder quantResidual(int value) {
      fields.setQuant_residual(value);
      return this;
    }

    /**
     * kvret_config.cluster_segment_tokens: most middle tokens one k-means of the cluster index
     * clusters: a longer prefill is cut into ceil(n / this) segments of equal length, clustered
     * apart, so the build is linear in the prefill length; 0 = the whole prefill in one k-means
     * (quadratic in its length); default 4096
     */
    public Builder clusterSegmentTokens(int value) {
      fields.setCluster_segment_tokens(value);
      return this;
    }

    /**
     * kvret_config.quant_attention: 1: on a KVRET_INDEX_QUANT context, kvret_seq_attend attends
     * over every token of the layer, the sink, local and selected tokens exact, select's
     * quant_rerank x budget candidates with their exact keys (their values low-bit unless selected)
     * and every other middle token as the low-bit copy has it (computed on the host); 0 (default):
     * over the working set, as for every other index. 1 needs index_kind = KVRET_INDEX_QUANT
     */
    public Builder quantAttention(int value) {
      fields.setQuant_attention(value);
      return this;
    }

    /**
     * kvret_config.cluster_reuse_steps: R: on a KVRET_INDEX_CLUSTER context, the clusters a layer's
     * fetches took in its last R fetches (steps) stay resident in the sequence: a copy of the rows
     * fetched from them (in kv_dtype), from which the next fetch serves the selected rows it holds
     * instead of the host store (the same bytes). A cluster fetched again stays resident with every
     * row it holds; one not fetched in R steps is dropped. Hits count in stats.cluster_reuse_hits
     * (and cache_hits), so cluster_reuse_hits / cluster_reuse_rows is the hit rate. Truncating a
     * layer drops its copy; a fork starts without one. 0 = off; 0..1024; default 1. Ignored by the
     * other index kinds
     */
    public Builder clusterReuseSteps(int value) {
      fields.setCluster_reuse_steps(value);
      return this;
    }

    /**
     * kvret_config.device_bytes_limit: most bytes of device memory the context's sequences keep
     * between calls (the working sets of kvret_seq_attend and the block caches;
     * stats.device_bytes). A working set that would pass it is KVRET_ERR_CAPACITY, naming this
     * field, before the call changes anything; a block cache that would pass it is not made (that
     * layer's fetches read every row from host memory and succeed; a later fetch tries again), and
     * a cache's block table that cannot grow stops admitting blocks past it. The temporaries of a
     * call (gather lists, attention weights, the cache's bookkeeping), freed before it returns, are
     * not counted. 0 = unlimited (default); >= 0. Ignored by the CPU backend, which uses no device
     * memory
     */
    public Builder deviceBytesLimit(long value) {
      fields.setDevice_bytes_limit(value);
      return this;
    }

    /**
     * kvret_config.session_dram_bytes: capacity of the session store's host DRAM tier in bytes; 0 =
     * unlimited; default 0; >= 0
     */
    public Builder sessionDramBytes(long value) {
      fields.setSession_dram_bytes(value);
      return this;
    }

    /**
     * kvret_config.session_disk_bytes: capacity of the disk tier (config.disk_path) in bytes; 0 =
     * unlimited; default 0; >= 0
     */
    public Builder sessionDiskBytes(long value) {
      fields.setSession_disk_bytes(value);
      return this;
    }

    /**
     * kvret_config.session_ttl_ms: a saved session expires this many milliseconds after its save
     * (then it is a miss, and its bytes are freed); 0 = never; default 0; >= 0
     */
    public Builder sessionTtlMs(long value) {
      fields.setSession_ttl_ms(value);
      return this;
    }

    /** kvret_config.session_policy: a kvret_session_policy; default KVRET_SESSION_SCHEDULER_AWARE */
    public Builder sessionPolicy(SessionPolicy value) {
      fields.setSession_policy(value.code);
      return this;
    }

    /**
     * kvret_config.rope_keys: 1: the keys appended are before RoPE; kvret rotates them at the
     * position each token has now (its index in the sequence) wherever keys are read: index builds,
     * select, fetch, attention and kvret_seq_read. Queries stay rotated as before. 0 (default):
     * keys are given rotated
     */
    public Builder ropeKeys(boolean value) {
      fields.setRope_keys(value ? 1 : 0);
      return this;
    }

    /**
     * kvret_config.rope_dims: rotated dimensions of each head (even, <= head_dim; the rest pass
     * unrotated); 0 = head_dim (default)
     */
    public Builder ropeDims(int value) {
      fields.setRope_dims(value);
      return this;
    }

    /** kvret_config.rope_layout: a kvret_rope_layout; default KVRET_ROPE_NEOX */
    public Builder ropeLayout(RopeLayout value) {
      fields.setRope_layout(value.code);
      return this;
    }

    /** kvret_config.rope_theta: the base of the rotary frequencies; > 0; default 10000 */
    public Builder ropeTheta(float value) {
      fields.setRope_theta(value);
      return this;
    }

    /**
     * kvret_config.rope_scale_factor: Llama-3 frequency scaling: the factor; 0 = none (default);
     * else >= 1
     */
    public Builder ropeScaleFactor(float value) {
      fields.setRope_scale_factor(value);
      return this;
    }

    /** kvret_config.rope_low_freq_factor: Llama-3 scaling: low-frequency factor; > 0; default 1 */
    public Builder ropeLowFreqFactor(float value) {
      fields.setRope_low_freq_factor(value);
      return this;
    }

    /**
     * kvret_config.rope_high_freq_factor: Llama-3 scaling: high-frequency factor; >
     * rope_low_freq_factor; default 4
     */
    public Builder ropeHighFreqFactor(float value) {
      fields.setRope_high_freq_factor(value);
      return this;
    }

    /**
     * kvret_config.rope_original_max_positions: Llama-3 scaling: the original context length; >= 1;
     * default 8192
     */
    public Builder ropeOriginalMaxPositions(int value) {
      fields.setRope_original_max_positions(value);
      return this;
    }

    /**
     * kvret_config.cluster_exact_fraction: share of each clustered segment's tokens (per KV head)
     * that the cluster index keeps out of the clusters: the ceil(fraction * n) keys of lowest
     * cosine to their k-means direction (ties to the earlier position; at most n minus the
     * segment's clusters), each a group of its own, scored by its exact q.k. A rare, sharp key (the
     * one a retrieval head copies from) is the one its cluster's mean hides. Costs fraction * n *
     * head_dim * 4 bytes per head. 0 = off (ClusterKV's own index); [0, 0.5]; default 0.05
     */
    public Builder clusterExactFraction(float value) {
      fields.setCluster_exact_fraction(value);
      return this;
    }

    /**
     * kvret_config.quant_rerank: on a KVRET_INDEX_QUANT context, select takes the quant_rerank x
     * budget middle tokens the low-bit keys score highest (at most the middle) as candidates,
     * scores them again with their exact keys from the KV store and keeps the top budget of those:
     * a key the 1-bit copy ranks just below the cut (a needle) is recovered for candidates x
     * head_dim multiply-adds more and a read of the candidates' keys. 1 = off (the low-bit ranking
     * alone, SpeCache's); 1..64; default 4. Ignored by the other index kinds. Under quant_attention
     * = 1 the candidates also enter that attention with their exact keys
     */
    public Builder quantRerank(int value) {
      fields.setQuant_rerank(value);
      return this;
    }

    /**
     * kvret_config.hamming_importance: a kvret_importance: where the importance behind KVCrush's
     * signatures, its representatives and kvret_seq_retained_set comes from; default
     * KVRET_IMPORTANCE_WINDOW
     */
    public Builder hammingImportance(Importance value) {
      fields.setHamming_importance(value.code);
      return this;
    }

    /**
     * kvret_config.hamming_granularity: tokens per KVCrush representative unit: 0 or 1 = single
     * tokens (default 0); a power of two 2..4096 = aligned runs of that many positions (chunks of
     * 8, or the engine's KV page), each representative unit sending all its tokens the index did
     * not select; the count a select returns does not change
     */
    public Builder hammingGranularity(int value) {
      fields.setHamming_granularity(value);
      return this;
    }
    // </generated setters>
  }
}
