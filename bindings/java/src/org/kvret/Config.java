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
  private static final Cleaner CLEANER = Cleaner.create();

  private final NativeConfig fields;
  private final String diskPath;

  private Config(NativeConfig fields, String diskPath) {
    this.fields = fields;
    this.diskPath = diskPath;
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
    return new Config(fields, KvretNative.kvret_swig_config_disk_path(fields));
  }

  /** A builder that starts from this config. */
  public Builder toBuilder() {
    Builder builder = new Builder();
    KvretNative.kvret_swig_config_copy(builder.fields, fields);
    builder.diskPath = diskPath;
    return builder;
  }

  NativeConfig fields() {
    return fields;
  }

  // ---- model geometry ----
  public int nLayers() {
    return fields.getN_layers();
  }

  public int nQHeads() {
    return fields.getN_q_heads();
  }

  public int nKvHeads() {
    return fields.getN_kv_heads();
  }

  public int headDim() {
    return fields.getHead_dim();
  }

  public KvDtype kvDtype() {
    return KvDtype.fromCode(fields.getKv_dtype());
  }

  // ---- device ----
  public DeviceType deviceType() {
    return DeviceType.fromCode(fields.getDevice_type());
  }

  public int deviceId() {
    return fields.getDevice_id();
  }

  // ---- token groups and budget ----
  public int nSink() {
    return fields.getN_sink();
  }

  public int nLocal() {
    return fields.getN_local();
  }

  public int budget() {
    return fields.getBudget();
  }

  public float budgetRatio() {
    return fields.getBudget_ratio();
  }

  public GqaFold gqaFold() {
    return GqaFold.fromCode(fields.getGqa_fold());
  }

  public IndexKind indexKind() {
    return IndexKind.fromCode(fields.getIndex_kind());
  }

  // ---- PQ ----
  public int pqM() {
    return fields.getPq_m();
  }

  public int pqBits() {
    return fields.getPq_bits();
  }

  public int pqIters() {
    return fields.getPq_iters();
  }

  public float pqTol() {
    return fields.getPq_tol();
  }

  public int pqTrainSample() {
    return fields.getPq_train_sample();
  }

  /** Share of each (layer, KV head)'s indexed tokens whose keys PQ quantizes worst that it keeps exact. */
  public float pqExactFraction() {
    return fields.getPq_exact_fraction();
  }

  // ---- ClusterKV, Quest pages, SpeCache, KVCrush ----
  public int clusterTokens() {
    return fields.getCluster_tokens();
  }

  public int clusterDecodeInterval() {
    return fields.getCluster_decode_interval();
  }

  public int clusterDecodeK() {
    return fields.getCluster_decode_k();
  }

  public int pageSize() {
    return fields.getPage_size();
  }

  public int quantBits() {
    return fields.getQuant_bits();
  }

  public float hammingFraction() {
    return fields.getHamming_fraction();
  }

  public int hammingBuckets() {
    return fields.getHamming_buckets();
  }

  // ---- storage and capacity ----
  public long maxSeqTokens() {
    return fields.getMax_seq_tokens();
  }

  public long hostBytesLimit() {
    return fields.getHost_bytes_limit();
  }

  /** The disk tier's directory, or null for none. */
  public String diskPath() {
    return diskPath;
  }

  // ---- GPU block cache ----
  public int blockTokens() {
    return fields.getBlock_tokens();
  }

  public CachePolicy cachePolicy() {
    return CachePolicy.fromCode(fields.getCache_policy());
  }

  public long cacheCapacityTokens() {
    return fields.getCache_capacity_tokens();
  }

  // ---- runtime ----
  public int nThreads() {
    return fields.getN_threads();
  }

  public boolean backgroundBuild() {
    return fields.getBackground_build() != 0;
  }

  public boolean checkFinite() {
    return fields.getCheck_finite() != 0;
  }

  public long seed() {
    return fields.getSeed();
  }

  /** Sets kvret_config fields; {@link #build()} makes an independent Config (the builder stays usable). */
  public static final class Builder {
    private final NativeConfig fields = new NativeConfig();
    private String diskPath;

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_config_init(fields);
    }

    public Config build() {
      NativeConfig copy = new NativeConfig();
      KvretNative.kvret_swig_config_copy(copy, fields);
      return new Config(copy, diskPath);
    }

    public Builder nLayers(int value) {
      fields.setN_layers(value);
      return this;
    }

    public Builder nQHeads(int value) {
      fields.setN_q_heads(value);
      return this;
    }

    public Builder nKvHeads(int value) {
      fields.setN_kv_heads(value);
      return this;
    }

    public Builder headDim(int value) {
      fields.setHead_dim(value);
      return this;
    }

    public Builder kvDtype(KvDtype value) {
      fields.setKv_dtype(value.code);
      return this;
    }

    /** Where the index and working set live: CPU (default) or CUDA with a device ordinal. */
    public Builder device(DeviceType type, int deviceId) {
      fields.setDevice_type(type.code);
      fields.setDevice_id(deviceId);
      return this;
    }

    public Builder nSink(int value) {
      fields.setN_sink(value);
      return this;
    }

    public Builder nLocal(int value) {
      fields.setN_local(value);
      return this;
    }

    /** Middle tokens selected per KV head; 0 = use the budget ratio. */
    public Builder budget(int value) {
      fields.setBudget(value);
      return this;
    }

    public Builder budgetRatio(float value) {
      fields.setBudget_ratio(value);
      return this;
    }

    public Builder gqaFold(GqaFold value) {
      fields.setGqa_fold(value.code);
      return this;
    }

    public Builder indexKind(IndexKind value) {
      fields.setIndex_kind(value.code);
      return this;
    }

    public Builder pqM(int value) {
      fields.setPq_m(value);
      return this;
    }

    public Builder pqBits(int value) {
      fields.setPq_bits(value);
      return this;
    }

    public Builder pqIters(int value) {
      fields.setPq_iters(value);
      return this;
    }

    public Builder pqTol(float value) {
      fields.setPq_tol(value);
      return this;
    }

    public Builder pqTrainSample(int value) {
      fields.setPq_train_sample(value);
      return this;
    }

    /**
     * Share of each (layer, KV head)'s indexed tokens whose keys PQ quantizes worst (largest reconstruction error)
     * that it keeps exact and scores exactly; 0 = off, valid range [0, 0.5].
     */
    public Builder pqExactFraction(float value) {
      fields.setPq_exact_fraction(value);
      return this;
    }

    public Builder clusterTokens(int value) {
      fields.setCluster_tokens(value);
      return this;
    }

    public Builder clusterDecodeInterval(int value) {
      fields.setCluster_decode_interval(value);
      return this;
    }

    public Builder clusterDecodeK(int value) {
      fields.setCluster_decode_k(value);
      return this;
    }

    public Builder pageSize(int value) {
      fields.setPage_size(value);
      return this;
    }

    public Builder quantBits(int value) {
      fields.setQuant_bits(value);
      return this;
    }

    public Builder hammingFraction(float value) {
      fields.setHamming_fraction(value);
      return this;
    }

    public Builder hammingBuckets(int value) {
      fields.setHamming_buckets(value);
      return this;
    }

    public Builder maxSeqTokens(long value) {
      fields.setMax_seq_tokens(value);
      return this;
    }

    public Builder hostBytesLimit(long value) {
      fields.setHost_bytes_limit(value);
      return this;
    }

    /** The disk tier's directory (null: none). */
    public Builder diskPath(String value) {
      diskPath = value;
      return this;
    }

    public Builder blockTokens(int value) {
      fields.setBlock_tokens(value);
      return this;
    }

    public Builder cachePolicy(CachePolicy value) {
      fields.setCache_policy(value.code);
      return this;
    }

    public Builder cacheCapacityTokens(long value) {
      fields.setCache_capacity_tokens(value);
      return this;
    }

    /** CPU threads for scoring and builds; 0 = all cores. */
    public Builder nThreads(int value) {
      fields.setN_threads(value);
      return this;
    }

    public Builder backgroundBuild(boolean value) {
      fields.setBackground_build(value ? 1 : 0);
      return this;
    }

    public Builder checkFinite(boolean value) {
      fields.setCheck_finite(value ? 1 : 0);
      return this;
    }

    public Builder seed(long value) {
      fields.setSeed(value);
      return this;
    }
  }
}
