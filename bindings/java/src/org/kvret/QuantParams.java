// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.
package org.kvret;

import java.lang.ref.Cleaner;

/**
 * The parameters of SpeCache's quantized copy, the quant index (KVRET_INDEX_QUANT; docs/quant.md).
 * Fill with kvret_quant_params_init; reached from config.quant. An immutable kvret_quant_params:
 * build one with {@link #builder()} and give it to {@link Config.Builder#quant}. Its values are
 * checked when the context is made (KvretException, Status.INVALID_ARGUMENT, naming the field, e.g.
 * config.quant.bits).
 */
public final class QuantParams {
  private static final Cleaner CLEANER = NativeHandles.CLEANER;

  private final NativeQuantParams fields;

  private QuantParams(NativeQuantParams fields) {
    this.fields = fields;
    CLEANER.register(this, fields::delete);
  }

  /** The library's defaults. */
  public static QuantParams defaults() {
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

  NativeQuantParams fields() {
    return fields;
  }

  private static void copy(NativeQuantParams from, NativeQuantParams to) {
    to.setBits(from.getBits());
    to.setGroup_size(from.getGroup_size());
    to.setResidual(from.getResidual());
    to.setRerank(from.getRerank());
    to.setAttention(from.getAttention());
  }

  /** kvret_quant_params.bits: bits per quantized key and value element: 1 or 2; default 2 */
  public int bits() {
    return fields.getBits();
  }

  /**
   * kvret_quant_params.group_size: elements per quantization group of the quant index (keys: tokens
   * of one channel, values: channels of one token), each with its own f16 min and max: 32 or 64;
   * default 64
   */
  public int groupSize() {
    return fields.getGroup_size();
  }

  /**
   * kvret_quant_params.residual: most recent middle tokens the quant index keeps in f16 (KIVI's
   * residual window; up to group_size - 1 more wait for a full key group): 0..65536; default 64
   */
  public int residual() {
    return fields.getResidual();
  }

  /**
   * kvret_quant_params.rerank: on a KVRET_INDEX_QUANT context, select takes the rerank x budget
   * middle tokens the low-bit keys score highest (at most the middle) as candidates, scores them
   * again with their exact keys from the KV store and keeps the top budget of those: a key the
   * 1-bit copy ranks just below the cut (a needle) is recovered for candidates x head_dim
   * multiply-adds more and a read of the candidates' keys. 1 = off (the low-bit ranking alone,
   * SpeCache's); 1..64; default 4. Ignored by the other index kinds. Under attention = 1 the
   * candidates also enter that attention with their exact keys
   */
  public int rerank() {
    return fields.getRerank();
  }

  /**
   * kvret_quant_params.attention: 1: on a KVRET_INDEX_QUANT context, kvret_seq_attend attends over
   * every token of the layer, the sink, local and selected tokens exact, select's rerank x budget
   * candidates with their exact keys (their values low-bit unless selected) and every other middle
   * token as the low-bit copy has it (computed on the host); 0 (default): over the working set, as
   * for every other index. 1 needs index_kind = KVRET_INDEX_QUANT
   */
  public int attention() {
    return fields.getAttention();
  }

  public static final class Builder {
    private final NativeQuantParams fields = new NativeQuantParams();

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_quant_params_init(fields);
    }

    public QuantParams build() {
      NativeQuantParams copy = new NativeQuantParams();
      KvretNative.kvret_quant_params_init(copy);
      copy(fields, copy);
      return new QuantParams(copy);
    }

    /** kvret_quant_params.bits: bits per quantized key and value element: 1 or 2; default 2 */
    public Builder bits(int value) {
      fields.setBits(value);
      return this;
    }

    /**
     * kvret_quant_params.group_size: elements per quantization group of the quant index (keys:
     * tokens of one channel, values: channels of one token), each with its own f16 min and max: 32
     * or 64; default 64
     */
    public Builder groupSize(int value) {
      fields.setGroup_size(value);
      return this;
    }

    /**
     * kvret_quant_params.residual: most recent middle tokens the quant index keeps in f16 (KIVI's
     * residual window; up to group_size - 1 more wait for a full key group): 0..65536; default 64
     */
    public Builder residual(int value) {
      fields.setResidual(value);
      return this;
    }

    /**
     * kvret_quant_params.rerank: on a KVRET_INDEX_QUANT context, select takes the rerank x budget
     * middle tokens the low-bit keys score highest (at most the middle) as candidates, scores them
     * again with their exact keys from the KV store and keeps the top budget of those: a key the
     * 1-bit copy ranks just below the cut (a needle) is recovered for candidates x head_dim
     * multiply-adds more and a read of the candidates' keys. 1 = off (the low-bit ranking alone,
     * SpeCache's); 1..64; default 4. Ignored by the other index kinds. Under attention = 1 the
     * candidates also enter that attention with their exact keys
     */
    public Builder rerank(int value) {
      fields.setRerank(value);
      return this;
    }

    /**
     * kvret_quant_params.attention: 1: on a KVRET_INDEX_QUANT context, kvret_seq_attend attends
     * over every token of the layer, the sink, local and selected tokens exact, select's rerank x
     * budget candidates with their exact keys (their values low-bit unless selected) and every
     * other middle token as the low-bit copy has it (computed on the host); 0 (default): over the
     * working set, as for every other index. 1 needs index_kind = KVRET_INDEX_QUANT
     */
    public Builder attention(int value) {
      fields.setAttention(value);
      return this;
    }
  }
}
