package org.kvret;

/** How the query heads of one KV group are folded into one score per token. */
public enum GqaFold {
  SUM_PROB(KvretNativeConstants.KVRET_FOLD_SUM_PROB),
  MAX_LOGIT(KvretNativeConstants.KVRET_FOLD_MAX_LOGIT);

  final int code;

  GqaFold(int code) {
    this.code = code;
  }

  static GqaFold fromCode(int code) {
    for (GqaFold value : values()) {
      if (value.code == code) {
        return value;
      }
    }
    throw new IllegalArgumentException("kvret: unknown GQA fold " + code);
  }
}
