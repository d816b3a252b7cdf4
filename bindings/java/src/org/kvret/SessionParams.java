// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.
package org.kvret;

import java.lang.ref.Cleaner;

/**
 * The parameters of the session store (AttentionStore; docs/sessions.md); its disk tier is
 * config.disk_path and its shared tier config.session_shared_url. Fill with
 * kvret_session_params_init; reached from config.session. An immutable kvret_session_params: build
 * one with {@link #builder()} and give it to {@link Config.Builder#session}. Its values are checked
 * when the context is made (KvretException, Status.INVALID_ARGUMENT, naming the field, e.g.
 * config.session.dram_bytes).
 */
public final class SessionParams {
  private static final Cleaner CLEANER = NativeHandles.CLEANER;

  private final NativeSessionParams fields;

  private SessionParams(NativeSessionParams fields) {
    this.fields = fields;
    CLEANER.register(this, fields::delete);
  }

  /** The library's defaults. */
  public static SessionParams defaults() {
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

  NativeSessionParams fields() {
    return fields;
  }

  private static void copy(NativeSessionParams from, NativeSessionParams to) {
    to.setDram_bytes(from.getDram_bytes());
    to.setDisk_bytes(from.getDisk_bytes());
    to.setTtl_ms(from.getTtl_ms());
    to.setPolicy(from.getPolicy());
  }

  /**
   * kvret_session_params.dram_bytes: capacity of the session store's host DRAM tier in bytes; 0 =
   * unlimited; default 0; >= 0
   */
  public long dramBytes() {
    return fields.getDram_bytes();
  }

  /**
   * kvret_session_params.disk_bytes: capacity of the disk tier (config.disk_path) in bytes; 0 =
   * unlimited; default 0; >= 0
   */
  public long diskBytes() {
    return fields.getDisk_bytes();
  }

  /**
   * kvret_session_params.ttl_ms: a saved session expires this many milliseconds after its save
   * (then it is a miss, and its bytes are freed); 0 = never; default 0; >= 0
   */
  public long ttlMs() {
    return fields.getTtl_ms();
  }

  /** kvret_session_params.policy: a kvret_session_policy; default KVRET_SESSION_SCHEDULER_AWARE */
  public SessionPolicy policy() {
    return SessionPolicy.fromCode(fields.getPolicy());
  }

  public static final class Builder {
    private final NativeSessionParams fields = new NativeSessionParams();

    private Builder() {
      CLEANER.register(this, fields::delete);
      KvretNative.kvret_session_params_init(fields);
    }

    public SessionParams build() {
      NativeSessionParams copy = new NativeSessionParams();
      KvretNative.kvret_session_params_init(copy);
      copy(fields, copy);
      return new SessionParams(copy);
    }

    /**
     * kvret_session_params.dram_bytes: capacity of the session store's host DRAM tier in bytes; 0 =
     * unlimited; default 0; >= 0
     */
    public Builder dramBytes(long value) {
      fields.setDram_bytes(value);
      return this;
    }

    /**
     * kvret_session_params.disk_bytes: capacity of the disk tier (config.disk_path) in bytes; 0 =
     * unlimited; default 0; >= 0
     */
    public Builder diskBytes(long value) {
      fields.setDisk_bytes(value);
      return this;
    }

    /**
     * kvret_session_params.ttl_ms: a saved session expires this many milliseconds after its save
     * (then it is a miss, and its bytes are freed); 0 = never; default 0; >= 0
     */
    public Builder ttlMs(long value) {
      fields.setTtl_ms(value);
      return this;
    }

    /** kvret_session_params.policy: a kvret_session_policy; default KVRET_SESSION_SCHEDULER_AWARE */
    public Builder policy(SessionPolicy value) {
      fields.setPolicy(value.code);
      return this;
    }
  }
}
