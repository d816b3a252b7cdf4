package org.kvret;

/** How the rotary embedding pairs the dimensions of a head (pre-RoPE keys). */
public enum RopeLayout {
  NEOX(KvretNativeConstants.KVRET_ROPE_NEOX),
  GPTJ(KvretNativeConstants.KVRET_ROPE_GPTJ);

  final int code;

  RopeLayout(int code) {
    this.code = code;
  }

  static RopeLayout fromCode(int code) {
    for (RopeLayout value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown RoPE layout " + code);
  }
}
