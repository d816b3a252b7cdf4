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
  // The parameter structs fields points at (null: none), kept alive with it.
  private final PqParams pq;
  private final ClusterParams cluster;
  private final QuantParams quant;
  private final CrushParams crush;
  private final SessionParams session;

  private Config(NativeConfig fields, String diskPath, String sessionSharedUrl, PqParams pq, ClusterParams cluster,
      QuantParams quant, CrushParams crush, SessionParams session) {
    this.fields = fields;
    this.diskPath = diskPath;
    this.sessionSharedUrl = sessionSharedUrl;
    this.pq = pq;
    this.cluster = cluster;
    this.quant = quant;
    this.crush = crush;
    this.session = session;
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
        NativeStrings.fromUtf8(KvretNative.kvret_swig_config_session_shared_url(fields)), null, null, null, null,
        null);
  }

  /** A builder that starts from this config. */
  public Builder toBuilder() {
    Builder builder = new Builder();
    KvretNative.kvret_swig_config_copy(builder.fields, fields);
    builder.diskPath = diskPath;
    builder.sessionSharedUrl = sessionSharedUrl;
    builder.pq = pq;
    builder.cluster = cluster;
    builder.quant = quant;
    builder.crush = crush;
    builder.session = session;
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

  /** PQCache's parameters given to {@link Builder#pq}, or null (a context's config reports them in the flat fields). */
  public PqParams pq() {
    return pq;
  }

  /** ClusterKV's parameters given to {@link Builder#cluster}, or null. */
  public ClusterParams cluster() {
    return cluster;
  }

  /** The quant index's parameters given to {@link Builder#quant}, or null. */
  public QuantParams quant() {
    return quant;
  }

  /** KVCrush's parameters given to {@link Builder#crush}, or null. */
  public CrushParams crush() {
    return crush;
  }

  /** The session store's parameters given to {@link Builder#session}, or null. */
  public SessionParams session() {
    return session;
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

  /** kvret_config.pq_m: kept for one release: use pq.m */
  public int pqM() {
    return fields.getPq_m();
  }

  /** kvret_config.pq_bits: kept for one release: use pq.bits */
  public int pqBits() {
    return fields.getPq_bits();
  }

  /** kvret_config.pq_iters: kept for one release: use pq.iters */
  public int pqIters() {
    return fields.getPq_iters();
  }

  /** kvret_config.pq_tol: kept for one release: use pq.tol */
  public float pqTol() {
    return fields.getPq_tol();
  }

  /** kvret_config.pq_train_sample: kept for one release: use pq.train_sample */
  public int pqTrainSample() {
    return fields.getPq_train_sample();
  }

  /** kvret_config.cluster_tokens: kept for one release: use cluster.tokens */
  public int clusterTokens() {
    return fields.getCluster_tokens();
  }

  /** kvret_config.cluster_decode_interval: kept for one release: use cluster.decode_interval */
  public int clusterDecodeInterval() {
    return fields.getCluster_decode_interval();
  }

  /** kvret_config.cluster_decode_k: kept for one release: use cluster.decode_k */
  public int clusterDecodeK() {
    return fields.getCluster_decode_k();
  }

  /** kvret_config.page_size: tokens per page; default 16 */
  public int pageSize() {
    return fields.getPage_size();
  }

  /** kvret_config.quant_bits: kept for one release: use quant.bits */
  public int quantBits() {
    return fields.getQuant_bits();
  }

  /** kvret_config.hamming_fraction: kept for one release: use crush.fraction */
  public float hammingFraction() {
    return fields.getHamming_fraction();
  }

  /** kvret_config.hamming_buckets: kept for one release: use crush.buckets */
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

  /** kvret_config.pq_exact_fraction: kept for one release: use pq.exact_fraction */
  public float pqExactFraction() {
    return fields.getPq_exact_fraction();
  }

  /** kvret_config.quant_group_size: kept for one release: use quant.group_size */
  public int quantGroupSize() {
    return fields.getQuant_group_size();
  }

  /** kvret_config.quant_residual: kept for one release: use quant.residual */
  public int quantResidual() {
    return fields.getQuant_residual();
  }

  /** kvret_config.cluster_segment_tokens: kept for one release: use cluster.segment_tokens */
  public int clusterSegmentTokens() {
    return fields.getCluster_segment_tokens();
  }

  /** kvret_config.quant_attention: kept for one release: use quant.attention */
  public int quantAttention() {
    return fields.getQuant_attention();
  }

  /** kvret_config.cluster_reuse_steps: kept for one release: use cluster.reuse_steps */
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

  /** kvret_config.session_dram_bytes: kept for one release: use session.dram_bytes */
  public long sessionDramBytes() {
    return fields.getSession_dram_bytes();
  }

  /** kvret_config.session_disk_bytes: kept for one release: use session.disk_bytes */
  public long sessionDiskBytes() {
    return fields.getSession_disk_bytes();
  }

  /** kvret_config.session_ttl_ms: kept for one release: use session.ttl_ms */
  public long sessionTtlMs() {
    return fields.getSession_ttl_ms();
  }

  /** kvret_config.session_policy: kept for one release: use session.policy */
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

  /** kvret_config.cluster_exact_fraction: kept for one release: use cluster.exact_fraction */
  public float clusterExactFraction() {
    return fields.getCluster_exact_fraction();
  }

  /** kvret_config.quant_rerank: kept for one release: use quant.rerank */
  public int quantRerank() {
    return fields.getQuant_rerank();
  }

  /** kvret_config.hamming_importance: kept for one release: use crush.importance */
  public Importance hammingImportance() {
    return Importance.fromCode(fields.getHamming_importance());
  }

  /** kvret_config.hamming_granularity: kept for one release: use crush.granularity */
  public int hammingGranularity() {
    return fields.getHamming_granularity();
  }
  // </generated getters>

  /** Sets kvret_config fields; {@link #build()} makes an independent Config (the builder stays usable). */
  public static final class Builder {
    private final NativeConfig fields = new NativeConfig();
    private String diskPath;
    private String sessionSharedUrl;
    private PqParams pq;
    private ClusterParams cluster;
    private QuantParams quant;
    private CrushParams crush;
    private SessionParams session;

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_config_init(fields);
    }

    public Config build() {
      NativeConfig copy = new NativeConfig();
      KvretNative.kvret_swig_config_copy(copy, fields);
      return new Config(copy, diskPath, sessionSharedUrl, pq, cluster, quant, crush, session);
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

    /**
     * PQCache's parameters in one place (kvret_config.pq; null: none), in place of the flat pq* setters, which are
     * kept for one release. Setting a flat pq* field from its default as well is refused when the context is made.
     */
    public Builder pq(PqParams value) {
      pq = value;
      fields.setPq(value == null ? null : value.fields());
      return this;
    }

    /** ClusterKV's parameters in one place (kvret_config.cluster; null: none), in place of the cluster* setters. */
    public Builder cluster(ClusterParams value) {
      cluster = value;
      fields.setCluster(value == null ? null : value.fields());
      return this;
    }

    /** The quant index's parameters in one place (kvret_config.quant; null: none), in place of the quant* setters. */
    public Builder quant(QuantParams value) {
      quant = value;
      fields.setQuant(value == null ? null : value.fields());
      return this;
    }

    /** KVCrush's parameters in one place (kvret_config.crush; null: none), in place of the hamming* setters. */
    public Builder crush(CrushParams value) {
      crush = value;
      fields.setCrush(value == null ? null : value.fields());
      return this;
    }

    /** The session store's parameters in one place (kvret_config.session; null: none), in place of session*. */
    public Builder session(SessionParams value) {
      session = value;
      fields.setSession(value == null ? null : value.fields());
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

    /** kvret_config.pq_m: kept for one release: use pq.m */
    public Builder pqM(int value) {
      fields.setPq_m(value);
      return this;
    }

    /** kvret_config.pq_bits: kept for one release: use pq.bits */
    public Builder pqBits(int value) {
      fields.setPq_bits(value);
      return this;
    }

    /** kvret_config.pq_iters: kept for one release: use pq.iters */
    public Builder pqIters(int value) {
      fields.setPq_iters(value);
      return this;
    }

    /** kvret_config.pq_tol: kept for one release: use pq.tol */
    public Builder pqTol(float value) {
      fields.setPq_tol(value);
      return this;
    }

    /** kvret_config.pq_train_sample: kept for one release: use pq.train_sample */
    public Builder pqTrainSample(int value) {
      fields.setPq_train_sample(value);
      return this;
    }

    /** kvret_config.cluster_tokens: kept for one release: use cluster.tokens */
    public Builder clusterTokens(int value) {
      fields.setCluster_tokens(value);
      return this;
    }

    /** kvret_config.cluster_decode_interval: kept for one release: use cluster.decode_interval */
    public Builder clusterDecodeInterval(int value) {
      fields.setCluster_decode_interval(value);
      return this;
    }

    /** kvret_config.cluster_decode_k: kept for one release: use cluster.decode_k */
    public Builder clusterDecodeK(int value) {
      fields.setCluster_decode_k(value);
      return this;
    }

    /** kvret_config.page_size: tokens per page; default 16 */
    public Builder pageSize(int value) {
      fields.setPage_size(value);
      return this;
    }

    /** kvret_config.quant_bits: kept for one release: use quant.bits */
    public Builder quantBits(int value) {
      fields.setQuant_bits(value);
      return this;
    }

    /** kvret_config.hamming_fraction: kept for one release: use crush.fraction */
    public Builder hammingFraction(float value) {
      fields.setHamming_fraction(value);
      return this;
    }

    /** kvret_config.hamming_buckets: kept for one release: use crush.buckets */
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

    /** kvret_config.pq_exact_fraction: kept for one release: use pq.exact_fraction */
    public Builder pqExactFraction(float value) {
      fields.setPq_exact_fraction(value);
      return this;
    }

    /** kvret_config.quant_group_size: kept for one release: use quant.group_size */
    public Builder quantGroupSize(int value) {
      fields.setQuant_group_size(value);
      return this;
    }

    /** kvret_config.quant_residual: kept for one release: use quant.residual */
    public Builder quantResidual(int value) {
      fields.setQuant_residual(value);
      return this;
    }

    /** kvret_config.cluster_segment_tokens: kept for one release: use cluster.segment_tokens */
    public Builder clusterSegmentTokens(int value) {
      fields.setCluster_segment_tokens(value);
      return this;
    }

    /** kvret_config.quant_attention: kept for one release: use quant.attention */
    public Builder quantAttention(int value) {
      fields.setQuant_attention(value);
      return this;
    }

    /** kvret_config.cluster_reuse_steps: kept for one release: use cluster.reuse_steps */
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

    /** kvret_config.session_dram_bytes: kept for one release: use session.dram_bytes */
    public Builder sessionDramBytes(long value) {
      fields.setSession_dram_bytes(value);
      return this;
    }

    /** kvret_config.session_disk_bytes: kept for one release: use session.disk_bytes */
    public Builder sessionDiskBytes(long value) {
      fields.setSession_disk_bytes(value);
      return this;
    }

    /** kvret_config.session_ttl_ms: kept for one release: use session.ttl_ms */
    public Builder sessionTtlMs(long value) {
      fields.setSession_ttl_ms(value);
      return this;
    }

    /** kvret_config.session_policy: kept for one release: use session.policy */
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

    /** kvret_config.cluster_exact_fraction: kept for one release: use cluster.exact_fraction */
    public Builder clusterExactFraction(float value) {
      fields.setCluster_exact_fraction(value);
      return this;
    }

    /** kvret_config.quant_rerank: kept for one release: use quant.rerank */
    public Builder quantRerank(int value) {
      fields.setQuant_rerank(value);
      return this;
    }

    /** kvret_config.hamming_importance: kept for one release: use crush.importance */
    public Builder hammingImportance(Importance value) {
      fields.setHamming_importance(value.code);
      return this;
    }

    /** kvret_config.hamming_granularity: kept for one release: use crush.granularity */
    public Builder hammingGranularity(int value) {
      fields.setHamming_granularity(value);
      return this;
    }
    // </generated setters>
  }
}
